"""The fuzzer's verdicts and their tally: `Failure` (why one example violates the fusion
property), `Outcome` (the verdict on one example), `Tally` (counts per shape and family, shared
by the property tests and the terminal summary) and `outcome_summary` (for bundles and notes).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusion.report import FusionReport
from tests.fuzz.strategies import SHAPES, GeneratedModule


@dataclass(frozen=True)
class Failure:
    """Why one example violates the fusion property."""

    kind: str
    message: str
    detail: str = ""
    observed: float | None = None
    tolerance: float | None = None

    @property
    def signature(self) -> str:
        """What makes two failures "the same" for de-duplicating repro bundles."""
        return f"{self.kind}|{self.message.splitlines()[0][:120]}"


@dataclass
class Outcome:
    """The verdict on one example: `status` is fused, refused or crashed (the unfused
    forward itself raised: a generator bug, counted but not a fusion failure)."""

    status: str
    report: FusionReport | None = None
    failure: Failure | None = None
    crash: str = ""
    """Why the unfused forward raised (crashed), or why a post-fuse edit example was not
    judged (`n/a`: no site for its kind; `discarded`: the unfused model refuses the edit,
    or both models raise after it)."""

    @property
    def fusers(self) -> tuple[str, ...]:
        return tuple(sorted({r.fuser for r in self.report.applied})) if self.report else ()


# -- the tally ------------------------------------------------------------------------------------


@dataclass
class Tally:
    """fused / refused / crashed counts per shape, for all modules and for safe ones, and
    which fusers applied. Shared by the property tests and the pytest terminal summary.

    A module counts as fused when any fuser applied anywhere in it (a decoder layer whose
    norms fused counts, whatever its attention did); `fusers` says which. When a property
    fails, the calls Hypothesis makes while shrinking are counted too.

    With `checkpoint` set, the tally so far is written there (JSON, replaced atomically)
    every `every` examples: a run of hours that is stopped or crashes keeps its counts."""

    counts: dict[str, Counter[str]] = field(default_factory=dict)
    fusers: dict[str, Counter[str]] = field(default_factory=dict)
    families: dict[str, Counter[str]] = field(default_factory=dict)
    """Per grammar family (a hazard's or feature's label up to its first ':', e.g.
    `region`, `guard`, `upcast`): how the examples that drew it ended."""
    checkpoint: Path | None = None
    every: int = 100

    def save(self, path: Path) -> None:
        """Writes `to_json()` to `path` through a temporary file, so a reader never sees a
        half-written tally."""
        partial = path.with_name(path.name + ".tmp")
        partial.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        partial.replace(path)

    def examples(self) -> int:
        """Examples recorded so far, every shape together."""
        return sum(row["examples"] for row in self.counts.values())

    def record(self, generated: GeneratedModule, outcome: Outcome) -> None:
        row = self.counts.setdefault(generated.shape, Counter())
        row[outcome.status] += 1
        row["examples"] += 1
        if generated.safe:
            row["safe"] += 1
            row[f"safe_{outcome.status}"] += 1
        if outcome.failure is not None:
            row["failures"] += 1
        for name in outcome.fusers:
            self.fusers.setdefault(generated.shape, Counter())[name] += 1
        for family in dict.fromkeys(
            label.split(":", 1)[0] for label in (*generated.hazards, *generated.features)
        ):
            row = self.families.setdefault(family, Counter())
            row[outcome.status] += 1
            row["examples"] += 1
            if outcome.failure is not None:
                row["failures"] += 1
        if self.checkpoint is not None and self.examples() % self.every == 0:
            self.save(self.checkpoint)

    def record_edit(self, shape: str, kind: str, outcome: Outcome) -> None:
        """One post-fuse edit example: counted in its edit kind's family (`edit-<kind>`) and
        in the `edit:<shape>` row, never in the generated module's own families, whose
        counts stay those of `test_fuse_is_safe`."""
        for row in (
            self.families.setdefault(f"edit-{kind}", Counter()),
            self.counts.setdefault(f"edit:{shape}", Counter()),
        ):
            row[outcome.status] += 1
            row["examples"] += 1
            if outcome.failure is not None:
                row["failures"] += 1
        if self.checkpoint is not None and self.examples() % self.every == 0:
            self.save(self.checkpoint)

    def merge(self, other: dict[str, Any]) -> None:
        """Add a `to_json()` dict (e.g. from an xdist worker)."""
        for shape, row in other.get("counts", {}).items():
            self.counts.setdefault(shape, Counter()).update(row)
        for shape, row in other.get("fusers", {}).items():
            self.fusers.setdefault(shape, Counter()).update(row)
        for family, row in other.get("families", {}).items():
            self.families.setdefault(family, Counter()).update(row)

    def safe_fused_ratio(self, shape: str) -> float:
        row = self.counts.get(shape, Counter())
        return row["safe_fused"] / row["safe"] if row["safe"] else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "counts": {shape: dict(row) for shape, row in self.counts.items()},
            "fusers": {shape: dict(row) for shape, row in self.fusers.items()},
            "families": {family: dict(row) for family, row in sorted(self.families.items())},
            "safe_fused_ratio": {shape: self.safe_fused_ratio(shape) for shape in self.counts},
        }

    def lines(self) -> list[str]:
        """A small table: one row per shape."""
        out = [
            f"{'shape':<14}{'examples':>9}{'fused':>7}{'refused':>8}{'crashed':>8}{'failed':>7}"
            f"{'safe':>6}{'safe fused':>11}  fusers"
        ]
        for shape in [s for s in SHAPES if s in self.counts] + sorted(
            set(self.counts) - set(SHAPES)
        ):
            row = self.counts[shape]
            fusers = ", ".join(f"{k}={v}" for k, v in sorted(self.fusers.get(shape, {}).items()))
            out.append(
                f"{shape:<14}{row['examples']:>9}{row['fused']:>7}{row['refused']:>8}"
                f"{row['crashed']:>8}{row['failures']:>7}{row['safe']:>6}"
                f"{self.safe_fused_ratio(shape):>10.0%}  {fusers}"
            )
        if self.families:
            out.append(
                f"{'family':<14}{'examples':>9}{'fused':>7}{'refused':>8}{'failed':>7}{'n/a':>6}"
            )
            for family, row in sorted(self.families.items()):
                # n/a: crashed (the unfused forward raised), or for an edit kind, no site or
                # discarded (the unfused model refuses the edit, or both raise after it)
                other = row["examples"] - row["fused"] - row["refused"]
                out.append(
                    f"{family:<14}{row['examples']:>9}{row['fused']:>7}{row['refused']:>8}"
                    f"{row['failures']:>7}{other:>6}"
                )
        return out


SESSION_TALLY = Tally()
"""Every example checked in this process (printed at the end of the pytest session)."""


def outcome_summary(outcome: Outcome) -> dict[str, Any]:
    """A JSON-ready summary of an outcome (for bundles and notes)."""
    report = outcome.report
    return {
        "status": outcome.status,
        "failure": (
            {
                key: (
                    repr(value) if isinstance(value, float) and not math.isfinite(value) else value
                )
                for key, value in dataclasses.asdict(outcome.failure).items()
            }
            if outcome.failure
            else None
        ),
        "applied": [
            {"qualname": r.qualname, "fuser": r.fuser, "description": r.description}
            for r in (report.applied if report else [])
        ],
        "skipped": [
            {"qualname": r.qualname, "fuser": r.fuser, "reason": r.reason}
            for r in (report.skipped if report else [])
        ],
    }
