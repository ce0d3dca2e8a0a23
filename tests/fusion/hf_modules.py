"""Real Transformers 5 submodules built from tiny configs (no hub access), for the core tests."""

from __future__ import annotations

import logging

from torch import nn
from transformers import (
    DeepseekV3Config,
    Gemma3TextConfig,
    GPTBigCodeConfig,
    LlamaConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

# Tiny dimensions shared by every real Transformers module built in these tests: hidden 64,
# 4 query heads of 16, 2 KV heads. Configs are built directly, never downloaded.
HIDDEN = 64
COMMON = dict(
    hidden_size=HIDDEN,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    head_dim=16,
)


def _deepseek_config(q_lora_rank: int | None) -> DeepseekV3Config:
    return DeepseekV3Config(
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    )


def build_module(name: str) -> nn.Module:
    """One real Transformers 5 submodule, by a short name, built from a tiny config."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention
    from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention, Gemma3RMSNorm
    from transformers.models.gpt_bigcode.modeling_gpt_bigcode import GPTBigCodeAttention
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    builders = {
        "LlamaAttention": lambda: LlamaAttention(LlamaConfig(**COMMON), layer_idx=0),
        "LlamaMLP": lambda: LlamaMLP(LlamaConfig(**COMMON)),
        "LlamaRMSNorm": lambda: LlamaRMSNorm(HIDDEN),
        "Qwen3Attention": lambda: Qwen3Attention(Qwen3Config(**COMMON), layer_idx=0),
        "Gemma3Attention": lambda: Gemma3Attention(Gemma3TextConfig(**COMMON), layer_idx=0),
        "Gemma3RMSNorm": lambda: Gemma3RMSNorm(HIDDEN),
        "Qwen3MoeSparseMoeBlock": lambda: Qwen3MoeSparseMoeBlock(
            Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        ),
        "DeepseekV3Attention[q_lora]": lambda: DeepseekV3Attention(
            _deepseek_config(32), layer_idx=0
        ),
        "DeepseekV3Attention[no_q_lora]": lambda: DeepseekV3Attention(
            _deepseek_config(None), layer_idx=0
        ),
        "GPTBigCodeAttention": lambda: GPTBigCodeAttention(
            GPTBigCodeConfig(n_embd=HIDDEN, n_head=4, n_layer=1), layer_idx=0
        ),
    }
    # Standalone attention modules log a warning about `_attn_implementation` being None on
    # every interface lookup; it is expected here and would drown real output.
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return builders[name]()


MODULE_NAMES = (
    "LlamaAttention",
    "LlamaMLP",
    "LlamaRMSNorm",
    "Qwen3Attention",
    "Gemma3Attention",
    "Gemma3RMSNorm",
    "Qwen3MoeSparseMoeBlock",
    "DeepseekV3Attention[q_lora]",
    "DeepseekV3Attention[no_q_lora]",
    "GPTBigCodeAttention",
)
