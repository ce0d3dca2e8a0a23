"""vLLM's Transformers-backend fuser detection against `fusion.plan`, over the corpus.

    python -m harness.peers.vllm [--arch GLOB ...] [--json FILE]

Runs in the peer environment (`scripts/vllm_peer.sh`, `tox -e vllm-peer`: vLLM 0.34.0 on
Transformers 5.22.2 and the CPU torch, `constraints/vllm-peer.txt`; 0.33.0 on 5.20.2 with
`tox -e vllm-peer-033`, `constraints/vllm-peer-0.33.txt`); vLLM is imported only
inside `vllm_decisions`, so this module imports anywhere. Per architecture it builds the
tiny float32 model once and asks both systems what they would fuse, changing nothing:

- vLLM: what `TransformersForCausalLM.recursive_replace` would decide, without building a
  vLLM layer: for each module it offers to its fusers (every module but the root, the base
  model and the linear, conv, layer-norm and embedding modules vLLM swaps for its own
  classes), `Fusers(model, cfg)[module]` with a stub config (tensor parallel size 1, the
  model's dtype and head size, MLA when the text config has `kv_lora_rank`, as vLLM's
  `ModelConfig.use_mla` decides for this backend, no quantization). Two departures, both
  stated in the output: the attention fuser counts when it *matches* (its validation reads
  `attn_implementation == "vllm"`, which only vLLM's runtime sets), and each MoE block
  (a child `experts` that is a ModuleList or holds only 3-D parameters, as vLLM's MoE mixin
  finds them) is `MoEBlockFuser.match(block, "experts")`: "block" when it matches (the
  block's forward is replaced, so no other fuser of the block counts), else "experts"
  (vLLM still swaps the experts for `FusedMoE`, routing left to Transformers).
- ours: `fusion.plan(model)`'s applied modules, and its refusal reasons for the rest.

Then `agreement.compare` classifies every disagreement with `RULES`. Exit status: 0 when
every disagreement is classified, 1 when one is not (a new kind a person must look at),
2 on bad usage or when vLLM cannot be imported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from harness.peers.agreement import (
    OURS_FAMILY,
    ArchComparison,
    Decision,
    Rule,
    category_counts,
    compare,
    grouped,
    report_json,
    table,
    total,
)

VLLM_FAMILY: dict[str, str] = {
    "QKVFuser": "qkv",
    "PackedQKVFuser": "packed_qkv",
    "GLUFuser": "glu",
    "MergedColumnParallelFuser": "merged_column",
    "MLAFuser": "mla",
    "RMSNormFuser": "rms_norm",
    "AttentionFuser": "attention",
    "MoEBlockFuser": "moe",
}
"""vLLM fuser class names -> family (an unknown class keeps its own name as family)."""

STACKED_FAMILIES = frozenset({"qkv", "glu", "merged_column", "mla"})
"""Families whose detail is the set of merged projections, compared between the systems."""

RULES: tuple[Rule, ...] = (
    Rule(
        "definition",
        "vLLM's attention fuser routes the module's attention-interface call to vLLM's "
        "paged-KV attention backend; it merges nothing and has no counterpart in our engine, "
        "which keeps Transformers' attention",
        family="attention",
        kind="peer-only",
    ),
    Rule(
        "definition",
        "vLLM's packed-QKV fuser re-lays one existing q/k/v linear out as a head-sharded "
        "QKVParallelLinear for tensor parallelism; at tensor parallel size 1 it is the same "
        "single GEMM, and our engine has nothing to merge",
        family="packed_qkv",
        kind="peer-only",
    ),
    Rule(
        "definition",
        "vLLM's MLA fuser also swaps the attention for MLAAttention (absorbed kv_b_proj, "
        "latent KV cache); without q_a_proj there is no down-projection pair to merge, which is "
        "all our mla fuser does",
        family="mla",
        kind="peer-only",
        peer="attention only",
    ),
    Rule(
        "definition",
        "the residual add + RMSNorm rewrite is a decoder-layer source rewrite of ours; vLLM "
        "does it as a compile pass (fusion of add + rms_norm in its torch.compile pipeline), "
        "not as a fuser",
        family="residual_norm",
        kind="ours-only",
    ),
    Rule(
        "definition",
        "decode_linear gives a large plain linear our row-major decode kernel behind its "
        "forward; vLLM swaps every linear for its own linear classes, outside the fusers",
        family="decode_linear",
        kind="ours-only",
    ),
    Rule(
        "definition",
        "both merge the same projections into one GEMM: vLLM with its QKV fuser, we with our "
        "sibling fuser (our qkv fuser declined the module); on one device the same computation",
        family="qkv",
        kind="other-family",
    ),
    Rule(
        "definition",
        "HY-V4's attention: vLLM's MLA fuser merges q_a_proj + kv_a_proj_with_mqa (and swaps in "
        "MLAAttention); our qkv fuser merges every projection of that input, gate_proj included",
        module_class="^HYV4Attention$",
        kind="peer-only|ours-only",
    ),
    Rule(
        "reach-gap-peer",
        "vLLM's GLU fuser does not match this MLP (w1/w3 with a functional silu, no act module "
        "called once as self.act_fn), so vLLM merges w1 + w3 without the act-and-mul kernel; "
        "we fuse it as a GLU",
        family="merged_column",
        kind="other-family",
    ),
    Rule(
        "reach-gap-peer",
        "vLLM's update_forward raises 'projection input is rebound or mutated before all "
        "calls': its check works on names (any write of a name the input's expression may "
        "alias, over-approximated); our alias analysis proves the input unchanged between the "
        "calls",
        module_class="^(FalconH1Attention|FalconH1MLP|MiMoV2FlashAttention|OPTAttention"
        "|Qwen3_5Attention|Qwen3_5MoeAttention|Qwen3NextAttention|Zamba2Attention"
        "|MossTranscribeDiarizeAudioAttention|BeamAttention|BailingHybridAttention"
        "|LagunaAttention|xLSTMFeedForward)$",
        kind="ours-only",
    ),
    Rule(
        "reach-gap-peer",
        "vLLM's merged-column fuser matches only sibling linears called on the forward's "
        "input directly (a placeholder); these projections read a derived tensor (gated "
        "delta-net, xLSTM, ProphetNet, XLM, BLT cross-attention, hyper-connection inputs), "
        "which our sibling fuser "
        "follows",
        family="merged_column",
        kind="ours-only",
        module_class="^(BailingHybridDeltaAttention|KimiLinearDeltaAttention"
        "|OlmoHybridGatedDeltaNet|ProphetNetAttention|ProphetNetNgramSelfAttention"
        "|Qwen3NextGatedDeltaNet|Qwen3_5GatedDeltaNet|Qwen3_5MoeGatedDeltaNet"
        "|Qwen4ExpTextGatedDeltaNet|Qwen4ExpTextGatedResidual|xLSTMLayer|MultiHeadAttention"
        "|BltCrossAttention)$",
    ),
    Rule(
        "reach-gap-peer",
        "vLLM validates a merge only when every projection has a bias or none does; Whisper's "
        "cross-attention k_proj has no bias and v_proj has one, which our merge carries as is",
        family="merged_column",
        kind="ours-only",
        module_class="^WhisperAttention$",
    ),
    Rule(
        "reach-gap-peer",
        "without q_a_proj vLLM's MLA fuser merges nothing (attention swap only); we merge "
        "q_proj + kv_a_proj_with_mqa, which read the same input",
        family="mla",
        kind="differ",
        peer="attention only",
    ),
    Rule(
        "reach-gap-peer",
        "xLSTM's feed-forward: vLLM's GLU fuser raises 'act_fn is not called exactly once as "
        "self.act_fn(arg)'; we fuse the GLU",
        family="glu",
        kind="ours-only",
        module_class="^xLSTMFeedForward$",
    ),
    Rule(
        "unsafe",
        "tied parameters: Zamba's shared transformer block is one set of Parameters used by "
        "several layers; a merge stacks them into one module's weight, so the other user "
        "either loses them or keeps a copy, and a copy unties them (an optimizer step, "
        "load_state_dict or in-place edit then reaches one user only). vLLM's merged linear is "
        "a fresh parameter filled from the checkpoint per layer: harmless for inference-only "
        "weights, doubled memory; tests/harness/peers/test_vllm_peer.py builds the hazard",
        kind="peer-only",
        ours="tied to another module",
    ),
    Rule(
        "unsafe",
        "experts with their own gating (`_apply_gate`: a clamped SwiGLU, a sigmoid-gated or "
        "cast variant): our engine refuses the block's FusedMoE (its kernel runs plain "
        "silu(gate) * up) and fuses the experts alone, replaying their gating op for op. "
        "vLLM's Transformers backend swaps these experts for FusedMoE with activation 'silu' "
        "whether or not it fuses the block; a clamped gate then differs once activations pass "
        "the limit (tests/harness/peers/test_vllm_peer.py shows it on a tiny module)",
        family="moe",
        kind="differ",
        ours="own gating",
    ),
    Rule(
        "reach-gap-ours",
        "the router is not read op by op by our block matcher (it has children, has no top-k, "
        "or adds a score term that is not a buffer); vLLM either keeps Transformers' routing "
        "(scoring_func None: experts and shared experts move, the HF gate routes) or matches "
        "a plain linear router with an optional correction bias. We fuse the experts alone",
        family="moe",
        kind="differ",
        ours="router has children|no top-k in the router|scores plus something not a buffer",
    ),
    Rule(
        "reach-gap-ours",
        "the block's experts store their weights transposed (is_transposed=True: Aria's text "
        "MoE), which our block path does not take, so our moe fuser fuses the experts alone "
        "(FusedExperts) and Transformers' router keeps routing; vLLM's MoEBlockFuser takes "
        "the whole block",
        family="moe",
        kind="differ",
        ours=r"is_transposed=True \(need False\)",
    ),
    Rule(
        "reach-gap-ours",
        "these experts are not Transformers experts-interface modules, which our experts-only "
        "path requires; vLLM swaps any `experts` child holding only 3-D parameters for "
        "FusedMoE (activation 'silu', routing left to Transformers) without checking the "
        "experts' own computation, which this comparison does not verify",
        family="moe",
        kind="peer-only",
        ours="not a Transformers experts-interface",
    ),
    Rule(
        "reach-gap-ours",
        "Nemotron-H's MoE mixer: our moe fuser records no decision on it (not reached); vLLM "
        "matches its sigmoid router and shared experts (its experts are non-gated ReLU^2, "
        "which vLLM's default 'silu' activation would not compute: not verified here)",
        family="moe",
        kind="peer-only",
        module_class="^NemotronHMoE$",
    ),
    Rule(
        "reach-gap-ours",
        "an RMSNorm without a weight: our rmsnorm fuser has no weightless FusedRMSNorm "
        "variant; vLLM's RMSNorm (has_weight=False) covers it",
        family="rms_norm",
        kind="peer-only",
        ours="computes no FusedRMSNorm variant",
    ),
    Rule(
        "reach-gap-ours",
        "our sibling fuser takes the projection whose output makes the returned value for the "
        "output projection (never merged); in BERT-style self-attention (no o_proj inside) "
        "that is `value`, so we merge fewer projections than vLLM",
        kind="peer-only|ours-only|differ",
        module_class="^(MegatronBertSelfAttention|GitSelfAttention)$",
    ),
    Rule(
        "reach-gap-ours",
        "our alias analysis refuses: 'projection input may change between the projection "
        "calls (written: query_states)', but query_states is a view of q_gate_proj's output, "
        "which cannot alias hidden_states (over-approximation); vLLM's check passes",
        family="mla",
        kind="peer-only",
        module_class="^AXK2Attention$",
    ),
    Rule(
        "reach-gap-ours",
        "vLLM merges q, k, r and v; we merge q + k only, with no refusal recorded for r and v "
        "(not investigated further in this run)",
        family="merged_column",
        kind="differ",
        module_class="^InklingAttention$",
    ),
    Rule(
        "reach-gap-ours",
        "vLLM's QKV fuser merges q/k/v; our qkv and sibling fusers record no refusal for this "
        "module (not investigated further in this run)",
        family="qkv",
        kind="peer-only",
        module_class="^(DogeAttention|GPTJAttention|GPTNeoSelfAttention)$",
    ),
    Rule(
        "reach-gap-peer",
        "vLLM's MoE mixin takes an `experts` child only when it is a ModuleList or every "
        "parameter is 3-D; these packed experts carry 2-D per-expert biases, so vLLM keeps "
        "Transformers' experts and routing, while we fuse the experts alone (biases included)",
        family="moe",
        kind="ours-only",
        ours=r"^experts \|.*biased",
    ),
)
"""How each known disagreement is classified (first match wins); see agreement.Rule."""

SKIPPED_CLASSES = ("Linear", "Conv2d", "Conv3d", "LayerNorm", "Embedding")
"""torch.nn classes vLLM replaces with its own before offering a module to its fusers."""


def _members(names: Sequence[str]) -> str:
    """A merge's detail: its projection names, sorted, joined with "+"."""
    return "+".join(sorted(names))


def _our_detail(family: str, description: str) -> str:
    """The comparable detail of one of our applied modules, parsed from its description.

    Stacked families: the "a + b + c" before the first " -> " (our descriptions' fixed form);
    moe: "experts" for a FusedExperts (block refused, experts fused alone), else "block".
    Returns "" (not compared) when the description has another form.
    """
    if family == "moe":
        return "experts" if "FusedExperts" in description else "block"
    if family in STACKED_FAMILIES and " -> " in description:
        head = description.split(" -> ", 1)[0]
        names = [part.strip() for part in head.split(" + ")]
        if len(names) >= 2 and all(name.isidentifier() for name in names):
            return _members(names)
    return ""


def our_decisions(model: Any) -> tuple[list[Decision], dict[str, list[str]]]:
    """`fusion.plan(model)` as decisions, and its refusal reasons by qualname.

    Safe: `plan` is a dry run; it installs nothing on `model`.
    """
    import fusion

    report = fusion.plan(model)
    decisions = [
        Decision(
            family=OURS_FAMILY.get(a.fuser, a.fuser),
            qualname=a.qualname,
            module_class=a.source_class,
            detail=_our_detail(OURS_FAMILY.get(a.fuser, a.fuser), a.description),
            note=a.description,
        )
        for a in report.applied
    ]
    refusals: dict[str, list[str]] = {}
    for s in report.skipped:
        refusals.setdefault(s.qualname, []).append(f"{s.fuser or 'all'}: {s.reason}")
    return decisions, refusals


def _stub_config(model: Any) -> SimpleNamespace:
    """The part of a VllmConfig the fusers' `validate` methods read, for a built HF model.

    Tensor parallel size 1; `use_mla` as vLLM's ModelConfig decides it for the Transformers
    backend (the text config has a `kv_lora_rank`); the head size from `head_dim` or
    hidden size / heads (fusers prefer the module's own `head_dim`); no quantization.
    """
    import torch

    config = model.config.get_text_config()

    def get_head_size() -> int:
        """Read only when a fuser asks (a module without `head_dim`): some configs lack it."""
        heads = getattr(config, "num_attention_heads", None) or 1
        return getattr(config, "head_dim", None) or config.hidden_size // heads

    dtype = next(model.parameters(), torch.empty(0)).dtype
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        model_config=SimpleNamespace(
            use_mla=getattr(config, "kv_lora_rank", None) is not None,
            get_head_size=get_head_size,
            dtype=dtype,
        ),
        quant_config=None,
    )


def _is_moe_experts(module: Any) -> bool:
    """vLLM's MoE mixin test for an `experts` child: a ModuleList, or only 3-D parameters."""
    from torch import nn

    params = list(module.parameters())
    return isinstance(module, nn.ModuleList) or (bool(params) and all(p.ndim == 3 for p in params))


def _vllm_detail(family: str, fuser: Any) -> str:
    """The comparable detail of one vLLM fuser: merged projections, or MLA without a merge."""
    if family in STACKED_FAMILIES:
        shards = [name for name, _ in getattr(fuser, "shards", [])]
        if len(shards) >= 2:
            return _members(shards)
        if family == "mla":
            return "attention only (no q_a_proj to merge)"
    return ""


def vllm_decisions(model: Any) -> list[Decision]:
    """What vLLM's Transformers backend would fuse in `model` (see the module docstring).

    Safe: detection only. `get_fusers` traces and compiles rewritten forwards for its
    cache but binds none; `MoEBlockFuser.match` only reads; no vLLM layer is built and the
    model is not changed.
    """
    from torch import nn
    from vllm.model_executor.models.transformers import fuser as vllm_fuser
    from vllm.model_executor.models.transformers.fusers import AttentionFuser, MoEBlockFuser

    fusers = vllm_fuser.Fusers(model, _stub_config(model))
    base = getattr(model, "base_model", model)
    skipped = tuple(getattr(nn, name) for name in SKIPPED_CLASSES)
    decisions: list[Decision] = []
    for qualname, module in model.named_modules():
        if module is model or module is base or isinstance(module, skipped):
            continue
        cls = type(module).__name__
        experts = dict(module.named_children()).get("experts")
        if experts is not None and _is_moe_experts(experts):
            block = MoEBlockFuser.match(module, "experts")
            detail = "block" if block is not None else "experts"
            decisions.append(Decision("moe", qualname, cls, detail, repr(block)))
            if block is not None:
                continue  # the block's forward is replaced: no other fuser of it applies
        chosen = list(fusers[module])
        chosen += [
            f
            for f in vllm_fuser.get_fusers(module)
            if isinstance(f, AttentionFuser) and f not in chosen
        ]
        for fuser in chosen:
            name = type(fuser).__name__
            family = VLLM_FAMILY.get(name, name)
            decisions.append(Decision(family, qualname, cls, _vllm_detail(family, fuser), name))
    return decisions


def compare_arch(name: str) -> ArchComparison:
    """Build `name` tiny (seed 0, float32, CPU) and compare both systems on it.

    A build failure or a crash in either detection is recorded as the comparison's
    `error` (with the exception's last frame), never raised.
    """
    import torch

    from harness.base import architectures

    try:
        model = architectures.build(name, seed=0, dtype=torch.float32, device="cpu")
    except Exception as exc:
        return ArchComparison(name, error=f"build: {type(exc).__name__}: {exc}"[:500])
    try:
        peer = vllm_decisions(model)
    except Exception as exc:
        return ArchComparison(name, error=f"vllm: {_where(exc)}"[:500])
    try:
        ours, refusals = our_decisions(model)
    except Exception as exc:
        return ArchComparison(name, error=f"ours: {_where(exc)}"[:500])
    return compare(name, ours, peer, refusals, RULES)


def _where(exc: BaseException) -> str:
    """An exception as one line: type, message and the innermost frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    at = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{at}"


def versions() -> dict[str, str]:
    """The versions the comparison ran on (vLLM's, torch's, Transformers')."""
    import torch
    import transformers
    import vllm

    return {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def render(comparisons: Sequence[ArchComparison]) -> str:
    """The printed report: table, categories, classified groups, then errors."""
    lines = [table(total(comparisons), "vLLM"), ""]
    counts = category_counts(comparisons)
    lines.append("disagreements by category: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    for group in grouped(comparisons):
        lines.append(
            f"\n[{group['category']}] {group['family']} {group['kind']}: {group['module_class']}"
            f" ({len(group['qualnames'])} modules in {', '.join(group['archs'])})"
        )
        lines.append(f"  e.g. {group['qualnames'][0]}")
        lines.append(f"  ours: {group['ours'] or '-'}")
        lines.append(f"  vLLM: {group['peer'] or '-'}")
        if group["explanation"]:
            lines.append(f"  why: {group['explanation']}")
    errors = [c for c in comparisons if c.error]
    if errors:
        lines.append(f"\n{len(errors)} architecture(s) not compared:")
        lines.extend(f"  {c.arch}: {c.error}" for c in errors)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The command: compare, print the report, write the JSON; the exit status (see above)."""
    parser = argparse.ArgumentParser(
        prog="python -m harness.peers.vllm",
        description="vLLM's fuser detection vs fusion.plan, module by module, over the corpus.",
    )
    parser.add_argument("--arch", action="append", default=[], help="name or glob (repeatable)")
    parser.add_argument("--json", type=Path, help="write the whole comparison here")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        meta = versions()
    except ImportError as exc:
        print(f"vllm-peer: error: vLLM is not importable here ({exc})", file=sys.stderr)
        return 2
    from harness.base import architectures

    try:
        names = architectures.select(args.arch, architectures.available())
    except architectures.UnknownArchitecture as exc:
        print(f"vllm-peer: error: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    comparisons = []
    for i, name in enumerate(names, 1):
        comparisons.append(compare_arch(name))
        status = comparisons[-1].error or f"{len(comparisons[-1].disagreements)} disagreement(s)"
        print(f"[{i}/{len(names)}] {name}: {status}", file=sys.stderr, flush=True)
    print(render(comparisons))
    if args.json:
        meta |= {
            "architectures_requested": len(names),
            "seconds": round(time.monotonic() - started, 1),
            "departures": [
                "attention fuser counted when it matches (validation needs vLLM's runtime)",
                "MoE block: MoEBlockFuser.match(block, 'experts'), else experts only",
            ],
        }
        args.json.write_text(json.dumps(report_json(comparisons, meta), indent=1) + "\n")
    unclassified = category_counts(comparisons)["unclassified"]
    return 1 if unclassified else 0


if __name__ == "__main__":
    sys.exit(main())
