"""Tiny Transformers models built from explicit configs (no hub access), shared by tests.

Weights are drawn with a realistic scale, norm weights included (not all ones), so a fused
module that computes a different function shows in the outputs.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from fusion import numerics

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=64,
)

CONFIGS: dict[str, dict] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},  # q/k/v carry biases, o does not
    "qwen3": {},
    "gemma2": {"hidden_activation": "gelu_pytorch_tanh"},
    "gemma3_text": {"hidden_activation": "gelu_pytorch_tanh"},
    "olmo2": {},
    "granite": {},
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 1,
    },
    "deepseek_v3": {
        "num_key_value_heads": 4,
        "head_dim": 8,  # the rotary part: DeepSeek sizes rope by qk_rope_head_dim
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
}


def randomize_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Redraw every parameter: matrices ~ N(0, 0.05), vectors (norms, biases) ~ 1 + N(0, 0.1)
    for names containing "norm" and N(0, 0.1) otherwise."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if param.ndim >= 2:
                value = noise * 0.05
            elif "norm" in name:
                value = 1.0 + 0.1 * noise
            else:
                value = 0.1 * noise
            param.copy_(value.to(param.dtype))
    return model


def tiny_model(model_type: str, seed: int = 0, **overrides) -> nn.Module:
    """A tiny, randomly initialised causal LM of `model_type`, in eval mode, float32."""
    kwargs = {**COMMON, **CONFIGS[model_type], **overrides}
    config = AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    return randomize_(model, seed).eval()


def token_ids(seed: int = 0, batch: int = 2, seq: int = 7, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def relative_error(reference: torch.Tensor, other: torch.Tensor) -> float:
    """`fusion.numerics.relative_error` of `other` against `reference` (reference first, as the
    tests read it): max-normalised, NaN when `other` is not finite, so `<= limit` never passes
    a NaN."""
    return numerics.relative_error(other, reference)
