"""Name-family rules of the tiny-config shrinker: which attribute shrinks to what.

Data more than code: each rule is a regular expression over a config attribute name and a
function of the attribute's default value. Rules are matched in order (``re.fullmatch``) and the
first match wins, so specific families (``qk_rope_head_dim``) come before general ones
(``.*_head_dim``). A rule only ever shrinks ints (``min(default, tiny)``); "fill" rules also set a
``None`` default. Attributes about numerics (eps, scales, softcaps, theta, init ranges) and token
ids are matched first and kept, so no rule can touch them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["KEEP", "KV_PATTERN", "RULES", "SIZES", "Rule", "Sizes", "is_int", "rule_for"]

Rule = Callable[[Any, "Sizes"], Any]


@dataclass(frozen=True)
class Sizes:
    """Target sizes of a tiny model (small enough that build + forward takes milliseconds)."""

    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    expert_intermediate: int = 32
    vocab: int = 256
    layers: int = 2
    positions: int = 128
    experts: int = 4
    top_k: int = 2
    shared_experts: int = 1
    expert_groups: int = 2
    lora_rank: int = 32
    rope_head_dim: int = 8
    nope_head_dim: int = 16
    ssm_state: int = 16
    low_rank: int = 8
    window: int = 4
    # Chunk / index sizes stay >= any input length the harness uses so chunked and sparse
    # attention paths keep their single-chunk semantics (several models assume it).
    chunk: int = 32
    # Special tokens beyond the tiny vocabulary are remapped into its top `reserved_ids` slots.
    reserved_ids: int = 32


SIZES = Sizes()

KEEP = object()  # sentinel: leave the attribute at its default


def is_int(v: Any) -> bool:
    """True for a real int (``bool`` is an int subclass but never a size)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _cap(n: int) -> Rule:
    """Shrink an int default to at most ``n``; leave ``None`` and non-ints alone."""

    def rule(d: Any, s: Sizes) -> Any:
        return min(d, n) if is_int(d) and d > 0 else KEEP

    return rule


def _fill(n: int) -> Rule:
    """Like :func:`_cap`, and also fill a ``None`` class default (a size the config leaves for
    the model to derive, or a feature such as GQA or MoE that is off by default)."""

    def rule(d: Any, s: Sizes) -> Any:
        if d is None:
            return n
        return min(d, n) if is_int(d) and d > 0 else KEEP

    rule.fills = True  # type: ignore[attr-defined]
    return rule


# Rules are matched in order against the full attribute name (re.fullmatch); first match wins.
# Names are families seen across Transformers configs; a rule only shrinks ints, so attributes
# that share a name but hold something else (strings, floats, bools) are never touched.
KV_PATTERN = (
    r"num_key_value_heads|num_kv_heads|n_kv_heads|multi_query_group_num|.*_num_key_value_heads|"
    r"(index|indexer)_kv_heads"
)
_S = SIZES
RULES: list[tuple[str, Rule]] = [
    # Numerics and ids are never rules' business (eps, scales, softcaps, theta, init ranges, ...).
    (
        r".*(eps|epsilon|scale|scaling|softcap|softcapping|theta|range|std|factor|multiplier|dropout|"
        r"pdrop|coef|alpha|beta|clip|threshold|floor|min|max_value).*",
        lambda d, s: KEEP,
    ),
    (r".*token_(id|ids|index|idx)|.*_token", lambda d, s: KEEP),
    # MLA (multi-head latent attention) ranks and split head dims.
    (r"qk_rope_head_dim", _cap(_S.rope_head_dim)),
    (r"qk_nope_head_dim", _cap(_S.nope_head_dim)),
    (r"qk_head_dim", _cap(_S.rope_head_dim + _S.nope_head_dim)),
    (r"(q|kv|o)_lora_rank", _cap(_S.lora_rank)),
    (r"rotary_dim|rotary_emb_dim", _cap(_S.head_dim // 2)),
    # Linear-attention value heads are a multiple of key heads: handled as a ratio below.
    (r"linear_num_(key|value)_heads", lambda d, s: KEEP),
    # SSM sizes.
    (r"state_size|ssm_state_size|mamba_d_state|d_state", _cap(_S.ssm_state)),
    (r"mamba_d_ssm", _cap(_S.intermediate)),
    # Head dims before heads (both contain "head").
    (r"head_dim", _fill(_S.head_dim)),
    (
        r"dim_head|kv_channels|attention_head_size|.*_head_dim|.*_head_size|mamba_d_head",
        _cap(_S.head_dim),
    ),
    # Key/value heads: MQA stays MQA, MHA stays MHA (see _kv_heads), GQA becomes 2.
    (KV_PATTERN, lambda d, s: KEEP),
    (
        r"num_attention_heads|n_head|n_heads|num_heads|.*_attention_heads|.*_num_attention_heads|"
        r"(index|indexer)_n_heads|linear_num_heads|heads_per_.*|num_.*_heads|n_.*_heads|.*_n_heads|"
        r".*_num_heads",
        _cap(_S.heads),
    ),
    # Experts and routing.
    (
        r"num_experts|n_routed_experts|num_local_experts|moe_num_experts|num_routed_experts|n_experts",
        _fill(_S.experts),
    ),
    (
        r"num_experts_per_tok|moe_topk|moe_k|top_k_experts|moe_top_k|num_experts_per_token|top_k",
        _fill(_S.top_k),
    ),
    (r"n_shared_experts|num_shared_experts|moe_num_shared_experts", _fill(_S.shared_experts)),
    (r"n_group", _cap(_S.expert_groups)),
    (r"topk_group", _cap(1)),
    (r"zero_expert_num", _cap(2)),
    (r"num_centroids", _cap(16)),
    (r"centroid_intermediate_top_k", _cap(4)),
    # Intermediate sizes: expert/shared ones are smaller still.
    (r".*(moe|expert|shared).*(intermediate|ffn|hidden_size).*", _cap(_S.expert_intermediate)),
    (
        r".*intermediate_size.*|.*ffn_dim|n_inner|dff|dim_ff|ffn_hidden_size|intermediate_dim|"
        r"mlp_dim",
        _cap(_S.intermediate),
    ),
    # Widths.
    (r".*hidden_size_per_layer_input|ple_embed_dim", _cap(16)),
    (
        r"hidden_size|d_model|n_embd|embed_dim|dim|model_dim|word_embed_proj_dim|embedding_size|"
        r"backbone_hidden_size|hidden_dim|projection_dim|proj_dim|.*_hidden_size|hidden_size_.*|"
        r"lru_width|d_inner|emb_dim|.*_emb_dim|.*embedding_size|.*_out_channels?|.*conv_channels|"
        r"output_channels",
        _cap(_S.hidden),
    ),
    # Depth (the exact layer count is decided by the per-layer resizing below).
    (
        r"num_hidden_layers|n_layer|n_layers|num_layers|decoder_layers|encoder_layers|"
        r"num_decoder_layers|num_encoder_layers|depth|num_blocks",
        _cap(_S.layers),
    ),
    (
        r"num_mtp_layers|num_nextn_predict_layers|n_input_layers|n_output_layers|n_recurrent_layers",
        _cap(1),
    ),
    (r"num_kv_shared_layers", _cap(1)),
    (r"first_k_dense_replace|num_dense_layers|moe_layer_start_index|max_window_layers", _cap(1)),
    (
        r".*_period|global_attn_every_n_layers|no_rope_layer_interval|sliding_window_pattern|"
        r"layer_group_size|interleave_moe_layer_step|decoder_sparse_step|n_layers_per_.*",
        _cap(2),
    ),
    (r".*_offset", _cap(1)),
    # Vocabularies: the main one, then proportional for auxiliary ones.
    (r"vocab_size", _cap(_S.vocab)),
    (r"type_vocab_size|task_type_vocab_size", lambda d, s: KEEP),
    (r".*vocab.*", _cap(4 * _S.vocab)),
    # Positions.
    (
        r"max_position_embeddings|n_positions|n_ctx|max_seq_len|max_target_positions|"
        r"max_source_positions|max_sequence_length",
        _cap(_S.positions),
    ),
    # Windows shrink below the input length so local attention really is local.
    (
        r"sliding_window|sliding_window_size|window_size|local_attention|local_attention_window_len|"
        r"attention_window",
        _cap(_S.window),
    ),
    # Chunk and index sizes stay >= the input length.
    (
        r"chunk_size|mamba_chunk_size|attention_chunk_size|index_topk|index_block_size|"
        r"split_ngram_parts|indexer_budget",
        _cap(_S.chunk),
    ),
    # Low ranks (LAUREL, loop gates, hyper-connections, gated norms).
    (r".*_rank|.*_lowrank", _cap(_S.low_rank)),
]
_COMPILED = [(re.compile(p), f) for p, f in RULES]


def rule_for(name: str) -> Rule | None:
    """The first rule whose pattern matches ``name`` entirely, or None."""
    for pat, rule in _COMPILED:
        if pat.fullmatch(name):
            return rule
    return None
