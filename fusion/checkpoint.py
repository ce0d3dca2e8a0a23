"""Map unfused checkpoints onto fused modules, and fused state back to unfused keys.

A fused model must load the checkpoint its unfused twin was saved with, and export one an
unfused model can load, bit for bit. The mapping is scoped by qualname: a fused module's
load hook only rewrites keys under its own prefix, so a same-named projection elsewhere (an
unfused expert's `gate_proj`) is never touched.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from fusion.modules import MergedLinear
from fusion.moe_modules import PackedExperts

_LOADER_ATTR = "_fusion_unfused_loaders"
"""Instance attribute listing the merged names a module already has a loader for."""


def _stack_shards(
    state_dict: dict[str, Any], prefix: str, merged_name: str, merged: MergedLinear
) -> None:
    keys = [f"{prefix}{name}.weight" for name in merged.shard_names]
    present = [key in state_dict for key in keys]
    if not any(present):
        return  # a fused checkpoint, or one without this module: nothing to map
    if not all(present):
        missing = [key for key, ok in zip(keys, present) if not ok]
        raise KeyError(f"unfused checkpoint lacks {missing} needed by {prefix}{merged_name}")
    weights = [state_dict.pop(key) for key in keys]
    state_dict[f"{prefix}{merged_name}.weight"] = torch.cat(weights, dim=0)
    if merged.bias is None:
        return
    biases = []
    for name, size, has_bias, weight in zip(
        merged.shard_names, merged.output_sizes, merged.shard_bias, weights
    ):
        key = f"{prefix}{name}.bias"
        if has_bias:
            biases.append(state_dict.pop(key))
        else:
            biases.append(torch.zeros(size, dtype=weight.dtype, device=weight.device))
    state_dict[f"{prefix}{merged_name}.bias"] = torch.cat(biases, dim=0)


def register_unfused_loader(module: nn.Module, merged_name: str) -> None:
    """Let `module.load_state_dict` (and any parent's) accept the unfused keys of the
    projections merged into `module.<merged_name>`.

    The hook sits on the parent, not on the merged child: a parent checks its own keys for
    unexpected entries before its children load, so the unfused keys must be rewritten
    before that check. The hook is bound to this instance only (registered per instance).
    """
    done = module.__dict__.setdefault(_LOADER_ATTR, [])
    if merged_name in done:
        return
    done.append(merged_name)

    def hook(mod: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        merged = getattr(mod, merged_name, None)
        if isinstance(merged, MergedLinear):
            _stack_shards(state_dict, prefix, merged_name, merged)

    module.register_load_state_dict_pre_hook(hook)


def _pack_experts(state_dict: dict[str, Any], prefix: str, packed: PackedExperts) -> None:
    """Replace `<prefix><e>.<gate|up|down>.weight` (a `ModuleList` of expert MLPs) with the
    packed `<prefix>gate_up_proj` / `<prefix>down_proj` tensors."""
    gate, up, down = packed.names
    keys = [
        [f"{prefix}{e}.{name}.weight" for name in (gate, up, down)]
        for e in range(packed.num_experts)
    ]
    flat = [key for row in keys for key in row]
    present = [key in state_dict for key in flat]
    if not any(present):
        return
    if not all(present):
        missing = [key for key, ok in zip(flat, present) if not ok]
        raise KeyError(f"unfused checkpoint lacks {missing[:3]}... needed by {prefix}gate_up_proj")
    rows = [[state_dict.pop(key) for key in row] for row in keys]
    state_dict[f"{prefix}gate_up_proj"] = torch.stack(
        [torch.cat([g, u], dim=0) for g, u, _ in rows]
    )
    state_dict[f"{prefix}down_proj"] = torch.stack([d for _, _, d in rows])


def register_packed_experts_loader(module: nn.Module, experts_name: str) -> None:
    """Let `module` (a `FusedMoE` whose `<experts_name>` is a `PackedExperts`) load the
    per-expert keys of the Transformers 4 `ModuleList` it replaced. Like
    `register_unfused_loader`, the hook sits on the parent so the keys are rewritten before
    the parent's unexpected-key check, and it touches only keys under its own prefix."""
    done = module.__dict__.setdefault(_LOADER_ATTR, [])
    if experts_name in done:
        return
    done.append(experts_name)

    def hook(mod: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        packed = getattr(mod, experts_name, None)
        if isinstance(packed, PackedExperts):
            _pack_experts(state_dict, f"{prefix}{experts_name}.", packed)

    module.register_load_state_dict_pre_hook(hook)


def _unpack_experts(
    result: OrderedDict[str, torch.Tensor], owner: str, leaf: str, tensor: torch.Tensor, packed
) -> None:
    prefix = f"{owner}." if owner else ""
    gate, up, down = packed.names
    for e in range(packed.num_experts):
        if leaf == "gate_up_proj":
            half = tensor.shape[1] // 2
            result[f"{prefix}{e}.{gate}.weight"] = tensor[e, :half]
            result[f"{prefix}{e}.{up}.weight"] = tensor[e, half:]
        else:
            result[f"{prefix}{e}.{down}.weight"] = tensor[e]


def unfused_state_dict(model: nn.Module) -> OrderedDict[str, torch.Tensor]:
    """`model.state_dict()` with every merged projection split back under its original keys,
    and every `PackedExperts` unpacked into its Transformers 4 per-expert keys.

    The tensors are exact slices of the stacked ones (so bit-identical to what was loaded);
    zero bias shards that were synthesised for bias-less projections are dropped.
    """
    merged_modules = {
        name: module for name, module in model.named_modules() if isinstance(module, MergedLinear)
    }
    packed_modules = {
        name: module for name, module in model.named_modules() if isinstance(module, PackedExperts)
    }
    result: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key, tensor in model.state_dict().items():
        owner, _, leaf = key.rpartition(".")
        if owner in packed_modules:
            _unpack_experts(result, owner, leaf, tensor, packed_modules[owner])
            continue
        merged = merged_modules.get(owner)
        if merged is None:
            result[key] = tensor
            continue
        parent = owner.rpartition(".")[0]
        prefix = f"{parent}." if parent else ""
        pieces = tensor.split(merged.output_sizes, dim=0)
        for name, has_bias, piece in zip(merged.shard_names, merged.shard_bias, pieces):
            if leaf == "bias" and not has_bias:
                continue
            result[f"{prefix}{name}.{leaf}"] = piece
    return result
