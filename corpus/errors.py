"""The corpus's one exception type, so callers can tell "this architecture cannot be built" apart
from bugs in their own code."""

from __future__ import annotations

__all__ = ["BuildError"]


class BuildError(RuntimeError):
    """A corpus architecture could not be turned into a tiny model (or run a forward).

    ``arch`` names the architecture, ``stage`` says where it failed (``config``, ``model``,
    ``forward``, ``unknown``) and ``reason`` is a one-line cause; ``str()`` combines them, so the
    message always names the architecture. The original exception is chained as ``__cause__``.
    """

    def __init__(self, arch: str, stage: str, reason: str) -> None:
        self.arch = arch
        self.stage = stage
        self.reason = reason
        super().__init__(f"corpus: cannot build {arch!r} ({stage}): {reason}")
