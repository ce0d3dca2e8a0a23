"""What a forward rewritten by the residual-norm fuser calls in place of `a + b` and the norm.

The rewritten statement is `H, t = self.fused_add_rms_norm(L, R, self.<norm>)`, with `t`
standing where `self.<norm>(H)` was. The helper is stored on the layer instance (a plain
function attribute: no parameter, buffer or child, so the state dict is unchanged) because
the rewritten forward runs in the Transformers module's globals, which fusion must not edit.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fusion.analysis.callpath import has_hooks, own_call_path
from fusion.runtime.norm_forward import NormForward

HELPER = "fused_add_rms_norm"
"""The instance attribute the rewritten forward calls (`self.fused_add_rms_norm`)."""


def fused_norm_forward(norm: Any) -> NormForward | None:
    """`norm`'s fused forward (`NormForward`) when calling `norm` runs nothing but it: no
    hooks on it or global, no call path of its own, and the forward is `norm`'s own (not a
    shallow copy's); else None."""
    if not isinstance(norm, nn.Module):
        return None
    forward = norm.__dict__.get("forward")
    if (
        type(forward) is NormForward
        and forward.module is norm
        and has_hooks(norm) is None
        and own_call_path(norm) is None
    ):
        return forward
    return None


def add_rms_norm(a: Any, b: Any, norm: nn.Module) -> tuple[Any, Any]:
    """`(s, norm(s))` with `s = a + b`: what the original statements bound to the sum and to
    the norm's result, in the original evaluation order (`a`, `b`, then the norm child).

    Safe whatever the child is when it runs: only a norm whose call runs nothing but its
    fused forward (`fused_norm_forward`) takes the fused kernel, whose result is bit for bit
    that forward on `a + b` where its premises hold, and otherwise exactly the two
    statements (`NormForward.add_forward`). Any other child (a norm the RMSNorm fuser has
    not reached, one a user swapped in, one with hooks added later) gets exactly the original
    code: `a + b`, then the child called on the sum. So does a norm on its route (`NormForward.add_forward`).
    """
    forward = fused_norm_forward(norm)
    if forward is not None:
        return forward.add_forward(a, b)
    total = a + b
    return total, norm(total)
