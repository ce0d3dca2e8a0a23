"""fusion: automatic, fail-closed kernel fusion of Hugging Face Transformers modules.

    import fusion
    report = fusion.fuse(model)      # in place; a FusionReport of what was applied / skipped
    report = fusion.plan(model)      # the same decisions, model untouched

Every rewrite either provably computes the same function or is refused with a reason.
"""

from __future__ import annotations

from torch import nn

from fusion.errors import RewriteRefused
from fusion.kernels import available_backends
from fusion.report import Applied, FusionReport, Skipped

__all__ = [
    "Applied",
    "FusionReport",
    "RewriteRefused",
    "Skipped",
    "available_backends",
    "fuse",
    "plan",
]


def fuse(model: nn.Module, backend: str = "auto") -> FusionReport:
    """Fuse `model` in place, instance by instance, and report what was applied and refused.

    `backend` names the kernel backend the fused modules call (`auto`: the fastest available
    for the tensors' device at call time). Never raises for a model it cannot fuse; raises
    TypeError if `model` is not an nn.Module, ValueError for an unknown backend.
    """
    from fusion import apply, kernels

    if backend != "auto" and backend not in kernels.available_backends():
        raise ValueError(
            f"unknown or unavailable backend {backend!r}; available: {kernels.available_backends()}"
        )
    report = apply.run(model, backend=backend)
    if isinstance(model, nn.Module) and report.applied:
        # Probe kernels now, not inside a later torch.compile trace (see kernels._AUTO).
        devices = {t.device for t in (*model.parameters(), *model.buffers())} or {"cpu"}
        kernels.resolve_ahead(devices)
    return report


def plan(model: nn.Module) -> FusionReport:
    """What `fuse` would do to `model`, without changing it (matching, rewriting and
    per-instance validation all run; nothing is installed)."""
    from fusion import apply

    return apply.run(model, dry_run=True)
