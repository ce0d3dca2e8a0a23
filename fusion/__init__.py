"""fusion: automatic, fail-closed kernel fusion of Hugging Face Transformers modules.

Public API: `fuse`, `plan`, `FusionReport`, `available_backends`.
"""

from fusion.report import Applied, FusionReport, Skipped

__all__ = ["Applied", "FusionReport", "Skipped", "fuse", "plan"]


def fuse(model, backend: str = "auto") -> FusionReport:  # placeholder until fusion.apply lands
    return FusionReport()


def plan(model) -> FusionReport:  # placeholder until fusion.apply lands
    return FusionReport(dry_run=True)
