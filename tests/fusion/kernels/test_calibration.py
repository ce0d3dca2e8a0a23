"""Measuring kernels and the on-disk table (`fusion.kernels.calibration`)."""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import statistics
import time
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fusion
from fusion.kernels import calibration
from fusion.kernels.calibration import SCHEMA, CalibrationWarning, Entry, Ratio, Table
from fusion.kernels.policy import POLICY
from tests.fusion.tiny_models import tiny_model, token_ids


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSION_HARNESS_CACHE", str(tmp_path))
    return tmp_path


def _entry() -> Entry:
    return Entry(
        op="stacked",
        shape=(8, 8, 16),
        dtype="float32",
        rows=16,
        threads=1,
        median_us={"reference": 10.0, "stacked": 8.0},
        ratios={"stacked": Ratio(1.25, 1.1, 1.3)},
        rounds=7,
    )


def test_ratio_wins_needs_margin_and_lower_quartile() -> None:
    assert Ratio(1.2, 1.0, 1.4).wins()
    assert not Ratio(1.2, 0.99, 1.4).wins()
    assert not Ratio(1.0 + calibration.MARGIN / 2, 1.0, 1.1).wins()


def test_best_takes_the_highest_winning_median() -> None:
    e = Entry(
        **{
            **_entry().__dict__,
            "ratios": {"stacked": Ratio(1.2, 1.1, 1.3), "native": Ratio(1.5, 0.9, 2.0)},
        }
    )
    assert e.best(("reference", "stacked", "native")) == "stacked"  # native's q25 < 1
    assert e.best(("reference", "native")) == "reference"


def test_judge_pairs_rounds() -> None:
    times = {"reference": [2.0, 4.0, 2.0, 2.0, 2.0], "fast": [1.0, 4.0, 1.0, 1.0, 1.0]}
    ratio = calibration.judge(times)["fast"]
    assert ratio.median == 2.0 and ratio.q25 == 2.0 and ratio.q75 == 2.0


def test_table_round_trip_and_foreign_files(cache) -> None:
    table = calibration.load_table()
    assert table.entries == {}
    table.add(_entry())
    path = calibration.save_table(table)
    assert path.parent == cache / "calibration"
    again = calibration.load_table()
    assert again.lookup("stacked", (8, 8, 16), "float32", 16, 1) == _entry()
    data = json.loads(path.read_text())
    data["key"] = "0" * 16
    path.write_text(json.dumps(data))
    with pytest.warns(CalibrationWarning, match="another machine"):
        assert calibration.load_table().entries == {}  # measured on another machine
    path.write_text("{not json")
    with pytest.warns(CalibrationWarning, match=str(path)):
        assert calibration.load_table().entries == {}


def test_machine_key_follows_the_limiting_environment(monkeypatch) -> None:
    base = calibration.machine_key()
    current = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2" if current == "default" else "default")
    assert calibration.machine_key() != base


def test_time_calls_interleaves_over_copies() -> None:
    """Every call reads the copy after the one the call before it read, and each round
    starts with another kernel (no kernel always runs right after the other)."""
    sequence: list[tuple[str, int]] = []
    calls = {name: (lambda i, n=name: sequence.append((n, i))) for name in ("ref", "other")}
    calls = {"reference": calls["ref"], "other": calls["other"]}
    times, rounds = calibration.time_calls(calls, copies=3, budget_s=0.0)
    assert rounds == calibration.MIN_ROUNDS
    assert all(len(v) == rounds for v in times.values())
    assert [i for _, i in sequence] == [n % 3 for n in range(2 * (rounds + 2))]
    firsts = [sequence[2 * r][0] for r in range(rounds + 2)]
    assert firsts[:4] == ["ref", "other", "ref", "other"]


def test_time_calls_keeps_a_calls_context_off_the_clock() -> None:
    """A context `within` runs around a name's calls (entered, one untimed call, the timed
    call, left): a slow switch in and out costs that side nothing on the clock, and a name
    without one is primed the same way."""
    inside: list[bool] = []
    state = {"in": False}

    @contextlib.contextmanager
    def slow_switch():
        time.sleep(0.003)
        state["in"] = True
        try:
            yield
        finally:
            state["in"] = False
            time.sleep(0.003)

    calls = {
        "switched": lambda i: inside.append(state["in"]),
        "plain": lambda i: inside.append(state["in"]),
    }
    times, rounds = calibration.time_calls(
        calls, copies=1, budget_s=0.0, within={"switched": slow_switch}
    )
    assert len(inside) == 4 * (rounds + 2)  # every call primed once, off the clock
    assert inside.count(True) == 2 * (rounds + 2)  # the switched side ran inside its context
    # both sides are empty calls: the 6 ms switch is nowhere near their medians
    assert statistics.median(times["switched"]) < 0.002
    assert statistics.median(times["plain"]) < 0.002


def test_measure_key_times_the_eligible_kernels() -> None:
    entry = calibration.measure_key("stacked", (32, 32, 64), "float32", 2, budget_s=0.0)
    assert entry is not None
    assert set(entry.median_us) >= {"reference", "stacked"}
    assert entry.rows == 2 and entry.threads == torch.get_num_threads()
    assert calibration.measure_key("linear", (32, 64), "float32", 2, budget_s=0.0) is None or (
        "native" in calibration.measure_key("linear", (32, 64), "float32", 2, budget_s=0.0).ratios
    )


def test_copies_cover_the_stream() -> None:
    stream = calibration.stream_bytes()
    assert calibration.copies_for(stream * 4) == 2
    assert calibration.copies_for(stream // 4) == 4
    assert calibration.copies_for(1) == calibration.MAX_COPIES
    assert calibration.copies_for(1 << 20, stream=64 << 20) == 64
    assert isinstance(Table("k").to_json()["entries"], list)


def _saved(table: Table) -> dict:
    return json.loads(json.dumps(table.to_json()))


def _load_warnings(path, data) -> tuple[Table, list[str]]:
    path.write_text(json.dumps(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = calibration.load_table()
    return table, [str(w.message) for w in caught if w.category is CalibrationWarning]


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda d: d["entries"][0]["ratios"]["stacked"].update(median="1.5"), "median: '1.5'"),
        (lambda d: d["entries"][0]["ratios"]["stacked"].update(q25=None), "q25: None"),
        (lambda d: d["entries"][0]["median_us"].update(reference=float("nan")), "nan"),
        (lambda d: d["entries"][0]["median_us"].update(stacked=-3.0), "-3.0"),
        (lambda d: d["entries"][0]["ratios"].update(fastest={}), "'fastest' is not one of"),
        (lambda d: d["entries"][0].update(op="conv"), "'conv' is not one of"),
        (lambda d: d["entries"][0].update(dtype="float33"), "'float33' is not the name"),
        (lambda d: d["entries"][0].update(dtype="int8"), "'int8' is not the name"),
        (lambda d: d["entries"][0].update(rows=12), "12 is not a row bucket"),
        (lambda d: d["entries"][0].update(threads=True), "True is not a positive integer"),
        (lambda d: d["entries"][0].update(shape=[8, 16]), "is not a stacked shape"),
        (lambda d: d["entries"][0].update(colour="blue"), "unknown field 'colour'"),
        (lambda d: d["entries"][0].pop("rounds"), "no 'rounds'"),
        (lambda d: d["entries"].append(d["entries"][0]), "a second entry"),
        (lambda d: d.update(entries={}), "not a list"),
        (lambda d: d.update(schema=SCHEMA + 1), "schema"),
    ],
)
def test_a_bad_table_is_ignored_with_one_warning_naming_it(cache, edit, problem) -> None:
    table = calibration.load_table()
    table.add(_entry())
    path = calibration.save_table(table)
    data = _saved(table)
    edit(data)
    loaded, messages = _load_warnings(path, data)
    assert loaded.entries == {}
    assert len(messages) == 1 and str(path) in messages[0] and problem in messages[0], messages


def test_a_valid_table_loads_without_a_warning(cache) -> None:
    table = calibration.load_table()
    table.add(_entry())
    loaded, messages = _load_warnings(calibration.save_table(table), _saved(table))
    assert messages == [] and list(loaded.entries.values()) == [_entry()]


# --- random corruptions of a table a fused model reads: no forward ever raises ---

_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.sampled_from(["float32", "bfloat16", "stacked", "native", "reference", "linear"]),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def _paths(node, prefix=()) -> list[tuple]:
    """Every (container path, key) in a JSON tree."""
    found = []
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in items:
        found.append((prefix, key))
        if isinstance(value, (dict, list)):
            found.extend(_paths(value, (*prefix, key)))
    return found


def _corrupt(data: dict, draw) -> dict:
    data = copy.deepcopy(data)
    prefix, key = draw(st.sampled_from(_paths(data)))
    parent = functools.reduce(lambda node, k: node[k], prefix, data)
    action = draw(st.sampled_from(["replace", "delete", "add"]))
    if action == "delete":
        del parent[key]
    elif action == "add" and isinstance(parent, dict):
        parent[draw(st.text(max_size=6))] = draw(_JSON)
    else:
        parent[key] = draw(_JSON)
    return data


@pytest.fixture(scope="module")
def calibrated_qwen3():
    """A fused tiny Qwen3 (stacked and linear products), the unfused logits, and a valid
    table that measures every product it asks about as a clear win for every kernel."""
    unfused = tiny_model("qwen3").eval()
    fused = copy.deepcopy(unfused)
    assert fusion.fuse(fused).applied
    ids = token_ids(batch=1, seq=3)
    POLICY.reset()
    POLICY.set_table(Table("tests"))
    with POLICY.recording_asks(), torch.no_grad():
        fused(ids)
    table = Table(calibration.machine_key())
    for op, shape, dtype, rows, threads in sorted(POLICY.asked):
        kernels = calibration.OPS[op][1:]
        table.add(
            Entry(
                op=op,
                shape=shape,
                dtype=dtype,
                rows=rows,
                threads=threads,
                median_us={"reference": 10.0, **dict.fromkeys(kernels, 5.0)},
                ratios=dict.fromkeys(kernels, Ratio(2.0, 1.5, 2.5)),
                rounds=9,
            )
        )
    assert {e.op for e in table.entries.values()} >= {"stacked"}
    with torch.no_grad():
        expected = unfused(ids).logits
    return fused, ids, expected, table


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_random_corruptions_never_make_a_forward_raise(cache, calibrated_qwen3, data) -> None:
    fused, ids, expected, table = calibrated_qwen3
    path = calibration.save_table(table)
    corrupted = _corrupt(_saved(table), data.draw)
    path.write_text(json.dumps(corrupted))
    POLICY.reset()
    POLICY.use("measured")
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        logits = fused(ids).logits  # loads the table from disk: must not raise
    messages = [w for w in caught if w.category is CalibrationWarning]
    assert len(messages) <= 1
    if messages:  # ignored whole: every product on its reference, as uncalibrated
        assert POLICY.table.entries == {}
        assert torch.equal(logits, expected)
    POLICY.reset()
