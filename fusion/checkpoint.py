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


def unfused_state_dict(model: nn.Module) -> OrderedDict[str, torch.Tensor]:
    """`model.state_dict()` with every merged projection split back under its original keys.

    The tensors are exact slices of the stacked ones (so bit-identical to what was loaded);
    zero bias shards that were synthesised for bias-less projections are dropped.
    """
    merged_modules = {
        name: module for name, module in model.named_modules() if isinstance(module, MergedLinear)
    }
    result: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key, tensor in model.state_dict().items():
        owner, _, leaf = key.rpartition(".")
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
