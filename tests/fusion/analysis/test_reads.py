"""fusion.analysis.reads: recording what an analysis reads, deriving the guarded set, and the guard."""

from __future__ import annotations

import copy
import functools
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusion.analysis.reads import AttributeGuard, ReadsGuard, guarded_reads, recording, resolved
from fusion.errors import RewriteRefused


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = 2.0
        self.act = nn.GELU()
        self.weight = nn.Parameter(torch.ones(3))
        self.fn = functools.partial(F.gelu, approximate="tanh")
        self.config = {"k": 1}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x) * self.scale * self.weight


class Sub(Scaled):
    pass


def test_recording_lists_reads_on_the_tree_only_and_restores_every_class() -> None:
    module, other = Scaled(), Scaled()
    with recording(module) as reads:
        _ = module.scale, module.act.approximate, other.scale
        assert type(module) is Scaled  # the class is the module's own while recording
    names = {(type(owner).__name__, name) for owner, name in reads}
    assert {("Scaled", "scale"), ("GELU", "approximate")} <= names
    assert all(owner is not other for owner, _ in reads)
    assert "__getattribute__" not in vars(Scaled) and "__getattribute__" not in vars(nn.GELU)


def test_recording_restores_on_error_and_counts_a_subclass_read_once() -> None:
    module = Sub()
    module.inner = Scaled()
    with pytest.raises(ValueError), recording(module) as reads:
        _ = module.scale
        raise ValueError
    assert [name for owner, name in reads if owner is module] == ["scale"]
    assert "__getattribute__" not in vars(Sub) and "__getattribute__" not in vars(Scaled)


def test_guarded_reads_keep_what_can_change_the_proof_and_refuse_what_a_guard_cannot_see() -> None:
    module = Scaled()
    with recording(module) as reads:
        _ = module.scale, module.act, module.fn, module.training, module._parameters
        _ = getattr(module, "absent", None)
    assert guarded_reads(module, reads) == (("", "absent"), ("", "act"), ("", "fn"), ("", "scale"))
    with recording(module) as reads:
        _ = module.weight
    with pytest.raises(RewriteRefused, match="weight"):
        guarded_reads(module, reads)
    assert guarded_reads(module, reads, live_tensors=True) == (("", "weight"),)
    with recording(module) as reads:
        _ = module.config
    with pytest.raises(RewriteRefused, match="config"):
        guarded_reads(module, reads)


def test_called_modules_guard_their_method_resolution_and_refuse_an_instance_forward() -> None:
    module = Scaled()
    found = guarded_reads(module, [], called=(module.act,))
    assert found == tuple(
        sorted(("act", n) for n in ("forward", "__call__", "_call_impl", "_wrapped_call_impl"))
    )
    guard = AttributeGuard.record(resolved(module, found))
    assert guard.holds()
    module.act.forward = lambda x: x
    assert guard.failure() == "GELU.forward"
    with pytest.raises(RewriteRefused, match="instance-level forward"):
        guarded_reads(module, [], called=(module.act,))


def test_within_limits_the_guard_to_some_modules() -> None:
    module = Scaled()
    with recording(module) as reads:
        _ = module.scale, module.act.approximate
    assert guarded_reads(module, reads, within=(module,)) == (("", "act"), ("", "scale"))


@pytest.mark.parametrize(
    ("name", "edit", "kind"),
    [
        ("scale", lambda m: setattr(m, "scale", 3.0), "value"),
        ("scale", lambda m: setattr(m, "scale", 2), "value"),  # 2 == 2.0, another type
        ("act", lambda m: setattr(m, "act", nn.GELU()), "child"),
        ("act", lambda m: object.__setattr__(m, "act", m.act), "child"),  # shadowed
        ("fn", lambda m: m.fn.keywords.update(approximate="none"), "partial"),
        ("fn", lambda m: setattr(m, "fn", F.gelu), "partial"),
        ("weight", lambda m: delattr(m, "weight"), "parameter"),
        ("bound", lambda m: setattr(m, "bound", m.act.forward), "object"),
        ("forward", lambda m: setattr(Sub, "forward", lambda self, x: x), "method"),
        ("absent", lambda m: setattr(m, "absent", 1), "missing"),
    ],
)
def test_attribute_guard_fails_on_each_kind_of_change(name, edit, kind) -> None:
    module = Sub()
    module.bound = module._get_name  # a bound method stored on the instance: by identity
    guard = AttributeGuard.record([(module, name)])
    assert guard.checks[0][2] == kind
    assert guard.holds()
    try:
        edit(module)
        assert guard.failure() == f"Sub.{name}"
    finally:
        if "forward" in vars(Sub):
            del Sub.forward


def test_parameter_guard_holds_for_a_replaced_parameter_read_by_name() -> None:
    module = Scaled()
    guard = AttributeGuard.record([(module, "weight")])
    module.weight = nn.Parameter(torch.zeros(3))  # read live by name: still the premise
    assert guard.holds()


def test_reads_guard_follows_deep_copies_and_pickles() -> None:
    module = Scaled()
    holder = nn.Module()
    holder.inner = module
    guard = ReadsGuard("activation", AttributeGuard.record([(module.act, "approximate")]))
    holder.guard = guard  # a plain attribute: copied with the module's dict
    for copied in (copy.deepcopy(holder), pickle.loads(pickle.dumps(holder))):
        copied.inner.act.approximate = "tanh"
        assert copied.guard.failure(copied) == "activation: GELU.approximate changed since fusing"
        assert guard.failure(holder) is None
