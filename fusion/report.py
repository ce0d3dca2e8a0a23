"""What a fusion pass did: the records `fusion.fuse` and `fusion.plan` return."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Applied:
    """One module instance rewritten by one fuser.

    `original_source` / `rewritten_source` hold the forward's source before and after the
    rewrite (None for fusers that replace the whole module instead of rewriting a forward),
    so a bug report can show exactly what changed.
    """

    qualname: str
    fuser: str
    source_class: str
    description: str
    original_source: str | None = None
    rewritten_source: str | None = None

    def __str__(self) -> str:
        return f"{self.qualname}: {self.description} ({self.source_class}) [{self.fuser}]"


@dataclass(frozen=True)
class Skipped:
    """One module instance a fuser (or every fuser, `fuser=None`) refused, and why."""

    qualname: str
    fuser: str | None
    source_class: str
    reason: str

    def __str__(self) -> str:
        # Without a fuser the record says why the module was left alone (e.g. already
        # fused), not that some fuser refused it.
        where = self.qualname or "<root>"
        if self.fuser is None:
            return f"{where} ({self.source_class}): skipped: {self.reason}"
        return f"{where} ({self.source_class}): {self.fuser} refused: {self.reason}"


@dataclass
class KernelChoice:
    """Which kernel computes one product of a fused model on this machine, at a decode
    step and at a prompt chunk, and why (`fusion.engine.tuning.kernel_choices`)."""

    op: str
    shape: tuple[int, ...]
    dtype: str
    backend: str
    decode: tuple[str, str]
    """(kernel, why) at one row."""
    prefill: tuple[str, str]
    """(kernel, why) at 128 rows."""
    modules: list[str]
    """The fused modules computing this product (same op, shape, dtype, backend)."""

    def __str__(self) -> str:
        shape = "x".join(map(str, self.shape))
        where = self.modules[0] + (f" and {len(self.modules) - 1} more" if self.modules[1:] else "")
        return (
            f"{self.op} {shape} {self.dtype} ({where}): decode {self.decode[0]} "
            f"({self.decode[1]}); prefill {self.prefill[0]} ({self.prefill[1]})"
        )


@dataclass
class FusionReport:
    """Applied and skipped records of one `fuse`/`plan` call, in model traversal order, and
    (after `fuse`) which kernel each fused product runs on this machine."""

    applied: list[Applied] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    dry_run: bool = False
    kernels: list[KernelChoice] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """Number of applied fusions per fuser name."""
        return dict(Counter(record.fuser for record in self.applied))

    def __str__(self) -> str:
        verb = "would apply" if self.dry_run else "applied"
        lines = [f"FusionReport: {len(self.applied)} {verb}, {len(self.skipped)} skipped"]
        for fuser, count in sorted(self.counts().items()):
            lines.append(f"  {fuser}: {count}")
        if self.applied:
            lines.append("applied:")
            lines.extend(f"  {record}" for record in self.applied)
        if self.skipped:
            lines.append("skipped:")
            lines.extend(f"  {record}" for record in self.skipped)
        if self.kernels:
            lines.append("kernels on this machine:")
            lines.extend(f"  {choice}" for choice in self.kernels)
        return "\n".join(lines)
