"""Golden fusion plans (docs/design.md, oracle 3): what fusion does to every architecture, per
Transformers line, in `corpus/expected/<transformers major.minor>.json`.

A *plan entry* summarises one architecture's result, with nothing in it that varies from run to
run (no timings, errors, qualnames or layer indices)::

    {"status": "pass",
     "plan": {"LlamaAttention": {"applied": {"qkv": 2}},
              "Qwen3MoeSparseMoeBlock": {"refused": {"moe": {"the block returns a tuple": 2}}}}}
    {"status": "build-error", "reason": "BuildError: corpus: cannot build 'x' (config): ..."}
    {"status": "unbuildable", "reason": "<the corpus catalog's reason>"}

- `status` is the result status (harness.base.results.STATUSES) or "unbuildable" for an architecture
  the corpus knows it cannot build. Every status but "pass" carries a `reason`: the result's
  message with numbers, hex addresses and file paths folded (`fold`).
- `plan` is present when fusion ran (not for build errors, crashes, timeouts or fuse errors):
  per module *class* (instances aggregated), `applied` counts instances per fuser and `refused`
  counts instances per fuser and reason category.
- `lifecycle`, when lifecycle checks ran (harness.oracles.lifecycle): {operation: pass|fail|n/a}.
  Operations are compared where both the golden entry and the run have a verdict (a run
  without `compile`, or with lifecycle checks off, compares the rest).

Reason categories (`reason_category`): a fuser's refusal reason cut to its stable head: the text
before the first ": " (what follows is detail: a graph dump, the written names, an exception),
with addresses and paths folded and white space collapsed. So "computes no FusedRMSNorm variant:
mul:float32(...)" is "computes no FusedRMSNorm variant" and "fuse failed, module left unchanged:
RuntimeError: ..." is "fuse failed, module left unchanged". Numbers and names stay: a reason is
made from the class and the tiny config, so it is the same on every run, and in "router(x)[2]"
or "(logits, routing weights, expert ids)" they carry the meaning. A failing test prints the
full current reason next to its category.

The golden file is JSON with sorted keys, two-space indent and a trailing newline, so a change
is a small reviewable git diff. It also records the options it was made with (default float32 /
cpu / seed 0; plans are compared only under the same options) and the versions that made it.
`fusion-harness run --update-expected` writes it; `tests/conformance` compares against it, and
`diff_entry` says what changed, per architecture, in words.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.base.errors import InputError
from harness.base.results import ArchResult

FORMAT = 1
EXPECTED_DIR_ENV = "FUSION_HARNESS_EXPECTED_DIR"
"""Overrides where golden files live (tests point it at a temporary directory)."""

UPDATE_HINT = "fusion-harness run --update-expected"

GOLDEN_OPTIONS = {"dtype": "float32", "device": "cpu", "seed": 0}
"""The options golden plans are recorded with (and the only ones they are compared under)."""

NO_PLAN = frozenset({"build-error", "crashed", "timeout", "fuse-error", "unbuildable"})
"""Statuses whose result holds no plan: fusion never ran, or raised."""

INTERRUPTED = frozenset({"crashed", "timeout"})
"""Statuses that describe the run (a worker killed or lost), not the architecture: `update`
never records one over an existing entry."""

RECORDABLE = frozenset({"inconclusive", "forward-error", "build-error", "unbuildable"})
"""Non-green statuses a golden file may accept (the model itself does not build or run, or
the float64 reference cannot judge it). A fusion failure (fail, fused-error, fuse-error) or a
crash/timeout fails conformance even when recorded: fusion is fail-closed."""


class PlanError(ValueError, InputError):
    """A golden file that is missing or unusable (the message says what to do)."""


# ---------------------------------------------------------------------------------- entries


def transformers_line(version: str | None = None) -> str:
    """The "major.minor" of a Transformers version (the installed one by default): "5.24"."""
    if version is None:
        import transformers

        version = transformers.__version__
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        raise PlanError(f"cannot read a major.minor version from {version!r}")
    return f"{int(match[1])}.{int(match[2])}"


def expected_dir() -> Path:
    configured = os.environ.get(EXPECTED_DIR_ENV)
    if configured:
        return Path(configured)
    import corpus

    return Path(corpus.__file__).resolve().parent / "expected"


def golden_path(line: str | None = None) -> Path:
    """corpus/expected/<line>.json (the installed Transformers line by default)."""
    return expected_dir() / f"{line or transformers_line()}.json"


def _fold_places(text: str) -> str:
    """Hex addresses and file paths folded, white space collapsed."""
    text = re.sub(r"0x[0-9a-fA-F]+", "<addr>", text)
    text = re.sub(r"(?<![\w.])(?:/[\w.+\-@]+){2,}/?", "<path>", text)
    return " ".join(text.split())


def fold(text: str) -> str:
    """`text` without what varies between runs and machines: hex addresses, file paths and
    numbers (errors, tolerances, layer indices) are folded, white space collapsed."""
    text = _fold_places(text)
    text = re.sub(r"(?<![A-Za-z_\d])\d+(\.\d+)?([eE][-+]?\d+)?", "N", text)
    return " ".join(text.split())


def reason_category(reason: str) -> str:
    """The stable short form of a refusal reason (see the module docstring)."""
    head = reason.split(": ", 1)[0]
    return _fold_places(head).rstrip(" .,;:") or _fold_places(reason)


def entry_of(result: ArchResult) -> dict[str, Any]:
    """The plan entry of one architecture's result."""
    entry: dict[str, Any] = {"status": result.status}
    if result.status != "pass":
        entry["reason"] = fold(result.message)
    if result.status in NO_PLAN:
        return entry
    plan: dict[str, dict[str, Any]] = {}
    for cls, per_fuser in result.applied_by_class.items():
        plan.setdefault(cls, {})["applied"] = dict(per_fuser)
    for refusal in result.refusals:
        refused = plan.setdefault(refusal.source_class, {}).setdefault("refused", {})
        per_reason = refused.setdefault(refusal.fuser or "none", {})
        category = reason_category(refusal.reason)
        per_reason[category] = per_reason.get(category, 0) + refusal.count
    entry["plan"] = _sorted(plan)
    cycle = lifecycle_of(result)
    if cycle:
        entry["lifecycle"] = cycle
    return entry


def lifecycle_of(result: ArchResult) -> dict[str, str]:
    """{operation: verdict} of the lifecycle checks that ran (a `compile` the mode skipped is
    left out, so plans made with and without compiling compare on what both ran)."""
    from harness.oracles.lifecycle import NOT_COMPILED

    return {
        op: v["verdict"]
        for op, v in sorted(result.lifecycle.items())
        if not (op == "compile" and v.get("detail") == NOT_COMPILED)
    }


def unbuildable_entry(reason: str) -> dict[str, Any]:
    return {"status": "unbuildable", "reason": fold(reason)}


def details_of(result: ArchResult) -> dict[tuple[str, str, str], str]:
    """{(class, fuser, category): one full reason}: the context a diff prints next to a new
    refusal category."""
    return {
        (r.source_class, r.fuser or "none", reason_category(r.reason)): r.reason
        for r in result.refusals
    }


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    return value


# ---------------------------------------------------------------------------------- files


@dataclass(frozen=True)
class Golden:
    """A golden file: where it is, what made it, and its plan entries by architecture."""

    path: Path
    line: str
    versions: dict[str, str]
    options: dict[str, Any]
    architectures: dict[str, dict[str, Any]]


def versions() -> dict[str, str]:
    import torch
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__}


def document(entries: Mapping[str, dict[str, Any]], *, line: str) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "transformers_line": line,
        "generated_with": versions(),
        "options": dict(GOLDEN_OPTIONS),
        "architectures": _sorted(dict(entries)),
    }


def dumps(doc: Mapping[str, Any]) -> str:
    """Stable text: sorted keys, two-space indent, trailing newline (reviewable git diffs)."""
    return json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def load(path: Path | None = None) -> Golden:
    """Read a golden file; PlanError (saying how to make it) if it is missing or malformed."""
    path = path or golden_path()
    line = path.stem
    if not path.exists():
        raise PlanError(
            f"no golden fusion plan for Transformers {line} ({path}); generate it with "
            f"`{UPDATE_HINT}` and review the result in git"
        )
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, expected {FORMAT}")
        entries = doc["architectures"]
        if not isinstance(entries, dict) or not all(
            isinstance(e, dict) and "status" in e for e in entries.values()
        ):
            raise ValueError("'architectures' is not a mapping of entries with a status")
        return Golden(
            path=path,
            line=line,
            versions=dict(doc.get("generated_with", {})),
            options=dict(doc["options"]),
            architectures=entries,
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PlanError(
            f"{path} is not a golden plan file ({exc}); regenerate it with `{UPDATE_HINT}`"
        ) from None


def matches_options(golden: Golden, options: Any) -> bool:
    """Were the golden plans recorded under these check options (dtype, device, seed)?"""
    ours = {k: getattr(options, k) for k in GOLDEN_OPTIONS}
    return ours == {k: golden.options.get(k) for k in GOLDEN_OPTIONS}


def update(
    results: Iterable[ArchResult],
    *,
    unbuildable: Mapping[str, str],
    known: Sequence[str],
    path: Path | None = None,
) -> tuple[Path, dict[str, list[str]]]:
    """Write the golden file of the installed line from `results`; return it and the changes.

    Entries of architectures not in `results` are kept (a sweep of some architectures updates
    only those), every known-unbuildable architecture is refreshed from `unbuildable`, and
    architectures neither in `known` nor unbuildable are dropped. A result that crashed or
    timed out (`INTERRUPTED`) never replaces a recorded entry: it says how this run went,
    not what the architecture does (a slow model under the full lifecycle can time out at the
    default limit on a loaded machine), so the entry is kept and the change says
    why. Returns {architecture: the diff in words} of every entry that changed or was kept
    over such a result.
    """
    path = path or golden_path()
    old: dict[str, dict[str, Any]] = {}
    if path.exists():
        try:
            old = load(path).architectures
        except PlanError:
            old = {}  # unreadable: rewritten whole
    entries = dict(old)
    entries.update({name: unbuildable_entry(reason) for name, reason in unbuildable.items()})
    kept = {r.architecture: r for r in results if r.status in INTERRUPTED and r.architecture in old}
    entries.update({r.architecture: entry_of(r) for r in results if r.architecture not in kept})
    keep = set(known) | set(unbuildable)
    entries = {name: entry for name, entry in entries.items() if name in keep}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(document(entries, line=path.stem)), encoding="utf-8")
    changes = {}
    for name in sorted(set(old) | set(entries)):
        lines = diff_entry(old.get(name), _sorted(entries.get(name)))
        if name in kept:
            lines.append(
                f"kept the recorded entry: this run's result is {kept[name].status}"
                f" ({kept[name].message}); rerun it alone (a larger --timeout) to update it"
            )
        if lines:
            changes[name] = lines
    return path, changes


# ---------------------------------------------------------------------------------- diffs


def _times(n: int) -> str:
    return f"{n} instance{'s' if n != 1 else ''}"


def describe(entry: Mapping[str, Any]) -> str:
    """One line: status (and reason), then the fusions applied per class."""
    text = entry["status"]
    if entry.get("reason"):
        text += f" ({entry['reason']})"
    plan = entry.get("plan")
    if plan is not None:
        fusions = [
            f"{cls} {fuser}({n})"
            for cls, decisions in sorted(plan.items())
            for fuser, n in sorted(decisions.get("applied", {}).items())
        ]
        text += "; fuses " + (", ".join(fusions) if fusions else "nothing")
    return text


def diff_entry(
    expected: Mapping[str, Any] | None,
    actual: Mapping[str, Any] | None,
    details: Mapping[tuple[str, str, str], str] | None = None,
) -> list[str]:
    """What changed from the golden entry to the actual one, one sentence per change.

    `details` ({(class, fuser, category): full reason}, see `details_of`) adds the full reason
    to a new refusal. Empty when the entries agree.
    """
    if expected is None and actual is None:
        return []
    if expected is None:
        return [f"not in the golden plan (new architecture): {describe(actual)}"]
    if actual is None:
        return [f"in the golden plan but no longer in the corpus (was: {describe(expected)})"]
    lines = []
    status, was = actual["status"], expected["status"]
    if status != was:
        why = f": {actual['reason']}" if actual.get("reason") else ""
        lines.append(f"status {status} (expected {was}){why}")
    elif actual.get("reason") != expected.get("reason"):
        lines.append(
            f"{status} for another reason: {actual.get('reason')} "
            f"(expected: {expected.get('reason')})"
        )
    cycle, golden_cycle = actual.get("lifecycle", {}), expected.get("lifecycle", {})
    for op in sorted(set(cycle) & set(golden_cycle)):
        if cycle[op] != golden_cycle[op]:
            lines.append(f"lifecycle {op}: {cycle[op]} (expected {golden_cycle[op]})")
    plan, golden_plan = actual.get("plan"), expected.get("plan")
    if plan is None or golden_plan is None:
        if plan is None and golden_plan:
            lines.append("no plan: fusion did not run (the golden plan has one)")
        elif golden_plan is None and plan:
            lines.append(f"fusion now runs ({describe({'status': status, 'plan': plan})})")
        return lines
    for cls in sorted(set(plan) | set(golden_plan)):
        lines += _diff_class(cls, golden_plan.get(cls, {}), plan.get(cls, {}), details or {})
    return lines


def _diff_class(
    cls: str,
    expected: Mapping[str, Any],
    actual: Mapping[str, Any],
    details: Mapping[tuple[str, str, str], str],
) -> list[str]:
    lines = []
    applied, was_applied = actual.get("applied", {}), expected.get("applied", {})
    refused, was_refused = actual.get("refused", {}), expected.get("refused", {})
    for fuser in sorted(set(applied) | set(was_applied)):
        n, e = applied.get(fuser, 0), was_applied.get(fuser, 0)
        if n == e:
            continue
        if not n:
            why = "; ".join(sorted(refused.get(fuser, {})))
            now = f"; {fuser} now refuses: {why}" if why else ""
            lines.append(f"{cls}: the {fuser} fusion disappeared (expected on {_times(e)}){now}")
        elif not e:
            lines.append(
                f"{cls}: new {fuser} fusion on {_times(n)}, not in the golden plan (review it)"
            )
        else:
            lines.append(f"{cls}: {fuser} fuses {_times(n)}, expected {e}")
    for fuser in sorted(set(refused) | set(was_refused)):
        now, before = refused.get(fuser, {}), was_refused.get(fuser, {})
        appeared, vanished = sorted(set(now) - set(before)), sorted(set(before) - set(now))
        if appeared and vanished and sum(now.values()) == sum(before.values()):
            # the same instances, refused for another reason: one sentence, not two
            new_reasons = "; ".join(_with_detail(details, cls, fuser, c) for c in appeared)
            lines.append(
                f"{cls}: {fuser} refuses {_times(sum(now.values()))} for another reason: "
                f"{new_reasons} (was: {'; '.join(vanished)})"
            )
            now = {c: n for c, n in now.items() if c not in appeared}
            before = {c: n for c, n in before.items() if c not in vanished}
        for category in sorted(set(now) | set(before)):
            n, e = now.get(category, 0), before.get(category, 0)
            if n == e:
                continue
            if not e:
                lines.append(
                    f"{cls}: new refusal by {fuser} on {_times(n)}: "
                    + _with_detail(details, cls, fuser, category)
                )
            elif not n:
                lines.append(f"{cls}: {fuser} no longer refuses: {category} (was {_times(e)})")
            else:
                lines.append(f"{cls}: {fuser} refuses {_times(n)}, expected {e}: {category}")
    return lines


def _with_detail(details: Mapping, cls: str, fuser: str, category: str) -> str:
    full = details.get((cls, fuser, category))
    return f"{category} [full reason: {full}]" if full and full != category else category


def format_diff(name: str, lines: Sequence[str], *, path: Path | None = None) -> str:
    """A failure message: the architecture, where its golden plan is, and the changes."""
    where = f" from {path}" if path else ""
    body = "\n".join(f"  - {line}" for line in lines)
    return (
        f"{name}: fusion plan differs{where}:\n{body}\n"
        f"  (if the change is intended: `{UPDATE_HINT} --arch {name}`, then review the git diff)"
    )


def accepted(entry: Mapping[str, Any]) -> bool:
    """May a golden file hold this non-green status as a known, reasoned break of the line?"""
    return entry["status"] in RECORDABLE and bool(entry.get("reason"))
