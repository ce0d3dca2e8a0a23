"""Unfused checkpoints load into fused models, and export back bit-identically."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fusion
from fusion.runtime.checkpoint import unfused_named, unfused_state_dict
from tests.fusion.fusers import hazards
from tests.fusion.tiny_models import tiny_model, token_ids


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "deepseek_v3"])
def test_round_trip_bit_identical(model_type: str) -> None:
    unfused = tiny_model(model_type, seed=1)
    fused = tiny_model(model_type, seed=2)  # different weights, same architecture
    fusion.fuse(fused)
    fused.load_state_dict(unfused.state_dict())  # strict: every unfused key maps
    exported = unfused_state_dict(fused)
    original = unfused.state_dict()
    assert set(exported) == set(original)
    assert all(torch.equal(exported[key], original[key]) for key in original)
    ids = token_ids()
    with torch.no_grad():
        assert torch.allclose(unfused(ids).logits, fused(ids).logits, rtol=1e-5, atol=1e-6)


def test_mixed_bias_round_trip_drops_synthetic_zeros() -> None:
    module = hazards.Attention()
    module.k_proj = nn.Linear(32, 16, bias=True)
    fused = copy.deepcopy(module)
    fusion.fuse(fused)
    exported = unfused_state_dict(fused)
    assert set(exported) == set(module.state_dict())
    assert "q_proj.bias" not in exported and torch.equal(
        exported["k_proj.bias"], module.k_proj.bias
    )


def test_mapping_is_scoped_by_qualname() -> None:
    # Two attention blocks; only the first is fused. The second's q_proj keys must stay.
    model = nn.ModuleDict({"fused": hazards.Attention(), "plain": hazards.Attention()})
    model["plain"].k_proj.register_forward_hook(lambda *args: None)  # keeps it unfused
    source = copy.deepcopy(model)
    report = fusion.fuse(model)
    assert [r.qualname for r in report.applied] == ["fused"]
    model.load_state_dict(source.state_dict())
    assert torch.equal(model["plain"].q_proj.weight, source["plain"].q_proj.weight)
    assert torch.equal(model["fused"].qkv_proj.stacked_weight[:32], source["fused"].q_proj.weight)


def test_partial_unfused_checkpoint_loads_like_stock() -> None:
    """Regression (defect: `load_state_dict(partial, strict=False)` raised KeyError): a
    partial unfused dict loads what it has; missing shards keep their values and are
    reported under their unfused names; `strict=True` raises PyTorch's own error."""
    fused = hazards.Attention()
    fusion.fuse(fused)
    before = fused.state_dict()
    state = hazards.Attention().state_dict()
    del state["v_proj.weight"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "v_proj\.weight"'):
        fused.load_state_dict(dict(state))
    result = fused.load_state_dict(dict(state), strict=False)
    assert result.missing_keys == ["v_proj.weight"] and result.unexpected_keys == []
    after = fused.state_dict()
    assert torch.equal(after["v_proj.weight"], before["v_proj.weight"])
    assert torch.equal(after["q_proj.weight"], state["q_proj.weight"])
    assert torch.equal(after["k_proj.weight"], state["k_proj.weight"])


def test_dict_without_the_module_reports_unfused_names() -> None:
    """A partial dict that lacks a fused module entirely reports its unfused keys missing,
    as the unfused model would, never the merged name the user never saw."""
    unfused = tiny_model("llama", seed=1)
    fused = copy.deepcopy(unfused)
    fusion.fuse(fused)
    state = {k: v for k, v in unfused.state_dict().items() if "layers.0." not in k}
    want = unfused.load_state_dict(dict(state), strict=False)
    got = fused.load_state_dict(dict(state), strict=False)
    assert sorted(got.missing_keys) == sorted(want.missing_keys)
    assert got.unexpected_keys == want.unexpected_keys == []


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "deepseek_v3"])
def test_state_dict_is_the_unfused_layout(model_type: str) -> None:
    """Regression (`save_pretrained` wrote fused keys): a fused model's own `state_dict()`
    has exactly the unfused keys, shapes and bits, and its tensors are views into the
    model (writing through them writes the model, as with a stock state dict)."""
    unfused = tiny_model(model_type, seed=1)
    fused = copy.deepcopy(unfused)
    report = fusion.fuse(fused)
    assert any(r.fuser in {"qkv", "glu", "mla"} for r in report.applied), str(report)
    got, want = fused.state_dict(), unfused.state_dict()
    assert list(got) != [] and set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    key = next(
        k for k in want if k.endswith("k_proj.weight") or k.endswith("kv_a_proj_with_mqa.weight")
    )
    got[key].zero_()
    assert not fused.state_dict()[key].any()


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_unfused_named_maps_gradients_and_absent_ones(model_type: str) -> None:
    """Gradients keyed like `named_parameters()` map to the unfused names with the unfused
    model's values; a merged parameter without a gradient maps to None for every shard."""
    unfused = tiny_model(model_type, seed=4)
    fused = copy.deepcopy(unfused)
    fusion.fuse(fused)
    ids = token_ids()
    for model in (unfused, fused):
        model(ids, labels=ids).loss.backward()
    got = unfused_named(fused, {n: p.grad for n, p in fused.named_parameters()})
    want = {n: p.grad for n, p in unfused.named_parameters()}
    assert set(got) == set(want)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    nothing = unfused_named(fused, {n: None for n, _ in fused.named_parameters()})
    assert set(nothing) == set(want) and all(v is None for v in nothing.values())


def _saved_tensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("original_format", [True, False])
@pytest.mark.parametrize("shard", [None, "40KB"])
def test_save_pretrained_writes_the_unfused_checkpoint(
    tmp_path, model_type: str, original_format: bool, shard: str | None
) -> None:
    """Regression (`save_pretrained` wrote fused keys): sharded or not, with Transformers'
    original-format conversion or without, the fused model's checkpoint holds the unfused
    keys with bit-identical tensors, and the stock class loads it to the same logits."""
    from transformers import AutoModelForCausalLM

    unfused = tiny_model(model_type, seed=6)
    fused = copy.deepcopy(unfused)
    fusion.fuse(fused)
    options = {"save_original_format": original_format}
    if shard:
        options["max_shard_size"] = shard
    unfused.save_pretrained(tmp_path / "unfused", **options)
    fused.save_pretrained(tmp_path / "fused", **options)
    want, got = _saved_tensors(tmp_path / "unfused"), _saved_tensors(tmp_path / "fused")
    assert set(got) == set(want)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    if shard:
        assert len(list((tmp_path / "fused").glob("*.safetensors"))) > 1
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "fused").eval()
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "unfused").eval()
    ids = token_ids()
    with torch.no_grad():
        assert torch.equal(stock(ids).logits, reference(ids).logits)


def _storage_groups(state_dict: dict[str, torch.Tensor]) -> list[list[str]]:
    """State-dict keys grouped by storage, as Transformers' tied-weight checks group them."""
    from transformers.pytorch_utils import id_tensor_storage

    groups: dict[tuple, list[str]] = {}
    for name, tensor in state_dict.items():
        groups.setdefault(id_tensor_storage(tensor), []).append(name)
    return sorted(group for group in groups.values() if len(group) > 1)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "deepseek_v3"])
def test_state_dict_entries_share_storage_exactly_as_unfused(model_type: str) -> None:
    """Regression (Transformers' `test_tied_weights_keys` under fusion): the slices of a
    merged weight in `state_dict()` used to be views of one storage, so storage-grouping
    tools read q/k/v as weights tied to each other. Storage groups now equal the unfused
    model's (tied embeddings stay grouped, merged slices do not)."""
    unfused = tiny_model(model_type, seed=7, tie_word_embeddings=True)
    fused = copy.deepcopy(unfused)
    report = fusion.fuse(fused)
    assert any(r.fuser in {"qkv", "glu", "mla"} for r in report.applied), str(report)
    assert _storage_groups(fused.state_dict()) == _storage_groups(unfused.state_dict())


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_storage_deduplicating_savers_keep_every_weight(tmp_path, model_type: str) -> None:
    """Regression (wrong checkpoint): accelerate's `save_model` keeps one name per storage,
    so a fused model's checkpoint silently lacked k_proj, v_proj and up_proj (the stock
    class then random-initialised them); safetensors' `save_model` refused the model. Both
    now write the unfused model's keys and bits."""
    from accelerate import Accelerator
    from safetensors.torch import load_file, save_model

    unfused = tiny_model(model_type, seed=8)
    fused = copy.deepcopy(unfused)
    fusion.fuse(fused)
    want = unfused.state_dict()
    Accelerator(cpu=True).save_model(fused, tmp_path / "accelerate")
    save_model(fused, str(tmp_path / "model.safetensors"))
    for got in (_saved_tensors(tmp_path / "accelerate"), load_file(tmp_path / "model.safetensors")):
        assert set(got) == set(want)
        assert all(torch.equal(got[k], v) for k, v in want.items())


def test_state_dict_entries_outlive_the_model() -> None:
    """An entry aliasing a merged weight keeps that weight's memory alive after the model
    is gone (the storage of its own must not dangle)."""
    import gc

    fused = tiny_model("llama", seed=9)
    fusion.fuse(fused)
    entries = fused.state_dict()
    key = next(k for k in entries if k.endswith("self_attn.v_proj.weight"))
    expected = entries[key].clone()
    del fused
    gc.collect()
    scratch = [torch.full((64, 64), 7.0) for _ in range(64)]  # reuse freed memory, if any
    assert torch.equal(entries[key], expected) and len(scratch) == 64


@pytest.mark.parametrize("assign", [False, True])
def test_own_state_dict_loads_back_into_the_model(assign: bool) -> None:
    """Entries alias the merged weights they are loaded into (self-load), or become the
    model's tensors (`assign=True`): values stay exactly what they were."""
    model = tiny_model("llama", seed=10)
    fusion.fuse(model)
    want = {key: value.clone() for key, value in model.state_dict().items()}
    model.load_state_dict(model.state_dict(), assign=assign)
    got = model.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    ids = token_ids()
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
