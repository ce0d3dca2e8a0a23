"""What else runs when a module is called: hooks and call paths of its own.

A fused forward no longer calls the children it merged, and alias analysis reads a call to
a child as its `forward` only. Both are exact only when calling the child runs nothing but
`forward`: no hook (on the child or global) and the `nn.Module` call path. These two
checks are the one place that decides it; fusers and `fusion.analysis.alias` import them.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as nn_module

HOOK_ATTRS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")

CALL_PATH = ("__call__", "_wrapped_call_impl", "_call_impl")
"""What runs between `self.<child>(x)` and `forward`: a merged call bypasses all of it."""


def has_hooks(module: nn.Module) -> str | None:
    """A description of the hooks on `module` (or installed globally), or None.

    Forward hooks can change what a call reads or returns; backward hooks would silently
    stop firing once the call is merged away. Either way the call is not just `forward`,
    so every caller refuses (or presumes the worst) when this is not None. The global
    registries count as hooks on every module: `register_module_full_backward_hook` fires
    for each module called through `__call__`, so a fused kernel that stands in for a call
    (a norm inside `add_rms_norm`) would skip it exactly as it skips a hook of the child.
    Runtime checks (the residual-norm helper) call this per call, so a global hook added
    after fusing is seen the next forward."""
    for attr in HOOK_ATTRS:
        if getattr(module, attr, None):
            return attr.strip("_").replace("_", " ")
    return global_hooks()


def global_hooks() -> str | None:
    """A description of the module hooks installed globally (`nn.modules.module.
    register_module_*_hook`), or None: forward, forward-pre, full backward and backward-pre
    hooks, each of which runs for every module call."""
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return "global forward hooks"
    if nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks:
        return "global backward hooks"
    return None


FUSION_INSTALLED = "fusion_installed"
"""The class attribute (True) of every forward object fusion installs on an instance
(`fusion.runtime.bound.BoundForward` and the fused forwards of kept modules): such an instance-level
`forward` computes the function of the class's own forward (proven, or its guards fall back
to it), so a parent's proof that reads the child as its forward still holds."""


def installed_forward(module: nn.Module) -> bool:
    """Whether `module`'s instance-level `forward`, if any, is one fusion installed: False
    for any other instance-level forward (a user's), True when there is none."""
    forward = module.__dict__.get("forward")
    return forward is None or getattr(type(forward), FUSION_INSTALLED, False) is True


def own_call_path(child: nn.Module) -> str | None:
    """The first of `CALL_PATH` that `child` does not take from `nn.Module` (its class
    overrides it, or the instance carries its own), or None.

    Such a call path may compute anything around `forward`, and may do it differently per
    instance (an attribute read at call time), so the one traced instance of a class
    proves nothing about the others."""
    for attr in CALL_PATH:
        if getattr(type(child), attr) is not getattr(nn.Module, attr) or attr in child.__dict__:
            return attr
    return None
