"""Check one architecture: build, fuse a deep copy, run three forwards, judge.

This is the one per-architecture function: the sweep's workers, the conformance tests and repro
replay all call it, so they can never disagree about what "green" means.

Steps, each recorded with its own status when it fails (see harness.base.results.STATUSES):
build (corpus) -> deep copies (fused; float64 reference) -> fusion.fuse(copy) -> unfused forward
with hooks recording every fused module's inputs -> float64 reference forward -> fused forward ->
model verdict on the logits -> per-module verdicts (harness.oracles.localise).

"fusion.fuse(copy)" is the system under test's `apply` (harness.runner.systems, `CheckOptions.system`):
our engine by default; for another system (torch.compile with Inductor) the same oracle judges
its model's logits, without per-module verdicts (it reports no fused modules), and with the
statuses the system names for its errors ("compile-error").
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fusion.kernels.policy import POLICY
from harness.base import architectures
from harness.base.results import ArchResult, Failure, ModuleResult
from harness.oracles import lifecycle, localise, parity, ties, warned
from harness.runner import systems
from harness.runner.arch_records import (
    applied_by_qualname,
    count_by_class,
    failure_record,
    group_refusals,
    model_failure,
    module_failure,
    module_result,
    signature,
)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

FuseFn = Callable[[nn.Module], Any]
"""fusion.fuse's shape: fuse in place, return a FusionReport."""


@dataclass(frozen=True)
class CheckOptions:
    """How to build and run one architecture (everything a result depends on)."""

    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    batch: int = 2
    seq: int = 6
    plugins: tuple[str, ...] = ()
    lifecycle: str = "quick"
    """Lifecycle checks after the parity verdict (`harness.oracles.lifecycle.MODES`)."""
    system: str = systems.DEFAULT
    """The system under test (`harness.runner.systems.NAMES`)."""

    def __post_init__(self) -> None:
        if self.system not in systems.NAMES:  # fail before a model is built for nothing
            systems.get(self.system)  # raises UnknownSystem, listing the known ones

    @property
    def torch_dtype(self) -> torch.dtype:
        try:
            return DTYPES[self.dtype]
        except KeyError:
            raise ValueError(f"dtype {self.dtype!r} is not one of {list(DTYPES)}") from None


@dataclass(frozen=True)
class Subject:
    """What a repro bundle needs beyond the Failure: how to rebuild exactly this model.

    `config` is `model.config.to_dict()` round-tripped through JSON (None when the model has no
    Transformers config); `applied` holds the fusion records with their forward sources.
    """

    architecture: str
    model_type: str | None
    config: dict[str, Any] | None
    options: CheckOptions
    applied: tuple = ()


@dataclass(frozen=True)
class Checked:
    """A check's result, plus the subject when a model was built (for bundles)."""

    result: ArchResult
    subject: Subject | None = None


@dataclass
class _Forwards:
    unfused: Any = None
    reference: Any = None
    fused: Any = None
    reference_error: BaseException | None = None
    fused_error: BaseException | None = None
    calls: dict[str, list] = field(default_factory=dict)
    alone_calls: dict[str, list] = field(default_factory=dict)
    """Calls of the units a system applied alone is localised to (`System.localise_alone`)."""
    unfused_warnings: warned.Lines = field(default_factory=warned.Lines)
    fused_warnings: warned.Lines = field(default_factory=warned.Lines)


def check_architecture(name: str, options: CheckOptions, *, fuse: FuseFn | None = None) -> Checked:
    """Build `name` and check it; never raises for a model-side problem (it is recorded).

    `fuse` defaults to `fusion.fuse` (looked up at call time, so a patched fusion.fuse is used).
    """
    started = time.perf_counter()
    try:
        model = architectures.build(
            name,
            seed=options.seed,
            dtype=options.torch_dtype,
            device=options.device,
            plugins=options.plugins,
        )
        inputs = make_inputs(model, options)
    except Exception as exc:
        return Checked(_result(name, options, started, "build-error", localise.one_line(exc)))
    return check_model(name, model, inputs, options, fuse=fuse, started=started)


def make_inputs(model: nn.Module, options: CheckOptions) -> dict[str, Any]:
    """The corpus's seeded forward inputs for `model` under `options`."""
    import corpus

    return corpus.make_inputs(
        model, seed=options.seed, batch=options.batch, seq=options.seq, device=options.device
    )


def _silent(step: str) -> None:
    """The progress of a check nobody watches (the sweep's workers)."""


def check_model(
    name: str,
    model: nn.Module,
    inputs: Mapping[str, Any],
    options: CheckOptions,
    *,
    fuse: FuseFn | None = None,
    started: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> Checked:
    """Check an already built model on `inputs` (see the module docstring for the steps).

    `model` is left unfused (the fused model and the float64 reference are deep copies), so a
    caller may inspect it afterwards. `options.system` names the system under test; `fuse`
    replaces `fusion.fuse` for the `fusion` system (ValueError for another system).
    `progress` is told each step as it starts (fusing, the forwards, each lifecycle operation):
    a real-size check takes minutes.

    Judged with the kernel policy's routes closed (`KernelPolicy.routing`): a rewritten
    forward runs its rewrite wherever its guards hold, the code a machine that measured a
    kernel faster runs, rather than its class's original, which an uncalibrated machine
    runs by default and which computes the unfused function by construction. The lifecycle
    operation `route` judges the route itself.
    """
    with POLICY.routing(False):
        return _check_model(name, model, inputs, options, fuse, started, progress)


def _check_model(
    name: str,
    model: nn.Module,
    inputs: Mapping[str, Any],
    options: CheckOptions,
    fuse: FuseFn | None,
    started: float | None,
    progress: Callable[[str], None] | None,
) -> Checked:
    """`check_model`'s steps (its docstring)."""
    started = time.perf_counter() if started is None else started
    progress = progress or _silent
    progress("copying the model (fused copy, float64 reference)")
    system = systems.get(options.system, fuse=fuse)
    model.eval()
    subject = _subject(name, model, options)
    fused = copy.deepcopy(model)
    reference = float64_reference(model)
    progress(f"applying {system.name}")
    try:
        with warned.capture() as fusing_warnings:
            prepared = system.apply(fused)
    except Exception as exc:
        failure = failure_record(system.apply_status, None, None, None, exc)
        result = _result(
            name, options, started, system.apply_status, failure.message, failures=[failure]
        )
        return Checked(result, subject)
    fused, report = prepared.model, prepared.report
    if report is not None:
        subject = dataclasses.replace(subject, applied=tuple(report.applied))
    applied, fusion_fields = _fusion_fields(prepared)

    progress("forwards: unfused, float64 reference, fused")
    runs = _Forwards()
    alone = localise.block_children(model) if system.localise_alone else []
    try:
        _unfused_forward(runs, model, inputs, options, applied, alone)
    except Exception as exc:
        message = f"unfused model does not run: {localise.one_line(exc)}"
        return Checked(
            _result(name, options, started, "forward-error", message, **fusion_fields), subject
        )
    _run_reference_and_fused(runs, reference, fused, inputs, options.torch_dtype)
    note = system.note()  # before a localisation applies the system again
    unapplied = system.unapplied() if runs.fused_error is None else ""
    progress("judging the logits and every fused module")
    judged = _judge(runs, model, fused, reference, inputs, options, applied, system)
    status, message = _with_unapplied(judged.status, judged.message, unapplied, judged.failures)
    cycle = _lifecycle(name, model, fused, inputs, options, runs, system, progress)
    if runs.fused_error is None and system.lifecycle:
        status, message = _with_lifecycle(status, message, cycle, judged.failures)
    warnings_record = _warnings(runs, fusing_warnings, system.diagnostics)
    status, message = _with_fused_warnings(
        status, message, warnings_record.get("fused-only", []), judged.failures
    )
    message = _with_note(status, message, note)
    message = _with_compiler_warnings(message, warnings_record.get("compiler", []))
    verdict = judged.verdict
    errors = {
        "unfused_error": verdict.unfused_error if verdict else None,
        "fused_error": verdict.fused_error if verdict else None,
        "tolerance": verdict.tolerance if verdict else None,
    }
    result = _result(
        name, options, started, status, message, **fusion_fields, **errors,
        modules=judged.modules, failures=judged.failures, lifecycle=cycle,
        warnings=warnings_record,
    )  # fmt: skip
    return Checked(result, subject)


def _fusion_fields(prepared: Any) -> tuple[dict[str, list], dict[str, Any]]:
    """({qualname: applied records}, the result fields of what the system applied) of a
    system's prepared model: the FusionReport's counts, classes, refusals and kernels, or
    only the counts a system without a report gives."""
    report = prepared.report
    if report is not None:
        return applied_by_qualname(report.applied), {
            "applied": dict(report.counts()),
            "applied_by_class": count_by_class(report.applied),
            "refusals": group_refusals(report.skipped),
            "kernels": [str(choice) for choice in getattr(report, "kernels", ())],
        }
    return {}, ({"applied": dict(prepared.applied)} if prepared.applied else {})


def _unfused_forward(
    runs: _Forwards,
    model: nn.Module,
    inputs: Mapping[str, Any],
    options: CheckOptions,
    applied: Mapping[str, list],
    alone: list[str],
) -> None:
    """The unfused forward into `runs`, recording the inputs of every fused module and of
    each block child judged alone; raises what the unfused model raises."""
    with (
        warned.capture() as runs.unfused_warnings,
        localise.record_calls(model, list(dict.fromkeys([*applied, *alone]))) as recorded,
    ):
        runs.unfused = _forward(model, inputs, options.torch_dtype)
    runs.calls = {q: recorded[q] for q in applied}
    runs.alone_calls = {q: recorded[q] for q in alone}


def _lifecycle(
    name: str,
    model: nn.Module,
    fused: nn.Module,
    inputs: Mapping[str, Any],
    options: CheckOptions,
    runs: _Forwards,
    system: systems.System,
    progress: Callable[[str], None],
) -> dict[str, dict[str, str]]:
    """The lifecycle verdicts (harness.oracles.lifecycle.check) where the fused forward ran
    and the system has them; `n/a` for a system without; none after a fused error."""
    if runs.fused_error is not None:
        return {}
    if not system.lifecycle:
        return not_applicable(system, options.lifecycle)
    return lifecycle.check(
        name,
        model,
        fused,
        inputs,
        options.torch_dtype,
        parity.logits_of(runs.unfused),
        parity.logits_of(runs.fused),
        mode=options.lifecycle,
        fuse=lambda model: system.apply(model).report,
        progress=progress,
        only=system.lifecycle_operations,
        not_selected=systems.not_applicable(system),
    )


def _warnings(
    runs: _Forwards, fusing: list[str], diagnostics: tuple[str, ...] = ()
) -> dict[str, list[str]]:
    """The result's `warnings` record: what the unfused forward raised, what fusing raised,
    what the fused forward raised that the unfused one did not (`fused-only`), and of those
    the ones raised from the system's own `diagnostics` modules (`compiler`, then not in
    `fused-only`); empty lists left out."""
    fused_only = warned.only_in(runs.fused_warnings, runs.unfused_warnings)
    fused_only, compiler = warned.split_by_origin(
        fused_only, runs.fused_warnings.origins, diagnostics
    )
    record = {
        "unfused": list(runs.unfused_warnings),  # plain lists: results cross processes
        "fusing": list(fusing),
        "fused-only": fused_only,
        "compiler": compiler,
    }
    return {key: lines for key, lines in record.items() if lines}


def _with_compiler_warnings(message: str, compiler: list[str]) -> str:
    """The message with the system's own diagnostics named (status unchanged: they describe
    the compiler, not the model); unchanged when there are none."""
    if not compiler:
        return message
    more = f" (+{len(compiler) - 1} more)" if len(compiler) > 1 else ""
    text = f"compiler warned: {compiler[0][:160]}{more}"
    return f"{message}; {text}" if message else text


def not_applicable(system: systems.System, mode: str) -> dict[str, dict[str, str]]:
    """The lifecycle record of a system to which no lifecycle check applies: every operation
    `n/a` with the reason, or {} when `mode` is off (as for a system that has the checks)."""
    if mode not in lifecycle.MODES:
        raise ValueError(f"lifecycle mode {mode!r} is not one of {lifecycle.MODES}")
    if mode == "off":
        return {}
    detail = systems.not_applicable(system)
    return {op: {"verdict": "n/a", "detail": detail} for op in lifecycle.OPERATIONS}


def _with_note(status: str, message: str, note: str) -> str:
    """The message with the system's note (Inductor's graph counts) added: alone on a pass,
    in brackets after anything else; unchanged when there is no note (the fusion system)."""
    if not note:
        return message
    return note if status == "pass" and not message else f"{message} [{note}]"


def _run_reference_and_fused(
    runs: _Forwards,
    reference: nn.Module,
    fused: nn.Module,
    inputs: Mapping[str, Any],
    dtype: torch.dtype,
) -> None:
    """The float64 reference and the fused forwards, each error kept in `runs` (not raised):
    a reference that cannot run makes the verdict inconclusive, a fused one that raises is
    the fused-error verdict."""
    try:
        with localise.default_dtype(torch.float64):
            runs.reference = _forward(reference, inputs, torch.float64)
    except Exception as exc:
        runs.reference_error = exc
    try:
        with warned.capture() as runs.fused_warnings:
            runs.fused = _forward(fused, inputs, dtype)
    except Exception as exc:
        runs.fused_error = exc


@dataclass
class _Judged:
    status: str
    message: str
    verdict: parity.Verdict | None
    modules: list[ModuleResult]
    failures: list[Failure]


def _judge(
    runs: _Forwards,
    model: nn.Module,
    fused: nn.Module,
    reference: nn.Module,
    inputs: Mapping[str, Any],
    options: CheckOptions,
    applied: dict[str, list],
    system: systems.System,
) -> _Judged:
    """Per-module verdicts (harness.oracles.localise) and the model verdict on the logits, with the
    failures they record, the first naming where to look. A fused forward that raised is
    the system's own status (`System.forward_status`), with the exception's message."""
    mask = parity.token_mask(inputs.get("attention_mask"))
    checks = localise.check_modules(
        runs.calls,
        unfused=model,
        fused=fused,
        reference=reference,
        dtype=options.torch_dtype,
        mask=mask,
    )
    modules = [module_result(check, applied[check.qualname]) for check in checks]
    failures = [module_failure(check, applied[check.qualname]) for check in checks]
    failures = [f for f in failures if f is not None]
    if runs.fused_error is not None:
        failures.insert(0, failure_record(system.forward_kind, None, None, None, runs.fused_error))
        return _Judged(system.forward_status, failures[0].message, None, modules, failures)
    if runs.reference_error is not None:
        reason = f"float64 reference does not run: {localise.one_line(runs.reference_error)}"
        verdict = parity.Verdict("inconclusive", math.nan, math.nan, math.nan, reason)
    else:
        verdict = parity.compare(
            parity.logits_of(runs.fused),
            parity.logits_of(runs.unfused),
            parity.logits_of(runs.reference),
            dtype=options.torch_dtype,
            mask=mask,
        )
        if verdict.status == "fail":
            verdict = _near_ties(verdict, runs, model, reference, inputs, options, mask)
        if verdict.status == "fail":
            failures.insert(0, model_failure(verdict))
            if system.localise_alone:
                found = _localise_alone(runs.alone_calls, model, reference, system, options, mask)
                modules += [module_result(check, records) for check, records in found]
                failures += [f for f in (module_failure(*pair) for pair in found) if f]
                if found and not any(check.verdict.status == "fail" for check, _ in found):
                    verdict = dataclasses.replace(
                        verdict,
                        reason=f"{verdict.reason}; each of the {len(found)} layer modules "
                        f"{system.name} was applied to alone agrees with eager: the departure "
                        "arises only in the whole model's graph",
                    )
                    failures[0] = model_failure(verdict)
    status, message = _overall(verdict, modules)
    return _Judged(status, message, verdict, modules, failures)


def _near_ties(
    verdict: parity.Verdict,
    runs: _Forwards,
    model: nn.Module,
    reference: nn.Module,
    inputs: Mapping[str, Any],
    options: CheckOptions,
    mask: torch.Tensor | None,
) -> parity.Verdict:
    """A failed logits `verdict`, or an inconclusive one when the logits fail only at tokens
    after a near-tie top-k choice of the float64 reference (`harness.oracles.ties`): the unfused and
    reference forwards are run again recording their topk scores, the fragile tokens and
    their rows' later positions leave the mask, and the rest must pass. Never a pass: the
    excluded tokens were not judged. Any doubt (no 2-D mask, calls that do not pair up, a
    row that cannot be placed, nothing left, a re-run that raises) keeps the failure."""
    if mask is None:
        return verdict
    try:
        with ties.record_topk() as mine:
            _forward(model, inputs, options.torch_dtype)
        with localise.default_dtype(torch.float64), ties.record_topk() as exact:
            _forward(reference, inputs, torch.float64)
    except Exception:  # the forwards ran before; a re-run that cannot is no evidence
        return verdict
    rows = ties.fragile_rows(mine, exact, options.torch_dtype)
    clean = ties.clean_mask(mask, rows, exact) if rows else None
    if clean is None or not clean.any():
        return verdict
    logits = [parity.logits_of(out) for out in (runs.fused, runs.unfused, runs.reference)]
    rest = parity.compare(*logits, dtype=options.torch_dtype, mask=clean)
    if rest.status != "pass":
        return verdict
    judged, total = int(clean.sum()), int(mask.sum())
    reason = (
        f"{verdict.reason}, only at or after near-tie top-k choices of the float64 reference "
        f"({ties.describe(rows, mask.shape[1])}); the other {judged} of {total} tokens pass "
        f"(fused error {rest.fused_error:.3g} <= {rest.tolerance:.3g})"
    )
    return dataclasses.replace(verdict, status="inconclusive", reason=reason)


@dataclass(frozen=True)
class _Alone:
    """What `module_result` reads of an applied record, for a module a system was applied to
    alone: its class, and the system's name where a fuser's would be."""

    qualname: str
    fuser: str
    source_class: str


def _localise_alone(
    calls: Mapping[str, list],
    model: nn.Module,
    reference: nn.Module,
    system: systems.System,
    options: CheckOptions,
    mask: torch.Tensor | None,
) -> list[tuple[localise.ModuleCheck, list[_Alone]]]:
    """Each recorded unit (`System.localise_alone`) judged with the system applied to a deep
    copy of the unfused module alone, on the inputs it saw in the unfused forward; with the
    records `module_result` names it by. Units the forward never called are left out (they
    cannot have moved these logits). Applying the system to a unit may raise: that unit is
    then a module that raised, named with the exception."""
    found = []
    for qualname, recorded in calls.items():
        if not recorded:
            continue
        unfused = model.get_submodule(qualname)
        records = [_Alone(qualname, system.name, type(unfused).__name__)]
        try:
            alone = system.apply(copy.deepcopy(unfused)).model
        except Exception as exc:
            raised = f"{system.name} applied to the module alone raised: {localise.one_line(exc)}"
            verdict = parity.Verdict("fail", math.nan, math.nan, math.nan, raised)
            check = localise.ModuleCheck(
                qualname, verdict, len(recorded), raised, localise.tail(exc)
            )
            found.append((check, records))
            continue
        versions = [unfused, alone, reference.get_submodule(qualname)]
        check = localise.check_versions(
            qualname, recorded, versions, dtype=options.torch_dtype, mask=mask
        )
        found.append((check, records))
    return found


def _with_lifecycle(
    status: str, message: str, cycle: dict[str, dict[str, str]], failures: list[Failure]
) -> tuple[str, str]:
    """Status and message once the lifecycle verdicts are in: a failed operation is a fusion
    defect (the unfused model did it), so it fails a run that otherwise passed, and each one
    is recorded as a `lifecycle` failure."""
    failed = [(op, v["detail"]) for op, v in cycle.items() if v["verdict"] == "fail"]
    for op, detail in failed:
        text = f"lifecycle {op}: {detail}"
        failures.append(
            Failure(
                kind="lifecycle",
                qualname=None,
                fuser=None,
                source_class=None,
                message=text,
                signature=signature("lifecycle", None, None, text),
            )
        )
    if not failed or status in {"fail", "fused-error"}:
        return status, message
    more = f"; {len(failed) - 1} more lifecycle operation(s) fail" if len(failed) > 1 else ""
    return "fail", f"lifecycle {failed[0][0]}: {failed[0][1]}{more}"


def _with_unapplied(
    status: str, message: str, unapplied: str, failures: list[Failure]
) -> tuple[str, str]:
    """Status and message once the system said whether it applied what it promised: a
    reason (`System.unapplied`) is a `not-applied` failure, first, and fails a run that
    otherwise passed: parity of a model the system left alone tests nothing."""
    if not unapplied:
        return status, message
    text = f"not-applied: {unapplied}"
    failures.insert(0, model_failure_text("not-applied", text))
    if status in {"fail", "fused-error"}:
        return status, f"{message}; {text}" if message else text
    return "fail", text


def model_failure_text(kind: str, text: str) -> Failure:
    """A model-level Failure of `kind` with `text` as its message."""
    return Failure(
        kind=kind,
        qualname=None,
        fuser=None,
        source_class=None,
        message=text,
        signature=signature(kind, None, None, text),
    )


def _with_fused_warnings(
    status: str, message: str, fused_only: list[str], failures: list[Failure]
) -> tuple[str, str]:
    """Status and message once the warnings are compared: a warning only the fused forward
    raises is something a user of the fused model sees and a user of the unfused one does
    not (fusion is not invisible), so it fails a run that otherwise passed, recorded as one
    `fused-warning` failure per line."""
    for text in fused_only:
        failures.append(
            Failure(
                kind="fused-warning",
                qualname=None,
                fuser=None,
                source_class=None,
                message=f"only the fused model warns: {text}",
                signature=signature("fused-warning", None, None, text),
            )
        )
    if not fused_only or status in {"fail", "fused-error"}:
        return status, message
    more = f"; {len(fused_only) - 1} more" if len(fused_only) > 1 else ""
    return "fail", f"only the fused model warns: {fused_only[0]}{more}"


def float64_reference(model: nn.Module) -> nn.Module:
    """A float64 deep copy of `model`: the same weights, upcast exactly, run as eager math.

    Mixture-of-experts layers default to torch's grouped_mm, which has no float64 kernel, so
    the copy is switched to the eager experts loop (the same function, computed per expert).
    """
    reference = copy.deepcopy(model).to(torch.float64)
    config = getattr(reference, "config", None)
    if getattr(config, "_experts_implementation", "eager") not in (None, "eager"):
        # If it cannot switch, the reference forward fails and that is recorded.
        with contextlib.suppress(Exception):
            reference.set_experts_implementation("eager")
    return reference


def _forward(model: nn.Module, inputs: Mapping[str, Any], dtype: torch.dtype) -> Any:
    """model(**inputs) without autograd, floating inputs cast to the model's compute dtype."""
    cast = {
        k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in inputs.items()
    }
    with torch.no_grad():
        return model(**cast)


def _overall(verdict: parity.Verdict, modules: list[ModuleResult]) -> tuple[str, str]:
    """Status and message of a run whose forwards all completed.

    A failing module is named first (it says where to look); the logits verdict follows.
    """
    bad = [m for m in modules if m.status == "fail"]
    if bad:
        m = bad[0]
        message = f"{m.qualname} ({m.source_class}) [{m.fuser}]: {m.reason}"
        more = f"; {len(bad) - 1} more module(s) fail" if len(bad) > 1 else ""
        logits = f"; logits: {verdict.reason}" if verdict.status == "fail" else ""
        return "fail", message + more + logits
    if verdict.status == "fail":
        return "fail", f"logits: {verdict.reason}"
    if verdict.status == "inconclusive":
        return "inconclusive", f"logits: {verdict.reason}"
    unsure = [m for m in modules if m.status == "inconclusive"]
    if unsure:
        return "inconclusive", f"{unsure[0].qualname}: {unsure[0].reason}"
    return "pass", ""


def _subject(name: str, model: nn.Module, options: CheckOptions) -> Subject:
    config = getattr(model, "config", None)
    config_dict = None
    if config is not None and hasattr(config, "to_json_string"):
        # Through JSON so the bundle holds exactly what replay will read back.
        config_dict = json.loads(config.to_json_string(use_diff=False))
    return Subject(name, getattr(config, "model_type", None), config_dict, options)


def _result(
    name: str, options: CheckOptions, started: float, status: str, message: str, **fields: Any
) -> ArchResult:
    return ArchResult(
        architecture=name,
        status=status,
        dtype=options.dtype,
        device=options.device,
        seed=options.seed,
        seconds=round(time.perf_counter() - started, 4),
        message=message,
        system=options.system,
        **fields,
    )
