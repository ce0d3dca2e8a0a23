"""`fusion.report`: records read as what happened to each module."""

from __future__ import annotations

from fusion.report import Applied, FusionReport, Skipped


def test_a_fuser_refusal_names_the_fuser() -> None:
    record = Skipped("model.layers.0.self_attn", "qkv", "LlamaAttention", "input written")
    assert str(record) == "model.layers.0.self_attn (LlamaAttention): qkv refused: input written"


def test_a_skip_without_a_fuser_is_not_called_a_refusal() -> None:
    record = Skipped("model.layers.0", None, "LlamaDecoderLayer", "already fused (FusedMoE)")
    text = str(record)
    assert "refused" not in text
    assert text == "model.layers.0 (LlamaDecoderLayer): skipped: already fused (FusedMoE)"


def test_counts_are_per_fuser() -> None:
    report = FusionReport(
        applied=[
            Applied("a.0", "qkv", "Attn", "q + k + v -> qkv"),
            Applied("a.1", "qkv", "Attn", "q + k + v -> qkv"),
            Applied("m.0", "glu", "MLP", "gate + up -> gate_up"),
        ]
    )
    assert report.counts() == {"qkv": 2, "glu": 1}
