"""Fusion reach: per fuser family, how many module classes fusion reaches, and why the rest
are refused, over a sweep's results.

A module class is *reached* by a family when a fuser of that family fused at least one of its
instances (in any architecture). A class no fuser fused is a *candidate* of every family
whose fusers refused it; a class some family fused counts for that family only (an MLP that
`glu` fused is not an attention candidate because `sibling` also looked at it). The refusals
listed are those of unreached classes, by reason category (`harness.reporting.plans.reason_category`),
counted in classes: what to work on to raise reach.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from harness.base.results import ArchResult
from harness.reporting.plans import reason_category

FAMILIES: dict[str, tuple[str, ...]] = {
    "attention": ("qkv", "sibling", "mla"),
    "glu": ("glu",),
    "rmsnorm": ("rmsnorm",),
    "moe": ("moe",),
}
"""Fuser family -> its fusers (`fusion.inspection.fuser_names()`)."""

_FAMILY_OF = {fuser: family for family, fusers in FAMILIES.items() for fuser in fusers}


@dataclass
class Reach:
    """One family's reach: candidate classes, reached classes, refusal categories."""

    family: str
    candidates: set[str] = field(default_factory=set)
    reached: set[str] = field(default_factory=set)
    refusals: Counter[str] = field(default_factory=Counter)

    @property
    def share(self) -> float:
        return len(self.reached) / len(self.candidates) if self.candidates else 1.0


def reach(results: Sequence[ArchResult]) -> dict[str, Reach]:
    """{family: Reach} over `results` (see the module docstring for the counting rules)."""
    fused_by: dict[str, set[str]] = {}
    refused_by: dict[str, dict[str, set[str]]] = {}  # class -> family -> categories
    for result in results:
        for cls, per_fuser in result.applied_by_class.items():
            for fuser, count in per_fuser.items():
                if count and fuser in _FAMILY_OF:
                    fused_by.setdefault(cls, set()).add(_FAMILY_OF[fuser])
        for refusal in result.refusals:
            family = _FAMILY_OF.get(refusal.fuser or "")
            if family is not None:
                categories = refused_by.setdefault(refusal.source_class, {})
                categories.setdefault(family, set()).add(reason_category(refusal.reason))
    table = {family: Reach(family) for family in FAMILIES}
    for cls, families in fused_by.items():
        for family in families:
            table[family].candidates.add(cls)
            table[family].reached.add(cls)
    for cls, per_family in refused_by.items():
        if cls in fused_by:
            continue
        for family, categories in per_family.items():
            table[family].candidates.add(cls)
            table[family].refusals.update(categories)
    return table


def format_reach(table: dict[str, Reach], *, top: int = 8) -> str:
    """One line per family (reached / candidate classes, the share), then its refusal
    categories one per line, most classes first: at most `top`, and a count of the rest,
    so a regression in reach shows in the summary without reading the results file."""
    lines = ["reach (module classes fused / candidates; refusals of the rest, in classes):"]
    for family, r in table.items():
        if not r.candidates:
            continue
        lines.append(f"  {family:<9} {len(r.reached):>4}/{len(r.candidates):<4} {r.share:4.0%}")
        ranked = r.refusals.most_common()
        lines.extend(f"    {n:>4}  {category}" for category, n in ranked[:top])
        if len(ranked) > top:
            rest = sum(n for _, n in ranked[top:])
            lines.append(f"    {rest:>4}  ({len(ranked) - top} more categories)")
    return "\n".join(lines)
