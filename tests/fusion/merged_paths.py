"""Steer every merged projection down one path: its stacked product (`stacked_products`),
the route around it (`measured_references`), the route by the row-bucket rule
(`measured_elsewhere`), or an injected fault (`inject`, tests of the oracles). Each path
is a context manager taking the model the block runs (only `measured_elsewhere` reads it).

A fault is `fault(merged, x) -> tensor`, the concatenated output it claims. Every path of
`MergedLinear.forward` (the concatenation, `pieces` that splits it, `outputs` that the GLU
rewrite takes) goes through `outputs`, so all of them then compute the fault."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from unittest import mock

import pytest
import torch

from fusion.kernels.calibration import OPS, Table
from fusion.kernels.policy import MAX_BUCKET, POLICY
from fusion.runtime import routes
from fusion.runtime.bound import BoundForward
from fusion.runtime.merged import MergedLinear
from tests.fusion.policy_tables import WIN, entry

Fault = Callable[[MergedLinear, torch.Tensor], torch.Tensor]


def inject(monkeypatch: pytest.MonkeyPatch, fault: Fault) -> None:
    """Make every `MergedLinear` compute `fault` (undone with `monkeypatch`)."""
    monkeypatch.setattr(MergedLinear, "outputs", lambda self, x: (fault(self, x),))


def _stacked(op: str, shape: tuple[int, ...], dtype: str, rows: int, backend: str) -> tuple:
    return ("stacked",) if op == "stacked" else ()


@contextmanager
def stacked_products(model: torch.nn.Module | None = None) -> Iterator[None]:
    """A block in which the kernel policy chooses the stacked product for every merged
    call (the path a kernel measured faster takes: one product on the stacked weight while
    the views hold and no gradient is recorded, its output split into pieces), compiled
    code included (the `fusion::stacked_product` node is traced: no answer made eagerly
    says the reference); the default policy computes every shard apart."""
    POLICY.forget()  # answers memoised before the patch must not answer inside it
    try:
        with (
            mock.patch.object(POLICY, "choose", _stacked),
            mock.patch.object(POLICY, "idle", lambda op, backend: False),
            mock.patch.object(POLICY, "traced_reference", lambda *args: False),
        ):
            yield
    finally:
        POLICY.forget()


@contextmanager
def measured_references(model: torch.nn.Module | None = None) -> Iterator[None]:
    """A block in which routes are open and every merged projection's product runs its
    reference (what an uncalibrated machine runs, or a table where nothing wins), so a
    rewritten forward whose kernels are all merged products runs its class's original
    instead (`fusion.runtime.routes`): the path a fused model takes where fusion only costs."""
    # routes keep the policy's answers for its epoch: a new one on entry, so no answer from
    # before the block decides inside it, and on leaving
    POLICY.forget()
    try:
        with (
            POLICY.routing(True),
            mock.patch.object(POLICY, "runs_reference", lambda *args: True),
        ):
            yield
    finally:
        POLICY.forget()


ELSEWHERE_DTYPES = ("float32", "bfloat16", "float16", "float64")


def elsewhere_table(model: torch.nn.Module | None = None) -> Table:
    """A table in which every product the policy watches (`KernelPolicy.own_wins`: each
    fused forward's, made or copied in this process; only `model`'s where given: their
    number grows with every model fused in the process, and each table is answered for all
    of them) won, in every floating dtype, only at the largest row bucket (`MAX_BUCKET`), by
    the first kernel its op has besides the reference that needs no build of its own (not
    `native`)."""
    shapes = None
    if model is not None:
        shapes = {tuple(m.kernel_shape) for m in model.modules() if isinstance(m, MergedLinear)}
        shapes |= {tuple(m.weight.shape) for m in model.modules() if type(m) is torch.nn.Linear}
    won = Table("winners only at the largest row bucket")
    for op, shape, _backend in list(POLICY.own_wins):
        if shapes is not None and shape not in shapes:
            continue
        kernel = next(k for k in OPS[op] if k not in ("reference", "native"))
        one = entry(op, shape, MAX_BUCKET, **{kernel: WIN})
        for dtype in ELSEWHERE_DTYPES:
            won.add(dataclasses.replace(one, dtype=dtype))
    return won


@contextmanager
def measured_elsewhere(model: torch.nn.Module | None = None) -> Iterator[None]:
    """A block in which routes are open and every watched product (of `model`, where given)
    won only at a row bucket no test input reaches (`elsewhere_table`): the process's quiet
    lane and each product's own are closed, so a rewritten forward or plain linear takes its
    route by the row-bucket rule alone (`KernelPolicy.won_rows`: nothing won for the call's
    dtype and row bucket), the path a calibrated machine's decode steps take when the
    winners were the prompt's. The table in use before is put back on leaving."""
    previous = POLICY.table
    POLICY.set_table(elsewhere_table(model))
    try:
        with POLICY.routing(True):
            yield
    finally:
        POLICY.set_table(previous)


def stale_route(
    monkeypatch: pytest.MonkeyPatch, factor: float, *, off_the_lane: bool = False
) -> None:
    """A fault only on the route (`fusion.runtime.routes`): whenever a rewritten forward takes its
    class's original, its merged projections' stacked weights (so their shards' Parameters,
    views of it) are first scaled by `factor` (undone with `monkeypatch`). `off_the_lane`:
    only where the process's quiet lane is closed (the row-bucket rule's routes)."""
    call = BoundForward.__call__

    def call_with_stale_shards(self, *args, **kwargs):
        # asked of the rule (`Route.takes_original`), so the route is faulted whichever
        # copy of it takes the call (`BoundForward.__call__` spells its lane block out)
        route = self._route
        if (
            isinstance(route, routes.Route)
            and route.takes_original(args, kwargs)
            and not (off_the_lane and POLICY.lane is not False)
        ):
            with torch.no_grad():
                for merged in route.merged:
                    merged.stacked_weight.mul_(factor)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(BoundForward, "__call__", call_with_stale_shards)
