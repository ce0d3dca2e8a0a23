"""A fused model's checkpoint layout is its unfused twin's, in both directions.

A fused model must be a drop-in replacement for saving and loading: `state_dict()` (and so
`save_pretrained`, `torch.save(model.state_dict())`, accelerate, DeepSpeed, ...) returns the
*unfused* keys, so a stock Transformers class (or vLLM) loads what a fused model saved; and
`load_state_dict` accepts the unfused keys (and, for older fused saves, the merged ones).

Merged projections (`MergedLinear`) need no translation: the projections stay children under
their names, with their own Parameters (views of the stacked weight), so `state_dict()`
has the unfused keys, order and bits and `load_state_dict` writes into the stacked weight
in place. One thing remains: the entries would share one storage (the stacked weight's),
and tools that group state-dict entries by storage (accelerate's and safetensors'
`save_model`, safetensors' `save_file`, Transformers' tied-weight checks) would see
weights "tied" to each other, which the unfused model's are not. A state-dict hook on the
parent gives each shard's entry a storage object of its own over the same memory
(`_own_storage`).

A Transformers 4 `experts` ModuleList repacked into `PackedExperts` (only in models fused
and pickled by an earlier version: the fuser no longer repacks) does need translation:

- a state-dict hook on that module replaces the packed tensors by their exact slices under
  the original keys (aliases of the packed tensor's memory, each with its own storage
  object, as above);
- a load pre-hook stacks the unfused keys back into the packed key before the module checks
  its own keys. A partial checkpoint loads what it has, as stock PyTorch does: experts it
  lacks keep their current values and are reported in `missing_keys` under their unfused
  names (so `strict=True` raises the stock error, `strict=False` returns them).

Hooks sit on the parent of the packed child: a parent checks its own keys for unexpected
entries before its children load, so the keys must be rewritten before that check. Each hook
touches only keys under its own prefix, so a same-named projection elsewhere (an unfused
module's `q_proj`) is never touched. Hooks are module-level dataclasses (picklable), so
`torch.save(model)` and `copy.deepcopy` keep them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.dlpack import from_dlpack, to_dlpack

from fusion.runtime.merged import MergedLinear
from fusion.runtime.moe import PackedExperts

_LAYOUT_ATTR = "_fusion_unfused_layouts"
"""Instance attribute listing the merged child names a module already has hooks for."""


def _own_storage(piece: torch.Tensor | None) -> torch.Tensor | None:
    """`piece` (a slice of a merged or packed tensor) as a tensor over the same memory with
    a storage object of its own, or `piece` itself where that cannot be made.

    Why: a stock state dict holds one storage per parameter, and savers deduplicate by
    storage identity: accelerate's `save_model` keeps one name per storage and silently
    drops the rest (k_proj and v_proj of a merged q/k/v were lost), safetensors'
    `save_model` refuses a storage no single entry covers. A DLPack round trip gives a
    storage that starts at the slice and spans only it. Safe because the memory is the
    same (writes through the entry still reach the model; bit-identical values) and the
    DLPack deleter holds a reference to the source tensor, so the merged weight outlives
    the entry even after the model is gone. Not done for tensor subclasses (DTensor, fake
    or functional tensors), meta tensors, tensors needing grad (`keep_vars=True`) or while
    Dynamo traces: those keep the plain view, the previous behaviour."""
    if (
        piece is None
        or type(piece) is not torch.Tensor
        or piece.device.type not in ("cpu", "cuda")
        or piece.requires_grad
        or torch.compiler.is_compiling()
    ):
        return piece
    try:
        return from_dlpack(to_dlpack(piece))
    except (RuntimeError, BufferError, TypeError):  # a dtype or layout DLPack lacks
        return piece


def _replace_in_place(
    destination: dict[str, Any], key: str, pieces: list[tuple[str, torch.Tensor]]
) -> None:
    """Replace `destination[key]` by `pieces`, at its position (the dict is mutated in place:
    state-dict hooks must not rebind it)."""
    items = list(destination.items())
    destination.clear()
    for existing, value in items:
        if existing == key:
            destination.update((name, _own_storage(piece)) for name, piece in pieces)
        else:
            destination[existing] = value


@dataclass
class OwnStoragesHook:
    """`state_dict` post-hook: each entry of a `MergedLinear`'s shards gets a storage object
    of its own (`_own_storage`) while they view its stacked weight."""

    merged_name: str

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, _meta: Any) -> None:
        merged = getattr(module, self.merged_name, None)
        if not isinstance(merged, MergedLinear) or not merged.views_hold():
            return
        for name in merged.shard_names:
            for leaf in ("weight", "bias"):
                key = f"{prefix}{name}.{leaf}"
                if key in state_dict:
                    state_dict[key] = _own_storage(state_dict[key])


class _LoadPreHook:
    """A `load_state_dict` pre-hook reduced to what the layouts use (`load`)."""

    def __call__(
        self,
        module: nn.Module,
        state_dict: dict,
        prefix: str,
        _meta: Any,
        _strict: bool,
        missing_keys: list[str],
        _unexpected: list[str],
        _errors: list[str],
    ) -> None:
        self.load(module, state_dict, prefix, missing_keys)

    def load(
        self, module: nn.Module, state_dict: dict, prefix: str, missing_keys: list[str]
    ) -> None:
        raise NotImplementedError


def _stack_into(
    state_dict: dict,
    merged_key: str,
    shard_keys: list[str | None],
    current: tuple[torch.Tensor, ...] | list[torch.Tensor],
    missing_keys: list[str],
    join: Callable[[list[torch.Tensor]], torch.Tensor],
) -> None:
    """Put `join(shards)` under `merged_key`, popping the shard keys.

    A shard key that is None (a synthetic zero bias) or absent takes its `current` value;
    absent ones are appended to `missing_keys`. Nothing is done when the merged key is already
    there (a fused-layout checkpoint) or when none of the shard keys is present and the merged
    key is not either: then the merged key gets its current value (a no-op load) and every
    shard key is reported missing, exactly what a stock module reports for a checkpoint
    without it, instead of the merged name the user never saw.
    """
    if merged_key in state_dict:
        return
    parts = []
    for key, value in zip(shard_keys, current):
        if key is not None and key in state_dict:
            parts.append(state_dict.pop(key))
            continue
        if key is not None:
            missing_keys.append(key)
        parts.append(value)
    state_dict[merged_key] = join(parts)


# --------------------------------------------------------------------------------------------
# Transformers 4 experts repacked into `PackedExperts`.


def _expert_keys(prefix: str, packed: PackedExperts) -> list[tuple[str, str, str]]:
    gate, up, down = packed.names
    return [
        (f"{prefix}{e}.{gate}.weight", f"{prefix}{e}.{up}.weight", f"{prefix}{e}.{down}.weight")
        for e in range(packed.num_experts)
    ]


@dataclass
class PackedStateDictHook:
    """`state_dict` post-hook: `<prefix><experts>.gate_up_proj|down_proj` -> per-expert keys."""

    experts_name: str

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, _meta: Any) -> None:
        packed = getattr(module, self.experts_name, None)
        if not isinstance(packed, PackedExperts):
            return
        inner = f"{prefix}{self.experts_name}."
        keys = _expert_keys(inner, packed)
        for leaf in ("gate_up_proj", "down_proj"):
            key = f"{inner}{leaf}"
            if key not in state_dict:
                continue
            tensor = state_dict[key]
            pieces = []
            with torch.no_grad():
                for e, (gate_key, up_key, down_key) in enumerate(keys):
                    if tensor is None:  # an absent gradient (`unfused_named`)
                        names = (gate_key, up_key) if leaf == "gate_up_proj" else (down_key,)
                        pieces += [(name, None) for name in names]
                    elif leaf == "gate_up_proj":
                        half = tensor.shape[1] // 2
                        pieces += [(gate_key, tensor[e, :half]), (up_key, tensor[e, half:])]
                    else:
                        pieces.append((down_key, tensor[e]))
            _replace_in_place(state_dict, key, pieces)


@dataclass
class PackedLoadHook(_LoadPreHook):
    """`load_state_dict` pre-hook: per-expert keys -> the packed tensors (see `_stack_into`)."""

    experts_name: str

    def load(
        self, module: nn.Module, state_dict: dict, prefix: str, missing_keys: list[str]
    ) -> None:
        packed = getattr(module, self.experts_name, None)
        if not isinstance(packed, PackedExperts):
            return
        inner = f"{prefix}{self.experts_name}."
        keys = _expert_keys(inner, packed)
        gate_up = packed.gate_up_proj.detach()
        half = gate_up.shape[1] // 2
        gate_up_current = [
            t for e in range(len(keys)) for t in (gate_up[e, :half], gate_up[e, half:])
        ]
        _stack_into(
            state_dict,
            f"{inner}gate_up_proj",
            [k for gate_key, up_key, _ in keys for k in (gate_key, up_key)],
            gate_up_current,
            missing_keys,
            lambda parts: torch.stack(
                [torch.cat(parts[i : i + 2], dim=0) for i in range(0, len(parts), 2)]
            ),
        )
        _stack_into(
            state_dict,
            f"{inner}down_proj",
            [down_key for _, _, down_key in keys],
            list(packed.down_proj.detach().unbind(0)),
            missing_keys,
            torch.stack,
        )


# --------------------------------------------------------------------------------------------
# Registration.


def _register(module: nn.Module, name: str, state_hook: Any, load_hook: Any) -> None:
    done = module.__dict__.setdefault(_LAYOUT_ATTR, [])
    if name in done:
        return
    done.append(name)
    module.register_state_dict_post_hook(state_hook)
    module.register_load_state_dict_pre_hook(load_hook)


def register_own_storages(module: nn.Module, merged_name: str) -> None:
    """Give the state-dict entries of the projections merged into `module.<merged_name>`
    (a `MergedLinear`) storage objects of their own. Per instance."""
    done = module.__dict__.setdefault(_LAYOUT_ATTR, [])
    if merged_name not in done:
        done.append(merged_name)
        module.register_state_dict_post_hook(OwnStoragesHook(merged_name))


def register_packed_experts_layout(module: nn.Module, experts_name: str) -> None:
    """The same for `module.<experts_name>` (a `PackedExperts`): the per-expert keys of the
    Transformers 4 `ModuleList` it replaced."""
    _register(module, experts_name, PackedStateDictHook(experts_name), PackedLoadHook(experts_name))


def unfused_state_dict(model: nn.Module) -> OrderedDict[str, torch.Tensor]:
    """The state dict an unfused twin of `model` has: keys, shapes and bits.

    Since merged projections keep their Parameters and repacked experts register their
    layout hooks, this is `model.state_dict()`
    itself; kept as the explicit name for callers that want to say what they rely on."""
    return model.state_dict()


def unfused_named(
    model: nn.Module, tensors: dict[str, torch.Tensor | None]
) -> dict[str, torch.Tensor | None]:
    """`tensors` keyed like `model.named_parameters()` (e.g. gradients), re-keyed and split
    into the unfused layout exactly as `state_dict()` is: packed entries become their
    original per-expert keys (merged projections already have theirs), None staying None for
    each. A new dict; `tensors` is not modified."""
    result = dict(tensors)
    for qualname, module in model.named_modules():
        prefix = f"{qualname}." if qualname else ""
        for hook in module._state_dict_hooks.values():
            if isinstance(hook, PackedStateDictHook):
                hook(module, result, prefix, None)
    return result


def fused_names(model: nn.Module) -> dict[str, str]:
    """Each unfused state-dict key of `model` -> the name of the fused model's parameter or
    buffer that holds its values (itself where nothing was merged).

    For reports about the fused model in checkpoint terms, and back: a loader's missing
    `experts.0.gate_proj.weight` is, on a repacked model, (a slice of)
    `experts.gate_up_proj`. Derived from the
    same state-dict hooks `state_dict()` runs, so the two cannot disagree."""
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    names += [name for name, _ in model.named_buffers(remove_duplicate=False)]
    mapping: dict[str, str] = {}
    for name in names:
        for key in unfused_named(model, {name: None}):
            mapping.setdefault(key, name)
    return mapping
