"""harness.runner.shard: the partition of a sweep over machines, and the merge of their results."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.base.results import ArchResult, Refusal, ResultsError, read_results
from harness.reporting import plans
from harness.runner import shard

REPO = Path(__file__).resolve().parents[3]
NAMES = [f"arch{i:02d}" for i in range(23)]
VERSIONS = {"transformers": "5.24.0", "torch": "2.13.0"}


def _r(name: str, status: str = "pass", **fields) -> ArchResult:
    fields.setdefault("versions", VERSIONS)
    fields.setdefault("seconds", 0.5)
    return ArchResult(name, status, fields.pop("dtype", "float32"), "cpu", 0, **fields)


# ------------------------------------------------------------------------------ parsing


@pytest.mark.parametrize(
    ("text", "index", "count"), [("1/1", 1, 1), ("2/4", 2, 4), (" 3 / 3", 3, 3)]
)
def test_shard_parses_k_of_n(text, index, count):
    part = shard.Shard.parse(text)
    assert (part.index, part.count) == (index, count)
    assert str(part) == f"{index}/{count}" and part.tag == f"shard{index}of{count}"


@pytest.mark.parametrize("text", ["0/2", "3/2", "1/0", "2", "a/b", "1/2/3", "-1/2", ""])
def test_shard_refuses_what_is_not_k_of_n(text):
    with pytest.raises(shard.ShardError, match="--shard"):
        shard.Shard.parse(text)


# ---------------------------------------------------------------------------- partition


@pytest.mark.parametrize("count", [1, 2, 3, 5, 23, 30])
@pytest.mark.parametrize("timed", [False, True])
def test_partition_is_disjoint_covering_and_stable(count, timed):
    durations = {name: float((i * 7) % 11) + 0.1 for i, name in enumerate(NAMES)} if timed else None
    shards = shard.partition(NAMES, count, durations)
    assert len(shards) == count
    flat = [name for part in shards for name in part]
    assert sorted(flat) == sorted(NAMES)  # covering, and disjoint (no name twice)
    assert all(part == sorted(part) for part in shards)
    # Stable: another order of the names (and of the durations) gives the same partition.
    shuffled = list(reversed(NAMES))
    again = dict(reversed(list(durations.items()))) if durations else None
    assert shard.partition(shuffled, count, again) == shards
    assert shard.partition(NAMES + NAMES[:3], count, durations) == shards  # repeats ignored


@pytest.mark.parametrize("count", [2, 3, 4, 7])
def test_without_durations_shard_sizes_differ_by_at_most_one(count):
    sizes = [len(part) for part in shard.partition(NAMES, count)]
    assert max(sizes) - min(sizes) <= 1


def test_durations_balance_the_shards_by_time():
    durations = {"big": 10.0, **{f"small{i}": 1.0 for i in range(10)}}
    first, second = shard.partition(durations, 2, durations)
    assert first == ["big"] and len(second) == 10  # round-robin would put big with 5 smalls


@pytest.mark.parametrize("count", [2, 3, 4])
def test_greedy_balance_is_within_one_architecture_of_the_mean(count):
    """The greedy bound: no shard exceeds the mean load by more than the longest architecture;
    round-robin on sorted names can (the slow ones here all sort first)."""
    slow = {i * count for i in range(4)}  # all four in round-robin's first shard
    durations = {name: (30.0 if i in slow else 1.0) for i, name in enumerate(NAMES)}
    loads = [sum(durations[n] for n in part) for part in shard.partition(NAMES, count, durations)]
    mean = sum(durations.values()) / count
    assert max(loads) <= mean + max(durations.values())
    naive = [sum(durations[n] for n in part) for part in shard.partition(NAMES, count)]
    assert max(loads) < max(naive)


def test_an_architecture_without_a_recorded_time_counts_as_the_mean():
    durations = {"a": 4.0, "b": 2.0}  # mean 3.0 for the new "c"
    assert shard.partition(["a", "b", "c"], 2, durations) == [["a"], ["b", "c"]]


def test_more_shards_than_architectures_leaves_some_empty():
    shards = shard.partition(["a", "b"], 4)
    assert shards == [["a"], ["b"], [], []]


def test_partition_needs_a_shard():
    with pytest.raises(shard.ShardError):
        shard.partition(NAMES, 0)


def test_pick_keeps_the_selection_order():
    names = ["qwen3", "llama", "gpt2", "mixtral"]
    picked = [shard.pick(names, shard.Shard(k, 2)) for k in (1, 2)]
    assert picked == [["gpt2", "mixtral"], ["qwen3", "llama"]]  # sorted round-robin, names order
    assert sorted(itertools.chain(*picked)) == sorted(names)


def test_durations_of_reads_recorded_seconds():
    assert shard.durations_of([_r("a", seconds=2.0), _r("b", seconds=0.25)]) == {
        "a": 2.0,
        "b": 0.25,
    }


# -------------------------------------------------------------------------------- merge


def test_merge_puts_disjoint_shards_together_in_name_order():
    merged = shard.merge(
        [(Path("s1"), [_r("qwen3"), _r("gpt2")]), (Path("s2"), [_r("llama", "fail")])]
    )
    assert [r.architecture for r in merged.results] == ["gpt2", "llama", "qwen3"]
    assert merged.results[1].status == "fail" and merged.repeated == 0


def test_merge_keeps_one_copy_of_a_result_recorded_twice():
    """A rerun: the same status and plan, other timings and errors."""
    again = _r("llama", seconds=9.0, fused_error=1e-7)
    merged = shard.merge([(Path("s1"), [_r("llama")]), (Path("s2"), [again])])
    assert len(merged.results) == 1 and merged.repeated == 1
    assert merged.results[0].seconds == 0.5  # the first file's record


@pytest.mark.parametrize(
    "other",
    [
        _r("llama", "fail"),
        _r("llama", applied_by_class={"LlamaAttention": {"qkv": 2}}),
        _r("llama", refusals=[Refusal("qkv", "LlamaAttention", "why", 2, "m")]),
        _r("llama", lifecycle={"generate": {"verdict": "fail", "detail": "x"}}),
    ],
)
def test_merge_refuses_an_architecture_with_two_different_results(other):
    with pytest.raises(shard.MergeError, match=r"llama has different results in s1 .* and s2"):
        shard.merge([(Path("s1"), [_r("llama")]), (Path("s2"), [other])])


@pytest.mark.parametrize(
    ("other", "what"),
    [
        (_r("gpt2", dtype="bfloat16"), "dtype/device/seed"),
        (_r("gpt2", versions={"transformers": "5.0.0", "torch": "2.13.0"}), "versions"),
        (_r("gpt2", versions={}), "versions"),  # unrecorded: cannot be shown the same
        (_r("gpt2", system="inductor"), "systems under test"),
    ],
)
def test_merge_refuses_results_of_other_options_or_versions(other, what):
    with pytest.raises(shard.MergeError, match=f"different {what}") as info:
        shard.merge([(Path("s1"), [_r("llama")]), (Path("s2"), [other])])
    assert "s1" in str(info.value) and "s2" in str(info.value)
    assert isinstance(info.value, ResultsError)  # the command line's exit 2


def test_merge_of_nothing_is_empty():
    assert shard.merge([(Path("s1"), [])]).results == []


# ---------------------------------------------------------------- shards as real processes


SELECTION = ["llama", "qwen2", "gpt2"]


def _harness(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("FUSION_HARNESS_TEST_PLUGINS", None)
    return subprocess.run(
        [sys.executable, "-m", "harness", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow  # three sweep processes and merges: 1-3 minutes on 2 cores
def test_shards_run_apart_merge_into_the_whole_sweep(tmp_path):
    common = ["--arch", *SELECTION, "--lifecycle", "off", "-j", "1", "--repro-dir", "bundles"]
    for k in (1, 2):  # default results file names: the shard is part of it
        run = _harness("run", *common, "--shard", f"{k}/2", cwd=tmp_path)
        assert run.returncode == 0, run.stdout + run.stderr
        assert f"shard {k}/2:" in run.stderr
    shards = sorted((tmp_path / "results").glob("sweep-float32-cpu-shard*of2.jsonl"))
    assert [p.name for p in shards] == [
        "sweep-float32-cpu-shard1of2.jsonl",
        "sweep-float32-cpu-shard2of2.jsonl",
    ]
    parts = [{r.architecture for r in read_results(p)} for p in shards]
    assert parts[0] and parts[1] and not parts[0] & parts[1]
    assert parts[0] | parts[1] == set(SELECTION)

    whole = _harness("run", *common, "--results", "whole.jsonl", cwd=tmp_path)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    merged = _harness(
        "merge", *map(str, shards), "--results", "merged.jsonl", "--json", "m.json", cwd=tmp_path
    )
    assert merged.returncode == 0, merged.stdout + merged.stderr
    assert "merged 2 files: 3 architectures" in merged.stdout
    assert "3 architectures: 3 built, 3 ran" in merged.stdout  # the sweep's summary

    def plan(path: Path) -> dict:
        return {r.architecture: plans.entry_of(r) for r in read_results(path)}

    assert plan(tmp_path / "merged.jsonl") == plan(tmp_path / "whole.jsonl")
    assert set(plan(tmp_path / "merged.jsonl")) == set(SELECTION)
    doc = json.loads((tmp_path / "m.json").read_text())
    assert doc["exit_status"] == 0 and doc["wall_seconds"] is None
    assert doc["options"]["merged_from"] == [str(p) for p in shards]

    # The whole sweep and a shard overlap: same results, so they merge, once each.
    again = _harness("merge", "whole.jsonl", str(shards[0]), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"({len(parts[0])} recorded twice, identically)" in again.stdout
