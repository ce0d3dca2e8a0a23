"""MLA fuser on DeepSeek-V3 attention, with and without q-LoRA."""

from __future__ import annotations

import pytest
import torch

from tests.fusion.fusers import hazards
from tests.fusion.fusers.helpers import fuse_copy, outputs_match
from tests.fusion.tiny_models import relative_error, tiny_model, token_ids


@pytest.mark.parametrize(
    ("q_lora_rank", "shards"),
    [(32, ("q_a_proj", "kv_a_proj_with_mqa")), (None, ("q_proj", "kv_a_proj_with_mqa"))],
)
def test_deepseek_v3_mla(q_lora_rank: int | None, shards: tuple[str, str]) -> None:
    model = tiny_model("deepseek_v3", q_lora_rank=q_lora_rank)
    fused, report = fuse_copy(model)
    norms = 9 if q_lora_rank else 7  # 4 per layer with q-LoRA (q_a_layernorm), 3 without; final
    assert report.counts() == {
        "mla": 2,
        "glu": 2,
        "rmsnorm": norms,
        "moe": 1,
        "residual_norm": 2,
    }, str(report)
    attn = fused.model.layers[0].self_attn
    assert attn.fused_qkv_a_proj.shard_names == shards
    record = next(r for r in report.applied if r.fuser == "mla")
    assert record.description == f"{shards[0]} + {shards[1]} -> fused_qkv_a_proj"
    ids = token_ids()
    with torch.no_grad():
        reference, out = model(ids).logits, fused(ids).logits
    assert not torch.isnan(out).any()
    assert relative_error(reference, out) <= 1e-5


def test_mla_found_by_dataflow_not_by_name() -> None:
    module = hazards.LatentAttention()
    fused, report = fuse_copy(module)
    assert report.counts() == {"mla": 1}, str(report)
    assert fused.fused_qkv_a_proj.shard_names == ("alpha", "beta")
    assert outputs_match(module, fused, 2, 5, 32)
