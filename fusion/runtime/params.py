"""The per-parameter state a merged parameter must carry over from the parameters it stacks.

Merging `q_proj.weight`, `k_proj.weight` and `v_proj.weight` into one `qkv_proj.weight`
creates a new Parameter. Everything a user (or a library) attached to the originals must
hold for the merged one too, or fusing changes what the model does later: a frozen
projection would start training, an unfrozen one would stop, a Parameter subclass (a
quantised or sharded weight) would silently become a plain tensor, an attribute a training
framework reads (`_is_hf_initialized`, `_no_weight_decay`, ...) would vanish.

The rule is fail-closed: the merged parameter can only carry *one* state, so the shards must
agree exactly; any disagreement refuses the merge with a reason naming the shard.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fusion.errors import RewriteRefused


@dataclass(frozen=True)
class ParamState:
    """What the shards agreed on: `requires_grad` and the instance attributes (by name)."""

    requires_grad: bool
    attributes: dict[str, Any] = field(default_factory=dict)


def _same(a: Any, b: Any) -> bool:
    """Equal attribute values (identity first: tensors and arbitrary objects compare by it)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # an object whose == raises or is ambiguous: not provably equal
        return False


def common_state(params: Mapping[str, torch.Tensor]) -> ParamState:
    """The state every tensor of `params` (name -> Parameter, in shard order) shares.

    Returns it when each is exactly an `nn.Parameter` (no subclass), all have the same
    `requires_grad`, and the same instance attributes with equal values. Otherwise raises
    RewriteRefused naming the first shard that differs, so a merge never changes what trains
    or drops state a shard carries.
    """
    items = list(params.items())
    if not items:
        raise ValueError("common_state needs at least one parameter")
    for name, param in items:
        if type(param) is not nn.Parameter:
            raise RewriteRefused(
                f"{name} is a {type(param).__name__}, not a plain nn.Parameter: its "
                "subclass behaviour cannot be carried onto a merged parameter"
            )
    first_name, first = items[0]
    for name, param in items[1:]:
        if param.requires_grad != first.requires_grad:
            frozen = first_name if not first.requires_grad else name
            raise RewriteRefused(
                f"mixed requires_grad among merged parameters ({frozen} is frozen, "
                f"{first_name}: {first.requires_grad}, {name}: {param.requires_grad}): one "
                "merged parameter cannot train some shards and not others"
            )
    attributes = dict(vars(first))
    for name, param in items[1:]:
        other = vars(param)
        if set(other) != set(attributes):
            differing = sorted(set(other) ^ set(attributes))
            raise RewriteRefused(
                f"{name} and {first_name} carry different attributes ({', '.join(differing)})"
            )
        for key, value in attributes.items():
            if not _same(value, other[key]):
                raise RewriteRefused(f"{name} and {first_name} differ in their attribute {key!r}")
    return ParamState(requires_grad=first.requires_grad, attributes=attributes)


def apply_state(param: nn.Parameter, state: ParamState) -> nn.Parameter:
    """Give the fresh merged `param` the shards' `state` (requires_grad, attributes);
    returns `param`."""
    param.requires_grad_(state.requires_grad)
    for key, value in state.attributes.items():
        setattr(param, key, value)
    return param
