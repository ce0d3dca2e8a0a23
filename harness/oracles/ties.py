"""Near-tie discrete decisions: the tokens whose top-k selection no oracle can hold a system to.

A mixture-of-experts router picks each token's experts with `torch.topk` over scores computed in
the model's dtype. Where the float64 reference picks by a margin smaller than the unfused
model's own rounding error on those scores, an equally accurate computation (a compiler that
keeps intermediates in float32, a merged GEMM that sums in another order) may pick otherwise,
and that token's output, and every later position of its row (causal attention), then differs
by a whole expert's contribution. The parity oracle's tolerance is about rounding, not about
discrete choices, so such a token makes it fail a computation that is as exact as the unfused
one.

This module finds those tokens without looking inside the system under test: it records the
scores of every `topk` call in the unfused and the float64 forwards (`record_topk`, a
`TorchFunctionMode` on eager code), and names the rows whose reference margin between the k-th
and the (k+1)-th score is within `ERROR_MULTIPLE` times the unfused model's error on that row
(the tolerance the system is held to), never less than the dtype floor (`fragile_rows`).
`clean_mask` removes them, and everything causally after them, from the token mask.

Fail-closed rules: the verdict a caller may draw is *inconclusive*, never pass; a forward whose
two runs made different numbers or shapes of topk calls, or a fragile row that cannot be mapped
to a (batch, position) token, gives no mask (None), so nothing is excused.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from fusion.numerics import ERROR_MULTIPLE, dtype_floor


@dataclass(frozen=True)
class TopkCall:
    """The scores one `topk` call chose from, as rows (the chosen dimension last, larger is
    chosen: `largest=False` is recorded negated), and its k."""

    scores: torch.Tensor
    k: int


@dataclass(frozen=True)
class FragileRow:
    """One row of one recorded topk call whose reference margin is within the noise."""

    call: int
    row: int
    margin: float
    """Reference score of the k-th choice minus the (k+1)-th."""
    noise: float
    """The bound it was held to: ERROR_MULTIPLE x the unfused row's error (dtype floor at least)."""


_TOPK = {torch.topk, torch.Tensor.topk}


class _Recorder(TorchFunctionMode):
    def __init__(self, calls: list[TopkCall]) -> None:
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TOPK:
            self.calls.append(_topk_call(*args, **kwargs))
        return func(*args, **kwargs)


def _topk_call(
    input: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True, **_
) -> TopkCall:
    scores = input.detach().movedim(dim, -1).reshape(-1, input.shape[dim]).clone()
    return TopkCall(scores if largest else -scores, int(k))


@contextmanager
def record_topk() -> Iterator[list[TopkCall]]:
    """Yields the list of every `torch.topk` / `Tensor.topk` call made while the block runs, in
    call order. For eager forwards: under the mode the fusion kernels run their references
    (a mode is not plain dense), so record the unfused model, not the one under test."""
    calls: list[TopkCall] = []
    with _Recorder(calls):
        yield calls


def fragile_rows(
    unfused: Sequence[TopkCall], reference: Sequence[TopkCall], dtype: torch.dtype
) -> list[FragileRow] | None:
    """The rows whose float64 choice is a near-tie (module docstring), or None when the two
    forwards' topk calls do not pair up one to one (same count, shapes and k)."""
    if len(unfused) != len(reference):
        return None
    found: list[FragileRow] = []
    for index, (mine, exact) in enumerate(zip(unfused, reference)):
        if mine.k != exact.k or mine.scores.shape != exact.scores.shape:
            return None
        width = exact.scores.shape[-1]
        if mine.k >= width or exact.scores.numel() == 0:
            continue  # every score is chosen: no decision to flip
        ranked = exact.scores.double().sort(dim=-1, descending=True).values
        margins = ranked[:, mine.k - 1] - ranked[:, mine.k]
        error = (mine.scores.double() - exact.scores.double()).abs().amax(dim=-1)
        floor = dtype_floor(dtype) * exact.scores.double().abs().amax(dim=-1)
        noise = ERROR_MULTIPLE * torch.maximum(error, floor)
        for row in torch.nonzero(margins <= noise).flatten().tolist():
            found.append(FragileRow(index, row, float(margins[row]), float(noise[row])))
    return found


def clean_mask(
    mask: torch.Tensor, rows: Sequence[FragileRow], calls: Sequence[TopkCall]
) -> torch.Tensor | None:
    """The (batch, seq) token `mask` without each fragile token and the later positions of its
    row (they attend to it); None when a fragile row's call does not have one row per token
    (batch x seq rows), so it cannot be placed."""
    batch, seq = mask.shape
    clean = mask.clone()
    for fragile in rows:
        if calls[fragile.call].scores.shape[0] != batch * seq:
            return None
        b, t = divmod(fragile.row, seq)
        clean[b, t:] = False
    return clean


def describe(rows: Sequence[FragileRow], seq: int, limit: int = 3) -> str:
    """Where the near-ties are, for a verdict's reason: 'topk call C, token (b, t): margin m
    <= noise n', the first `limit` and a count of the rest."""
    parts = [
        f"topk call {r.call}, token ({r.row // seq}, {r.row % seq}): margin {r.margin:.2g} "
        f"<= noise {r.noise:.2g}"
        for r in rows[:limit]
    ]
    more = f" (+{len(rows) - limit} more)" if len(rows) > limit else ""
    return "; ".join(parts) + more
