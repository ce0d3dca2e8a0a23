"""The experts child of an MoE block: which child holds the experts (Transformers 5 packed
experts, or a Transformers 4 `ModuleList` of expert MLPs, which the fuser refuses), and
whether packed experts compute what `moe_experts` computes (the standard layout)."""

from __future__ import annotations

import inspect
import sys

from torch import nn

from fusion.errors import RewriteRefused
from fusion.fusers.glu import activation_kind
from fusion.fusers.moe.provenance import INTERFACE_MODULE, experts_dispatch

PACKED_FLAGS = {
    "has_gate": True,
    "has_bias": False,
    "is_transposed": False,
    "is_concatenated": True,
    "has_post_expert_norm": False,
    "_is_expert_parallel": False,
}
"""Transformers' experts-interface flags of the layout `moe_experts` computes."""


_FLAGS_IMPLIED_WHEN_ABSENT = {
    "has_gate": True,
    "is_concatenated": True,
    "has_post_expert_norm": False,
    "_is_expert_parallel": False,
}
"""Flags an older experts interface (Transformers 5.0 sets only has_bias and is_transposed)
does not define because it has no other variant: its only layout is gated, concatenated
[gate; up], without a post-expert norm, not expert-parallel. Read from the instance (the
flag is absent), never from a version number; the numeric check still runs."""


def experts_child(module: nn.Module) -> tuple[str, str] | None:
    """(name, style) of the one child holding the experts, or None."""
    found = []
    for name, child in module.named_children():
        params = dict(child.named_parameters(recurse=False))
        if params.get("gate_up_proj") is not None and params["gate_up_proj"].ndim == 3:
            found.append((name, "packed"))
        elif (
            isinstance(child, nn.ModuleList)
            and len(child) >= 2
            and any(isinstance(c, nn.Linear) for c in child[0].children())
        ):
            found.append((name, "modulelist"))
    return found[0] if len(found) == 1 else None


def packed_experts_activation(child: nn.Module) -> str:
    """The activation of a Transformers 5 experts module in the layout `moe_experts`
    computes; RewriteRefused naming the difference otherwise."""
    name = type(child).__name__
    if not hasattr(inspect.unwrap(type(child).forward), "__code__") or not hasattr(
        type(child).forward, "__wrapped__"
    ):
        raise RewriteRefused(f"{name} is not a Transformers experts-interface class")
    for flag, expected in PACKED_FLAGS.items():
        value = getattr(child, flag, _FLAGS_IMPLIED_WHEN_ABSENT.get(flag))
        if value != expected:
            raise RewriteRefused(f"experts {flag}={value!r} (need {expected})")
    # What the experts compute is proven by the identity of their functions, never by the
    # block's numeric sample alone (a decorated loop of its own may drop rows).
    experts_dispatch(child)
    moe = sys.modules[INTERFACE_MODULE]  # loaded: the dispatcher was proven to be its own
    if getattr(type(child), "_apply_gate", None) is not moe._default_apply_gate:
        raise RewriteRefused(f"{name} has its own gating (_apply_gate)")
    params = dict(child.named_parameters(recurse=False))
    if set(params) != {"gate_up_proj", "down_proj"} or list(child.buffers()):
        raise RewriteRefused(f"{name} holds {sorted(params)}, not gate_up_proj and down_proj")
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    if gate_up.ndim != 3 or down.ndim != 3:
        raise RewriteRefused("expert weights are not 3-D")
    experts, two_i, hidden = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (experts, hidden, two_i // 2):
        raise RewriteRefused(f"expert shapes {tuple(gate_up.shape)} / {tuple(down.shape)}")
    if gate_up.dtype != down.dtype or gate_up.device != down.device:
        raise RewriteRefused("expert weights differ in dtype or device")
    count = getattr(child, "num_experts", experts)
    if count != experts:  # what the eager loop and grouped_mm count experts by
        raise RewriteRefused(f"experts num_experts={count!r} but {experts} expert weights")
    act = getattr(child, "act_fn", None)
    if not isinstance(act, nn.Module):
        raise RewriteRefused(f"{name} has no activation module")
    return activation_kind(act)
