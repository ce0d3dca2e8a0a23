"""Systems under test: what the harness does to a built model before the oracles judge it.

The harness's oracles (parity against the unfused model and a float64 reference, the
lifecycle checks, golden plans, repro bundles) judge a *system*: something that takes an
unfused model and returns the model to run. Each system is a `System` record:

- `fusion` (the default): this project's engine, `fusion.fuse` in place. Its FusionReport is
  the plan (applied and refused modules, golden plans compare it), every lifecycle check
  applies, and its failures are `fuse-error` / `fused-error`.
- `inductor`: `torch.compile` with its default Inductor backend, applied in place
  (`nn.Module.compile`), so every call of the model, `generate` included, runs compiled
  code and `state_dict` keys stay the model's own. Compilation happens at the first call; an
  error there (or in the compile call) where the eager model runs is `compile-error`. The
  plan it reports is what Dynamo counted: graphs and graph breaks.
- `inductor-freezing`: the same with Inductor's `freezing` option, for inference under
  `torch.no_grad` (the harness's forwards): weights are folded into the compiled graph as
  constants when it is compiled, so later weight edits are not seen by design.
- `vllm`: vLLM's own Transformers-backend fusers applied with its layers' native forwards at
  tensor parallel size 1 (`harness.peers.vllm_apply`; only where vLLM imports, the peer
  environment). Its note is what vLLM applied and left per family; its failures are
  `fuse-error` / `fused-error`, as ours are, with the system named in every result.
- `liger`: Liger Kernel's own `apply_liger_kernel_to_<type>(model=...)`, its globals scoped
  to the patched model (`harness.peers.liger_apply`; Triton's interpreter where no GPU). Its
  report lists the module forwards Liger replaced (per-module verdicts judge each), the
  lifecycle checks that apply to it run (`LIGER_LIFECYCLE`), and a patch whose model
  launched none of the kernels it promised fails as `not-applied` (`System.unapplied`).

A compiler's warnings about its own work (`System.diagnostics`) are recorded apart, as
`compiler` warnings named in the result's message, rather than failing as a warning only the
fused model raises: they describe the compiler, and the oracles judge what the compiled model
computes.

Lifecycle checks do not apply to the Inductor and vLLM systems yet: most of them (a training step,
save/load, weight edits) would each compile again (tens of seconds apiece on a 2-core CPU),
and `harness.oracles.lifecycle.check` runs all of its operations or none; vLLM's layers are built for
serving (no training, no save_pretrained). They are recorded `n/a` with the reason
(`not_applicable`).

`get(name)` makes a system; `NAMES` lists them; `unavailable(name)` says why one cannot run
here. Nothing here holds state between calls beyond what a system's own `note` reports of its
last `apply` (held in that System's closure): a System is frozen, and `apply` changes only
the model it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._dynamo.utils import counters

import fusion
from fusion.report import FusionReport
from harness.peers import liger_apply, vllm_apply

DEFAULT = "fusion"
NAMES = ("fusion", "inductor", "inductor-freezing", "vllm", "liger")
"""Every system `get` makes; the first is the default."""

FUSION_TIMEOUT = 300.0
"""Seconds one architecture may take in a sweep of `fusion`: a hang's bound, not a budget.
Build, fuse, three forwards and the quick lifecycle checks take seconds; the full lifecycle
on the slowest corpus model (musicgen on Transformers 4.57) stays well inside it, its
slowest operations being edit-attributes, quantize-dynamic and load-state-dict."""

INDUCTOR_TIMEOUT = 600.0
"""Seconds one architecture may take in a sweep of an Inductor system: above a tiny model's
first compile (Inductor's one-time start-up included), which takes longer for deep MoE
models whose experts loop unrolls."""

VLLM_TIMEOUT = 300.0
"""Seconds one architecture may take in a sweep of `vllm`: its fusers trace and compile each
class's rewritten forward besides our own steps."""

LIGER_TIMEOUT = 600.0
"""Seconds one architecture may take in a sweep of `liger`: an interpreted forward is
100-300x slower than eager (0.3-2 s for a tiny dense model, 4-9 s with MoE experts on a
loaded 2-core CPU), and the lifecycle checks run several more forwards and a backward."""

LIGER_LIFECYCLE = ("generate", "train", "save-pretrained")
"""The lifecycle operations that apply to a Liger-patched model: what a Liger user does with
it (generate, fine-tune, save). The others check properties of our engine's rewrites
(merged Parameters, guards, routes, fused-model copies) or re-apply the system to copies."""

LIGER_DIAGNOSTICS = ("liger_kernel",)
"""Liger's own warnings about its dispatch (a GPU backend that does not import here) are
its diagnostics, recorded apart and named, as a compiler's are."""

COMPILER_MODULES = ("torch._dynamo", "torch._inductor")
"""Where torch.compile's own diagnostics come from: Dynamo's (graph breaks, "ignores the cache
wrapper" of an `lru_cache` function it traces through) and Inductor's ("does not support code
generation for complex operators", a fallback to eager kernels). Measured on the 5.24 corpus:
these were every fused-only warning of the `inductor` sweeps (6 of 193 architectures in
float32, 59 in bfloat16), each with parity passing."""


class UnknownSystem(ValueError):
    """A system name that `get` does not know; the message lists the known ones."""


@dataclass(frozen=True)
class Prepared:
    """What `System.apply` returns: the model to judge (the argument itself, changed in
    place), the fusion report when the system is our engine (None otherwise), and for
    another system that rewrites modules, how many rewrites it applied per family (results
    and summaries count them as they count ours)."""

    model: nn.Module
    report: FusionReport | None = None
    applied: dict[str, int] | None = None


@dataclass(frozen=True)
class System:
    """One system under test: how to apply it and how the harness records its outcomes."""

    name: str
    description: str
    apply: Callable[[nn.Module], Prepared]
    """Apply the system to a model (in place) and return the model to run."""
    note: Callable[[], str]
    """After the forwards: what the system can say about what it did, beyond a
    FusionReport ("" when nothing): Inductor's graph and graph-break counts."""
    lifecycle: bool
    """Whether the lifecycle checks (harness.oracles.lifecycle) apply; when not, each operation is
    recorded `n/a` with `not_applicable(...)` as the reason."""
    golden: bool
    """Whether golden plans (harness.reporting.plans) describe this system's results."""
    apply_status: str
    """Result status (and failure kind) when `apply` raises."""
    forward_status: str
    """Result status when the applied model's forward raises where the eager one runs."""
    forward_kind: str
    """Failure kind recorded for that forward error (harness.runner.repro.KINDS)."""
    timeout: float
    """Default seconds per architecture in a sweep."""
    diagnostics: tuple[str, ...] = ()
    """Modules whose warnings are the system's own diagnostics about how it handled the model
    (a compiler's performance fallbacks and caveats), not something the model does: a
    fused-only warning raised from one of them is recorded as a `compiler` warning and named
    in the message, never a `fused-warning` failure. Empty for our engine: every warning a
    fused model raises that the unfused one does not is a failure of fusion."""
    lifecycle_operations: tuple[str, ...] | None = None
    """The lifecycle operations that apply when `lifecycle` is true (None: all); the others
    are recorded `n/a` with `not_applicable(...)` as the reason."""
    unapplied: Callable[[], str] = lambda: ""
    """After the forwards: why the system, though its apply returned, did not apply what it
    promised ("" when it did); a non-empty reason fails the run as `not-applied`."""
    localise_alone: bool = False
    """Whether a failed logits verdict is localised by applying the system (`apply`) to a
    copy of each decoder-layer child alone (`harness.oracles.localise.block_children`) and judging
    it on the inputs that child saw in the unfused forward. For a compiler, which keeps no
    module of its own to replay: a module compiled alone is not bit for bit what the whole
    model's graph runs (the compiler fuses across module boundaries there), so this names
    where the compiler's numerics depart, as evidence beside the logits verdict. False for
    our engine, whose fused modules are replayed where they stand."""


def not_applicable(system: System) -> str:
    """The detail of a lifecycle verdict recorded `n/a` because `system` has no such check."""
    return f"not applicable to system {system.name}"


def get(name: str = DEFAULT, *, fuse: Callable[[nn.Module], Any] | None = None) -> System:
    """The system called `name`; UnknownSystem (listing NAMES) for any other name.

    `fuse` replaces `fusion.fuse` for the `fusion` system (tests inject faults with it); it
    is a ValueError for any other system, which would silently ignore it.
    """
    if name == "fusion":
        return _fusion(fuse)
    if fuse is not None:
        raise ValueError(f"a fuse function applies only to system fusion, not {name!r}")
    if name == "inductor":
        return _inductor("inductor", {}, "torch.compile, default Inductor, of the unfused model")
    if name == "inductor-freezing":
        return _inductor(
            "inductor-freezing",
            {"freezing": True},
            "torch.compile, Inductor with freezing (weights folded as constants), inference "
            "under torch.no_grad",
        )
    if name == "vllm":
        return _vllm()
    if name == "liger":
        return _liger()
    raise UnknownSystem(f"unknown system {name!r}; known systems: {', '.join(NAMES)}")


def unavailable(name: str) -> str | None:
    """Why system `name` cannot run in this environment, or None when it can: `vllm` needs
    vLLM importable (the peer environment) and willing to make its config on this machine;
    `liger` needs liger-kernel and, without a GPU, TRITON_INTERPRET=1; the others need only
    torch. A CLI turns the reason into a usage error before any model is built."""
    if name == "liger":
        return liger_apply.unavailable()
    if name != "vllm":
        return None
    try:
        vllm_apply.RUNTIME.make_config()  # imports vLLM, then asks it for a config
    except vllm_apply.PeerUnavailable as exc:
        return str(exc)
    return None


def _fusion(fuse: Callable[[nn.Module], Any] | None) -> System:
    def apply(model: nn.Module) -> Prepared:
        # fusion.fuse looked up at call time, so a patched fusion.fuse is the one used.
        report = fusion.fuse(model) if fuse is None else fuse(model)
        return Prepared(model, report)

    return System(
        name="fusion",
        description="fusion.fuse (this project's engine), in place",
        apply=apply,
        note=_no_note,
        lifecycle=True,
        golden=True,
        apply_status="fuse-error",
        forward_status="fused-error",
        forward_kind="fused-forward-error",
        timeout=FUSION_TIMEOUT,
    )


def _no_note() -> str:
    """Nothing beyond the FusionReport, which the result records field by field."""
    return ""


def _inductor(name: str, options: dict[str, Any], description: str) -> System:
    def apply(model: nn.Module) -> Prepared:
        # A fresh Dynamo per model: a worker checks many architectures, and code objects
        # they share (Transformers' masking and generic forwards) would otherwise reach
        # Dynamo's recompile limit and silently run eager, judging nothing compiled.
        torch._dynamo.reset()
        counters.clear()
        model.compile(backend="inductor", options=dict(options) or None)
        return Prepared(model)

    return System(
        name=name,
        description=description,
        apply=apply,
        note=compiled_note,
        lifecycle=False,
        golden=False,
        apply_status="compile-error",
        forward_status="compile-error",
        forward_kind="compile-error",
        timeout=INDUCTOR_TIMEOUT,
        diagnostics=COMPILER_MODULES,
        localise_alone=True,
    )


def compiled_note() -> str:
    """Dynamo's counts since the last `apply` of an Inductor system: "N graph(s), M graph
    break(s)" and the most frequent break reason. Read from Dynamo's process-wide counters,
    which `apply` clears, so it describes the model compiled last."""
    graphs = counters["stats"].get("unique_graphs", 0)
    breaks = counters["graph_break"]
    text = f"compiled: {graphs} graph(s), {sum(breaks.values())} graph break(s)"
    if breaks:
        reason, count = breaks.most_common(1)[0]
        first = reason.strip().splitlines()[0] if reason.strip() else "?"
        text += f", most often ({count}x): {first[:120]}"
    return text


def _vllm() -> System:
    last: list[vllm_apply.Application] = []

    def apply(model: nn.Module) -> Prepared:
        last[:] = [vllm_apply.apply(model)]
        return Prepared(model, applied=last[0].counts())

    def note() -> str:
        """What vLLM applied and left in the model it rewrote last."""
        return last[0].summary() if last else ""

    return System(
        name="vllm",
        description="vLLM's Transformers-backend fusers (0.34, the pinned peer) with its "
        "layers' native forwards, tensor parallel size 1, CPU (harness.peers.vllm_apply)",
        apply=apply,
        note=note,
        lifecycle=False,
        golden=False,
        apply_status="fuse-error",
        forward_status="fused-error",
        forward_kind="fused-forward-error",
        timeout=VLLM_TIMEOUT,
    )


def _liger() -> System:
    last: list[liger_apply.Application] = []

    def apply(model: nn.Module) -> Prepared:
        last[:] = [liger_apply.apply(model)]
        return Prepared(model, report=last[0].report)

    def note() -> str:
        """What Liger replaced and how many of its kernels the patched model launched."""
        return last[0].summary() if last else ""

    def unapplied() -> str:
        return last[0].unapplied() if last else ""

    return System(
        name="liger",
        description=f"Liger Kernel {liger_apply.LIGER_VERSION}'s apply_liger_kernel_to_<type>"
        "(model=...), globals scoped to the patched model (harness.peers.liger_apply)",
        apply=apply,
        note=note,
        lifecycle=True,
        golden=False,
        apply_status="fuse-error",
        forward_status="fused-error",
        forward_kind="fused-forward-error",
        timeout=LIGER_TIMEOUT,
        diagnostics=LIGER_DIAGNOSTICS,
        lifecycle_operations=LIGER_LIFECYCLE,
        unapplied=unapplied,
    )
