"""Lifecycle operations that run the fused model another way: `generate`, autocast, matmul
precision, dynamic quantization, `torch.compile`.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from fusion.inspection import preserved_globals
from fusion.kernels.calibration import Table
from fusion.kernels.policy import POLICY
from harness.oracles.lifecycle.core import (
    _FLOOR,
    Context,
    _cast,
    _compare,
    _Failed,
    _logits,
    _NotApplicable,
    _twins,
    _unfused,
)
from harness.oracles.lifecycle.edits import scale_data_assign
from harness.oracles.lifecycle.guards import dtype_mismatch, output_dtypes

# --------------------------------------------------------------------------------------------
# The operations. Each returns its pass detail or raises _NotApplicable / _Failed.


def _generate(ctx: Context) -> str:
    """Greedy `generate` of the two models with Transformers' default (dynamic) KV cache,
    then with the preallocated `StaticCache` (`cache_implementation="static"`, what
    Transformers recommends under torch.compile: the attention writes into a cache of fixed
    shape in place). A cache the unfused model cannot generate with is reported, not
    judged; a fused model whose tokens differ off a near-tie fails either way."""
    can = getattr(ctx.unfused, "can_generate", None)
    if not callable(can) or not can():
        raise _NotApplicable("the model cannot generate")
    kwargs = {k: v for k, v in _cast(ctx.inputs, ctx.dtype).items() if k != "use_cache"}
    options = dict(
        max_new_tokens=3,
        do_sample=False,
        num_beams=1,
        output_scores=True,
        return_dict_in_generate=True,
    )
    detail = f"{_greedy_identical(ctx, kwargs, options, 'generate')} tokens identical"
    try:
        _greedy_identical(
            ctx, kwargs, {**options, "cache_implementation": "static"}, "static-cache generate"
        )
    except _NotApplicable as exc:
        return f"{detail}; static cache not judged: {exc}"
    except _Failed as exc:
        raise _Failed(f"with a static cache: {exc}") from exc
    return f"{detail}, and with a static cache"


def _greedy_identical(
    ctx: Context, kwargs: dict[str, object], options: dict[str, object], what: str
) -> int:
    """`generate(**kwargs, **options)` of the fused model against the unfused one's: the
    number of new tokens where the sequences are identical; `_NotApplicable` where the
    unfused model raises or they part on a near-tie (`ctx.allowance`), `_Failed`
    otherwise."""
    with torch.no_grad():
        want = _unfused(what, lambda: ctx.unfused.generate(**kwargs, **options))
        got = ctx.fused.generate(**kwargs, **options)
    if torch.equal(got.sequences, want.sequences):
        return want.sequences.shape[-1] - kwargs["input_ids"].shape[-1]
    if got.sequences.shape != want.sequences.shape:
        raise _Failed(
            f"sequences of shape {tuple(got.sequences.shape)}, unfused "
            f"{tuple(want.sequences.shape)}"
        )
    prompt = kwargs["input_ids"].shape[-1]
    differs = (got.sequences != want.sequences).nonzero()
    row, col = (int(i) for i in differs[0])
    step = col - prompt
    scores = want.scores[step][row].double()
    margin = float(scores[want.sequences[row, col]] - scores[got.sequences[row, col]])
    if margin <= ctx.allowance:
        raise _NotApplicable(
            f"tokens diverge at step {step} on a near-tie (unfused margin {margin:.3g} <= "
            f"allowed {ctx.allowance:.3g}): not judged"
        )
    raise _Failed(f"token {step} of row {row} differs (unfused margin {margin:.3g})")


def _device_type(model: nn.Module) -> str:
    first = next(iter(model.parameters()), None)
    return "cpu" if first is None else first.device.type


def _autocast(ctx: Context) -> str:
    device = _device_type(ctx.unfused)
    unfused, fused = _twins(ctx)

    def run(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.dtype]]:
        with torch.autocast(device, dtype=torch.bfloat16), output_dtypes(model) as dtypes:
            return _logits(model, ctx), dtypes

    want, want_dtypes = _unfused("a forward under autocast", lambda: run(unfused))
    got, got_dtypes = run(fused)
    mismatch = dtype_mismatch(want_dtypes, got_dtypes)
    if mismatch:
        raise _Failed(f"under autocast {mismatch}")
    if got.dtype != want.dtype:
        raise _Failed(f"under autocast the logits are {got.dtype}, unfused {want.dtype}")
    scale = float(want.double().abs().max()) if want.numel() else 0.0
    allowance = ctx.allowance + _FLOOR[torch.bfloat16] * max(scale, 1.0)
    diff = _compare("logits under autocast", got, want, allowance)
    return f"{len(got_dtypes)} modules return the unfused dtypes; logits within {diff:.3g}"


# How much less than the unfused logits the fused ones may move under a reduced matmul
# precision before a kernel is taken to ignore it (a blind kernel moves them by zero, or only
# by what the layers around it move; an honest one by about as much as unfused).
_PRECISION_MOVE_RATIO = 4.0


def _matmul_precision(ctx: Context) -> str:
    unfused, fused = _twins(ctx)
    with preserved_globals():  # puts the caller's precision back, whichever API set it
        torch.set_float32_matmul_precision("medium")
        want = _unfused("a forward at matmul precision medium", lambda: _logits(unfused, ctx))
        got = _logits(fused, ctx)
    moved = float((want.double() - ctx.unfused_logits.double()).abs().max())
    diff = _compare("logits at matmul precision medium", got, want, ctx.allowance + 4 * moved)
    if moved == 0.0:
        return f"logits within {diff:.3g} (the setting changes no unfused logit here)"
    fused_moved = float((got.double() - ctx.fused_logits.double()).abs().max())
    if fused_moved < moved / _PRECISION_MOVE_RATIO:
        # Both models round the same matmul inputs the same way under the setting, so an
        # honest fused model moves about as far as the unfused one; bit-identity alone is
        # not the test: on a CPU whose own GEMMs honour the setting (AMX), the layers a
        # fusion leaves alone move the fused logits too while a blind kernel still hides
        # most of the unfused movement.
        raise _Failed(
            f"the setting moves the unfused logits by {moved:.3g} and the fused ones by only "
            f"{fused_moved:.3g}: a fused kernel ignores it"
        )
    return (
        f"logits within {diff:.3g}; the setting moved both (unfused by {moved:.3g}, "
        f"fused by {fused_moved:.3g})"
    )


_QUANTIZATION_SHARE = 0.25
"""The share of the unfused model's own quantisation error (its quantized logits against its
float ones) that `quantize-dynamic` adds to the allowance where the float models differ:
there a rounding difference may move a dynamically quantized activation across a step."""


def quantized_modules(model: nn.Module) -> dict[str, str]:
    """{qualified name: class name} of every quantized module of `model` (a class of
    `torch.ao.nn`, what `quantize_dynamic` installs in place of the types it maps)."""
    return {
        name: type(module).__qualname__
        for name, module in model.named_modules()
        if type(module).__module__.startswith("torch.ao.nn.")
    }


def _quantized(model: nn.Module) -> nn.Module:
    """`model` (a twin: a copy of the context's model) quantized in place: a third copy of a
    large corpus model (musicgen on 4.57: 420M parameters) ran two workers out of memory."""
    with warnings.catch_warnings():
        # torch.ao.quantization's deprecation notices, once per call
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(
            model, {nn.Linear}, dtype=torch.qint8, inplace=True
        )


def _quantized_logits(model: nn.Module, ctx: Context) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _logits(model, ctx)


def _quantize_dynamic(ctx: Context) -> str:
    """A type-keyed transform after fusing: the fused model's quantized modules must be the
    unfused model's (same names, same classes), and its quantized logits the unfused one's
    (the rewritten forwards whose children were replaced run their originals)."""
    unfused, fused = _twins(ctx)
    unfused = _unfused("quantize_dynamic", lambda: _quantized(unfused))
    want = _unfused("a forward of the quantized model", lambda: _quantized_logits(unfused, ctx))
    fused = _quantized(fused)
    want_kinds, got_kinds = quantized_modules(unfused), quantized_modules(fused)
    if got_kinds != want_kinds:
        missing = sorted(set(want_kinds) - set(got_kinds))
        extra = sorted(set(got_kinds) - set(want_kinds))
        changed = sorted(
            n for n in set(want_kinds) & set(got_kinds) if want_kinds[n] != got_kinds[n]
        )
        shown = missing[:1] or extra[:1] or changed[:1]
        still = {n: type(m).__name__ for n, m in ctx.fused.named_modules()}
        raise _Failed(
            f"quantize_dynamic quantized {len(got_kinds)} modules of the fused model, "
            f"{len(want_kinds)} of the unfused ({len(missing)} not quantized, {len(extra)} "
            f"only fused, {len(changed)} of another class; first: {shown[0]}, a "
            f"{still.get(shown[0], '?')} in the fused model)"
        )
    if not want_kinds:
        raise _NotApplicable("quantize_dynamic quantizes no module of the unfused model")
    got = _quantized_logits(fused, ctx)
    moved = float((want.double() - ctx.unfused_logits.double()).abs().max())
    identical = torch.equal(ctx.fused_logits, ctx.unfused_logits)
    allowance = ctx.allowance + (0.0 if identical else _QUANTIZATION_SHARE * moved)
    diff = _compare("quantized logits", got, want, allowance)
    return (
        f"{len(want_kinds)} modules quantized as unfused; logits within {diff:.3g} "
        f"(quantisation moved the unfused logits by {moved:.3g})"
    )


def _compile(ctx: Context) -> str:
    """Where the unfused model compiles fullgraph, the fused one must too (a graph break
    the fusion introduced is a defect); otherwise both compile with graph breaks."""
    import torch._dynamo

    unfused, fused = _twins(ctx)
    torch._dynamo.reset()
    try:
        want = _logits(torch.compile(unfused, fullgraph=True, backend="eager"), ctx)
        fullgraph = True
    except Exception:
        torch._dynamo.reset()
        unfused = copy.deepcopy(ctx.unfused)
        want = _unfused(
            "torch.compile", lambda: _logits(torch.compile(unfused, backend="eager"), ctx)
        )
        fullgraph = False
    torch._dynamo.reset()
    try:
        compiled = torch.compile(fused, fullgraph=fullgraph, backend="eager")
        got = _logits(compiled, ctx)
        _compare("compiled logits", got, ctx.fused_logits, ctx.allowance)
        _compare("compiled logits vs compiled unfused", got, want, ctx.allowance)
        _compiled_after_moves(ctx, compiled, fused)
    finally:
        torch._dynamo.reset()
    how = "fullgraph, as the unfused model" if fullgraph else "with graph breaks, as unfused"
    return (
        f"compiled (Dynamo, eager backend; {how}) logits agree, and after every weight moved"
        f"{_compiled_lane(ctx, fullgraph)}"
    )


def _compiled_after_moves(ctx: Context, compiled: nn.Module, fused: nn.Module) -> None:
    """Dynamo guards neither a Parameter's `.data` nor its address: after a compiled call,
    every weight of the fused model moves to memory of its own (`p.data = p.data * 0.75`,
    which breaks each merged projection's views of its stacked weight), and the compiled
    model called again must compute what the unfused model computes after the same edit
    (a compiled stacked product checks the views when it runs). Raises _Failed."""
    unfused = copy.deepcopy(ctx.unfused)
    for model in (unfused, fused):
        for param in model.parameters():
            if param.is_floating_point():
                scale_data_assign(param)
    want = _unfused("editing weights by p.data = ...", lambda: _logits(unfused, ctx))
    _compare(
        "compiled logits after every weight moved (p.data = p.data * 0.75)",
        _logits(compiled, ctx),
        want,
        ctx.allowance,
    )


def _compiled_lane(ctx: Context, fullgraph: bool) -> str:
    """The rewrites are compiled above with routes closed; here the quiet lane is: routes
    open and nothing measured anywhere (`KernelPolicy.traced_lane`), where compiled code
    traces the classes' originals on the fused state. Its logits must agree with the
    unfused model's as well, compiled as fully. A clause for the verdict's detail."""
    import torch._dynamo

    if POLICY.mode == "eligible":
        return "; the quiet lane: not in the eligible mode (no lane there)"
    fused = copy.deepcopy(ctx.fused)
    previous = POLICY.table
    POLICY.set_table(Table("quiet lane"))  # nothing measured: the lane is open
    try:
        torch._dynamo.reset()
        with POLICY.routing(True):
            got = _logits(torch.compile(fused, fullgraph=fullgraph, backend="eager"), ctx)
    finally:
        torch._dynamo.reset()
        POLICY.set_table(previous)
    _compare("compiled logits on the quiet lane", got, ctx.unfused_logits, ctx.allowance)
    return "; on the quiet lane too"
