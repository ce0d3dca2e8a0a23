"""From one architecture's findings to result records: per-module results, failures with
their signatures, refusals grouped by reason, counts by class (harness.base.results).

Pure functions of a FusionReport's records and the oracles' checks; nothing here runs a
model.
"""

from __future__ import annotations

import re

from harness.base.results import Failure, ModuleResult, Refusal
from harness.oracles import localise, parity


def applied_by_qualname(records) -> dict[str, list]:
    """Applied records grouped by qualname, in report order."""
    grouped: dict[str, list] = {}
    for record in records:
        grouped.setdefault(record.qualname, []).append(record)
    return grouped


def fusers_of(records) -> str:
    return "+".join(dict.fromkeys(r.fuser for r in records))


def module_result(check: localise.ModuleCheck, records) -> ModuleResult:
    """The recorded form of a module check, with the class and fuser(s) from the report.

    A module the forward never called (a vision tower, cross-attention without encoder states)
    is "unused": it cannot have changed these logits, so it does not make the run inconclusive.
    """
    v = check.verdict
    return ModuleResult(
        qualname=check.qualname,
        source_class=records[0].source_class,
        fuser=fusers_of(records),
        status="unused" if check.calls == 0 else v.status,
        fused_error=v.fused_error,
        unfused_error=v.unfused_error,
        tolerance=v.tolerance,
        reason=v.reason,
        calls=check.calls,
    )


def count_by_class(applied) -> dict[str, dict[str, int]]:
    """Applied records counted per module class and fuser: {class: {fuser: instances}}."""
    counts: dict[str, dict[str, int]] = {}
    for record in applied:
        per_fuser = counts.setdefault(record.source_class, {})
        per_fuser[record.fuser] = per_fuser.get(record.fuser, 0) + 1
    return counts


def group_refusals(skipped) -> list[Refusal]:
    """Skipped records counted per (fuser, class, reason), first qualname as the example."""
    groups: dict[tuple, list[str]] = {}
    for record in skipped:
        key = (record.fuser, record.source_class, record.reason)
        groups.setdefault(key, []).append(record.qualname)
    return [
        Refusal(fuser=f, source_class=c, reason=r, count=len(q), example=q[0])
        for (f, c, r), q in groups.items()
    ]


def signature(kind: str, fuser: str | None, source_class: str | None, message: str) -> str:
    """What makes two failures "the same": kind, fuser, class and the message's shape.

    Numbers, hex addresses and layer indices are folded so the same bug in layer 0 and layer 1
    (or with another observed error) has one signature.
    """
    shape = re.sub(r"0x[0-9a-fA-F]+", "0x_", message)
    shape = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", shape)
    return f"{kind}|{fuser or '-'}|{source_class or '-'}|{shape}"


def failure_record(kind, qualname, fuser, source_class, exc: BaseException) -> Failure:
    message = localise.one_line(exc)
    return Failure(
        kind=kind,
        qualname=qualname,
        fuser=fuser,
        source_class=source_class,
        message=message,
        detail=localise.tail(exc),
        signature=signature(kind, fuser, source_class, message),
    )


def model_failure(verdict: parity.Verdict) -> Failure:
    # The message shape (not the numbers) goes into the signature: NaN vs out-of-tolerance.
    return Failure(
        kind="model-parity",
        qualname=None,
        fuser=None,
        source_class=None,
        message=f"logits: {verdict.reason}",
        observed=verdict.fused_error,
        tolerance=verdict.tolerance,
        signature=signature("model-parity", None, None, verdict.reason),
    )


def module_failure(check: localise.ModuleCheck, records) -> Failure | None:
    if check.verdict.status != "fail":
        return None
    fuser, source_class = fusers_of(records), records[0].source_class
    kind = "module-error" if check.raised else "module-parity"
    message = check.raised or check.verdict.reason
    return Failure(
        kind=kind,
        qualname=check.qualname,
        fuser=fuser,
        source_class=source_class,
        message=message,
        detail=check.detail,
        observed=None if check.raised else check.verdict.fused_error,
        tolerance=None if check.raised else check.verdict.tolerance,
        signature=signature(kind, fuser, source_class, message),
    )
