"""Lifecycle operations on the guards of rewritten forwards: a watched child replaced and put
back, the measured route, and hooks that must not judge the unfused path.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch import nn

from fusion import inspection
from fusion.kernels.calibration import Entry, Ratio, Table
from fusion.kernels.policy import MAX_BUCKET, POLICY, row_bucket
from harness.oracles.lifecycle.core import (
    Context,
    _compare,
    _Failed,
    _logits,
    _NotApplicable,
    _twins,
    _unfused,
)


def watched_children(model: nn.Module) -> set[int]:
    """ids of the modules a rewritten forward's guards watch as plainly called
    (`fusion.inspection.FusedForward.watched`): a hook on one of them makes that forward run its original
    instead, so an oracle that hooks them would judge the unfused path."""
    return {id(child) for f in inspection.fused_forwards(model) for _, child in f.watched}


@contextlib.contextmanager
def output_dtypes(model: nn.Module):
    """Yields a dict that fills, while the block runs, with {qualified name: dtype of the
    module's first tensor output} for every module of `model` called (first call wins),
    except the modules fused forwards' guards watch (`watched_children`): they are not
    hooked, so the fused path stays the one judged."""
    dtypes: dict[str, torch.dtype] = {}
    watched = watched_children(model)
    names = {id(m): n for n, m in model.named_modules()}

    def record(module: nn.Module, args: Any, output: Any) -> None:
        first = output if isinstance(output, torch.Tensor) else None
        if first is None and isinstance(output, (tuple, list)) and output:
            first = output[0] if isinstance(output[0], torch.Tensor) else None
        name = names.get(id(module))
        if first is not None and name is not None:
            dtypes.setdefault(name, first.dtype)

    handles = [m.register_forward_hook(record) for m in model.modules() if id(m) not in watched]
    try:
        yield dtypes
    finally:
        for handle in handles:
            handle.remove()


def dtype_mismatch(want: dict[str, torch.dtype], got: dict[str, torch.dtype]) -> str | None:
    """Where the fused model's module outputs (`got`, from `output_dtypes`) have another
    dtype than the unfused model's (`want`), or None: a module both have (same name) must
    return the same dtype; a module only the fused model has (a merged projection) must
    return a dtype one of the modules only the unfused model has under the same parent (the
    ones it replaced) returned. Its output feeds code the two models share, where a float32
    value would be silently promoted or rounded, so values alone may not show it."""

    def parent(name: str) -> str:
        return name.rpartition(".")[0]

    for name in sorted(set(want) & set(got)):
        if got[name] != want[name]:
            return f"{name or 'the model'} returns {got[name]}, unfused {want[name]}"
    for name in sorted(set(got) - set(want)):
        replaced = {
            dtype
            for other, dtype in want.items()
            if other not in got and parent(other) == parent(name)
        }
        if replaced and got[name] not in replaced:
            shown = ", ".join(sorted(str(d) for d in replaced))
            return f"{name} returns {got[name]} where the modules it replaced returned {shown}"
    return None


class Doubled(nn.Module):
    """A user's replacement of a child (a LoRA wrapper stands in): the child, output x2."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(*args, **kwargs)
        return out * 2.0 if isinstance(out, torch.Tensor) else out


def guarded_children(model: nn.Module) -> list[tuple[str, str]]:
    """(qualified name of a module with a rewritten forward, the name of a child its guards
    watch as plainly called), merged projections' shards first."""
    found = [
        (not isinstance(child, nn.Linear), f.qualname, name)
        for f in inspection.fused_forwards(model)
        for name, child in f.watched
    ]
    return [site[1:] for site in sorted(found)]


def double_child(models: tuple[nn.Module, ...], qualname: str, name: str) -> list[nn.Module] | None:
    """Replace `<qualname>.<name>` in each of `models` by `Doubled` around it (a user's
    replacement after fusing); the replaced children, or None (nothing replaced) where the
    first model has no such child."""
    parents = [model.get_submodule(qualname) for model in models]
    if name not in parents[0]._modules:
        return None
    children = [parent._modules[name] for parent in parents]
    for parent, child in zip(parents, children):
        setattr(parent, name, Doubled(child))
    return children


def _guard_round_trip(ctx: Context) -> str:
    """The first guarded child whose module the forward runs (a cross-attention without
    encoder states is never called): replaced, the logits agree and the rewrite fell back;
    put back, the fused forward runs again."""
    sites = guarded_children(ctx.fused)
    if not sites:
        raise _NotApplicable("no rewritten forward guards a child in this model")
    unfused = fused = None
    for qualname, name in sites[:8]:
        unfused = fused = None  # the last site's twins go before the next pair is made
        unfused, fused = _twins(ctx)
        children = double_child((unfused, fused), qualname, name)
        if children is None:
            continue
        parents = [m.get_submodule(qualname) for m in (unfused, fused)]
        where = f"{qualname + '.' if qualname else ''}{name}"
        want = _unfused(f"a forward with {where} replaced", lambda u=unfused: _logits(u, ctx))
        got = _logits(fused, ctx)
        _compare(f"logits with {where} replaced", got, want, ctx.allowance)
        failures = inspection.guard_failures(parents[1])
        if failures == 0:
            continue  # this forward did not run on these inputs: the next site
        for parent, child in zip(parents, children):
            setattr(parent, name, child)
        _compare(f"logits with {where} put back", _logits(fused, ctx), ctx.fused_logits, 0.0)
        if inspection.guard_failures(parents[1]) != failures:
            raise _Failed(f"with {where} put back, {qualname} still runs its original forward")
        return f"{where} replaced: original forward ran, logits agree; put back: fused again"
    raise _NotApplicable("no guarded rewritten forward runs on these inputs")


def _references_measured(model: nn.Module, winners_at: int | None = None) -> Table:
    """A calibration table in which every merged projection of `model` was measured, at
    every row bucket and this thread count, in every floating dtype, to run its reference
    (no kernel won): what `fusion.calibrate` writes on a machine where fusion only costs.
    `winners_at`: except at that row bucket, where the stacked GEMM won (`WON`)."""
    table = Table("lifecycle: every merged product measured to lose")
    for merged in inspection.merged_projections(model):
        for dtype in ("float32", "bfloat16", "float16", "float64"):
            for bucket in _buckets():
                won = bucket == winners_at
                table.add(
                    Entry(
                        op="stacked",
                        shape=merged.kernel_shape,
                        dtype=dtype,
                        rows=bucket,
                        threads=torch.get_num_threads(),
                        median_us={"reference": 1.0, **({"stacked": 0.5} if won else {})},
                        ratios={"stacked": WON} if won else {},
                        rounds=9 if won else 0,
                    )
                )
    return table


WON = Ratio(2.0, 1.8, 2.2)
"""A measurement no margin or spread can call anything but a win."""


def _route(ctx: Context) -> str:
    """With routes open, where every merged product runs its reference (a table measuring
    each to lose, which no machine's winners can override), the rewritten forwards run
    their classes' originals on the fused state (`FusedForward.routed`; with no linear
    winning either, by the quiet lane, `KernelPolicy.quiet`, which the plain linears'
    forwards take too): the logits agree with the unfused model's, and at least one forward
    took the route. Then with every merged product measured to win only at a row bucket
    the inputs never use (a calibration whose winners are a prompt's rows, seen by a
    decode step): the routes are taken by that rule (`KernelPolicy.won_rows`), and the
    logits agree again. The other checks run with routes closed
    (`harness.runner.arch_check.check_model`), judging the rewrites."""
    if POLICY.mode != "measured":
        raise _NotApplicable(f"kernel policy mode {POLICY.mode!r}: routes are measured-mode only")
    fused = copy.deepcopy(ctx.fused)
    forwards = [f for f in inspection.fused_forwards(fused) if f.routed]
    if not forwards:
        raise _NotApplicable("no rewritten forward has a route (no merged projection it calls)")
    taken = _taken_on(fused, forwards, ctx, _references_measured(fused))
    if not taken:
        raise _NotApplicable("no route taken on these inputs (hooks, or another input width)")
    said = f"{taken} of the rewritten forwards' calls ran the original; logits agree"
    used = {row_bucket(rows) for rows in _input_rows(ctx)}
    unused = next((b for b in _buckets() if b not in used), None)
    if unused is None:
        return said
    table = _references_measured(fused, winners_at=unused)
    by_rows = _taken_on(fused, forwards, ctx, table)
    if not by_rows:
        raise _Failed(
            f"with every merged product winning only at {unused} rows, which these inputs "
            "never use, no rewritten forward took its route"
        )
    return f"{said}; winners only at {unused} rows: {by_rows} calls routed, logits agree"


def _taken_on(fused: nn.Module, forwards: list, ctx: Context, table: Table) -> int:
    """How many calls of `forwards` ran the original while `fused` computed the inputs with
    routes open on `table` (the logits compared with the unfused model's)."""
    before = sum(inspection.original_calls(f.module) for f in forwards)
    previous = POLICY.table
    POLICY.set_table(table)
    try:
        with POLICY.routing(True), POLICY.counting_routes():
            got = _logits(fused, ctx)
    finally:
        POLICY.set_table(previous)
    _compare("logits on the route", got, ctx.unfused_logits, ctx.allowance)
    return sum(inspection.original_calls(f.module) for f in forwards) - before


def _input_rows(ctx: Context) -> set[int]:
    """The row counts a projection of the model sees on the check's inputs (batch x
    sequence of every tensor input of two or more dimensions)."""
    return {
        int(value.shape[0] * value.shape[1])
        for value in ctx.inputs.values()
        if isinstance(value, torch.Tensor) and value.dim() >= 2
    }


def _buckets() -> list[int]:
    """Every row bucket a calibration table can hold, smallest first."""
    return sorted({row_bucket(rows) for rows in range(1, MAX_BUCKET + 1)})
