"""The performance verdict (`fusion-harness perf`): per architecture, is the fused model
measurably slower, the same, or faster than the unfused one, at real widths?

Each architecture is built at its **real default widths** (its Transformers config class's
defaults; only the depth is capped, to `layers`, and the vocabulary, to `vocab`, since only the
decoder stack is timed, as `harness.speed.bench`'s model cases do), with random weights. A deep copy
is fused (`fusion.fuse`) and calibrated (`fusion.calibrate`: the kernel policy runs a fast
kernel only where it measured faster on this machine; cached per machine), then the two
decoder forwards (`model.base_model(input_ids=..., use_cache=False)`, no grad, batch 1) are
timed **interleaved**, round by round (`harness.speed.bench.timers.time_cpu_interleaved`), at each
token count. The per-round ratios unfused / fused give the median and the quartiles; the
verdict of one token count (`verdict`):

- `slower` when the ratio's upper quartile is below `SLOWER` (0.97), and again when that
  count is timed a second time (`confirmed`): measurably slower, a failure of the command
  (exit 1);
- `faster` when its lower quartile is above `FASTER` (1.03);
- `same` otherwise.

An architecture that is too large to build here (`estimate_bytes`: parameters x bytes per
element x 2, the unfused model and its fused copy) is skipped with the estimate, one that does
not build, fuse or run is recorded with the reason: never fatal. Architectures run one after
the other in this process, never in parallel, so no other work of ours overlaps a timing.
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import json
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

import fusion
from corpus.builder import build_from_config, quiet_transformers, tiny_kwargs
from corpus.catalog import config_class, model_class
from corpus.inputs import make_inputs
from corpus.overrides import deep_merge, override
from corpus.tiny import config_values, is_config
from harness.base import architectures
from harness.reporting import table as text_table
from harness.speed.bench.decode import greedy, prompt_ids
from harness.speed.bench.table import machine_info
from harness.speed.bench.timers import (
    MALLOC_ENV,
    iqr,
    malloc_env_set,
    measure,
    time_cpu_interleaved,
)

SLOWER = 0.97
"""A token count is `slower` when the upper quartile of unfused / fused is below this."""

FASTER = 1.03
"""A token count is `faster` when the lower quartile of unfused / fused is above this."""

TOKENS = (1, 128)
"""Default token counts: one decode step, a prompt chunk."""
GENERATE = (8, 8)
"""(prompt tokens, new tokens) of the greedy `generate` timed beside the forwards."""

LAYERS = 2
VOCAB = 1024
MAX_GB = 4.0
POSITIONS = 8192
BUDGET_S = 1.0
MIN_ROUNDS = 7

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

DEPTH = re.compile(
    r"num_hidden_layers|n_layer|n_layers|num_layers|decoder_layers|num_decoder_layers|"
    r"num_mtp_layers|num_nextn_predict_layers|n_input_layers|n_output_layers|"
    r"n_recurrent_layers|num_kv_shared_layers|first_k_dense_replace|num_dense_layers|"
    r"moe_layer_start_index|max_window_layers|.*_period|global_attn_every_n_layers|"
    r"no_rope_layer_interval|sliding_window_pattern|layer_group_size|"
    r"interleave_moe_layer_step|decoder_sparse_step|n_layers_per_.*|.*_layer_offset|"
    r"is_decoder"
)
"""Config attributes about depth and layer kinds: taken from the corpus's tiny config (which
keeps one layer of every kind, and e.g. `first_k_dense_replace` below the depth, so an MoE
stack still has MoE layers; Jamba's attention offset below its period), never about widths.
`is_decoder` too: a causal LM of an encoder-decoder family (Reformer) needs it set."""

LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers")
"""The attribute names of a config's layer count (the first one that is an int is used)."""

TOKEN = re.compile(r".*token_(id|ids|index|idx)|.*_token")
VOCABS = re.compile(r".*vocab.*")
POSITION_NAMES = re.compile(r"max_position_embeddings|n_positions|n_ctx|max_seq_len")


class PerfError(ValueError):
    """Options that cannot work (the command exits 2 with the message)."""


@dataclass(frozen=True)
class PerfOptions:
    """How each architecture is built and timed.

    `widths`: constructor kwargs merged over the real-width ones (a test hook: a test times a
    small model in seconds; empty for a real verdict)."""

    layers: int = LAYERS
    tokens: tuple[int, ...] = TOKENS
    vocab: int = VOCAB
    max_gb: float = MAX_GB
    dtype: str = "float32"
    device: str = "cpu"
    budget_s: float = BUDGET_S
    min_rounds: int = MIN_ROUNDS
    clock: str = "wall"
    seed: int = 0
    calibrate: bool = True
    generate: tuple[int, int] | None = GENERATE
    """(prompt, new tokens) of the timed greedy `generate` with the KV cache; None: none."""
    widths: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class TokenPerf:
    """Fused vs unfused at one token count: medians and IQRs of the per-round times (ms), and
    the median and quartiles of the per-round ratios unfused / fused (above 1: fused faster)."""

    tokens: int
    unfused_ms: float
    fused_ms: float
    unfused_iqr_ms: float
    fused_iqr_ms: float
    ratio: float
    ratio_q1: float
    ratio_q3: float
    rounds: int
    verdict: str
    kind: str = "forward"
    """`forward`: the decoder stack on `tokens` tokens, no cache; `generate`: a greedy
    `generate` of `tokens` new tokens with the KV cache (`PerfOptions.generate`)."""


@dataclass
class ArchPerf:
    """The verdict of one architecture: `faster`, `same` or `slower` (the worst of its token
    counts, `faster` only when every one is), or `skipped: ...` / `error: ...` with the reason."""

    arch: str
    verdict: str
    timings: list[TokenPerf] = field(default_factory=list)
    params: int | None = None
    estimate_gb: float | None = None
    layers: int | None = None
    fused_modules: int = 0
    calibrated: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    """What else was found: a `generate` this model cannot run, greedy tokens that differ."""


# --------------------------------------------------------------------------------------------
# The verdict


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(lower quartile, median, upper quartile) of `values` (inclusive method); a single
    value is all three. Raises ValueError for no values."""
    if not values:
        raise ValueError("no values")
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def verdict(q1: float, q3: float, *, slower: float = SLOWER, faster: float = FASTER) -> str:
    """`slower` if the ratio's upper quartile `q3` < `slower`, `faster` if its lower quartile
    `q1` > `faster`, else `same`: a verdict other than `same` needs three quarters of the
    rounds past the margin, so noise alone rarely gives one."""
    if q3 < slower:
        return "slower"
    if q1 > faster:
        return "faster"
    return "same"


def token_perf(tokens: int, unfused: Sequence[float], fused: Sequence[float]) -> TokenPerf:
    """The `TokenPerf` of per-round seconds per call `unfused[i]`, `fused[i]` (round i of both
    timed back to back, so their ratio sees the same machine load). Raises ValueError when the
    lists differ in length or are empty."""
    if len(unfused) != len(fused) or not unfused:
        raise ValueError(f"{len(unfused)} unfused vs {len(fused)} fused rounds")
    ratios = [u / f for u, f in zip(unfused, fused)]
    q1, median, q3 = quartiles(ratios)
    return TokenPerf(
        tokens=tokens,
        unfused_ms=statistics.median(unfused) * 1e3,
        fused_ms=statistics.median(fused) * 1e3,
        unfused_iqr_ms=iqr(list(unfused)) * 1e3,
        fused_iqr_ms=iqr(list(fused)) * 1e3,
        ratio=median,
        ratio_q1=q1,
        ratio_q3=q3,
        rounds=len(ratios),
        verdict=verdict(q1, q3),
    )


def confirmed(measure: Callable[[], TokenPerf], notes: list[str]) -> TokenPerf:
    """`measure()`, and where its verdict is `slower`, `measure()` once more: the second
    timing is the one judged, and a first `slower` the second does not repeat is noted.

    Why: a run over every default architecture makes about 350 judgments, and noise alone
    gives an occasional one past the margin (two in one full run, neither repeated when
    timed again: docs/benchmarks.md); a model that really is slower is slower twice, so the
    verdict fails where both timings agree, and where one alone said so the note keeps it
    visible."""
    first = measure()
    if first.verdict != "slower":
        return first
    second = measure()
    if second.verdict != "slower":
        label = f"gen {first.tokens}" if first.kind == "generate" else f"{first.tokens} tokens"
        notes.append(
            f"{label}: slower at first ({first.ratio:.2f}x [{first.ratio_q1:.2f}-"
            f"{first.ratio_q3:.2f}]), {second.verdict} timed again ({second.ratio:.2f}x)"
        )
    return second


def arch_verdict(timings: Sequence[TokenPerf]) -> str:
    """`slower` if any token count is, `faster` if every one is, else `same`."""
    verdicts = {t.verdict for t in timings}
    if "slower" in verdicts:
        return "slower"
    if verdicts == {"faster"}:
        return "faster"
    return "same"


def exit_status(records: Iterable[ArchPerf]) -> int:
    """1 if any architecture is `slower`, else 0 (skipped and errored ones do not fail)."""
    return 1 if any(r.verdict == "slower" for r in records) else 0


# --------------------------------------------------------------------------------------------
# Real-width models


def _layer_count(values: Mapping[str, Any]) -> tuple[str | None, int | None]:
    for name in LAYER_COUNTS:
        value = values.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return name, value
    return None, None


def _uniform(value: Any, length: int) -> bool:
    """A per-layer list of `length` entries that are all equal."""
    return (
        isinstance(value, (list, tuple))
        and len(value) == length
        and all(v == value[0] for v in value)
    )


def real_width_kwargs(
    default: Any, tiny: Mapping[str, Any], options: PerfOptions, *, fill_unset: bool = False
) -> dict:
    """Constructor kwargs that keep `default`'s widths: only the depth, the layer kinds, the
    vocabularies, the special token ids and the context length are changed.

    `tiny` is the corpus's tiny kwargs of the same config: its depth attributes and per-layer
    lists (every layer kind kept, `DEPTH`) and its special token ids (remapped into a 256-id
    vocabulary, valid for any `vocab` >= 256) are taken; vocabularies are capped to
    `options.vocab` (an auxiliary one equal to the default vocabulary follows it, as the
    embedding it indexes is indexed by the same ids; others take the tiny value), positions
    to `POSITIONS`. Where the tiny stack's layers are all of one kind, the depth is
    `options.layers` (at most the default). A size the default leaves None is kept None
    (often an optional feature left off: Qwen4-Exp's token indexer) unless `fill_unset`
    (the model cannot be built so: HunYuan's head width, dots1's expert counts), then it
    is `_unset_size`'s. Sub-configs recurse. Pure: neither argument is mutated."""
    values = config_values(default)
    count_name, count = _layer_count(values)
    kw: dict[str, Any] = {}
    per_layer: list[str] = []
    for name, value in tiny.items():
        sub = values.get(name)
        if isinstance(value, Mapping) and "model_type" in value and is_config(sub):
            kw[name] = {"model_type": value["model_type"]}
            kw[name].update(real_width_kwargs(sub, value, options, fill_unset=fill_unset))
        elif DEPTH.fullmatch(name) or TOKEN.fullmatch(name):
            kw[name] = copy.deepcopy(value)
        elif VOCABS.fullmatch(name) and name != "vocab_size":
            follows = sub is not None and sub == values.get("vocab_size")
            kw[name] = min(sub, options.vocab) if follows else value
        elif isinstance(count, int) and _is_per_layer(values.get(name), count):
            kw[name] = copy.deepcopy(value)
            per_layer.append(name)
        elif fill_unset and sub is None and name in values and _is_size(value):
            kw[name] = _unset_size(name, value, values)
    tiny_count = kw.get(count_name) if count_name else None
    if isinstance(count, int) and count_name:
        depth = min(options.layers, count)
        if isinstance(tiny_count, int) and all(_uniform(kw[n], tiny_count) for n in per_layer):
            kw[count_name] = depth
            for name in per_layer:
                kw[name] = type(kw[name])([kw[name][0]] * depth)
        elif not per_layer:
            kw[count_name] = depth
    vocab = values.get("vocab_size")
    if isinstance(vocab, int) and vocab > options.vocab:
        kw["vocab_size"] = options.vocab
    for name, value in values.items():
        if POSITION_NAMES.fullmatch(name) and isinstance(value, int) and value > POSITIONS:
            kw[name] = POSITIONS
    return kw


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _unset_size(name: str, tiny: int, values: Mapping[str, Any]) -> int:
    """The size for `name`, which the default config leaves None and the tiny one sets to
    `tiny`: a head width (`*head_dim`) is the model's own head width, or the real hidden
    width over the real head count where that is unset too (what a Transformers model
    derives where it does: a tiny head would not fit the real rotary width); the key/value
    heads are the attention heads (Transformers' reading of an unset count: no grouping);
    anything else (expert counts, top-k, budgets) is a count, not a width, and takes the
    tiny value."""
    heads = values.get("num_attention_heads")
    if name == "num_key_value_heads" and _is_size(heads):
        return heads
    if not name.endswith("head_dim"):
        return tiny
    own, hidden = values.get("head_dim"), values.get("hidden_size")
    if _is_size(own):
        return own
    if _is_size(hidden) and _is_size(heads) and heads > 0:
        return hidden // heads
    return tiny


def _is_per_layer(value: Any, count: int) -> bool:
    """A per-layer list (one entry per layer) or pattern string of a `count`-layer stack."""
    return isinstance(value, (list, tuple, str)) and len(value) == count and count > 1


def _structural_fixes(fixes: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of an `overrides.toml` `config` table that are not sizes (ints or lists of
    ints belong to the tiny widths): layer-kind lists, rope tables, flags; a sub-config's
    table (a `text_config`) likewise, entry by entry (Qwen4-Exp's tiny indexer widths
    would not fit its real heads)."""

    def is_size(value: Any) -> bool:
        if isinstance(value, bool):
            return False
        if isinstance(value, int):
            return True
        return isinstance(value, (list, tuple)) and all(is_size(v) for v in value) and value

    return {
        k: _structural_fixes(v) if isinstance(v, Mapping) else v
        for k, v in fixes.items()
        if not is_size(v)
    }


def real_width_config(arch: str, options: PerfOptions, *, fill_unset: bool = False) -> Any:
    """The config of `arch` at its real default widths with the depth and vocabulary of
    `options` (`real_width_kwargs`), then `options.widths` merged over it. What the model is
    built from: the sub-config the causal-LM class takes, for composite configs. Raises
    whatever the config constructor raises."""
    ov = override(arch)
    defaults = ov.get("defaults", {})
    cls = config_class(arch)
    with quiet_transformers():
        default = cls(**copy.deepcopy(defaults))
    real = real_width_kwargs(default, tiny_kwargs(arch), options, fill_unset=fill_unset)
    kw = deep_merge(defaults, real)
    kw = deep_merge(kw, _structural_fixes(ov.get("config", {})))
    kw = deep_merge(kw, dict(options.widths))
    with quiet_transformers():
        config = cls(**kw)
    want = getattr(model_class(arch), "config_class", None)
    if want is not None and not isinstance(config, want):
        config = next(
            (v for v in vars(config).values() if is_config(v) and isinstance(v, want)), config
        )
    if not hasattr(config, "pad_token_id"):
        config.pad_token_id = None  # as corpus.tiny_config: some 5.x models read it
    return config


def count_params(arch: str, config: Any) -> int:
    """Parameters of `arch` built from `config`, counted on the meta device (no memory, no
    initialisation). Raises whatever construction raises."""
    with quiet_transformers(), torch.device("meta"):
        model = model_class(arch)._from_config(config)
    return sum(p.numel() for p in model.parameters())


def sized_config(arch: str, options: PerfOptions) -> tuple[Any, int, bool]:
    """(config, parameters, whether unset sizes were filled): `real_width_config` as the
    defaults leave it where that builds (on the meta device, `count_params`), else with the
    sizes the defaults leave None filled (`fill_unset`). Raises the first failure where
    neither builds, so the recorded error is the one the defaults themselves give."""
    try:
        config = real_width_config(arch, options)
        return config, count_params(arch, config), False
    except Exception as first:
        try:
            config = real_width_config(arch, options, fill_unset=True)
            return config, count_params(arch, config), True
        except Exception:
            raise first from None


def estimate_bytes(params: int, dtype: torch.dtype) -> int:
    """Memory the verdict needs for a model of `params` parameters: the unfused model and its
    fused deep copy, `params x bytes per element x 2`."""
    return params * torch.empty((), dtype=dtype).element_size() * 2


def _layers_of(config: Any) -> int | None:
    return _layer_count(config_values(config))[1]


def decoder_forward(model: nn.Module, tokens: int, seed: int) -> Callable[[], Any]:
    """A no-grad call of `model`'s decoder stack (`base_model`: no LM head) on `tokens`
    seeded random ids (batch 1, no cache): what is timed."""
    ids = make_inputs(model, seed=seed, batch=1, seq=tokens)["input_ids"]
    ids = ids.to(next(model.parameters()).device)
    base = model.base_model
    kwargs: dict[str, Any] = {"input_ids": ids}
    params = inspect.signature(base.forward).parameters
    if "use_cache" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs["use_cache"] = False

    def run() -> Any:
        with torch.no_grad():
            return base(**kwargs)

    return run


def calibration_run(model: nn.Module, seed: int) -> Callable[[int], Any]:
    """`fusion.calibrate`'s `run`: the very forward the verdict times (`decoder_forward`,
    its inputs made once per token count, off the calibration's clock), so what is
    calibrated is what is judged, and a model whose inputs are not one row of token ids
    (MusicGen's codebook rows) is calibrated on the inputs the corpus makes for it."""
    forwards: dict[int, Callable[[], Any]] = {}

    def run(tokens: int) -> Any:
        if tokens not in forwards:
            forwards[tokens] = decoder_forward(model, tokens, seed)
        return forwards[tokens]()

    return run


def forward_perf(
    model: nn.Module, fused: nn.Module, tokens: int, options: PerfOptions, notes: list[str]
) -> TokenPerf:
    """The timing of the two models' decoder forwards on `tokens` tokens (`decoder_forward`),
    interleaved (`time_pair`), a `slower` one timed again (`confirmed`)."""
    unfused_call = decoder_forward(model, tokens, options.seed)
    fused_call = decoder_forward(fused, tokens, options.seed)
    return confirmed(
        lambda: token_perf(tokens, *time_pair(unfused_call, fused_call, options)), notes
    )


def generate_perf(
    model: nn.Module, fused: nn.Module, options: PerfOptions, notes: list[str]
) -> TokenPerf | None:
    """The `generate` timing of the two models (greedy, KV cache, `options.generate`), or
    None with the reason in `notes` where the unfused model cannot generate (not a causal
    LM's `generate`: then nothing of the user's decode is there to judge). Greedy tokens
    that differ from the unfused ones are noted (with random weights near-tied logits may
    flip under a measured kernel's rounding; the bench's trained model is where they must
    not)."""
    prompt, new = options.generate or GENERATE
    try:
        ids = prompt_ids(model, prompt, options.seed)
        want = greedy(model, ids, new)
    except Exception as exc:
        notes.append(f"generate: not timed, the unfused model cannot: {_one_line(exc)}")
        return None
    got = greedy(fused, ids, new)
    if not torch.equal(got, want):
        notes.append("generate: greedy tokens differ from the unfused model's")

    def measure() -> TokenPerf:
        unfused_times, fused_times = time_pair(
            lambda: greedy(model, ids, new), lambda: greedy(fused, ids, new), options
        )
        timing = token_perf(new, unfused_times, fused_times)
        timing.kind = "generate"
        return timing

    return confirmed(measure, notes)


def time_pair(
    unfused: Callable[[], Any], fused: Callable[[], Any], options: PerfOptions
) -> tuple[list[float], list[float]]:
    """Per-round seconds per call of the two forwards, interleaved: on CPU round by round
    (`time_cpu_interleaved`); on a GPU in `options.min_rounds` alternating blocks of
    CUDA-event timings (`measure`), each block's median one round."""
    if torch.device(options.device).type != "cuda":
        times = time_cpu_interleaved(
            {"unfused": unfused, "fused": fused},
            budget_s=options.budget_s,
            clock=options.clock,
            min_rounds=options.min_rounds,
        )
        return times["unfused"], times["fused"]
    block = options.budget_s / options.min_rounds
    u, f = [], []
    for _ in range(options.min_rounds):
        u.append(statistics.median(measure(unfused, options.device, block)))
        f.append(statistics.median(measure(fused, options.device, block)))
    return u, f


def _one_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def measure_arch(
    arch: str, options: PerfOptions, progress: Callable[[str], None] = lambda _: None
) -> ArchPerf:
    """The `ArchPerf` of `arch`: built, fused, calibrated and timed as the module doc says.
    Never raises for the model's sake: a config, build, fuse, calibration or forward failure
    becomes an `error: ...` verdict, an estimate over `options.max_gb` a `skipped: ...` one
    (KeyboardInterrupt still propagates)."""
    started = time.perf_counter()
    record = ArchPerf(arch=arch, verdict="")
    dtype = DTYPES[options.dtype]
    stage = "config"
    try:
        config, record.params, filled = sized_config(arch, options)
        record.layers = _layers_of(config)
        if filled:
            record.notes.append("sizes the default config leaves unset were filled")
        record.estimate_gb = estimate_bytes(record.params, dtype) / 1e9
        if record.estimate_gb > options.max_gb:
            record.verdict = f"skipped: too large ({record.estimate_gb:.1f} GB)"
            return record
        stage = "build"
        progress(f"{arch}: building ({record.params / 1e6:.0f}M parameters, {options.dtype})")
        model = build_from_config(
            config, seed=options.seed, dtype=dtype, device=options.device, name=arch
        )
        fused = copy.deepcopy(model)
        stage = "fuse"
        report = fusion.fuse(fused)
        record.fused_modules = len(report.applied)
        if not report.applied:
            record.verdict = "skipped: nothing fused"
            return record
        if options.calibrate:
            stage = "calibrate"
            progress(f"{arch}: calibrating at {options.tokens} tokens")
            run = calibration_run(fused, options.seed)
            record.calibrated = len(fusion.calibrate(fused, tokens=options.tokens, run=run).entries)
        stage = "time"
        for tokens in options.tokens:
            progress(f"{arch}: timing {tokens} tokens")
            record.timings.append(forward_perf(model, fused, tokens, options, record.notes))
        if options.generate:
            stage = "generate"
            progress(f"{arch}: timing generate {options.generate[0]}+{options.generate[1]}")
            timing = generate_perf(model, fused, options, record.notes)
            if timing is not None:
                record.timings.append(timing)
        record.verdict = arch_verdict(record.timings)
    except Exception as exc:  # recorded, never fatal: the next architecture still runs
        record.verdict = f"error: {stage}: {_one_line(exc)}"
    finally:
        record.seconds = time.perf_counter() - started
    return record


def run(
    archs: Sequence[str],
    options: PerfOptions,
    progress: Callable[[str], None] = lambda _: None,
    records: list[ArchPerf] | None = None,
    done: Callable[[ArchPerf], None] = lambda _: None,
) -> list[ArchPerf]:
    """`measure_arch` of each of `archs`, one after the other in this process (timings never
    overlap other work of ours); each model is freed (reference cycles of bound forwards
    included) before the next is built. Each record is appended to `records` (a list of
    the caller's, so what was measured survives an interrupt) and passed to `done` as it
    is finished, its verdict told to `progress` (`record_line`)."""
    records = [] if records is None else records
    for arch in archs:
        record = measure_arch(arch, options, progress)
        records.append(record)
        progress(record_line(record))
        done(record)
        gc.collect()
        if torch.device(options.device).type == "cuda":
            torch.cuda.empty_cache()
    return records


def record_line(record: ArchPerf) -> str:
    """One architecture's verdict as a progress line: the verdict, each token count's ratio
    and the seconds it took, e.g. "llama: same (1: 1.01x, 128: 1.00x, gen 8: 0.99x; 41 s)"."""
    ratios = ", ".join(
        f"{t.tokens if t.kind == 'forward' else f'gen {t.tokens}'}: {t.ratio:.2f}x"
        for t in record.timings
    )
    timed = f"{ratios}; " if ratios else ""
    return f"{record.arch}: {record.verdict} ({timed}{record.seconds:.0f} s)"


# --------------------------------------------------------------------------------------------
# Reporting


def format_table(records: Sequence[ArchPerf]) -> str:
    """The verdict table: one row per (architecture, token count) with the unfused and fused
    medians (ms), the ratio unfused / fused as median [lower quartile - upper quartile] and
    the verdict; an architecture without timings gets one row with its verdict alone."""
    header = ["arch", "tokens", "unfused ms", "fused ms", "ratio [IQR]", "verdict"]
    table = [header]
    for r in records:
        if not r.timings:
            table.append([r.arch, "-", "-", "-", "-", r.verdict])
        for i, t in enumerate(r.timings):
            table.append(
                [
                    r.arch if i == 0 else "",
                    str(t.tokens) if t.kind == "forward" else f"gen {t.tokens}",
                    f"{t.unfused_ms:.2f}",
                    f"{t.fused_ms:.2f}",
                    f"{t.ratio:.2f}x [{t.ratio_q1:.2f}-{t.ratio_q3:.2f}]",
                    t.verdict,
                ]
            )
    return text_table.render(header, table[1:], right={1, 2, 3})


def summary_line(records: Sequence[ArchPerf]) -> str:
    """Counts per architecture verdict, e.g. "perf: 2 faster, 1 same, 0 slower, 1 skipped"."""
    counts = {"faster": 0, "same": 0, "slower": 0, "skipped": 0, "error": 0}
    for r in records:
        counts[r.verdict.split(":")[0]] += 1
    return "perf: " + ", ".join(f"{n} {k}" for k, n in counts.items())


def document(
    records: Sequence[ArchPerf], options: PerfOptions, complete: bool = True
) -> dict[str, Any]:
    """The JSON document of a run: machine, options, thresholds and every record;
    `complete` False while the run goes on or after it was interrupted."""
    opts = asdict(options)
    opts["widths"] = dict(options.widths)
    return {
        "machine": machine_info(options.device),
        "options": opts,
        "thresholds": {"slower": SLOWER, "faster": FASTER},
        "complete": complete,
        "records": [asdict(r) for r in records],
    }


# --------------------------------------------------------------------------------------------
# The command


def options_from_args(args: argparse.Namespace) -> PerfOptions:
    """`PerfOptions` from parsed arguments; PerfError for values that cannot work."""
    try:
        tokens = tuple(int(v) for v in args.tokens.split(",") if v.strip())
    except ValueError:
        tokens = ()
    if not tokens or min(tokens) < 1:
        raise PerfError(f"--tokens {args.tokens!r}: expected comma-separated positive integers")
    if args.layers < 1:
        raise PerfError("--layers must be at least 1")
    if args.vocab < 256:
        raise PerfError("--vocab must be at least 256 (the corpus's special token ids)")
    if args.max_gb <= 0 or args.budget <= 0:
        raise PerfError("--max-gb and --budget must be positive")
    generate = None
    if args.generate.strip().lower() != "off":
        try:
            generate = tuple(int(v) for v in args.generate.split(","))
        except ValueError:
            generate = ()
        if len(generate) != 2 or min(generate) < 1:
            raise PerfError(
                f"--generate {args.generate!r}: expected PROMPT,NEW (two positive integers) or off"
            )
    if args.threads is not None and args.threads < 1:
        raise PerfError("--threads must be at least 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise PerfError(f"--device {args.device}: CUDA is not available here")
    return PerfOptions(
        layers=args.layers,
        tokens=tokens,
        vocab=args.vocab,
        max_gb=args.max_gb,
        dtype=args.dtype,
        device=args.device,
        budget_s=args.budget,
        clock=args.clock,
        seed=args.seed,
        calibrate=not args.no_calibrate,
        generate=generate,
    )


def run_from_args(args: argparse.Namespace) -> int:
    """`fusion-harness perf ARGS` (parsed by harness.cli.perf): prints the table and returns
    the exit status (0, 1 if any architecture is slower, 2 for options that cannot work)."""
    try:
        options = options_from_args(args)
        archs = architectures.select(args.arch, architectures.available())
    except (PerfError, architectures.UnknownArchitecture) as exc:
        print(f"fusion-harness perf: error: {exc}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if torch.device(options.device).type == "cpu" and not malloc_env_set():
        settings = " ".join(f"{k}={v}" for k, v in MALLOC_ENV.items())
        print(f"perf: note: set {settings} for steadier CPU timings", file=sys.stderr)
    print(
        f"perf: {len(archs)} architectures, {options.layers} layers, tokens {options.tokens}, "
        f"{options.dtype} on {options.device}, {torch.get_num_threads()} threads",
        file=sys.stderr,
    )
    records: list[ArchPerf] = []

    def save(complete: bool) -> None:
        # after every architecture too, so a run killed hours in keeps what it measured
        if args.json:
            args.json.write_text(json.dumps(document(records, options, complete), indent=1) + "\n")

    interrupted = False
    try:
        run(
            archs,
            options,
            lambda line: print(f"perf: {line}", file=sys.stderr, flush=True),
            records,
            lambda _record: save(complete=False),
        )
    except KeyboardInterrupt:
        interrupted = True
        print(
            f"perf: interrupted after {len(records)} of {len(archs)} architectures; "
            "the table and summary hold those",
            file=sys.stderr,
        )
    print(format_table(records))
    for r in records:
        for note in r.notes:
            print(f"{r.arch}: {note}")
    print(summary_line(records))
    save(complete=not interrupted)
    status = exit_status(records)
    return 130 if interrupted and status == 0 else status
