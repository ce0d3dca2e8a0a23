"""Liger's sweep results as a table, every non-pass classified: whose finding it is.

`python -m harness.peers.liger_findings RESULTS.jsonl [...]` (a results file of `fusion-harness
run --system liger`) prints one Markdown row per architecture: the harness's status, the
parity verdict on its own (Liger's error against float64 vs the tolerance the unfused model's
own error sets), the per-module and lifecycle verdicts, Liger's kernel launches, and for each
failure the owner and reason from `RULES` (Liger's, Transformers', the interpreter's, ours).
A failure no rule matches is `unclassified` and the exit status is 1: every finding must be
read by someone before it is filed.

The shown class is the first matching rule of each failure; a row lists each distinct class.
`not-applied` rows come from the `not-applied:` failures `harness.runner.arch_check` records.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.base.results import ArchResult, read_results


@dataclass(frozen=True)
class Rule:
    """Failures whose message matches `pattern` (and, when given, whose architecture is one
    of `architectures`) are `owner`'s, for `reason`."""

    name: str
    owner: str
    pattern: str
    reason: str
    architectures: frozenset[str] = frozenset()

    def matches(self, architecture: str, message: str) -> bool:
        """Whether a failure of `architecture` with `message` is this rule's."""
        if self.architectures and architecture not in self.architectures:
            return False
        return re.search(self.pattern, message) is not None


ROPE_DECODE = frozenset({"exaone4"})
"""Architectures whose q/k reach Liger's RoPE contiguous in (batch, heads, seq, dim) layout
(a q/k norm after the transpose), where the decode bug shows."""

RULES: tuple[Rule, ...] = (
    Rule(
        "deprecated-arguments",
        "Liger's",
        r"`past_key_values`(/`cache_params`)? (is|are) deprecated|`use_return_dict` is deprecated"
        r"|`(image|audio)_hidden_states` is deprecated",
        "Liger 0.8.5's lce_forward passes `past_key_values` and reads `use_return_dict` (and the "
        "multimodal ones `image_hidden_states` / `audio_hidden_states`), deprecated in "
        "Transformers 5.24: warnings only the patched model raises, on every forward",
    ),
    Rule(
        "rope-decode-stride",
        "Liger's",
        r"lifecycle generate: token \d+ of row \d+ differs",
        "Liger's rope_forward takes q.stride(1) as the row stride after .contiguous(); with one "
        "token per row (decode) and q contiguous in (batch, heads, seq, dim) layout, that "
        "stride is head_dim, not heads x head_dim (torch ignores a size-1 dim's stride), so "
        "rows of batch > 0 read other rows' q/k: greedy tokens change",
        ROPE_DECODE,
    ),
    Rule(
        "llama4-rope-batch-positions",
        "Liger's",
        r"lifecycle generate: token \d+ of row [1-9]\d* differs",
        "Liger's Llama 4 RoPE flattens freqs_cis (batch, seq, dim) and keeps its first seq_len "
        "rows, i.e. row 0's: every row is rotated with row 0's positions, so a batch whose "
        "rows sit at different positions (generate with padding) decodes rows > 0 wrong",
        frozenset({"llama4", "llama4_text"}),
    ),
    Rule(
        "gradient-allowance",
        "ours",
        r"lifecycle train: gradient of ",
        "the lifecycle `train` check compares the patched model's gradients with the unfused "
        "model's within an allowance set by the forward logits, with no float64 yardstick: in "
        "bfloat16, DeepSeek-V4's router gradient (float64: ~1e-19) is 1.2e-5 from float64 with "
        "Liger and 1.6e-5 unfused. Liger is nearer the exact value; a false finding of ours",
        frozenset({"deepseek_v4"}),
    ),
    Rule(
        "gemma3-multimodal-forward",
        "Liger's",
        r"'NoneType' object has no attribute 'pooler_output'",
        "Liger's Gemma 3 multimodal_forward reads `outputs.image_hidden_states`, which "
        "Transformers 5.24 made a deprecated property over `image_outputs.pooler_output`: it "
        "raises on a text-only batch (no image outputs). Liger's call of a deprecated API; the "
        "property raising instead of returning None is arguably Transformers' too",
    ),
    Rule(
        "gemma4-output-class",
        "Liger's",
        r"LigerGemma4CausalLMOutputWithPast.__init__\(\) got an unexpected keyword argument",
        "Liger's multimodal forward passes image_hidden_states= to its "
        "LigerGemma4CausalLMOutputWithPast, whose Transformers 5.24 base class no longer has "
        "that field (deprecated to a property): Liger written against another Transformers",
    ),
)
"""Known findings of liger-kernel 0.8.5 on Transformers 5.24 (docs/systems.md)."""


def classify(result: ArchResult) -> list[tuple[str, str]]:
    """(owner, rule name) of each distinct class among `result`'s failures; an unmatched
    failure is ("unclassified", its message's first 80 characters)."""
    found: list[tuple[str, str]] = []
    for failure in result.failures:
        rule = next((r for r in RULES if r.matches(result.architecture, failure.message)), None)
        pair = (rule.owner, rule.name) if rule else ("unclassified", failure.message[:80])
        if pair not in found:
            found.append(pair)
    return found


def parity(result: ArchResult) -> str:
    """The logits verdict alone: "ok 2.5e-07 <= 1e-06", "OVER 3e-2 > 1e-2", or "-" (not judged)."""
    if result.fused_error is None or result.tolerance is None:
        return "-"
    if result.fused_error <= result.tolerance:
        return f"ok {result.fused_error:.2g} <= {result.tolerance:.2g}"
    return f"OVER {result.fused_error:.2g} > {result.tolerance:.2g}"


def _cells(result: ArchResult) -> list[str]:
    """The table row of `result`: status (`not-applied` where that failed it), parity,
    module verdicts by status, lifecycle (the failed operations, else how many passed),
    launches read from the message, classes."""
    counts: dict[str, int] = {}
    for module in result.modules:
        counts[module.status] = counts.get(module.status, 0) + 1
    judged = ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "-"
    ops = {op: v["verdict"] for op, v in result.lifecycle.items() if v["verdict"] != "n/a"}
    failed = [f"{op} {verdict}" for op, verdict in ops.items() if verdict != "pass"]
    life = ", ".join(failed) or (f"{len(ops)} pass" if ops else "-")
    match = re.search(r"(\d+) kernel launch\(es\)", result.message)
    launches = match.group(1) if match else "-"
    classes = "; ".join(f"{owner}: {name}" for owner, name in classify(result)) or ""
    status = "not-applied" if result.message.startswith("not-applied") else result.status
    return [result.architecture, status, parity(result), judged, life, launches, classes]


def table(results: Sequence[ArchResult]) -> str:
    """The Markdown table of `results` (one row each, in order)."""
    head = ["arch", "status", "logits vs float64", "modules", "lifecycle", "launches", "finding"]
    rows = [head, ["---"] * len(head), *(_cells(r) for r in results)]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table of each results file; exit 1 if any failure is unclassified."""
    parser = argparse.ArgumentParser(prog="python -m harness.peers.liger_findings")
    parser.add_argument("results", nargs="+", type=Path, help="results JSONL of --system liger")
    args = parser.parse_args(argv)
    unclassified = False
    for path in args.results:
        results = read_results(path)
        print(f"### {path.name}\n\n{table(results)}\n")
        unclassified |= any(o == "unclassified" for r in results for o, _ in classify(r))
    return 1 if unclassified else 0


if __name__ == "__main__":
    sys.exit(main())
