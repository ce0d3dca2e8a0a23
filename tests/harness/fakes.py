"""Fusers that are wrong on purpose, independent of the real fusion engine.

Each returns a `fuse(model)` callable that rebinds one module's forward (as a real fuser does)
and reports it with a matching `Applied` record, so the harness can be shown to catch, localise
and bundle the fault whatever state `fusion/` is in.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

from fusion import Applied, FusionReport

FAKE_FUSER = "fake-glu"


def _applied(module: nn.Module, qualname: str, fuser: str, note: str) -> Applied:
    original = inspect.getsource(type(module).forward)
    return Applied(
        qualname=qualname,
        fuser=fuser,
        source_class=type(module).__name__,
        description=f"test fault: {note}",
        original_source=original,
        rewritten_source=original.replace("return ", f"return  # {note}\n        ", 1),
    )


def faulty_fuse(
    qualnames: str | list[str] = "model.layers.0.mlp",
    *,
    change: Callable[[torch.Tensor], torch.Tensor] = lambda out: out * 1.01,
    note: str = "output scaled by 1.01",
    fuser: str = FAKE_FUSER,
) -> Callable[[nn.Module], FusionReport]:
    """A fuse that applies `change` to the tensor output of the module(s) at `qualnames`."""
    names = [qualnames] if isinstance(qualnames, str) else list(qualnames)

    def fuse(model: nn.Module) -> FusionReport:
        report = FusionReport()
        for name in names:
            module = model.get_submodule(name)
            original_forward = module.forward

            def forward(*args, _original=original_forward, **kwargs):
                return change(_original(*args, **kwargs))

            module.forward = forward
            report.applied.append(_applied(module, name, fuser, note))
        return report

    return fuse


def raising_change(out: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("fused kernel exploded on shape 2x6")


def nan_change(out: torch.Tensor) -> torch.Tensor:
    out = out.clone()
    out[0, 0, 0] = float("nan")
    return out


def identity_fuse(qualname: str = "model.layers.0.mlp") -> Callable[[nn.Module], FusionReport]:
    """A fuse that "rewrites" a module without changing what it computes (must pass)."""
    return faulty_fuse(qualname, change=lambda out: out, note="no change")
