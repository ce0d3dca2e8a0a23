"""fusion: automatic, fail-closed kernel fusion of Hugging Face Transformers modules.

    import fusion
    report = fusion.fuse(model)      # in place; a FusionReport of what was applied / skipped
    report = fusion.plan(model)      # the same decisions, model untouched
    state = fusion.unfused_state_dict(model)  # a fused model's state under unfused names

Layers, bottom to top (each package's `__init__` says what it holds; each imports only the
layers below it, enforced by import-linter, pyproject.toml `[tool.importlinter]`): the leaf
modules `errors`, `numerics`, `report`; `kernels`; `trace`; `analysis`; `runtime`; `fusers`;
`engine`; this package on top.

Every rewrite either provably computes the same function or is refused with a reason.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from fusion import kernels
from fusion.engine import apply
from fusion.engine.tuning import calibrate, kernel_choices
from fusion.errors import RewriteRefused
from fusion.fusers import registry
from fusion.kernels import available_backends, ops
from fusion.report import Applied, FusionReport, Skipped
from fusion.runtime.checkpoint import unfused_state_dict

__all__ = [
    "Applied",
    "FusionReport",
    "RewriteRefused",
    "Skipped",
    "available_backends",
    "calibrate",
    "fuse",
    "kernel_choices",
    "plan",
    "unfused_state_dict",
]


def _chosen_fusers(fusers: Iterable[str] | None) -> tuple | None:
    """The fuser classes named in `fusers`, in the registry's priority order (None: all).
    ValueError naming every unknown name; TypeError for a bare string."""
    if fusers is None:
        return None
    if isinstance(fusers, str):
        raise TypeError(f"fusers: an iterable of fuser names, not the string {fusers!r}")
    names = list(fusers)
    known = [f.name for f in registry.FUSERS]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(
            f"unknown fuser name{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}; known: {', '.join(known)}"
        )
    return tuple(f for f in registry.FUSERS if f.name in names)


def fuse(
    model: nn.Module, backend: str = "auto", *, fusers: Iterable[str] | None = None
) -> FusionReport:
    """Fuse `model` in place, instance by instance, and report what was applied and refused.

    `backend` names the kernel backend the fused modules call: `auto` chooses per op, shape
    and machine by measurement (`fusion.kernels.policy`: where nothing was measured on this
    machine, the reference computes, at the unfused model's speed); `torch` runs torch's
    own ops only; `native`, `onednn` (CPU), `triton`, `vllm` (GPU) pin that backend's
    kernels wherever they are eligible. Only the named backend is built or probed. Works the
    same inside `torch.inference_mode` (what it makes is ordinary tensors); a model whose
    tensors are inference tensors is refused whole (`apply.inference_refusal`). Never
    raises for a model it cannot fuse; raises TypeError if `model` is not an nn.Module,
    ValueError for an unknown backend or one that cannot run on the model's devices.

    `fusers` names the fusers to try (`fusion.inspection.fuser_names()`; default: every
    one), in their usual priority order whatever the order given; ValueError names any
    unknown name.
    """
    chosen = _chosen_fusers(fusers)
    devices = set()
    if isinstance(model, nn.Module):
        devices = {t.device for t in (*model.parameters(), *model.buffers())} or {"cpu"}
    if backend != "auto":
        if backend not in kernels.known_backends():
            raise ValueError(
                f"unknown kernel backend {backend!r}; known: {', '.join(kernels.known_backends())}"
            )
        for device in devices:
            kernels.get(backend, device)  # ValueError naming why it cannot run there
    report = apply.run(model, backend=backend, fusers=chosen)
    if devices and report.applied:
        # Probe kernels and load the policy's table now, not inside a later torch.compile
        # trace (compiled code only reads them); with inference mode off, as `apply.run`
        # fuses, so nothing made here is an inference tensor.
        with torch.inference_mode(False):
            kernels.resolve_ahead(devices)
            ops.prepare(backend)
            report.kernels = kernel_choices(model)
    return report


def plan(model: nn.Module, *, fusers: Iterable[str] | None = None) -> FusionReport:
    """What `fuse` would do to `model`, without changing it (matching, rewriting and
    per-instance validation all run; nothing is installed). `fusers` as in `fuse`."""
    return apply.run(model, dry_run=True, fusers=_chosen_fusers(fusers))
