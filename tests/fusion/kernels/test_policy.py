"""The kernel policy: measured choices, modes, backend restrictions (no timing here: the
tables are written by hand; `test_calibration.py` tests the measuring)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fusion.kernels import policy
from fusion.kernels.calibration import Entry, Ratio
from fusion.kernels.policy import POLICY, UNMEASURED, allowed, row_bucket
from tests.fusion.policy_tables import LOSS, NOISE, WIN, entry, table

SHAPE = (64, 32, 32, 128)


@pytest.mark.parametrize(
    ("rows", "bucket"), [(0, 0), (1, 1), (2, 2), (3, 4), (16, 16), (17, 32), (512, 512), (513, 0)]
)
def test_row_buckets(rows: int, bucket: int) -> None:
    assert row_bucket(rows) == bucket


def test_backends_restrict_the_kernels() -> None:
    assert allowed("stacked", "torch") == ("reference", "stacked")
    assert allowed("linear", "torch") == ("reference",)
    assert allowed("experts", "torch") == ("reference",)
    assert allowed("linear", "native") == ("native",)
    assert allowed("linear", "onednn") == ("onednn-row",)
    assert allowed("stacked", "auto") == policy.OPS["stacked"]


def test_nothing_measured_runs_the_reference() -> None:
    assert POLICY.mode == "measured"
    for op in policy.OPS:
        assert POLICY.choose(op, SHAPE, "float32", 16, "auto") == ()


def test_a_measured_winner_runs_only_where_allowed_and_measured() -> None:
    POLICY.set_table(
        table(
            entry("stacked", SHAPE, 16, stacked=WIN, native=Ratio(1.8, 1.5, 2.0)),
            entry("stacked", SHAPE, 1, stacked=NOISE, native=LOSS),
        )
    )
    assert POLICY.choose("stacked", SHAPE, "float32", 16, "auto") == ("native",)
    assert POLICY.choose("stacked", SHAPE, "float32", 9, "auto") == ("native",)  # bucket 16
    assert POLICY.choose("stacked", SHAPE, "float32", 16, "torch") == ("stacked",)
    assert POLICY.choose("stacked", SHAPE, "float32", 1, "auto") == ()  # noise is no win
    assert POLICY.choose("stacked", SHAPE, "float32", 32, "auto") == ()  # not measured
    assert POLICY.choose("stacked", SHAPE, "bfloat16", 16, "auto") == ()
    assert POLICY.choose("stacked", (1, 2, 3), "float32", 16, "auto") == ()
    previous = torch.get_num_threads()
    torch.set_num_threads(previous + 1)
    try:
        assert POLICY.choose("stacked", SHAPE, "float32", 16, "auto") == ()  # other threads
    finally:
        torch.set_num_threads(previous)


def test_a_native_measurement_of_another_build_is_not_used() -> None:
    stale = entry("linear", (64, 128), 16, native=WIN)
    POLICY.set_table(table(Entry(**{**stale.__dict__, "native_build": "another.so"})))
    assert POLICY.choose("linear", (64, 128), "float32", 16, "auto") == ()
    kernel, why = POLICY.explain("linear", (64, 128), "float32", 16, "auto")
    assert kernel == "reference" and "another kernel build" in why


def test_modes_and_pins() -> None:
    POLICY.set_table(table(entry("linear", (64, 128), 16, native=LOSS)))
    assert POLICY.choose("linear", (64, 128), "float32", 16, "auto") == ()
    assert POLICY.choose("linear", (64, 128), "float32", 16, "native") == ("native",)
    assert POLICY.choose("linear", (64, 128), "float32", 16, "torch") == ()
    with POLICY.override("eligible"):
        assert (
            POLICY.choose("linear", (64, 128), "float32", 16, "auto") == policy.ELIGIBLE["linear"]
        )
        assert POLICY.choose("linear", (64, 128), "float32", 16, "torch") == ()
    POLICY.set_table(table(entry("linear", (64, 128), 16, native=WIN)))
    with POLICY.override("reference"):
        assert POLICY.choose("linear", (64, 128), "float32", 16, "auto") == ()
    assert POLICY.choose("linear", (64, 128), "float32", 16, "auto") == ("native",)


def test_mode_from_the_environment(monkeypatch) -> None:
    POLICY.reset()
    monkeypatch.setenv(policy.MODE_ENV, "reference")
    assert POLICY.mode == "reference"
    POLICY.reset()
    monkeypatch.setenv(policy.MODE_ENV, "fastest")
    with pytest.raises(ValueError, match="FUSION_KERNELS='fastest': expected one of measured"):
        POLICY.mode  # noqa: B018
    with pytest.raises(ValueError, match="unknown kernel policy mode"):
        POLICY.use("fastest")


def test_asked_records_what_had_a_choice() -> None:
    POLICY.choose("stacked", SHAPE, "float32", 5, "auto")
    POLICY.choose("linear", (64, 128), "float32", 1, "torch")  # nothing to choose
    POLICY.choose("linear", (64, 128), "float32", 600, "auto")  # past every bucket
    threads = torch.get_num_threads()
    assert POLICY.asked == {("stacked", SHAPE, "float32", 8, threads)}


def test_explain_names_the_reason() -> None:
    assert "not measured" in POLICY.explain("linear", (64, 128), "float32", 1, "auto")[1]
    assert "pins native" in POLICY.explain("linear", (64, 128), "float32", 1, "native")[1]
    POLICY.set_table(table(entry("linear", (64, 128), 1, native=WIN)))
    kernel, why = POLICY.explain("linear", (64, 128), "float32", 1, "auto")
    assert kernel == "native" and "native 1.40x [1.20-1.60]" in why and "fastest" in why


def test_idle_means_every_choice_would_be_the_reference() -> None:
    """`idle` lets a product skip `choose` only where `choose` could answer nothing but the
    reference: checked against `choose` over shapes, rows and backends."""
    assert POLICY.idle("linear", "auto") and POLICY.idle("stacked", "auto")  # empty table
    assert not POLICY.idle("linear", "native")  # pinned: its kernel runs unmeasured
    POLICY.set_table(
        table(entry("stacked", SHAPE, 16, native=WIN), entry("linear", (64, 128), 1, native=LOSS))
    )
    assert not POLICY.idle("stacked", "auto") and POLICY.choose(
        "stacked", SHAPE, "float32", 16, "auto"
    )
    assert POLICY.idle("linear", "auto")  # measured, but only a loss
    assert POLICY.idle("stacked", "torch")  # the one winner is native, which torch forbids
    with POLICY.override("eligible"):
        assert not POLICY.idle("linear", "auto")
    with POLICY.override("reference"):
        assert POLICY.idle("stacked", "auto")
    with POLICY.recording_asks():  # calibration must see every product asked
        assert not POLICY.idle("linear", "auto")
    assert POLICY.idle("linear", "auto")
    for op, backend in (("linear", "auto"), ("stacked", "torch")):
        for rows in (1, 2, 16, 100):
            for shape in (SHAPE, (64, 128)):
                assert POLICY.choose(op, shape, "float32", rows, backend) == ()


def test_the_quiet_lane_is_open_exactly_where_no_linear_product_could_choose() -> None:
    """`quiet` answers whether every plain and merged linear product of a lane backend is
    idle, and a kept answer (`lane`) never outlives a change of table or mode."""
    assert POLICY.quiet() and POLICY.lane is True  # empty table
    POLICY.set_table(table(entry("linear", (64, 128), 1, native=LOSS)))
    assert POLICY.lane is True and POLICY.quiet()  # measured, but only a loss
    POLICY.reset()
    assert POLICY.lane is None  # no table loaded: answered at first use, not here
    POLICY.use("measured")
    POLICY.set_table(table(entry("linear", (64, 128), 1, native=WIN)))
    assert not POLICY.quiet() and POLICY.lane is False
    POLICY.set_table(table(entry("stacked", SHAPE, 16, stacked=WIN)))
    assert not POLICY.quiet()  # `torch` allows the stacked GEMM: a lane backend could choose
    POLICY.set_table(table())
    assert POLICY.quiet()
    with POLICY.override("eligible"):
        assert not POLICY.quiet()
    assert POLICY.quiet()
    with POLICY.override("reference"):
        POLICY.set_table(table(entry("linear", (64, 128), 1, native=WIN)))
        assert POLICY.quiet()  # the mode runs every reference whatever the table says
    assert not POLICY.quiet()  # measured again, with that table
    POLICY.set_table(table())
    with POLICY.routing(True), POLICY.recording_asks():
        # the lane's own answer; the forwards also ask `routes` and `recording` per call
        assert POLICY.quiet() and not POLICY.routes_open()


def test_idle_for_one_shape_is_idle_where_its_own_entries_win_nothing() -> None:
    """`idle_for` answers `idle` for one shape: a winner measured for another shape (another
    model calibrated here) leaves it idle; its own winner, a pin, the eligible mode or a
    recording do not."""
    POLICY.set_table(table(entry("stacked", SHAPE, 16, native=WIN)))
    other = (64, 32, 32, 256)
    assert not POLICY.quiet()
    assert POLICY.idle_for("stacked", other, "auto") and not POLICY.idle_for(
        "stacked", SHAPE, "auto"
    )
    assert POLICY.idle_for("stacked", SHAPE, "torch")  # native won, which torch forbids
    assert not POLICY.idle_for("stacked", other, "native")  # pinned: runs unmeasured
    with POLICY.recording_asks():
        assert not POLICY.idle_for("stacked", other, "auto")
    with POLICY.override("eligible"):
        assert not POLICY.idle_for("stacked", other, "auto")
    with POLICY.override("reference"):
        assert POLICY.idle_for("stacked", SHAPE, "auto")
    for rows in (1, 2, 16, 100):  # held to `choose`
        assert POLICY.choose("stacked", other, "float32", rows, "auto") == ()


def test_watched_own_lanes_are_answered_outside_a_trace_and_read_inside() -> None:
    """`watch_lane` reads nothing; `answer_lanes` and every `forget` with the table loaded
    answer each watched key as `idle_for`; a `forget` without one unanswers them (compiled
    code then traces the rewrite); `traced_own_lane` reads only those answers, with routes
    open and nothing recording; `reset` forgets the keys."""
    other = (64, 32, 32, 256)
    POLICY.reset()
    mine = POLICY.watch_lane("stacked", SHAPE, "auto")
    theirs = POLICY.watch_lane("stacked", other, "auto")
    assert POLICY.own_wins == {mine: None, theirs: None}
    assert not POLICY.traced_own_lane((mine,))  # unanswered: the rewrite
    POLICY.answer_lanes()
    assert POLICY.own_wins == {mine: frozenset(), theirs: frozenset()}  # the empty table
    POLICY.set_table(table(entry("stacked", SHAPE, 16, native=WIN)))
    for key in (mine, theirs):
        assert POLICY.own_lane(key) == POLICY.idle_for(*key)
    assert POLICY.traced_own_lane((theirs,)) and not POLICY.traced_own_lane((theirs, mine))
    with POLICY.recording_asks():
        assert not POLICY.traced_own_lane((theirs,))
    with POLICY.routing(False):
        assert not POLICY.traced_own_lane((theirs,))
    POLICY._table = None
    POLICY.forget()
    assert POLICY.own_wins == {mine: None, theirs: None}
    assert POLICY.won_rows((theirs,)) == {} and POLICY.own_lane(theirs)  # loads, answers
    POLICY.reset()
    assert POLICY.own_wins == {}


def test_describe_counts_the_table_entries_with_a_winner() -> None:
    """What a bench header and a repro bundle print: a table with winners (which closes the
    quiet lane) is told apart from one that only measured losses."""
    POLICY.set_table(table(entry("stacked", SHAPE, 1, native=LOSS)))
    assert policy.describe()["table"].endswith("(1 measured, 0 with a winner)")
    POLICY.set_table(
        table(entry("stacked", SHAPE, 1, native=LOSS), entry("linear", (8, 8), 1, native=WIN))
    )
    assert policy.describe()["table"].endswith("(2 measured, 1 with a winner)")


def test_own_wins_are_the_dtype_and_row_buckets_anything_won_for() -> None:
    """`own_wins` (answered with the own lanes) lists the (dtype, row bucket) pairs a kernel
    won for at this shape, at any thread count (a trace cannot read it), so
    `traced_reference` says the reference only where no count could choose a kernel;
    `UNMEASURED` (the operator decides when it runs) in the `eligible` mode and for a pinned
    backend; empty (the reference for every call) in the `reference` mode."""
    key = POLICY.watch_lane("stacked", SHAPE, "auto")
    pinned = POLICY.watch_lane("stacked", SHAPE, "native")
    other_threads = dataclasses.replace(
        entry("stacked", SHAPE, 8, native=WIN), threads=torch.get_num_threads() + 1
    )
    POLICY.set_table(table(entry("stacked", SHAPE, 1, native=WIN), other_threads))
    assert POLICY.own_wins[key] == {("float32", 1), ("float32", 8)}
    assert not POLICY.traced_reference(key, "float32", 1)
    assert not POLICY.traced_reference(key, "float32", 5)  # bucket 8: won at another count
    assert POLICY.traced_reference(key, "float32", 16) and POLICY.traced_reference(
        key, "bfloat16", 1
    )
    assert POLICY.traced_reference(key, "float32", 10_000)  # past every bucket
    assert POLICY.own_wins[pinned] == UNMEASURED and not POLICY.traced_reference(
        pinned, "float32", 16
    )
    with POLICY.override("eligible"):
        assert POLICY.own_wins[key] == UNMEASURED
    with POLICY.override("reference"):
        assert POLICY.own_wins[key] == frozenset() and POLICY.traced_reference(key, "float32", 1)
    with POLICY.routing(True):
        assert POLICY.traced_route((key,), "float32", 16)
        assert not POLICY.traced_route((key, pinned), "float32", 16)
        with POLICY.recording_asks():
            assert not POLICY.traced_route((key,), "float32", 16)
    with POLICY.routing(False):
        assert not POLICY.traced_route((key,), "float32", 16)


def test_the_row_lane_is_the_smallest_bucket_won_per_dtype_in_the_table() -> None:
    """`row_lane`: per torch dtype, the smallest row bucket any linear or stacked entry
    of the table won at under a lane backend, at any thread count, whatever the shape,
    answered with the quiet lane; {} in the `reference` mode, None in the `eligible` mode.
    `in_row_lane` is exactly "the call's row bucket is below it" (or no winner for its
    dtype), checked against `row_bucket` for every row count up to the largest bucket
    (past it: not in the lane)."""
    other = (64, 32, 32, 256)
    bf16_elsewhere = dataclasses.replace(
        entry("stacked", other, 4, native=WIN),
        dtype="bfloat16",
        threads=torch.get_num_threads() + 1,
    )
    POLICY.set_table(
        table(
            entry("stacked", SHAPE, 8, native=WIN),
            entry("linear", (8, 8), 64, native=WIN),
            entry("stacked", other, 2, native=LOSS),  # measured, lost: no winner
            entry("experts", (4, 16, 8, 2), 1, native=WIN),  # not a lane's op
            bf16_elsewhere,
        )
    )
    lane = POLICY.row_lane
    assert POLICY.lane is False and lane == {torch.float32: 8, torch.bfloat16: 4}
    width = 3
    for rows in range(0, policy.MAX_BUCKET + 3):
        x = torch.zeros(rows, width)
        bucket = row_bucket(rows)
        # past the largest bucket the reference runs too, but the lane leaves those
        # calls to the per-call rule (no prompt that long is a decode step)
        assert policy.in_row_lane(lane, x, width) == (bucket < 8 and rows <= 4), rows
    assert policy.in_row_lane(lane, torch.zeros(1, 2, width, dtype=torch.bfloat16), width)
    assert not policy.in_row_lane(lane, torch.zeros(3, width, dtype=torch.bfloat16), width)
    assert policy.in_row_lane(lane, torch.zeros(300, width, dtype=torch.float16), width)
    assert not policy.in_row_lane(None, torch.zeros(1, 3), 3)
    POLICY.forget()
    assert POLICY.row_lane == lane  # answered again with the lane
    only_torch = entry("stacked", SHAPE, 2, stacked=WIN)  # a kernel `backend="torch"` allows
    POLICY.set_table(table(only_torch))
    assert POLICY.row_lane == {torch.float32: 2}
    with POLICY.override("eligible"):
        assert POLICY.quiet() is False and POLICY.row_lane is None
    with POLICY.override("reference"):
        assert POLICY.quiet() and POLICY.row_lane == {}  # nothing may win: every call
    POLICY.reset()
    assert POLICY.row_lane is None


def test_routes_are_counted_only_inside_counting_routes() -> None:
    assert not POLICY.counting
    with POLICY.counting_routes():
        assert POLICY.counting
        with POLICY.counting_routes():
            pass
        assert POLICY.counting
    assert not POLICY.counting
    POLICY.counting = True
    POLICY.reset()
    assert not POLICY.counting
