"""`fusion.analysis.callpath`: hooks and call paths of a module's own are named, so every caller can
refuse (or presume the worst about) a call that runs more than `forward`."""

from __future__ import annotations

from torch import nn

from fusion.analysis.callpath import has_hooks, own_call_path


def test_has_hooks_names_each_kind() -> None:
    linear = nn.Linear(2, 2)
    assert has_hooks(linear) is None
    handle = linear.register_forward_pre_hook(lambda *a: None)
    assert has_hooks(linear) == "forward pre hooks"
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert has_hooks(linear) == "global forward hooks"
    finally:
        handle.remove()


def test_has_hooks_sees_backward_hooks() -> None:
    linear = nn.Linear(2, 2)
    handle = linear.register_full_backward_hook(lambda *a: None)
    try:
        assert has_hooks(linear) == "backward hooks"
    finally:
        handle.remove()


def test_own_call_path_names_class_and_instance_overrides() -> None:
    class Wrapped(nn.Linear):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs) * 2

    assert own_call_path(nn.Linear(2, 2)) is None
    assert own_call_path(Wrapped(2, 2)) == "__call__"
    plain = nn.Linear(2, 2)
    plain._call_impl = lambda *a, **k: None
    assert own_call_path(plain) == "_call_impl"
