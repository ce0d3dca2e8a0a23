"""The lifecycle checks' shared vocabulary: modes, operation names, verdicts, the `Context`
every operation reads, and the helpers that compare logits and make unfused/fused twins.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import fusion
from harness.oracles import localise
from harness.oracles.parity import logits_of

MODES = ("off", "quick", "full", "all")
"""`off`: no lifecycle checks; `quick`: every operation but `compile`; `full`: `compile` too,
for `COMPILE_SELECTION`; `all`: `compile` for every architecture."""

OPERATIONS = (
    "generate",
    "train",
    "save-pretrained",
    "load-state-dict",
    "edit-weights",
    "edit-attributes",
    "deepcopy",
    "torch-save",
    "autocast",
    "matmul-precision",
    "optimizer-before-fuse",
    "parameters",
    "guard-round-trip",
    "route",
    "quantize-dynamic",
    "lora-after-fuse",
    "train-global-hook",
    "compile",
)

COMPILE_SELECTION = frozenset({"llama", "qwen3", "gemma2", "qwen3_moe", "deepseek_v3", "olmo2"})
"""Architectures `quick` compiles: a dense GQA model, q/k norms, a GELU-tanh GLU with
offset norms, an MoE model, MLA with MoE, and in-place q/k writes (OLMo 2's clamp)."""

VERDICTS = ("pass", "fail", "n/a")

_FLOOR = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 2e-2, torch.float16: 4e-3}
"""Allowance relative to the logits' scale, per dtype (a few units of rounding)."""


@dataclass(frozen=True)
class OpVerdict:
    verdict: str
    detail: str = ""

    def record(self) -> dict[str, str]:
        return {"verdict": self.verdict, "detail": self.detail}


class _NotApplicable(Exception):
    """The unfused model cannot do this operation: the verdict is `n/a`."""


class _Failed(Exception):
    """The fused model does this operation differently: the verdict is `fail`."""


@dataclass(frozen=True)
class Context:
    """What every operation needs: both models (already run once), inputs, dtype and the
    reference logits and allowance from the plain forward."""

    architecture: str
    unfused: nn.Module
    fused: nn.Module
    inputs: Mapping[str, Any]
    dtype: torch.dtype
    unfused_logits: torch.Tensor
    fused_logits: torch.Tensor
    fuse: Callable[[nn.Module], Any] = fusion.fuse
    """How the fused model was fused (applied again to unfused copies)."""
    shared: dict[str, Any] = field(default_factory=dict)
    """Work two operations share (`_fused_late`: one copy fused after an optimiser)."""

    @property
    def allowance(self) -> float:
        base = float((self.fused_logits.double() - self.unfused_logits.double()).abs().max())
        scale = float(self.unfused_logits.double().abs().max())
        return 4 * base + _FLOOR.get(self.dtype, 1e-5) * max(scale, 1.0)


NOT_COMPILED = "not run in this mode (`--lifecycle full` compiles a selection, `all` every model)"
"""The detail of a `compile` verdict the mode skipped (`harness.reporting.plans` ignores it)."""

NOT_INSTALLED = "not installed: "
"""How the detail of an operation that needs a missing optional package starts ("not
installed: peft (pip install peft)"): recorded `n/a` (results files and golden plans keep their
format), shown "not run" with that reason (`harness.reporting.summary.shown_verdict`), since nothing was
tried and the unfused model may well be able to do it."""


def not_installed(package: str) -> str:
    """The n/a detail of an operation whose optional `package` does not import here."""
    return f"{NOT_INSTALLED}{package} (pip install {package})"


def _compiles(mode: str, architecture: str) -> bool:
    return mode == "all" or (mode == "full" and architecture in COMPILE_SELECTION)


def _run(operation: Callable[[Context], str], ctx: Context) -> OpVerdict:
    try:
        return OpVerdict("pass", operation(ctx))
    except _NotApplicable as exc:
        return OpVerdict("n/a", str(exc))
    except _Failed as exc:
        return OpVerdict("fail", str(exc))
    except Exception as exc:  # the fused side raised where the unfused side did not
        return OpVerdict("fail", f"raises: {localise.one_line(exc)}")


def _unfused(what: str, action: Callable[[], Any]) -> Any:
    """Run an unfused-side `action`; its exception makes the operation `n/a`."""
    try:
        return action()
    except Exception as exc:
        raise _NotApplicable(f"unfused model: {what} raises: {localise.one_line(exc)}") from exc


def _cast(inputs: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    return {
        k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in inputs.items()
    }


def _logits(model: nn.Module, ctx: Context) -> torch.Tensor:
    with torch.no_grad():
        return logits_of(model(**_cast(ctx.inputs, ctx.dtype)))


def _compare(what: str, got: torch.Tensor, want: torch.Tensor, allowance: float) -> float:
    """The max difference; raises _Failed when over `allowance` (NaN never passes)."""
    if got.shape != want.shape:
        raise _Failed(f"{what}: shape {tuple(got.shape)}, unfused {tuple(want.shape)}")
    diff = float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
    if not diff <= allowance:
        raise _Failed(f"{what}: max difference {diff:.3g} > allowed {allowance:.3g}")
    return diff


def _twins(ctx: Context) -> tuple[nn.Module, nn.Module]:
    return copy.deepcopy(ctx.unfused), copy.deepcopy(ctx.fused)


@contextmanager
def collecting_copies() -> Iterator[Callable[[], None]]:
    """A block whose `collect()` frees the reference cycles made since the block began (an
    operation's model copies) without walking the heap that was there before it.

    A full `gc.collect()` walks every object the process tracks: with Transformers' model
    modules imported it took about 0.2 s here (2-core Xeon, Python 3.11, a corpus worker),
    and 17 of them per architecture were 3.3 s of a 3.8 s lifecycle check. Objects present
    when the block begins (the models under test, the imported modules) are frozen
    (`gc.freeze`): they are kept by their owners for the whole block anyway, and plain
    reference counting still frees them. On leaving, they are unfrozen and one full
    collection runs, so nothing the block made stays uncollected. Where something else froze
    objects first (a forked worker that froze its imports), nothing is frozen here and
    `collect()` is an ordinary collection: another owner's freeze is never undone."""
    owned = gc.get_freeze_count() == 0
    if owned:
        gc.freeze()
    try:
        yield gc.collect
    finally:
        if owned:
            gc.unfreeze()
        gc.collect()
