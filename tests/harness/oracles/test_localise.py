"""harness.oracles.localise: recording module calls and re-running fused modules on them."""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from harness.oracles import localise
from harness.runner.arch_check import float64_reference
from tests.harness.fakes import faulty_fuse, nan_change, raising_change

QUALNAME = "model.layers.0.mlp"


def test_record_calls_records_clones_and_removes_hooks():
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    x = torch.ones(1, 3)
    with localise.record_calls(model, ["1"]) as calls:
        hidden = model[0](x)
        model[1](hidden)
        hidden.add_(100)  # an in-place write after the call must not reach the record
    assert len(calls["1"]) == 1
    assert not torch.equal(calls["1"][0].args[0], hidden)
    assert not model[1]._forward_pre_hooks


def test_record_calls_removes_hooks_when_the_forward_raises(llama):
    try:
        with localise.record_calls(llama, [QUALNAME]):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert not llama.get_submodule(QUALNAME)._forward_pre_hooks


def test_caches_are_copied_per_replay():
    cache = DynamicCache()
    call = localise.ModuleCall((torch.ones(1),), {"cache": cache})
    copied = localise.clone_inputs(call)
    assert copied.kwargs["cache"] is not cache
    assert isinstance(copied.kwargs["cache"], DynamicCache)


def test_to_float64_upcasts_floats_only():
    call = localise.ModuleCall((torch.ones(2), torch.tensor([1, 2])), {"flag": True})
    up = localise.to_float64(call)
    assert up.args[0].dtype == torch.float64
    assert up.args[1].dtype == torch.int64
    assert up.kwargs["flag"] is True


def _calls(model, inputs):
    with localise.record_calls(model, [QUALNAME]) as calls, torch.no_grad():
        model(**inputs)
    return calls


def _check(llama, inputs, fuse):
    fused = copy.deepcopy(llama)
    fuse(fused)
    calls = _calls(llama, inputs)
    return localise.check_module(
        QUALNAME,
        calls[QUALNAME],
        unfused=llama,
        fused=fused,
        reference=float64_reference(llama),
        dtype=torch.float32,
        mask=None,
    )


def test_an_unchanged_module_passes(llama, llama_inputs):
    check = _check(llama, llama_inputs, faulty_fuse(QUALNAME, change=lambda o: o))
    assert check.verdict.passed, check.verdict
    assert check.calls == 1


def test_a_perturbed_module_fails(llama, llama_inputs):
    check = _check(llama, llama_inputs, faulty_fuse(QUALNAME))
    assert check.verdict.status == "fail"
    assert check.verdict.fused_error > 1e-3


def test_a_nan_module_fails(llama, llama_inputs):
    check = _check(llama, llama_inputs, faulty_fuse(QUALNAME, change=nan_change))
    assert check.verdict.status == "fail"
    assert "not finite" in check.verdict.reason


def test_a_raising_module_is_named_with_its_exception(llama, llama_inputs):
    check = _check(llama, llama_inputs, faulty_fuse(QUALNAME, change=raising_change))
    assert check.verdict.status == "fail"
    assert check.raised == "RuntimeError: fused kernel exploded on shape 2x6"
    assert "raising_change" in check.detail


def test_a_module_never_called_is_inconclusive(llama):
    check = localise.check_module(
        QUALNAME, [], unfused=llama, fused=llama, reference=llama, dtype=torch.float32, mask=None
    )
    assert check.calls == 0
    assert check.verdict.status == "inconclusive"


def test_default_dtype_is_restored():
    with localise.default_dtype(torch.float64):
        assert torch.tensor(1.0).dtype == torch.float64
    assert torch.get_default_dtype() == torch.float32


def test_block_children_are_each_layers_children_in_module_order(llama):
    layers = len(llama.model.layers)
    children = ["self_attn", "mlp", "input_layernorm", "post_attention_layernorm"]
    assert localise.block_children(llama) == [
        f"model.layers.{i}.{child}" for i in range(layers) for child in children
    ]
    assert localise.block_children(nn.Linear(2, 2)) == []
