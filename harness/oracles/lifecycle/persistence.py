"""Lifecycle operations that save and copy: `save_pretrained` -> stock `from_pretrained`,
`load_state_dict`, `copy.deepcopy`, `torch.save`/`torch.load` (the copy must still be fused).
"""

from __future__ import annotations

import contextlib
import copy
import io
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusion import inspection
from harness.oracles.lifecycle.core import (
    Context,
    _compare,
    _Failed,
    _logits,
    _NotApplicable,
    _twins,
    _unfused,
)


def _safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def _storage_groups(model: nn.Module) -> list[list[str]]:
    """`state_dict()` keys grouped by storage (groups of two or more), the grouping that
    accelerate, safetensors and Transformers apply before saving."""
    from transformers.pytorch_utils import id_tensor_storage

    groups: dict[Any, list[str]] = {}
    for key, tensor in model.state_dict().items():
        groups.setdefault(id_tensor_storage(tensor), []).append(key)
    return sorted(group for group in groups.values() if len(group) > 1)


def _save_pretrained(ctx: Context) -> str:
    if not hasattr(ctx.unfused, "save_pretrained"):
        raise _NotApplicable("the model has no save_pretrained")
    shared, unfused_shared = _storage_groups(ctx.fused), _storage_groups(ctx.unfused)
    if shared != unfused_shared:
        extra = [group for group in shared if group not in unfused_shared]
        raise _Failed(
            f"state_dict entries share storage where the unfused model's do not: {extra[:2]} "
            "(savers that keep one name per storage would drop the others)"
        )
    with tempfile.TemporaryDirectory() as root:
        mine, theirs = Path(root, "unfused"), Path(root, "fused")
        with _quiet():
            _unfused("save_pretrained", lambda: ctx.unfused.save_pretrained(mine))
            ctx.fused.save_pretrained(theirs)
        want, got = _safetensors(mine), _safetensors(theirs)
        if set(got) != set(want):
            extra, lost = sorted(set(got) - set(want)), sorted(set(want) - set(got))
            raise _Failed(f"checkpoint keys differ: extra {extra[:3]}, missing {lost[:3]}")
        for key, tensor in want.items():
            if got[key].dtype != tensor.dtype or not torch.equal(got[key], tensor):
                raise _Failed(f"checkpoint tensor {key} is not bit-identical")
        cls = type(ctx.unfused)
        load = dict(dtype=ctx.dtype)
        reloaded = _unfused("from_pretrained", lambda: _from_pretrained(cls, mine, load))
        with _quiet():
            stock = _from_pretrained(cls, theirs, load)
    want_logits = _logits(reloaded, ctx)
    _compare("stock from_pretrained logits", _logits(stock, ctx), want_logits, 0.0)
    return f"{len(want)} tensors bit-identical; stock {cls.__name__} reloads them"


def _from_pretrained(cls: type, directory: Path, load: dict[str, Any]) -> nn.Module:
    with _quiet():
        model = cls.from_pretrained(directory, **load)
    return model.eval()


@contextlib.contextmanager
def _quiet():
    """Silence Transformers' progress bars and load reports for the checks' own saves."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        hf_logging.set_verbosity(verbosity)


def _load_state_dict(ctx: Context) -> str:
    unfused, fused = _twins(ctx)
    _logits(fused, ctx)  # "after the first forward": anything cached is warm
    state = {
        key: value * 0.75 if value.is_floating_point() else value.clone()
        for key, value in ctx.unfused.state_dict().items()
    }
    _unfused("load_state_dict", lambda: unfused.load_state_dict(dict(state)))
    fused.load_state_dict(dict(state))
    diff = _compare("logits", _logits(fused, ctx), _logits(unfused, ctx), ctx.allowance)
    return f"strict load of {len(state)} unfused keys; logits within {diff:.3g}"


def _fused_state(model: nn.Module) -> tuple[int, int, int]:
    """(instance-level forwards, rewritten forwards whose guards hold, merged projections
    whose Parameters still view their stacked weight): what a copy must keep to still be
    the fused model, not merely compute like it."""
    forwards = [
        m
        for m in model.modules()
        # one fusion installed (a `LinearForward` too), or a bound function other than the
        # class's own (a pickled bound method restores as that, which is no rewrite)
        if "forward" in m.__dict__
        and (
            inspection.has_installed_forward(m)
            or getattr(m.__dict__["forward"], "__func__", None) not in (None, type(m).forward)
        )
    ]
    guarded = sum(f.rewrite and f.failure is None for f in inspection.fused_forwards(model))
    stacked = sum(p.views_hold for p in inspection.merged_projections(model))
    return len(forwards), guarded, stacked


def _same_fused(copied: nn.Module, ctx: Context, what: str) -> str:
    want, got = _fused_state(ctx.fused), _fused_state(copied)
    if got != want:
        raise _Failed(
            f"{what} has {got[0]} instance forwards ({got[1]} guarded rewrites holding) and "
            f"{got[2]} stacked merges; the fused model {want[0]} ({want[1]}) and {want[2]}"
        )
    logits = _logits(copied, ctx)
    if not torch.equal(logits, ctx.fused_logits):
        _compare(f"{what} logits", logits, ctx.fused_logits, 0.0)
    return f"still fused ({got[1]} rewritten forwards, {got[2]} stacked), logits bit-identical"


def _deepcopy(ctx: Context) -> str:
    return _same_fused(copy.deepcopy(ctx.fused), ctx, "the deep copy")


def _torch_save(ctx: Context) -> str:
    buffer = io.BytesIO()
    _unfused("torch.save", lambda: torch.save(ctx.unfused, io.BytesIO()))
    torch.save(ctx.fused, buffer)
    buffer.seek(0)
    return _same_fused(torch.load(buffer, weights_only=False), ctx, "the reloaded model")
