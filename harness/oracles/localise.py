"""Per-module localisation (docs/design.md, oracle 2): which fused module changed the function?

Forward pre-hooks record the inputs of every fused module's counterpart during the unfused
forward; each fused module (same qualname in the fused model) is then re-run on exactly those
inputs, next to the unfused module and its float64 twin, and judged by `harness.oracles.parity`. A
mismatch therefore names the module, its class and the fuser, instead of "the logits differ".
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from harness.oracles import parity

NAN = float("nan")  # the errors of a module that could not be compared: there are none


@dataclass(frozen=True)
class ModuleCall:
    """The positional and keyword arguments of one module call (tensors cloned, detached)."""

    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class ModuleCheck:
    """The judgement of one fused module over every call recorded for it.

    `raised` holds the exception (one line) when the fused module raised on the recorded
    inputs, and `detail` the end of its traceback; `verdict` is then a failure.
    """

    qualname: str
    verdict: parity.Verdict
    calls: int
    raised: str | None = None
    detail: str = ""


def map_tensors(value: object, fn, other=lambda v: v) -> object:
    """`value` with `fn` applied to every tensor inside tuples, lists and dicts.

    Any other object goes through `other` (identity by default: shared, not copied).
    """
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(map_tensors(v, fn, other) for v in value)
    if isinstance(value, list):
        return [map_tensors(v, fn, other) for v in value]
    if isinstance(value, dict):
        return {k: map_tensors(v, fn, other) for k, v in value.items()}
    return other(value)


def _copy_state(value: object) -> object:
    """A deep copy of a Transformers cache, any other object shared.

    Some models hand their layers a cache object even with use_cache=False, and every call
    appends to it; replaying a call on the cache the forward already filled would attend to
    twice the tokens. Copied at call time and again per replay, each re-run sees the cache
    exactly as the original call did. Other objects (configs, flags) are not mutated by a call.
    """
    from transformers.cache_utils import Cache

    return copy.deepcopy(value) if isinstance(value, Cache) else value


def clone_inputs(call: ModuleCall) -> ModuleCall:
    """A private copy of a call's tensors (and caches), so one re-run cannot leak into another."""

    def clone(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone()

    return ModuleCall(
        args=map_tensors(call.args, clone, _copy_state),
        kwargs=map_tensors(call.kwargs, clone, _copy_state),
    )


def to_float64(call: ModuleCall) -> ModuleCall:
    """The call with its floating tensors upcast to float64 (exactly), for the reference twin."""

    def upcast(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(torch.float64) if t.is_floating_point() else t.detach().clone()

    return ModuleCall(args=map_tensors(call.args, upcast), kwargs=map_tensors(call.kwargs, upcast))


@contextmanager
def record_calls(model: nn.Module, qualnames: Sequence[str]) -> Iterator[dict[str, list]]:
    """Record every call of the named submodules while the block runs.

    Yields {qualname: [ModuleCall, ...]} filled as the model runs; the hooks are removed on
    exit even if the forward raised. Inputs are cloned at call time because the model may later
    modify them in place (residual adds).
    """
    calls: dict[str, list[ModuleCall]] = {name: [] for name in qualnames}
    handles = []

    def recorder(name: str):
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            calls[name].append(clone_inputs(ModuleCall(args, kwargs)))

        return hook

    try:
        for name in qualnames:
            module = model.get_submodule(name)
            handles.append(module.register_forward_pre_hook(recorder(name), with_kwargs=True))
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def run_call(module: nn.Module, call: ModuleCall) -> object:
    """`module` called on a private copy of `call`, without autograd."""
    call = clone_inputs(call)
    with torch.no_grad():
        return module(*call.args, **call.kwargs)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Make `dtype` torch's default dtype for the block, restoring the previous one after.

    The float64 reference runs under a float64 default: modelling code builds constants with
    `torch.full(..., torch.finfo(x.dtype).min)` and similar calls that take the *default* dtype,
    and a float32 constant cannot hold float64's extremes.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def block_children(model: nn.Module) -> list[str]:
    """Qualnames of the children of every element of every `nn.ModuleList` in `model` (a
    decoder's layers: their attention, MLP or MoE block, norms), in module order.

    The units a whole-model verdict is localised to when a system can be applied to one
    module alone (`harness.runner.systems.System.localise_alone`): each holds a layer's worth of
    computation, small enough to name, large enough to compile on its own."""
    names: list[str] = []
    for qualname, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            for index, element in module.named_children():
                prefix = f"{qualname}.{index}" if qualname else index
                names.extend(f"{prefix}.{child}" for child, _ in element.named_children())
    return names


def check_module(
    qualname: str,
    calls: Sequence[ModuleCall],
    *,
    unfused: nn.Module,
    fused: nn.Module,
    reference: nn.Module,
    dtype: torch.dtype,
    mask: torch.Tensor | None,
) -> ModuleCheck:
    """Re-run the three versions of the module at `qualname` on each recorded call and judge.

    `unfused`, `fused` and `reference` are the whole models; the module is looked up in each by
    qualname (fusers keep it there). A module the forward never called is inconclusive, not a
    pass: nothing about it was checked.
    """
    if not calls:
        return _never_called(qualname)
    return check_versions(
        qualname,
        calls,
        [m.get_submodule(qualname) for m in (unfused, fused, reference)],
        dtype=dtype,
        mask=mask,
    )


def _never_called(qualname: str) -> ModuleCheck:
    verdict = parity.Verdict(
        "inconclusive", NAN, NAN, NAN, "module was not called by the model's forward"
    )
    return ModuleCheck(qualname, verdict, 0)


def check_versions(
    qualname: str,
    calls: Sequence[ModuleCall],
    modules: Sequence[nn.Module],
    *,
    dtype: torch.dtype,
    mask: torch.Tensor | None,
) -> ModuleCheck:
    """`check_module` on the three versions given directly: `modules` is (unfused, fused,
    float64 reference) of the module at `qualname` (a system applied to the module alone
    supplies its own fused version)."""
    if not calls:
        return _never_called(qualname)
    verdicts = []
    for call in calls:
        try:
            unfused_out = run_call(modules[0], call)
            with default_dtype(torch.float64):
                reference_out = run_call(modules[2], to_float64(call))
        except Exception as exc:  # the unfused twins ran inside the model; outside, they may not
            reason = f"unfused/reference module raised on replay: {one_line(exc)}"
            verdicts.append(parity.Verdict("inconclusive", NAN, NAN, NAN, reason))
            continue
        try:
            fused_out = run_call(modules[1], call)
        except Exception as exc:
            raised = one_line(exc)
            verdict = parity.Verdict("fail", NAN, NAN, NAN, f"fused module raised: {raised}")
            return ModuleCheck(qualname, verdict, len(calls), raised=raised, detail=tail(exc))
        verdicts.append(
            parity.compare_outputs(fused_out, unfused_out, reference_out, dtype=dtype, mask=mask)
        )
    return ModuleCheck(qualname, parity.worst(verdicts), len(calls))


def check_modules(
    calls: Mapping[str, Sequence[ModuleCall]],
    *,
    unfused: nn.Module,
    fused: nn.Module,
    reference: nn.Module,
    dtype: torch.dtype,
    mask: torch.Tensor | None,
) -> list[ModuleCheck]:
    """`check_module` for every recorded qualname, in recording order."""
    return [
        check_module(
            name,
            recorded,
            unfused=unfused,
            fused=fused,
            reference=reference,
            dtype=dtype,
            mask=mask,
        )
        for name, recorded in calls.items()
    ]


def one_line(exc: BaseException) -> str:
    """`Type: message` on one line (the first line of the message)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def tail(exc: BaseException, frames: int = 6) -> str:
    """The last few frames of the exception's traceback, for a bundle or a log."""
    return "".join(traceback.format_exception(exc)[-frames:])
