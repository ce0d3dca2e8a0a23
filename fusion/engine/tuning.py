"""`fusion.calibrate` (defined here): time, on this machine, the kernels a fused model could
run, so the kernel policy (`fusion.kernels.policy`) runs a fast kernel only where it measured faster.

Which products to time is not guessed from module types: the fused model is run once per
token count, and every (op, shape, dtype, row bucket, threads) the policy was asked to
choose for is timed (`fusion.kernels.calibration.measure_key`). The table is saved under
this machine's key, so later processes on the same machine (and build) choose the same
kernels without measuring again; any other machine starts from nothing measured, which
runs the references.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusion.kernels import calibration, policy
from fusion.report import KernelChoice
from fusion.runtime.linear_forward import linear_forward
from fusion.runtime.merged import MergedLinear


@dataclass
class Calibrated:
    """What one `calibrate` call measured."""

    entries: list[calibration.Entry] = field(default_factory=list)
    """The new measurements (one per key and thread count)."""
    unchanged: int = 0
    """Keys the table already held (not measured again without `refresh`)."""
    nothing_to_choose: int = 0
    """Keys where only the reference was eligible here (nothing to time)."""
    path: Path | None = None
    """Where the table was saved (None with `save=False`)."""
    model_ratios: dict[int, calibration.Ratio] = field(default_factory=dict)
    """Per token count checked, the whole model with the chosen kernels against all
    references (`model_check`); a count that did not win had its choices vetoed."""
    seconds: float = 0.0

    def __str__(self) -> str:
        lines = [
            f"calibrated {len(self.entries)} products in {self.seconds:.1f} s "
            f"({self.unchanged} already measured, {self.nothing_to_choose} with one kernel)"
        ]
        for entry in self.entries:
            shape = "x".join(map(str, entry.shape))
            kernels = tuple(entry.ratios)
            lines.append(f"  {entry.op} {shape} {entry.dtype}: {entry.summary(kernels)}")
        for count, ratio in sorted(self.model_ratios.items()):
            verdict = "kept" if ratio.wins() else "vetoed: the references run"
            lines.append(
                f"  whole model at {count} tokens: {ratio.median:.2f}x "
                f"[{ratio.q25:.2f}-{ratio.q75:.2f}] with the chosen kernels; {verdict}"
            )
        if self.path is not None:
            lines.append(f"table: {self.path}")
        return "\n".join(lines)


def _special_ids(config: Any) -> set[int]:
    """The token ids `config` names (`*_token_id`, `*_token_index`, `*_token_ids`): an
    image or audio placeholder among random ids makes a multimodal forward ask for
    features no input carries."""
    ids: set[int] = set()
    for name, value in vars(config).items():
        if name.endswith(("_token_id", "_token_index", "_token_ids")):
            values = value if isinstance(value, (list, tuple)) else [value]
            ids.update(v for v in values if isinstance(v, int) and not isinstance(v, bool))
    return ids


def default_run(model: nn.Module) -> Callable[[int], Any]:
    """A forward of a Transformers causal LM on `tokens` random ids (batch 1, no cache).

    The vocabulary is the text model's (`config.get_text_config()`: a multimodal model's
    top config has none of its own) and the ids avoid every special token id the configs
    name, so a placeholder for an image never appears without its image. Raises TypeError
    where no vocabulary is found (pass `run=`)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if not isinstance(vocab, int):
        raise TypeError(
            f"{type(model).__name__} has no config.vocab_size: pass `run=` to "
            "fusion.calibrate (a function of the token count that calls the model)"
        )
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    special = _special_ids(config) | _special_ids(text)
    plain = torch.tensor([i for i in range(vocab) if i not in special] or [0], device=device)

    def run(tokens: int) -> Any:
        ids = plain[torch.randint(0, len(plain), (1, tokens), device=device)]
        return model(input_ids=ids, use_cache=False)

    return run


def products_asked(run: Callable[[int], Any], tokens: Iterable[int]) -> dict[int, set[tuple]]:
    """Per token count, the keys the policy is asked about while `run` runs (no grad)."""
    asked = policy.POLICY.asked
    found: dict[int, set[tuple]] = {}
    with policy.POLICY.override("measured"), policy.POLICY.recording_asks(), torch.no_grad():
        for count in tokens:
            asked.clear()
            run(count)
            found[count] = set(asked)
        asked.clear()
    return found


def model_check(run: Callable[[int], Any], count: int, *, budget_s: float) -> calibration.Ratio:
    """The whole forward at `count` tokens with the table's choices against the same forward
    with every product on its reference (`FUSION_KERNELS=reference`), interleaved round by
    round (`calibration.time_calls`): reference time / chosen time.

    Why: a product timed alone can win while the model loses (another kernel's cache or
    thread-pool effects on its neighbours, the frames of the rewrite a route would have
    skipped: a gate/up product measured faster alone has made a whole decode step slower).
    Only this check sees that. The mode switch and the first call after it (memoised
    answers rebuilt) are off the clock (`time_calls`' `within`): timed, they made the
    reference pay two table scans a call, and on a small model a slower choice won the
    check (a 256-wide stacked q/k/v kept at 1.14x that made the model 0.85x)."""

    def forward(_: int) -> object:
        return run(count)

    with torch.no_grad():
        times, _ = calibration.time_calls(
            {"reference": forward, "chosen": forward},
            copies=1,
            budget_s=budget_s,
            within={"reference": lambda: policy.POLICY.override("reference")},
        )
    return calibration.judge(times)["chosen"]


def calibrate(
    model: nn.Module,
    *,
    tokens: Sequence[int] = (1, 16, 128),
    threads: Sequence[int] | None = None,
    run: Callable[[int], Any] | None = None,
    refresh: bool = False,
    save: bool = True,
    budget_s: float = calibration.BUDGET_S,
    progress: Callable[[str], None] | None = None,
) -> Calibrated:
    """Measure the kernels `model` (already fused) could run at `tokens` tokens, at each
    thread count of `threads` (default: torch's current one), add them to this machine's
    table, save it (unless `save` is False) and make the process's policy use it.

    Safe to call on any model: it only runs forwards and times products on random weights
    of the same shapes; a model with nothing to choose measures nothing. `run(tokens)`
    calls the model (default: `default_run`, a causal LM on random ids; where that call
    raises, TypeError naming the model and the model's error, and asking for `run=`)."""
    started = time.perf_counter()
    if run is not None:
        per_count = products_asked(run, tokens)
    else:
        run = default_run(model)
        try:
            per_count = products_asked(run, tokens)
        except Exception as exc:
            lines = str(exc).strip().splitlines() or [""]
            raise TypeError(
                f"{type(model).__name__} cannot run on one row of random token ids (the "
                f"default run: {type(exc).__name__}: {lines[0][:200]}): pass `run=` to "
                "fusion.calibrate (a function of the token count that calls the model)"
            ) from exc
    keys = set().union(*per_count.values()) if per_count else set()
    table = policy.POLICY.table
    result = Calibrated()
    previous = torch.get_num_threads()
    try:
        for count in tuple(threads) if threads else (previous,):
            torch.set_num_threads(count)
            for op, shape, dtype, rows, _ in sorted(keys):
                if not refresh and table.lookup(op, shape, dtype, rows, count) is not None:
                    result.unchanged += 1
                    continue
                if progress is not None:
                    progress(f"{op} {'x'.join(map(str, shape))} {dtype} {rows} rows {count}t")
                entry = calibration.measure_key(op, shape, dtype, rows, budget_s=budget_s)
                if entry is None:
                    result.nothing_to_choose += 1
                    continue
                table.add(entry)
                result.entries.append(entry)
            policy.POLICY.set_table(table)
            _check_models(run, per_count, table, count, result, budget_s, progress)
    finally:
        torch.set_num_threads(previous)
    if save:
        result.path = calibration.save_table(table)
    policy.POLICY.set_table(table)
    result.seconds = time.perf_counter() - started
    return result


def _check_models(
    run: Callable[[int], Any],
    per_count: dict[int, set[tuple]],
    table: calibration.Table,
    threads: int,
    result: Calibrated,
    budget_s: float,
    progress: Callable[[str], None] | None,
) -> None:
    """At each token count whose products have a winner, time the whole model with the
    winners against all references (`model_check`); where it is not measurably faster
    (`Ratio.wins`), veto every winner of that count's products, so the reference runs
    there. Counts with nothing chosen are not timed (nothing would change)."""
    for count, keys in sorted(per_count.items()):
        entries = [
            table.lookup(op, shape, dtype, rows, threads) for op, shape, dtype, rows, _ in keys
        ]
        chosen = [e for e in entries if e is not None and e.best(tuple(e.ratios)) != "reference"]
        if not chosen:
            continue
        if progress is not None:
            progress(f"model at {count} tokens {threads}t: chosen kernels vs references")
        ratio = model_check(run, count, budget_s=max(budget_s, 1.0))
        result.model_ratios[count] = ratio
        if ratio.wins():
            continue
        veto = (
            f"the model at {count} tokens measured {ratio.median:.2f}x "
            f"[{ratio.q25:.2f}-{ratio.q75:.2f}] with the products' winners"
        )
        for entry in chosen:
            table.add(dataclasses.replace(entry, veto=veto))
    policy.POLICY.set_table(table)


DECODE_ROWS = 1
PREFILL_ROWS = 128
"""The row counts `kernel_choices` reports: one decode step, a prompt chunk."""


def _explained(
    op: str, shape: tuple[int, ...], dtype: str, rows: int, backend: str
) -> tuple[str, str]:
    """`KernelPolicy.explain`, saying so where the reference routes the rewritten forwards
    calling this merged product to their classes' originals (`fusion.runtime.routes`)."""
    kernel, why = policy.POLICY.explain(op, shape, dtype, rows, backend)
    chooser = policy.POLICY
    if (
        op == "stacked"
        and chooser.routes_open()
        and chooser.runs_reference(op, shape, dtype, rows, backend)
    ):
        why += "; the rewritten forward calling it runs its class's original (route)"
    return kernel, why


def kernel_choices(model: nn.Module) -> list[KernelChoice]:
    """For each distinct product of a fused model (merged projections, linears with a
    `LinearForward`), the kernel the policy runs at `DECODE_ROWS` and `PREFILL_ROWS` rows
    on this machine, now, and why (`policy.KernelPolicy.explain`, and where a merged
    product's measured reference routes the forward calling it to its original,
    `fusion.runtime.routes`). Routed experts choose per call (their row counts depend on the
    routing): not listed."""
    seen: dict[tuple, KernelChoice] = {}
    for name, module in model.named_modules():
        if isinstance(module, MergedLinear):
            op, shape, backend = "stacked", module.kernel_shape, module.backend
            weight = module.stacked_weight
            dtype = module.shards[0].weight.dtype if weight is None else weight.dtype
        elif linear_forward(module) is not None:
            op, shape = "linear", tuple(module.weight.shape)
            backend, dtype = module.__dict__["forward"].backend, module.weight.dtype
        else:
            continue
        dtype_name = str(dtype).removeprefix("torch.")
        key = (op, shape, dtype_name, backend)
        if key in seen:
            seen[key].modules.append(name)
            continue
        decode, prefill = (
            _explained(op, shape, dtype_name, rows, backend) for rows in (DECODE_ROWS, PREFILL_ROWS)
        )
        seen[key] = KernelChoice(op, shape, dtype_name, backend, decode, prefill, [name])
    return list(seen.values())
