"""Two fusion systems' decisions compared module by module: the agreement table, classified.

A *decision* is one system fusing one module in one fuser *family* (`qkv`, `glu`,
`merged_column`, `packed_qkv`, `mla`, `rms_norm`, `moe`, `attention`, `residual_norm`,
`decode_linear`), with a `detail` saying what it fuses (the merged projections, or `block` /
`experts` for an MoE block) where the two systems' details are comparable. Comparing the two
systems' decisions on one architecture gives, per family, the modules both fuse alike
(`same`), those only the peer fuses (`peer-only`), those only we fuse (`ours-only`) and those
both fuse differently (`differ`: other projections, or a whole MoE block against its experts
alone) and those both merge alike under different families (`other-family`). Every disagreement is then classified by the first matching `Rule`:

- `reach-gap-ours`: a rewrite our engine could make and does not reach;
- `unsafe`: a rewrite our analysis refuses because it could change the function (the hazard
  is described, and where it runs on a CPU built as a test);
- `definition`: the two systems define the family differently (vLLM's attention dispatch and
  packed-QKV re-layout for tensor parallelism, our residual-norm and decode-linear rewrites,
  which vLLM leaves to its compile passes and linear classes);
- `reach-gap-peer`: a rewrite we make and the peer does not;
- `unclassified`: no rule matched; a new disagreement a person must look at.

Nothing here imports a peer or builds a model: it is plain data, so the logic is tested with
synthetic decisions. Nothing holds state between calls.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

FAMILIES: tuple[str, ...] = (
    "qkv",
    "packed_qkv",
    "glu",
    "merged_column",
    "mla",
    "rms_norm",
    "moe",
    "attention",
    "residual_norm",
    "decode_linear",
)
"""Table rows, in order. A family seen in decisions but not listed here is appended."""

OURS_FAMILY: dict[str, str] = {
    "qkv": "qkv",
    "glu": "glu",
    "sibling": "merged_column",
    "mla": "mla",
    "rmsnorm": "rms_norm",
    "moe": "moe",
    "residual_norm": "residual_norm",
    "decode_linear": "decode_linear",
}
"""Our fuser names (fusion.plan's `Applied.fuser`) -> family."""

KINDS: tuple[str, ...] = ("same", "peer-only", "ours-only", "differ", "other-family")
"""Table columns. `other-family`: both merge the same projections of one module, filed under
different families (vLLM's QKV fuser where our sibling fuser merged, say); counted once,
under the peer's family."""

MERGE_FAMILIES = frozenset({"qkv", "glu", "merged_column", "mla"})
"""Families whose decisions merge projections, paired across families by `compare`."""

CATEGORIES: tuple[str, ...] = (
    "reach-gap-ours",
    "unsafe",
    "definition",
    "reach-gap-peer",
    "unclassified",
)


@dataclass(frozen=True)
class Decision:
    """One system fusing one module (`qualname`, of class `module_class`) in `family`.

    `detail` is what is fused, in a form both systems spell alike (sorted projection names
    joined with "+", or "block" / "experts" for MoE); "" when not comparable, in which case
    any two decisions of one family on one module count as the same. `note` is the system's
    own words (our description, the peer's fuser class), for the reader only.
    """

    family: str
    qualname: str
    module_class: str
    detail: str = ""
    note: str = ""


@dataclass(frozen=True)
class Rule:
    """Classifies a disagreement: it applies when every given field matches.

    `family` compares equal and `kind` is a regular expression matched in full ("" matches
    any of either); `module_class`, `ours` and `peer` are
    regular expressions searched in the module's class name, in our side's text (our detail,
    note or refusal reasons) and in the peer's side's text ("" matches any).
    """

    category: str
    explanation: str
    family: str = ""
    kind: str = ""
    module_class: str = ""
    ours: str = ""
    peer: str = ""

    def matches(self, d: Disagreement) -> bool:
        """Whether this rule describes `d` (pure: reads only its arguments)."""
        return (
            (not self.family or self.family == d.family)
            and (not self.kind or re.fullmatch(self.kind, d.kind) is not None)
            and (not self.module_class or re.search(self.module_class, d.module_class) is not None)
            and (not self.ours or re.search(self.ours, d.ours) is not None)
            and (not self.peer or re.search(self.peer, d.peer) is not None)
        )


@dataclass(frozen=True)
class Disagreement:
    """One module on which the two systems differ in one family, once classified.

    `ours` / `peer` hold each side's detail and note, or our refusal reasons for a module only
    the peer fuses ("" when that side did nothing there and said nothing).
    """

    arch: str
    family: str
    qualname: str
    module_class: str
    kind: str
    ours: str
    peer: str
    category: str = "unclassified"
    explanation: str = ""


@dataclass
class ArchComparison:
    """One architecture compared: per family the count of each kind, and the disagreements.

    `error` is set (and the counts empty) when the model could not be built or a system's
    detection raised: the architecture is recorded, not fatal.
    """

    arch: str
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    disagreements: list[Disagreement] = field(default_factory=list)
    error: str = ""


def _side_text(decision: Decision | None, reasons: Sequence[str] = ()) -> str:
    """A side's words for a disagreement: detail and note, else the refusal reasons."""
    if decision is not None:
        return " | ".join(part for part in (decision.detail, decision.note) if part)
    return " | ".join(reasons)


def compare(
    arch: str,
    ours: Iterable[Decision],
    peer: Iterable[Decision],
    our_refusals: dict[str, list[str]] | None = None,
    rules: Sequence[Rule] = (),
) -> ArchComparison:
    """Compare two systems' decisions on one architecture; classify every disagreement.

    Decisions are keyed by (family, qualname); a system with two decisions on one key keeps
    the first. `our_refusals` ({qualname: reasons}) explains the modules only the peer fuses.
    Returns counts for every family either side used (kinds absent count 0). Pure: the
    inputs are not changed.
    """
    refusals = our_refusals or {}
    mine: dict[tuple[str, str], Decision] = {}
    theirs: dict[tuple[str, str], Decision] = {}
    for decision in ours:
        mine.setdefault((decision.family, decision.qualname), decision)
    for decision in peer:
        theirs.setdefault((decision.family, decision.qualname), decision)
    _pair_other_families(mine, theirs)
    result = ArchComparison(arch)
    for key in sorted(mine.keys() | theirs.keys(), key=_key_order):
        family, qualname = key
        a, b = mine.get(key), theirs.get(key)
        if a is not None and b is not None and a.family != b.family:
            kind = "other-family"
        elif a is not None and b is not None:
            kind = "same" if not a.detail or not b.detail or a.detail == b.detail else "differ"
        else:
            kind = "ours-only" if a is not None else "peer-only"
        row = result.counts.setdefault(family, dict.fromkeys(KINDS, 0))
        row[kind] += 1
        if kind == "same":
            continue
        present = a if a is not None else b
        assert present is not None
        found = Disagreement(
            arch=arch,
            family=family,
            qualname=qualname,
            module_class=present.module_class,
            kind=kind,
            ours=(f"as {a.family}: " if a is not None and a.family != family else "")
            + _side_text(a, refusals.get(qualname, ())),
            peer=_side_text(b),
        )
        result.disagreements.append(classify(found, rules))
    return result


def _pair_other_families(
    mine: dict[tuple[str, str], Decision], theirs: dict[tuple[str, str], Decision]
) -> None:
    """Re-key our merge decisions that the peer files under another family of merges.

    A module we alone merge in family F and the peer alone merges in family G, both with the
    same non-empty detail (the same projections), becomes one entry under the peer's key (G),
    our decision keeping its own `family`. Changes only the dict `mine` built by `compare`.
    """
    for (family, qualname), decision in list(mine.items()):
        if family not in MERGE_FAMILIES or not decision.detail or (family, qualname) in theirs:
            continue
        for (other, name), peer in theirs.items():
            if (
                name == qualname
                and other != family
                and other in MERGE_FAMILIES
                and (other, name) not in mine
                and peer.detail == decision.detail
            ):
                del mine[(family, qualname)]
                mine[(other, name)] = decision
                break


def _key_order(key: tuple[str, str]) -> tuple[int, str, str]:
    """Sort key: family in table order, then qualname."""
    family, qualname = key
    rank = FAMILIES.index(family) if family in FAMILIES else len(FAMILIES)
    return rank, family, qualname


def classify(d: Disagreement, rules: Sequence[Rule]) -> Disagreement:
    """`d` with the category and explanation of the first rule that matches it.

    Returns `d` unchanged ("unclassified") when none does, so a new kind of disagreement is
    reported, never hidden under a guess.
    """
    for rule in rules:
        if rule.matches(d):
            return Disagreement(
                **{**asdict(d), "category": rule.category, "explanation": rule.explanation}
            )
    return d


def total(comparisons: Iterable[ArchComparison]) -> dict[str, dict[str, int]]:
    """Per family, the counts of each kind summed over architectures, rows in table order."""
    sums: dict[str, dict[str, int]] = {}
    for comparison in comparisons:
        for family, row in comparison.counts.items():
            acc = sums.setdefault(family, dict.fromkeys(KINDS, 0))
            for kind, n in row.items():
                acc[kind] += n
    order = sorted(sums, key=lambda f: _key_order((f, "")))
    return {family: sums[family] for family in order}


def table(sums: dict[str, dict[str, int]], peer_name: str = "peer") -> str:
    """The agreement table as Markdown: a row per family, a column per kind, a total row."""
    header = ["family", "same", f"{peer_name} only", "ours only", "differ", "other family"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    totals = dict.fromkeys(KINDS, 0)
    for family, row in sums.items():
        lines.append("| " + " | ".join([family, *(str(row[k]) for k in KINDS)]) + " |")
        for kind in KINDS:
            totals[kind] += row[kind]
    lines.append("| **total** | " + " | ".join(str(totals[k]) for k in KINDS) + " |")
    return "\n".join(lines)


def category_counts(comparisons: Iterable[ArchComparison]) -> dict[str, int]:
    """How many disagreements fall in each category (every category listed, 0 included)."""
    counts = dict.fromkeys(CATEGORIES, 0)
    for comparison in comparisons:
        for d in comparison.disagreements:
            counts[d.category] = counts.get(d.category, 0) + 1
    return counts


def grouped(comparisons: Iterable[ArchComparison]) -> list[dict[str, Any]]:
    """Disagreements grouped by (family, kind, module class, category, explanation).

    Returns one entry per group with its architectures and qualnames, so a class repeated
    in every layer of many models reads as one line. Order: category, family, class.
    """
    groups: dict[tuple[str, ...], dict[str, Any]] = {}
    for comparison in comparisons:
        for d in comparison.disagreements:
            key = (d.category, d.family, d.kind, d.module_class, d.explanation)
            entry = groups.setdefault(
                key,
                {
                    "category": d.category,
                    "family": d.family,
                    "kind": d.kind,
                    "module_class": d.module_class,
                    "explanation": d.explanation,
                    "ours": d.ours,
                    "peer": d.peer,
                    "archs": [],
                    "qualnames": [],
                },
            )
            if d.arch not in entry["archs"]:
                entry["archs"].append(d.arch)
            entry["qualnames"].append(f"{d.arch}:{d.qualname}")
    rank = {c: i for i, c in enumerate(CATEGORIES)}
    return sorted(
        groups.values(),
        key=lambda g: (rank.get(g["category"], len(rank)), g["family"], g["module_class"]),
    )


def report_json(comparisons: Sequence[ArchComparison], meta: dict[str, Any]) -> dict[str, Any]:
    """The whole comparison as JSON-ready data: meta, totals, categories, groups, per arch."""
    return {
        **meta,
        "totals": total(comparisons),
        "categories": category_counts(comparisons),
        "groups": grouped(comparisons),
        "architectures": [asdict(c) for c in comparisons],
    }
