"""Steer every merged projection down one path: its stacked product (`stacked_products`),
the route around it (`measured_references`), or an injected fault (`inject`, tests of the
oracles).

A fault is `fault(merged, x) -> tensor`, the concatenated output it claims. Every path of
`MergedLinear.forward` (the concatenation, `pieces` that splits it, `outputs` that the GLU
rewrite takes) goes through `outputs`, so all of them then compute the fault."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from unittest import mock

import pytest
import torch

from fusion.kernels.policy import POLICY
from fusion.runtime import routes
from fusion.runtime.merged import MergedLinear

Fault = Callable[[MergedLinear, torch.Tensor], torch.Tensor]


def inject(monkeypatch: pytest.MonkeyPatch, fault: Fault) -> None:
    """Make every `MergedLinear` compute `fault` (undone with `monkeypatch`)."""
    monkeypatch.setattr(MergedLinear, "outputs", lambda self, x: (fault(self, x),))


def _stacked(op: str, shape: tuple[int, ...], dtype: str, rows: int, backend: str) -> tuple:
    return ("stacked",) if op == "stacked" else ()


@contextmanager
def stacked_products() -> Iterator[None]:
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
def measured_references() -> Iterator[None]:
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


def stale_route(monkeypatch: pytest.MonkeyPatch, factor: float) -> None:
    """A fault only on the route (`fusion.runtime.routes`): whenever a rewritten forward takes its
    class's original, its merged projections' stacked weights (so their shards' Parameters,
    views of it) are first scaled by `factor` (undone with `monkeypatch`)."""
    takes = routes.Route.takes_original

    def takes_with_stale_shards(self, args, kwargs):
        taken = takes(self, args, kwargs)
        if taken:
            with torch.no_grad():
                for merged in self.merged:
                    merged.stacked_weight.mul_(factor)
        return taken

    monkeypatch.setattr(routes.Route, "takes_original", takes_with_stale_shards)
