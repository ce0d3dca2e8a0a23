"""Which kernel computes each fused product: the one explicit, resettable kernel policy.

A fused module asks `POLICY.choose(op, shape, dtype, rows, backend)` where it could run
more than one kernel for the same function, and gets a kernel name back:

- `linear` (a plain linear's `fusion.runtime.linear_forward.LinearForward`: one weight `[N, K]`,
  shape `(N, K)`): `reference` (`F.linear`), `native` (`native_gemm`), `onednn-row`
  (`onednn_backend.row_linear`, one row);
- `stacked` (`MergedLinear`: shards `[N_i, K]` stacked, shape `(N_1, ..., N_s, K)`):
  `reference` (each shard's own `F.linear`: the unfused calls), `stacked` (one `F.linear`
  on the stacked weight), `native` and `onednn-row` on the stacked weight;
- `experts` (CPU routed experts, shape `(E, 2I, H, topk)`): `reference` (`reference`),
  `native`, `onednn` (those backends' `moe_experts`).

Every kernel computes the reference's function (their tests bound the rounding); they differ
in speed, and speed differs by machine. So, in the default mode, **a kernel other than the
reference runs only where it was measured on this machine to beat the reference**
(`fusion.kernels.calibration`: interleaved timing, per (op, shape, dtype, threads, row
bucket), cached on disk under this machine's key); where nothing was measured the reference
runs, so an uncalibrated fused model computes exactly what its unfused twin computes, at its
speed. Which kernel runs depends only on the table and the call's shape, dtype, thread count
and backend: the same inputs on the same machine take the same path.

`backend` restricts the choice, as `fusion.fuse(backend=...)` promises: `torch` allows only
torch's own ops (`reference`, `stacked`), still chosen by measurement; `native` and `onednn`
pin their kernel wherever it is eligible (no measurement: the name means that kernel);
`auto` (and the GPU backends, which have no CPU products) choose by measurement among all.

Modes (`FUSION_KERNELS` in the environment, read at first use; `POLICY.use(mode)`):
`measured` (default, above), `reference` (every op on its reference: fast paths off) and
`eligible` (every fast kernel wherever its static rules allow it, unmeasured: what a kernel's
own tests and the benchmarks that find the rules need). Eligibility (the dispatcher's
contract, the operand rules, the kernel built here) is always checked again at the call: the
policy only ever narrows what may run, never widens it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from fusion.kernels.calibration import OPS, Entry, Table, load_table, machine
from fusion.kernels.native import gemm as native_gemm

MODES = ("measured", "reference", "eligible")
MODE_ENV = "FUSION_KERNELS"

ELIGIBLE: dict[str, tuple[str, ...]] = {
    "linear": ("native", "onednn-row"),
    "stacked": ("native", "onednn-row"),
    "experts": ("onednn", "native"),
}
"""`eligible` mode: the fast kernels tried in this order, the first eligible one runs (the
static rules the kernels had before they were measured; the reference otherwise)."""

LANE_BACKENDS = ("auto", "torch")
"""The backends whose fused forwards take the quiet lane (`KernelPolicy.quiet`): those that
choose by measurement. A pinned backend names its kernel, measured or not."""

TORCH_ONLY = frozenset({"reference", "stacked"})
"""The kernels that are torch's own ops (what `backend="torch"` allows)."""

PINNED: dict[str, tuple[str, ...]] = {
    "native": ("native",),
    "onednn": ("onednn-row", "onednn"),
    "triton": ("stacked",),
    "vllm": ("stacked",),
}
"""Backends that name kernels: theirs run wherever eligible, unmeasured (the GPU backends'
fused modules are the stacked GEMM: they have no products of their own)."""


NO_WINS: frozenset[tuple[str, int]] = frozenset()
"""`KernelPolicy.own_wins`' answer where nothing was measured to win: the own quiet lane."""

UNMEASURED = "unmeasured"
"""`KernelPolicy.own_wins`' answer where a kernel may run unmeasured (a pinned backend, the
`eligible` mode): compiled code traces the operator, which decides when it runs."""


MAX_BUCKET = 512
"""Rows past this fall in no bucket: the reference (no fast kernel is for prompts that long)."""


def row_bucket(rows: int) -> int:
    """The bucket `rows` is timed and looked up in: the smallest power of two >= `rows`
    (1, 2, 4, ..., `MAX_BUCKET`), or 0 for none (no rows, or more than `MAX_BUCKET`)."""
    if rows < 1 or rows > MAX_BUCKET:
        return 0
    return 1 << (rows - 1).bit_length()


def quiet_for(won: dict[Any, frozenset[int]], x: torch.Tensor, width: int) -> bool:
    """Is a call on `x` (a tensor whose rows are `width` wide) outside every bucket of
    `won` (`KernelPolicy.won_rows`), so every product it describes runs its reference?
    The row bucket is `row_bucket`'s, inline (this runs on every call of a calibrated
    model's fused forwards)."""
    buckets = won.get(x.dtype)
    if not buckets:
        return True
    rows = x.numel() // width
    return not 1 <= rows <= MAX_BUCKET or (1 << (rows - 1).bit_length()) not in buckets


def in_row_lane(lane: dict[Any, int] | None, x: torch.Tensor, width: int) -> bool:
    """Is a call on `x` (a tensor whose rows are `width` wide) in the row-bucket lane
    `lane` (`KernelPolicy.row_lane`): its dtype absent, or its row bucket below the
    smallest winning one (`2 * rows <= bound`, the buckets being powers of two)? Rows
    past every bucket also run the reference, but are left to the per-call rule. Its hot
    callers spell this out inline; a test holds them to it."""
    if lane is None:
        return False
    bound = lane.get(x.dtype)
    return bound is None or 2 * x.numel() <= bound * width


def allowed(op: str, backend: str) -> tuple[str, ...]:
    """The kernels of `op` that `backend` allows, reference first. A pinned backend's tuple
    is its own kernel alone (see `pinned`)."""
    kernels = OPS[op]
    if backend == "torch":
        return tuple(k for k in kernels if k in TORCH_ONLY)
    pin = PINNED.get(backend)
    if pin is not None:
        return tuple(k for k in kernels if k in pin)
    return kernels


@dataclass
class KernelPolicy:
    """The process's kernel choices: a mode, the calibration table of this machine (loaded
    at first use) and a memo of answers. `reset()` forgets all three (tests, a refreshed
    table); nothing else in the package keeps kernel-choice state."""

    _mode: str | None = None
    _table: Table | None = None
    _memo: dict[tuple, Any] = field(default_factory=dict)
    asked: set[tuple[str, tuple[int, ...], str, int, int]] = field(default_factory=set)
    """Every (op, shape, dtype, row bucket, threads) a choice was asked for with a kernel
    to choose between: what `fusion.calibrate` measures after running a model."""
    recording: bool = False
    """While set (`recording_asks`), `idle` answers False, so every product asks `choose`
    and lands in `asked`."""
    epoch: object = field(default_factory=object)
    """A fresh object each time the memoised answers are forgotten (`use`, `set_table`,
    `reset`, an `override` ending): a caller that keeps a choice of its own keys it by the
    epoch, so it is never older than the policy's (`ops.chosen_for`). An object, not a
    count: a key copied or unpickled into another process (or another epoch) never equals
    the current one."""
    idle_answers: dict[tuple[str, str], bool] = field(default_factory=dict)
    """`idle(op, backend)`'s answers by `(op, backend)`, forgotten with the memo: for a caller
    on the hottest path (`LinearForward`) to read without a call (not while `recording`, when
    `idle` answers False whatever this holds; a missing key: ask `idle`)."""
    routes: bool = True
    """Whether a rewritten forward may run its class's original where every product it
    would compute runs its reference (`routes_open`, `fusion.runtime.routes`). On by
    default: there the rewrite computes the unfused calls anyway, through more frames. The
    harness judges rewrites with routes closed (`routing(False)`), so the code a calibrated
    machine runs is what its oracles see, and judges the route apart."""
    lane: bool | None = None
    """`quiet()`'s answer, None until asked since the last `forget` (which asks it at once
    where the table is loaded): a plain attribute, for the fused forwards of the lane's
    backends to read before anything else."""

    counting: bool = False
    """While set (`counting_routes`), every call a fused forward sends to its class's
    original by a route is counted in that forward's `original_calls`. Off by default:
    outside a trace the count needs a call to ask whether Dynamo traces (it must not guard
    on a count), and on a decode step that frame, run from the caches a GEMV has just
    emptied, is most of what a routed call costs over the unfused one."""
    row_lane: dict[Any, int] | None = None
    """The process's row-bucket lane, answered with `lane` (`quiet`): by input dtype (a
    `torch.dtype` where the table's name is one), the smallest row bucket at which a kernel
    other than the reference won, at any thread count, in any entry of the table for a
    plain or merged linear under a lane backend (`LANE_BACKENDS`); {} in the `reference`
    mode, None in the `eligible` mode and until answered. A call of a dtype absent from
    it, or whose rows `r` satisfy `2 * r <= bound`, runs the reference of every product of
    a lane backend, whatever its shape and the thread count (`in_row_lane`): the buckets
    are powers of two, so `row_bucket(r)` is below the smallest winning bucket exactly
    there. Read from the table, not from the products a process watches, so a product
    made later (a copy, another model) is covered as the quiet lane covers it. A fused
    forward reads it first where the quiet lane is closed by winners at other rows (a
    calibration whose winners are the prompt's, seen by the decode's one-row calls), alike
    eager and traced (it implies `traced_route` for every product of a lane backend:
    Dynamo guards what it read, so a new table recompiles)."""
    own_wins: dict[tuple[str, tuple[int, ...], str], frozenset[tuple[str, int]] | str | None] = (
        field(default_factory=dict)
    )
    """Each watched product's answer by `(op, shape, backend)`: the (dtype, row bucket) pairs
    a kernel other than the reference was measured to win for, at any thread count (empty:
    the product's own quiet lane, `own_lane`), `UNMEASURED` where a kernel may run
    unmeasured (a pinned backend, the `eligible` mode), None where not answered since the
    last `forget` without a loaded table. Fused forwards watch their products when made
    (`watch_lane`); `fusion.fuse` (`answer_lanes`) and every `forget` where the table is
    loaded answer them, outside any trace, and compiled code only reads them
    (`traced_own_lane`, `traced_reference`): Dynamo guards each value it read, so a new
    table or mode that changes one recompiles, and one that changes none does not. Keys
    are a model's product shapes: a handful per model, never per call."""

    def quiet(self) -> bool:
        """Would every product of a plain or merged linear under a lane backend
        (`LANE_BACKENDS`) run its reference whatever the call (`idle`, recording aside)?
        That is a fused model on a machine nobody calibrated. With routes open and nothing
        recording (`routes_open`), a fused forward of a lane backend then runs its class's
        original (the unfused function, what every guard failure runs) after three
        attribute reads (`lane`, `routes`, `recording`): on a decode step every check a
        forward makes runs from caches the last GEMV emptied, and the per-call checks of
        the routes cost 3% of a SmolLM2 token (`docs/benchmarks.md`). Kept in `lane` until
        a change of mode or table (`forget`)."""
        lane = self.lane
        if lane is None:
            lane = self.lane = all(
                self._idle_answer(op, backend)
                for op in ("linear", "stacked")
                for backend in LANE_BACKENDS
            )
            self.row_lane = self._row_lane()
        return lane

    def _row_lane(self) -> dict[Any, int] | None:
        """`row_lane`, computed from the mode and the table."""
        if self.mode == "reference":
            return {}
        if self.mode != "measured":
            return None
        lowest: dict[Any, int] = {}
        for entry in self.table.entries.values():
            if entry.op not in ("linear", "stacked") or not any(
                _best(entry, allowed(entry.op, backend)) != "reference" for backend in LANE_BACKENDS
            ):
                continue
            named = getattr(torch, entry.dtype, None)
            dtype = named if isinstance(named, torch.dtype) else entry.dtype
            lowest[dtype] = min(lowest.get(dtype, entry.rows), entry.rows)
        return lowest

    def traced_lane(self) -> bool:
        """While Dynamo traces: may a fused forward of a lane backend trace its class's
        original, as its eager call would run it? Only on the quiet lane as last answered
        eagerly (`lane` is True: never asked here, where the answer would read the table),
        with routes open and nothing recording. Dynamo guards the three attributes it reads,
        so a change that forgets the lane (a table, a mode: `forget`) recompiles, and the
        compiled code runs what Inductor compiles best, the unfused calls, where no kernel
        of ours could run anyway (`docs/benchmarks.md`: 0.81x of the compiled unfused model
        otherwise). A route changes speed, never the result, so even a stale one is safe."""
        return self.lane is True and self.routes and not self.recording

    def traced_own_lane(self, keys: tuple[tuple[str, tuple[int, ...], str], ...]) -> bool:
        """While Dynamo traces: may a fused forward whose products are `keys` (`watch_lane`)
        trace its class's original where the process's lane is closed (winners measured for
        other shapes, `traced_lane` False)? Routes open, nothing recording, and every key's
        own lane answered (`own_wins` empty, answered eagerly: never computed here, where it
        would read the table). An unanswered key traces the rewrite: slower, never wrong."""
        if not self.routes or self.recording:
            return False
        wins = self.own_wins
        return all(wins.get(key) == NO_WINS for key in keys)

    def traced_reference(
        self, key: tuple[str, tuple[int, ...], str], dtype: str, rows: Any
    ) -> bool:
        """While Dynamo traces: does the watched product `key` (`watch_lane`) compute its
        reference for a call of `dtype` (a policy dtype name) and `rows` rows, whatever the
        thread count (which a trace cannot read)? True where nothing was measured to win for
        its shape at all, or for that dtype and row bucket at any thread count (`own_wins`);
        False where unanswered, where anything may run unmeasured, or where `rows` is not a
        plain int (a dynamic shape): the caller then traces the operator, which decides when
        it runs. Read only (Dynamo guards what it reads); a stale answer costs speed only."""
        wins = self.own_wins.get(key)
        if not isinstance(wins, frozenset):
            return False
        if not wins:
            return True
        return isinstance(rows, int) and (dtype, row_bucket(rows)) not in wins

    def traced_route(
        self, keys: tuple[tuple[str, tuple[int, ...], str], ...], dtype: str, rows: Any
    ) -> bool:
        """While Dynamo traces: may a fused forward whose products are `keys` trace its
        class's original for this call? Routes open, nothing recording, and every product
        on its reference for it (`traced_reference`)."""
        if not self.routes or self.recording:
            return False
        return all(self.traced_reference(key, dtype, rows) for key in keys)

    def watch_lane(self, op: str, shape: tuple[int, ...], backend: str) -> tuple:
        """Watch the product `op` at `shape` under `backend` (`own_wins`, unanswered until
        `answer_lanes` or `won_rows`); returns its key. Reads nothing: safe in a
        constructor."""
        key = (op, tuple(int(n) for n in shape), backend)
        self.own_wins.setdefault(key, None)
        return key

    def answer_lanes(self) -> None:
        """Answer every watched product now (`own_wins`; loads the table)."""
        for key in self.own_wins:
            self._answer_lane(key)

    def own_lane(self, key: tuple[str, tuple[int, ...], str]) -> bool:
        """Is `key`'s own quiet lane answered open (nothing measured to win for its shape:
        `own_wins` empty)? Reads the answers only."""
        return self.own_wins.get(key) == NO_WINS

    def won_rows(
        self, keys: tuple[tuple[str, tuple[int, ...], str], ...]
    ) -> dict[Any, frozenset[int]] | None:
        """Eager: the row buckets a kernel was measured to win for at any thread count, by
        input dtype (a `torch.dtype` where the table's name is one, else the name), over
        the watched products `keys` (`own_wins`, answered here where they were not), or
        None where one may run a kernel unmeasured (a pinned backend, the `eligible`
        mode). A call whose dtype and row bucket are not in it runs every product's
        reference whatever the thread count (`quiet_for`): the rule compiled code reads
        (`traced_reference`), so a product whose winners are for the prompt's rows leaves
        the one-row decode calls on the unfused path. Not while recording (the caller
        asks `routes_open` first)."""
        won: dict[Any, set[int]] = {}
        for key in keys:
            wins = self.own_wins.get(key)
            if wins is None:
                wins = self._answer_lane(key)
            if not isinstance(wins, frozenset):
                return None
            for dtype, bucket in wins:
                named = getattr(torch, dtype, None)
                won.setdefault(named if isinstance(named, torch.dtype) else dtype, set()).add(
                    bucket
                )
        return {dtype: frozenset(buckets) for dtype, buckets in won.items()}

    def _answer_lane(
        self, key: tuple[str, tuple[int, ...], str]
    ) -> frozenset[tuple[str, int]] | str:
        """Answer and return `key`'s `own_wins` entry."""
        op, shape, backend = key
        if self._own_answer(key):
            wins: frozenset[tuple[str, int]] | str = NO_WINS
        elif backend in PINNED or self.mode != "measured":
            wins = UNMEASURED
        else:
            kernels = allowed(op, backend)
            wins = frozenset(
                (entry.dtype, entry.rows)
                for entry in self.table.entries.values()
                if entry.op == op
                and tuple(entry.shape) == shape
                and _best(entry, kernels) != "reference"
            )
        self.own_wins[key] = wins
        return wins

    def _own_answer(self, key: tuple[str, tuple[int, ...], str]) -> bool:
        op, shape, backend = key
        return self._idle_answer(op, backend) or self._idle(op, backend, shape)

    def forget(self) -> None:
        """Drop every memoised answer (choices, idle answers), and start
        a new `epoch`. Every change of mode or table does this; so must anything else that
        changes what `choose` or `idle` answer (a test patching them)."""
        self._memo.clear()
        self.idle_answers.clear()
        self.epoch = object()
        self.lane = None
        self.row_lane = None
        if self._table is not None:
            # answered now, where that reads no file: compiled code only reads the answer
            # (`traced_lane`), and a model compiled on the lane finds it again after a
            # table that closed it is put back, instead of recompiling without it; so
            # are the watched products (`own_wins`)
            self.quiet()
            self.answer_lanes()
        else:
            for key in self.own_wins:
                self.own_wins[key] = None

    def reset(self) -> None:
        self._mode = None
        self._table = None
        self.forget()
        self.asked.clear()
        self.recording = False
        self.routes = True
        self.counting = False
        self.own_wins.clear()

    @contextmanager
    def _flag(self, name: str, value: bool) -> Iterator[None]:
        """A block in which the flag attribute `name` is `value`, then as before."""
        previous = getattr(self, name)
        setattr(self, name, value)
        try:
            yield
        finally:
            setattr(self, name, previous)

    def routing(self, enabled: bool) -> AbstractContextManager[None]:
        """A block in which routes are open (`enabled`) or closed, then as before."""
        return self._flag("routes", enabled)

    def counting_routes(self) -> AbstractContextManager[None]:
        """A block in which routed calls are counted (`counting`), then as before."""
        return self._flag("counting", True)

    def routes_open(self) -> bool:
        """May a rewritten forward take its route now: routes enabled and no asks being
        recorded (while recording, every product must ask `choose`, so nothing may route
        around it)."""
        return self.routes and not self.recording

    def recording_asks(self) -> AbstractContextManager[None]:
        """A block in which every product asks `choose` (no `idle` shortcut)."""
        return self._flag("recording", True)

    def idle(self, op: str, backend: str) -> bool:
        """Would `choose(op, ...)` answer the reference (an empty tuple) for every shape,
        dtype, row count and thread count under `backend` now? Then a caller may compute
        its reference without asking, touching as little code as possible: on a decode step
        every extra Python frame after a weight-streaming GEMV runs from cold caches (tens
        of microseconds per module). True for the `reference` mode, for a backend that
        allows no fast kernel of `op`, and in `measured` mode when no entry of the table
        has a winner for `op`; never for a pinned backend, the `eligible` mode, or while
        `recording`. One dict lookup after the first call (memoised with the choices,
        forgotten with them by `use`, `set_table`, `reset`)."""
        return not self.recording and self._idle_answer(op, backend)

    def _idle_answer(self, op: str, backend: str) -> bool:
        """`idle`'s answer as if nothing were recording, memoised in `idle_answers`."""
        answer = self.idle_answers.get((op, backend))
        if answer is None:
            answer = self.idle_answers[op, backend] = self._idle(op, backend)
        return answer

    def idle_for(self, op: str, shape: tuple[int, ...], backend: str) -> bool:
        """Would `choose(op, shape, ...)` answer the reference for every dtype, row count and
        thread count under `backend` now (`idle`, for one shape)? The quiet lane of one
        fused module (`LinearForward`, a route) where the process's lane (`quiet`) is closed
        by winners measured for other shapes (another model calibrated on this machine).
        Reads the table; a caller keeps the answer for the policy's `epoch`."""
        return not self.recording and self._own_answer((op, shape, backend))

    def _idle(self, op: str, backend: str, shape: tuple[int, ...] | None = None) -> bool:
        """`idle`'s answer, computed: for every shape, or for `shape` alone."""
        if backend in PINNED:
            return False
        kernels = allowed(op, backend)
        if all(k == "reference" for k in kernels) or self.mode == "reference":
            return True
        if self.mode != "measured":
            return False
        return not any(
            entry.op == op
            and (shape is None or tuple(entry.shape) == tuple(shape))
            and _best(entry, kernels) != "reference"
            for entry in self.table.entries.values()
        )

    @property
    def mode(self) -> str:
        if self._mode is None:
            mode = os.environ.get(MODE_ENV, "measured").strip() or "measured"
            if mode not in MODES:
                raise ValueError(f"{MODE_ENV}={mode!r}: expected one of {', '.join(MODES)}")
            self._mode = mode
        return self._mode

    def use(self, mode: str) -> None:
        """Set the mode for the rest of the process (until `reset`)."""
        if mode not in MODES:
            raise ValueError(f"unknown kernel policy mode {mode!r}; known: {', '.join(MODES)}")
        self._mode = mode
        self.forget()

    @contextmanager
    def override(self, mode: str) -> Iterator[None]:
        """`use(mode)` for a block, then the previous mode again."""
        previous = self._mode
        self.use(mode)
        try:
            yield
        finally:
            self._mode = previous
            self.forget()

    @property
    def table(self) -> Table:
        if self._table is None:
            self._table = load_table()
        return self._table

    def set_table(self, table: Table) -> None:
        """Use `table` (a fresh calibration, or a test's) instead of the one on disk."""
        self._table = table
        self.forget()

    def choose(
        self, op: str, shape: tuple[int, ...], dtype: str, rows: int, backend: str
    ) -> tuple[str, ...]:
        """The kernels `op` may run for `rows` rows of this shape and dtype under `backend`
        at torch's current thread count, in the order to try them: the caller runs the
        first that is eligible for the call (the dispatcher's contract, the operand rules),
        and the reference when none is (an empty tuple: the reference). One dict lookup
        after the first call per key."""
        threads = torch.get_num_threads()
        key = (op, shape, dtype, row_bucket(rows), threads, backend)
        chosen = self._memo.get(key)
        if chosen is None:
            chosen = self._decide(op, shape, dtype, key[3], threads, backend)
            self._memo[key] = chosen
        return chosen

    def runs_reference(
        self, op: str, shape: tuple[int, ...], dtype: str, rows: int, backend: str
    ) -> bool:
        """Does `op` compute its reference for `rows` rows of this shape and dtype under
        `backend` at the current thread count: no kernel to choose (`idle`), or `choose`
        names none (nothing measured to win, no row bucket, the `reference` mode)? Then a
        caller whose only other work is that reference may compute it its own way
        (`fusion.runtime.routes`). False for a pinned backend and in the `eligible` mode,
        which name kernels unmeasured. Asks `choose` (so the key lands in `asked`, what a
        calibration measures) unless idle; one memoised lookup either way."""
        return self.idle(op, backend) or not self.choose(op, shape, dtype, rows, backend)

    def explain(
        self, op: str, shape: tuple[int, ...], dtype: str, rows: int, backend: str
    ) -> tuple[str, str]:
        """(kernel, why) for a report: the first kernel `choose` answers (where eligible)
        and the reason it was chosen."""
        order = self.choose(op, shape, dtype, rows, backend)
        kernel = order[0] if order else "reference"
        if backend in PINNED:
            return kernel, f"backend={backend} pins {' / '.join(allowed(op, backend)) or 'none'}"
        if row_bucket(rows) == 0:
            return kernel, f"{rows} rows: past every fast kernel's sizes"
        if self.mode != "measured":
            return kernel, f"{MODE_ENV}={self.mode}"
        entry = self.table.lookup(op, shape, dtype, row_bucket(rows), torch.get_num_threads())
        if entry is None:
            return kernel, "not measured on this machine: the reference runs"
        summary = entry.summary(allowed(op, backend))
        if "native" in entry.ratios and entry.native_build != native_gemm.build_id():
            summary += " (native measured on another kernel build: not used)"
        return kernel, summary

    def _decide(
        self, op: str, shape: tuple[int, ...], dtype: str, bucket: int, threads: int, backend: str
    ) -> tuple[str, ...]:
        kernels = allowed(op, backend)
        if backend in PINNED:
            return tuple(k for k in kernels if k != "reference")
        if bucket == 0 or self.mode == "reference":
            return ()
        if self.mode == "eligible":
            return tuple(k for k in ELIGIBLE[op] if k in kernels)
        if len(kernels) > 1:
            self.asked.add((op, shape, dtype, bucket, threads))
        entry = self.table.lookup(op, shape, dtype, bucket, threads)
        best = "reference" if entry is None else _best(entry, kernels)
        return () if best == "reference" else (best,)


def _best(entry: Entry, kernels: tuple[str, ...]) -> str:
    """`entry.best(kernels)`, not counting a native measurement of another kernel build
    than this process runs (asked only when native won, so nothing else builds it)."""
    best = entry.best(kernels)
    if best == "native" and entry.native_build != native_gemm.build_id():
        best = entry.best(tuple(k for k in kernels if k != "native"))
    return best


def describe() -> dict[str, str]:
    """What decides the kernels of this process, as strings for a result line or a repro
    bundle: the machine's calibration key fields (`calibration.machine`), the native
    kernel's status, the policy mode and the table in use (key, measured entries, and how
    many of them have a kernel other than the reference winning: any closes the quiet
    lane, `KernelPolicy.quiet`)."""
    info = dict(machine())
    info["native"] = native_gemm.status()
    info["policy"] = POLICY.mode
    table = POLICY.table
    winners = sum(_best(e, OPS[e.op]) != "reference" for e in table.entries.values())
    info["table"] = f"{table.key} ({len(table.entries)} measured, {winners} with a winner)"
    return info


POLICY = KernelPolicy()
"""The process's one policy object (`POLICY.reset()` restores the defaults)."""
