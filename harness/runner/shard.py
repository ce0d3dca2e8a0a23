"""A sweep split across machines: shards of the selected architectures, and their merge.

`fusion-harness run --shard K/N` runs shard K (1-based) of N. Every shard computes the same
partition from the same inputs, with no coordination: the selected names sorted (so the
order of `--arch` patterns does not matter), then

- with recorded durations (`--balance RESULTS.jsonl`, an earlier results file): longest
  first, each to the shard with the least total so far (greedy LPT; ties to the lowest
  shard), an architecture without a recorded time counted at the mean of the recorded ones;
- without: round-robin over the sorted names (shard sizes differ by at most one).

So the shards are disjoint and cover the selection, provided every shard sees the same
selection and the same balance file (the same checkout, Transformers line and options).

`fusion-harness merge` puts shard results files back together: `merge` refuses results of
different dtype, device, seed, system under test (harness.runner.systems) or versions, and an architecture recorded twice with different
results (the same status, plan and lifecycle verdicts count as the same result: a rerun).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.base.errors import InputError
from harness.base.results import ArchResult, ResultsError
from harness.reporting.plans import entry_of


class ShardError(ValueError, InputError):
    """A --shard value that is not K/N with 1 <= K <= N."""


class MergeError(ResultsError):
    """Results files that cannot be merged into one sweep (the message says why)."""


@dataclass(frozen=True)
class Shard:
    """Shard `index` (1-based) of `count`."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        """`Shard` of "K/N"; ShardError unless K and N are integers with 1 <= K <= N."""
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if not match:
            raise ShardError(f"--shard {text!r} is not K/N (for example 2/4)")
        index, count = int(match[1]), int(match[2])
        if not 1 <= index <= count:
            raise ShardError(f"--shard {text!r}: K must be between 1 and N")
        return cls(index, count)

    @property
    def tag(self) -> str:
        """ "shardKofN": a file-name part that keeps shards' default results files apart."""
        return f"shard{self.index}of{self.count}"

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def partition(
    names: Iterable[str], count: int, durations: Mapping[str, float] | None = None
) -> list[list[str]]:
    """`count` disjoint lists covering the distinct `names`, each sorted, balanced as the module
    docstring says (by `durations`, seconds per architecture, when given and not empty).

    Deterministic: it depends only on the set of names, `count` and `durations`, never on the
    order of `names` or on the process, so separate machines agree on it.
    """
    if count < 1:
        raise ShardError(f"the number of shards must be at least 1, not {count}")
    ordered = sorted(set(names))
    shards: list[list[str]] = [[] for _ in range(count)]
    if not durations:
        for i, name in enumerate(ordered):
            shards[i % count].append(name)
        return shards
    mean = sum(durations.values()) / len(durations)
    cost = {name: max(0.0, float(durations.get(name, mean))) for name in ordered}
    loads = [0.0] * count
    for name in sorted(ordered, key=lambda n: (-cost[n], n)):
        lightest = min(range(count), key=lambda i: (loads[i], i))
        shards[lightest].append(name)
        loads[lightest] += cost[name]
    return [sorted(shard) for shard in shards]


def pick(
    names: Sequence[str], shard: Shard, durations: Mapping[str, float] | None = None
) -> list[str]:
    """The architectures of `shard`, in `names` order (see `partition`)."""
    mine = set(partition(names, shard.count, durations)[shard.index - 1])
    return [name for name in names if name in mine]


def durations_of(results: Iterable[ArchResult]) -> dict[str, float]:
    """{architecture: recorded seconds} of an earlier results file (the last record wins)."""
    return {r.architecture: r.seconds for r in results}


@dataclass(frozen=True)
class Merged:
    """Shard results merged: every architecture once, sorted by name; `repeated` counts
    records dropped as the same result recorded again."""

    results: list[ArchResult]
    repeated: int


def _same_result(a: ArchResult, b: ArchResult) -> bool:
    """Do two records of one architecture say the same (status, reason, plan, lifecycle
    verdicts; timings, errors and bundle paths aside)?"""
    return entry_of(a) == entry_of(b)


def merge(files: Sequence[tuple[Path, Sequence[ArchResult]]]) -> Merged:
    """One sweep's results from several results files (path, its records), in name order.

    Raises MergeError, naming both files, when records differ in dtype, device, seed, system
    under test or versions (one table must compare like with like), or when one architecture has two
    different results (`_same_result`): either would make the merged verdict a guess.
    """
    first: tuple[Path, ArchResult] | None = None
    chosen: dict[str, tuple[Path, ArchResult]] = {}
    repeated = 0
    for path, results in files:
        for result in results:
            if first is None:
                first = (path, result)
            _check_compatible(first, (path, result))
            earlier = chosen.get(result.architecture)
            if earlier is None:
                chosen[result.architecture] = (path, result)
                continue
            if not _same_result(earlier[1], result):
                raise MergeError(
                    f"{result.architecture} has different results in {earlier[0]} "
                    f"({earlier[1].status}) and {path} ({result.status}); merge shards of "
                    "one sweep, or drop one of the files"
                )
            repeated += 1
    return Merged([chosen[name][1] for name in sorted(chosen)], repeated)


def _check_compatible(first: tuple[Path, ArchResult], other: tuple[Path, ArchResult]) -> None:
    """MergeError unless `other` was computed under `first`'s options and versions."""
    (path_a, a), (path_b, b) = first, other
    for what, ours, theirs in (
        ("dtype/device/seed", (a.dtype, a.device, a.seed), (b.dtype, b.device, b.seed)),
        ("systems under test", a.system, b.system),
        ("versions", _versions(a), _versions(b)),
    ):
        if ours != theirs:
            raise MergeError(
                f"cannot merge results of different {what}: {a.architecture} in {path_a} has "
                f"{ours}, {b.architecture} in {path_b} has {theirs}"
            )


def _versions(result: ArchResult) -> str:
    """The result's versions in words ("unrecorded" for records that carry none)."""
    if not result.versions:
        return "unrecorded"
    return ", ".join(f"{k} {v}" for k, v in sorted(result.versions.items()))
