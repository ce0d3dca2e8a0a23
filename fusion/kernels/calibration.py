"""Kernel timings measured on this machine, and the table the kernel policy reads.

`measure` times every kernel of one op (`OPS`) against its reference
on one (shape, dtype, threads, rows) and returns an `Entry`; `Table` holds the entries of
this machine and is saved as JSON under the cache directory, in a file named by
`machine_key()`: the CPU model and flags, ATen's CPU capability and the environment that
limits it (`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`, `MKL_ENABLE_INSTRUCTIONS`), the
last-level cache size (the measurement streams a multiple of it) and the torch version.
Anything that changes the code a product runs, or what its measurement streams, changes the
key, so a table is never read on a machine it was not measured on. The native kernel's build is recorded per
entry (`Entry.native_build`) instead, and the policy ignores a native measurement of another
build: that way reading the table never builds the kernel (`backend="torch"` builds nothing).

How a kernel is judged (`judge`): calls are interleaved (each round calls every kernel once,
in a rotating order), each call on a weight not read since many calls (copies cycled through
`memory.STREAM_FACTOR` times the last-level cache this machine reports, as a model's layers are), so every kernel sees
the same machine state; the per-round ratio reference time / kernel time is paired, which
cancels the drift of a busy machine. A kernel *wins* only if its median ratio is at least
`1 + MARGIN` and its lower quartile at least 1: measurably faster, not faster on average.
The policy runs the winner with the highest median ratio, else the reference, so no measured
choice makes a product slower than the reference beyond the noise of its own measurement.

Reading a table (`load_table`) validates it field by field before anything uses it
(`parse_table`): the schema and key, each entry's op, shape, dtype name, row bucket, thread
count and round count, every kernel name against `OPS`, every time and ratio a finite
positive number, no field unknown or missing. A file with any problem is ignored whole, with
one `CalibrationWarning` naming the file and its first problem: the policy then runs every
reference, as on a machine that never calibrated. Whole, not entry by entry: a file with one
field wrong was written by something other than `save_table` (a hand edit, another version,
a torn write), so its other fields are no evidence either, and the references are always
correct.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from fusion import kernels
from fusion.kernels import onednn as onednn_backend
from fusion.kernels.memory import last_level_cache_bytes, stream_bytes
from fusion.kernels.native import build as native_build
from fusion.kernels.native import gemm as native_gemm

SCHEMA = 1

OPS: dict[str, tuple[str, ...]] = {
    "linear": ("reference", "native", "onednn-row"),
    "stacked": ("reference", "stacked", "native", "onednn-row"),
    "experts": ("reference", "native", "onednn"),
}
"""Per op, its kernels; the reference first (`fusion.kernels.policy` chooses among them; a
table naming any other op or kernel is not read)."""

MARGIN = 0.03
"""A kernel must beat the reference by this fraction (median of paired ratios) to be used."""


MAX_COPIES = 1 << 12
"""At most this many weight copies per measurement (a bound on the list, not on memory)."""

MIN_ROUNDS = 7
MAX_ROUNDS = 101
BUDGET_S = 0.6
"""Rounds continue past `MIN_ROUNDS` until the calls took this long (or `MAX_ROUNDS`)."""

_LIMITING_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


@dataclass(frozen=True)
class Ratio:
    """Reference time / kernel time over the paired rounds of one measurement."""

    median: float
    q25: float
    q75: float

    def wins(self) -> bool:
        return self.median >= 1 + MARGIN and self.q25 >= 1.0


@dataclass(frozen=True)
class Entry:
    """One measurement: `op` at `shape`, `dtype`, `threads`, `rows` (a row bucket)."""

    op: str
    shape: tuple[int, ...]
    dtype: str
    rows: int
    threads: int
    median_us: dict[str, float]
    """Median time per call of each kernel measured (the reference included)."""
    ratios: dict[str, Ratio]
    """Each non-reference kernel's paired ratio against the reference."""
    rounds: int
    native_build: str = ""
    """`native_gemm.build_id()` of the kernel measured as 'native' ('' if it was not)."""
    veto: str = ""
    """Why the whole model did not get faster with this key's winners (`fusion.engine.tuning`'s
    model-level check): then the reference runs, whatever the product's own timing said."""

    def best(self, kernels: Iterable[str]) -> str:
        """Of `kernels`, the winner (`Ratio.wins`) with the highest median ratio; else
        'reference'."""
        if self.veto:
            return "reference"
        winners = [(r.median, k) for k, r in self.ratios.items() if k in kernels and r.wins()]
        return max(winners)[1] if winners else "reference"

    def summary(self, kernels: Iterable[str]) -> str:
        """One line: each kernel's measured ratio (median [q25-q75]) and the verdict."""
        kernels = tuple(kernels)
        parts = [
            f"{k} {r.median:.2f}x [{r.q25:.2f}-{r.q75:.2f}]"
            for k, r in self.ratios.items()
            if k in kernels
        ]
        best = self.best(kernels)
        verdict = f"{best} measured fastest" if best != "reference" else "no kernel beat it"
        if self.veto:
            verdict = f"reference: {self.veto}"
        ref = self.median_us.get("reference", float("nan"))
        return (
            f"measured at {self.rows} rows, {self.threads} threads: reference {ref:.0f} us; "
            f"{', '.join(parts) or 'no other kernel eligible'}; {verdict}"
        )

    def to_json(self) -> dict:
        out = asdict(self)
        out["shape"] = list(self.shape)
        return out

    @classmethod
    def from_json(cls, data: object, where: str = "entry") -> Entry:
        """The entry `data` (one item of a saved table's `entries`) describes; `TableError`
        naming the first field (under `where`) that `save_table` would not have written."""
        _fields(data, where, _ENTRY_FIELDS, _ENTRY_OPTIONAL)
        assert isinstance(data, dict)
        op = data["op"]
        if op not in OPS:
            raise TableError(f"{where}.op: {op!r} is not one of {', '.join(OPS)}")
        kernels = OPS[op]
        median_us = _kernel_map(data["median_us"], f"{where}.median_us", kernels, _number)
        if "reference" not in median_us:
            raise TableError(f"{where}.median_us: no 'reference' time")
        ratios = _kernel_map(data["ratios"], f"{where}.ratios", kernels[1:], _ratio)
        return cls(
            op=op,
            shape=_shape(op, data["shape"], f"{where}.shape"),
            dtype=_dtype_name(data["dtype"], f"{where}.dtype"),
            rows=_bucket(data["rows"], f"{where}.rows"),
            threads=_count(data["threads"], f"{where}.threads"),
            median_us=median_us,
            ratios=ratios,
            rounds=_count(data["rounds"], f"{where}.rounds"),
            native_build=_text(data.get("native_build", ""), f"{where}.native_build"),
            veto=_text(data.get("veto", ""), f"{where}.veto"),
        )


class TableError(ValueError):
    """A table's JSON is not what `save_table` writes; the message names the first field
    that is wrong (its path in the file) and why."""


class CalibrationWarning(UserWarning):
    """A calibration table on disk was ignored (`load_table`); the message names the file
    and its first problem."""


_ENTRY_FIELDS = ("op", "shape", "dtype", "rows", "threads", "median_us", "ratios", "rounds")
_ENTRY_OPTIONAL = ("native_build", "veto")
_TABLE_FIELDS = ("schema", "key", "entries")
_TABLE_OPTIONAL = ("machine",)
_SHAPE_LENGTH = {"linear": (2, 2), "stacked": (3, 1 << 16), "experts": (4, 4)}
"""Per op, the (fewest, most) dims of its shape: `(N, K)`; `(N_1, ..., N_s, K)` with at
least two shards; `(E, 2I, H, topk)`."""


def _fields(data: object, where: str, required: tuple[str, ...], optional=()) -> None:
    """Raise `TableError` unless `data` is an object with every `required` key and no key
    outside `required` and `optional`."""
    if not isinstance(data, dict):
        raise TableError(f"{where}: {type(data).__name__}, not an object")
    for name in required:
        if name not in data:
            raise TableError(f"{where}: no {name!r}")
    for name in data:
        if name not in required and name not in optional:
            raise TableError(f"{where}: unknown field {name!r}")


def _number(value: object, where: str) -> float:
    """`value` as a float, if it is a finite positive JSON number (not a bool, string, null,
    NaN or infinity: every time and ratio `measure` writes is one); else `TableError`."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise TableError(f"{where}: {value!r} is not a finite positive number")
    return float(value)


def _count(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TableError(f"{where}: {value!r} is not a positive integer")
    return value


def _text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise TableError(f"{where}: {value!r} is not a string")
    return value


def _bucket(value: object, where: str) -> int:
    """A row bucket: a positive power of two (`policy.row_bucket`'s values)."""
    rows = _count(value, where)
    if rows & (rows - 1):
        raise TableError(f"{where}: {rows} is not a row bucket (a power of two)")
    return rows


def _dtype_name(value: object, where: str) -> str:
    """The name of a floating torch dtype (`float32`, `bfloat16`, ...), as `measure` writes."""
    dtype = getattr(torch, value, None) if isinstance(value, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TableError(f"{where}: {value!r} is not the name of a floating torch dtype")
    return value


def _shape(op: str, value: object, where: str) -> tuple[int, ...]:
    fewest, most = _SHAPE_LENGTH[op]
    if not isinstance(value, list) or not fewest <= len(value) <= most:
        raise TableError(f"{where}: {value!r} is not a {op} shape")
    return tuple(_count(v, f"{where}[{i}]") for i, v in enumerate(value))


def _ratio(value: object, where: str) -> Ratio:
    _fields(value, where, ("median", "q25", "q75"))
    assert isinstance(value, dict)
    ratio = Ratio(*(_number(value[k], f"{where}.{k}") for k in ("median", "q25", "q75")))
    if not ratio.q25 <= ratio.median <= ratio.q75:
        raise TableError(f"{where}: quartiles out of order")
    return ratio


def _kernel_map(value: object, where: str, kernels: tuple[str, ...], parse: Callable) -> dict:
    """`{kernel: parse(item)}` for an object keyed by kernel names among `kernels`."""
    if not isinstance(value, dict):
        raise TableError(f"{where}: {type(value).__name__}, not an object")
    out = {}
    for name, item in value.items():
        if name not in kernels:
            raise TableError(f"{where}: {name!r} is not one of {', '.join(kernels)}")
        out[name] = parse(item, f"{where}.{name}")
    return out


@dataclass
class Table:
    """The entries measured on one machine (`key`), looked up by (op, shape, dtype, rows,
    threads)."""

    key: str
    machine: dict[str, str] = field(default_factory=dict)
    entries: dict[tuple, Entry] = field(default_factory=dict)

    def lookup(
        self, op: str, shape: tuple[int, ...], dtype: str, rows: int, threads: int
    ) -> Entry | None:
        return self.entries.get((op, tuple(shape), dtype, rows, threads))

    def add(self, entry: Entry) -> None:
        self.entries[(entry.op, entry.shape, entry.dtype, entry.rows, entry.threads)] = entry

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "key": self.key,
            "machine": self.machine,
            "entries": [e.to_json() for e in self.entries.values()],
        }


def machine() -> dict[str, str]:
    """What the code a product runs depends on here (the module docstring)."""
    info = {
        "cpu": _cpu_field("model name") or platform.processor() or platform.machine(),
        "flags": hashlib.sha256(_cpu_field("flags").encode()).hexdigest()[:12],
        "capability": native_gemm.capability(),
        "llc": str(last_level_cache_bytes()),
        "torch": torch.__version__,
    }
    for name in _LIMITING_ENV:
        info[name] = os.environ.get(name, "")
    return info


def machine_key(info: dict[str, str] | None = None) -> str:
    """16 hex digits naming this machine's table (`machine()` hashed)."""
    info = machine() if info is None else info
    text = "\0".join(f"{k}={v}" for k, v in sorted(info.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cpu_field(name: str) -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[-1].strip()
    except OSError:
        pass
    return ""


def table_path(key: str | None = None) -> Path:
    """Where this machine's table lives (`native_build.cache_dir()`/calibration)."""
    return native_build.cache_dir() / "calibration" / f"{key or machine_key()}.json"


def parse_table(data: object, key: str, info: dict[str, str]) -> Table:
    """The table that `data` (a saved table's JSON) holds for the machine `key` (`info`
    its fields); `TableError` naming the first problem: a schema or key other than this
    machine's, or any field `save_table` would not have written (`Entry.from_json`), so
    every entry of a table returned is one `measure` could have made."""
    _fields(data, "table", _TABLE_FIELDS, _TABLE_OPTIONAL)
    assert isinstance(data, dict)
    if data["schema"] != SCHEMA:
        raise TableError(f"schema: {data['schema']!r}, this version reads {SCHEMA}")
    if data["key"] != key:
        raise TableError(f"key: {data['key']!r} is another machine's, not {key!r}")
    if not isinstance(data["entries"], list):
        raise TableError(f"entries: {type(data['entries']).__name__}, not a list")
    table = Table(key, info)
    for index, item in enumerate(data["entries"]):
        entry = Entry.from_json(item, f"entries[{index}]")
        if table.lookup(entry.op, entry.shape, entry.dtype, entry.rows, entry.threads):
            raise TableError(f"entries[{index}]: a second entry for the same key")
        table.add(entry)
    return table


def load_table(path: Path | None = None) -> Table:
    """This machine's table from disk, or an empty one: nothing measured, so the policy
    runs the references. Empty, silently, where there is no file; empty, with one
    `CalibrationWarning` naming the file and its first problem, where the file cannot be
    read, is not JSON, or is not a table `save_table` writes for this machine
    (`parse_table`). A bad file is ignored whole (the module docstring says why), so no
    field of it ever reaches a kernel choice."""
    info = machine()
    key = machine_key(info)
    path = table_path(key) if path is None else path
    try:
        return parse_table(json.loads(path.read_text()), key, info)
    except FileNotFoundError:
        return Table(key, info)
    except (OSError, ValueError, RecursionError) as problem:  # TableError is a ValueError
        warnings.warn(
            f"calibration table {path} ignored ({problem}); every product runs its "
            "reference until `fusion.calibrate` writes a new one",
            CalibrationWarning,
            stacklevel=2,
        )
        return Table(key, info)


def save_table(table: Table, path: Path | None = None) -> Path:
    """Write `table` atomically (a temporary file renamed); returns the path."""
    path = table_path(table.key) if path is None else path
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(table.to_json(), indent=1))
    temporary.replace(path)
    return path


def judge(times: dict[str, list[float]]) -> dict[str, Ratio]:
    """Each kernel's paired ratio against `times['reference']` (same-round pairs)."""
    reference = times["reference"]
    out = {}
    for kernel, samples in times.items():
        if kernel == "reference":
            continue
        ratios = sorted(r / s for r, s in zip(reference, samples) if s > 0)
        if not ratios:
            continue
        q25, median, q75 = statistics.quantiles(ratios, n=4, method="inclusive")
        out[kernel] = Ratio(round(median, 4), round(q25, 4), round(q75, 4))
    return out


Call = Callable[[int], object]
"""A kernel under measurement: called with the index of the weight copy to read."""


def time_calls(
    calls: dict[str, Call],
    copies: int,
    *,
    budget_s: float = BUDGET_S,
    sync: Callable = lambda: None,
    within: Mapping[str, Callable[[], AbstractContextManager[Any]]] | None = None,
) -> tuple[dict[str, list[float]], int]:
    """Interleaved timings (seconds per call) of `calls`, and the number of rounds. Each
    call reads the next of `copies` weight copies, so none reads a weight left in cache by
    the call before it. Two warm-up rounds are not counted.

    `within`: for a name, a context each of its calls runs in (a kernel mode), entered
    before its clock starts and left after it stops, with one untimed call first inside it,
    so neither the switch nor what it makes the next call rebuild (memoised answers) is
    timed; a name without one is primed likewise (the priming call reads the copy the
    timed call then reads: `within` is for whole-model calls, `copies=1`). Off the clock,
    or the side that switches pays for the switch (a whole-model check's reference mode
    paid two table scans a call and won the check for kernels that made the model
    slower)."""
    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    index = 0
    rounds = 0
    spent = 0.0
    for warm_or_timed in range(MAX_ROUNDS + 2):
        order = names[warm_or_timed % len(names) :] + names[: warm_or_timed % len(names)]
        for name in order:
            context = None if within is None else within.get(name, contextlib.nullcontext)
            with contextlib.nullcontext() if context is None else context():
                if context is not None:
                    calls[name](index % copies)
                sync()
                start = time.perf_counter()
                calls[name](index % copies)
                sync()
                elapsed = time.perf_counter() - start
            index += 1
            if warm_or_timed >= 2:
                times[name].append(elapsed)
                spent += elapsed
        if warm_or_timed >= 2:
            rounds += 1
            if rounds >= MIN_ROUNDS and spent >= budget_s:
                break
    return times, rounds


def copies_for(nbytes: int, stream: int | None = None) -> int:
    """How many weight copies of `nbytes` each cover `stream` bytes (default
    `stream_bytes()`): at least 2, at most `MAX_COPIES`."""
    stream = stream_bytes() if stream is None else stream
    return max(2, min(MAX_COPIES, -(-stream // max(nbytes, 1))))


def measure(
    op: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    rows: int,
    calls: dict[str, Call],
    copies: int,
    *,
    budget_s: float = BUDGET_S,
) -> Entry:
    """Time `calls` (a 'reference' and the eligible kernels, built by the caller on
    `copies` weight copies) at torch's current thread count; the `Entry` of the result."""
    times, rounds = time_calls(calls, copies, budget_s=budget_s)
    return Entry(
        op=op,
        shape=tuple(shape),
        dtype=str(dtype).removeprefix("torch."),
        rows=rows,
        threads=torch.get_num_threads(),
        median_us={k: round(statistics.median(v) * 1e6, 2) for k, v in times.items()},
        ratios=judge(times),
        rounds=rounds,
        native_build=native_gemm.build_id() if "native" in calls else "",
    )


def _weights(rows_n: int, width: int, dtype: torch.dtype, copies: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rows_n * 31 + width)
    first = torch.randn(rows_n, width, generator=generator).mul_(0.02).to(dtype)
    return [first] + [first.clone() for _ in range(copies - 1)]


def _product_calls(
    op: str, shape: tuple[int, ...], dtype: torch.dtype, rows: int
) -> tuple[dict[str, Call], int]:
    """The eligible kernels of a `linear` or `stacked` product, as calls on weight copies,
    and the number of copies. A kernel is eligible where its own rules take the sample
    operands now (`native_gemm.applies`, `onednn_backend.row_linear_applies`)."""
    sizes, width = list(shape[:-1]), shape[-1]
    total = sum(sizes)
    element = torch.tensor([], dtype=dtype).element_size()
    copies = copies_for(total * width * element)
    weights = _weights(total, width, dtype, copies)
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows)).to(dtype)
    linear = torch.nn.functional.linear
    calls: dict[str, Call] = {}
    if op == "stacked":
        pieces = [w.split(sizes, dim=0) for w in weights]
        calls["reference"] = lambda i: torch.cat([linear(x, p) for p in pieces[i]], dim=-1)
        calls["stacked"] = lambda i: linear(x, weights[i])
    else:
        calls["reference"] = lambda i: linear(x, weights[i])
    if native_gemm.applies(x, weights[0], None):
        calls["native"] = lambda i: native_gemm.linear(x, weights[i], None)
    if onednn_backend.row_linear_applies(x, weights[0], None):
        calls["onednn-row"] = lambda i: onednn_backend.row_linear(x, weights[i], None)
    return calls, copies


def _experts_calls(
    shape: tuple[int, ...], dtype: torch.dtype, rows: int
) -> tuple[dict[str, Call], int]:
    """The available experts backends (`native`, `onednn`) and the reference, as calls on
    one set of expert weights with a different random routing per call (so each call reads
    experts the one before did not, as decode steps do), and the number of routings."""
    experts, gate_up_rows, hidden_size, top_k = shape
    generator = torch.Generator().manual_seed(experts + hidden_size)
    gate_up = torch.randn(experts, gate_up_rows, hidden_size, generator=generator)
    down = torch.randn(experts, hidden_size, gate_up_rows // 2, generator=generator)
    gate_up, down = gate_up.mul_(0.02).to(dtype), down.mul_(0.02).to(dtype)
    hidden = torch.randn(rows, hidden_size, generator=generator).to(dtype)
    routings = []
    for _ in range(8):
        scores = torch.rand(rows, experts, generator=generator)
        ids = scores.topk(min(top_k, experts), dim=-1).indices
        routings.append((ids, torch.softmax(torch.rand(ids.shape, generator=generator), -1)))
    routings = [(ids, w.to(dtype)) for ids, w in routings]
    reference = kernels.get("torch", "cpu")
    backends = {"reference": reference}
    for name in ("native", "onednn"):
        try:
            backends[name] = kernels.get(name, "cpu")
        except ValueError:  # not available on this machine
            continue

    def call(backend: kernels.Kernels) -> Call:
        return lambda i: backend.moe_experts(hidden, gate_up, down, *routings[i], "silu")

    return {name: call(b) for name, b in backends.items()}, len(routings)


def measure_key(
    op: str,
    shape: tuple[int, ...],
    dtype: str,
    rows: int,
    *,
    budget_s: float = BUDGET_S,
) -> Entry | None:
    """Measure `op`'s eligible kernels at one key (`rows`: a row bucket) at torch's current
    thread count, on CPU; None where no kernel but the reference is eligible (nothing to
    choose: the reference runs)."""
    torch_dtype = getattr(torch, dtype)
    with torch.no_grad():
        if op == "experts":
            calls, copies = _experts_calls(shape, torch_dtype, rows)
        else:
            calls, copies = _product_calls(op, shape, torch_dtype, rows)
        if len(calls) < 2:
            return None
        return measure(op, shape, torch_dtype, rows, calls, copies, budget_s=budget_s)
