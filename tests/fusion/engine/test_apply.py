"""fusion.fuse / fusion.plan: transactional application, handover, reports."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fusion
from fusion.engine import apply
from fusion.fusers import matches, registry
from fusion.fusers.qkv import QKVFuser
from tests.fusion.fusers import hazards
from tests.fusion.fusers.helpers import outputs_match
from tests.fusion.fusers.moe_helpers import SparseMoeV4, randomized
from tests.fusion.merged_paths import stacked_products
from tests.fusion.tiny_models import relative_error, tiny_model, token_ids


def test_fuse_rejects_misuse() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module"):
        fusion.fuse("not a model")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"unknown kernel backend .no-such-backend.; known: auto, torch"
    ):
        fusion.fuse(nn.Linear(2, 2), backend="no-such-backend")


def test_plan_leaves_model_untouched() -> None:
    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = fusion.plan(model)
    assert report.dry_run and report.counts() == {
        "qkv": 2,
        "glu": 2,
        "rmsnorm": 5,
        "residual_norm": 2,
    }
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert "would apply" in str(report)


def test_report_str_summarises() -> None:
    report = fusion.fuse(tiny_model("llama"))
    text = str(report)
    assert text.splitlines()[0] == "FusionReport: 11 applied, 0 skipped"
    assert "  glu: 2" in text and "  qkv: 2" in text and "  rmsnorm: 5" in text
    assert (
        "model.layers.0.self_attn: q_proj + k_proj + v_proj -> qkv_proj (LlamaAttention) [qkv]"
        in text
    )


def test_failure_part_way_leaves_module_exactly_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    module = hazards.Attention()
    reference = copy.deepcopy(module)
    children_before = dict(module.named_children())

    def broken_fuse(self, target, backend):
        del target.q_proj  # a partial change, then a crash
        target.junk = nn.Linear(1, 1)
        raise RuntimeError("boom")

    monkeypatch.setattr(QKVFuser, "fuse", broken_fuse)
    report = apply.run(module, fusers=(QKVFuser,))
    assert dict(module.named_children()) == children_before
    assert "forward" not in module.__dict__ and not hasattr(module, "junk")
    assert not report.applied
    assert "fuse failed, module left unchanged: RuntimeError: boom" in report.skipped[0].reason
    assert outputs_match(reference, module, 2, 5, 32)

    # With the full registry the next candidate takes over: the plain assignments qualify
    # for the sibling merge.
    report = fusion.fuse(module)
    assert any("RuntimeError: boom" in r.reason and r.fuser == "qkv" for r in report.skipped)
    assert report.counts() == {"sibling": 1}
    assert outputs_match(reference, module, 2, 5, 32)


def test_replacing_fuser_installs_in_parent_and_rolls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "FUSERS", (QKVFuser,))
    registry.clear_cache()

    parent = nn.Sequential(hazards.Attention())
    monkeypatch.setattr(QKVFuser, "fuse", lambda self, target, backend: nn.Identity())
    apply.run(parent)
    assert isinstance(parent[0], nn.Identity)

    # A replacement that cannot be installed (not a module): the slot and the module it held
    # are restored exactly, and the failure is reported.
    parent = nn.Sequential(hazards.Attention())
    original_child = parent[0]
    children_before = dict(original_child.named_children())

    def uninstallable(self, target, backend):
        del target.q_proj  # a partial change first
        return "not a module"

    monkeypatch.setattr(QKVFuser, "fuse", uninstallable)
    report = apply.run(parent)
    registry.clear_cache()
    assert parent[0] is original_child
    assert dict(original_child.named_children()) == children_before
    assert not report.applied
    assert "fuse failed, module left unchanged: TypeError" in report.skipped[0].reason


def test_one_class_traced_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    original_trace = matches.traced

    def counting_trace(module):
        calls.append(type(module).__name__)
        return original_trace(module)

    monkeypatch.setattr(matches, "traced", counting_trace)
    registry.clear_cache()
    fusion.plan(tiny_model("llama", num_hidden_layers=4))
    registry.clear_cache()
    assert calls.count("LlamaAttention") == 1
    assert calls.count("LlamaMLP") == 1


def test_fused_model_still_trains_and_backprops() -> None:
    model = tiny_model("qwen3")
    fusion.fuse(model)
    ids = torch.randint(0, 128, (2, 5))
    loss = model(ids, labels=ids).loss
    loss.backward()
    grad = model.model.layers[0].self_attn.k_proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all()


def test_a_merge_that_would_untie_weights_is_refused() -> None:
    """Regression (found by the lifecycle checks on Zamba): two attention modules whose
    projections are tied (`tie_weights` shares Parameters across distinct modules) would each
    get their own merged copy, so a training step or an edit would reach one side only. The
    merge is rolled back with the reason; a module shared by object (two paths, one module)
    still fuses, once."""
    tied = nn.ModuleDict({"a": hazards.Attention(), "b": hazards.Attention()})
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(tied["b"], name).weight = getattr(tied["a"], name).weight
    before = {n: p.clone() for n, p in tied.state_dict().items()}
    planned = fusion.plan(tied)  # a dry run finds the same refusal (by fusing a copy)
    assert "qkv" not in planned.counts(), str(planned)
    report = fusion.fuse(tied)
    assert [s.reason for s in planned.skipped] == [s.reason for s in report.skipped]
    assert "qkv" not in report.counts(), str(report)
    reasons = [s.reason for s in report.skipped if s.fuser == "qkv"]
    assert reasons and all("tied to another module's" in r for r in reasons)
    assert tied["a"].q_proj.weight is tied["b"].q_proj.weight
    assert all(torch.equal(tied.state_dict()[n], t) for n, t in before.items())

    shared = hazards.Attention()
    twice = nn.ModuleDict({"a": shared, "b": shared})
    assert fusion.fuse(twice).counts() == {"qkv": 1}
    assert twice["a"] is twice["b"] and hasattr(twice["b"], "qkv_proj")


def test_fuse_keeps_the_parallel_plans_whose_names_survive() -> None:
    """Every fusion of Qwen3 and Qwen3-MoE keeps the names a tensor-parallel plan can hold
    (merged shards stay, FusedRMSNorm holds the norm's Parameter under its name, FusedMoE
    keeps router and experts as children), so the plans stay whole; `plan` changes nothing."""
    for arch in ("qwen3", "qwen3_moe"):
        model = tiny_model(arch)
        before = dict(model.tp_plan)
        ep_before = dict(model._ep_plan or {})
        fusion.plan(model)
        assert model.tp_plan == before
        report = fusion.fuse(model)
        assert "rmsnorm" in report.counts(), str(report)
        if arch == "qwen3_moe":
            assert "moe" in report.counts(), str(report)
            assert ep_before and model._ep_plan == ep_before
        assert model.tp_plan == before
        assert any(".self_attn.q_norm" in key for key in before)


class _PlannedBlock(nn.Module):
    """A Transformers 4 style MoE block and an attention under one owner of a TP plan."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = randomized(SparseMoeV4())
        self.attn = hazards.Attention()
        self._tp_plan = {
            "mlp.gate": "replicate",
            "mlp.experts.*.w1": "colwise",
            "mlp.experts.*.w2": "rowwise",
            "attn.q_proj": "colwise",
            "attn.o_proj": "rowwise",
        }


def test_fuse_keeps_the_plan_of_blocks_whose_names_survive() -> None:
    """A Transformers 4 MoE block is no longer repacked (its experts are merged one by one,
    names and Parameters kept), and the attention's merge keeps its names: the whole plan
    stays true, so it stays whole."""
    owner = _PlannedBlock()
    plan = dict(owner._tp_plan)
    report = fusion.fuse(owner)
    assert {"glu", "qkv"} <= set(report.counts()) and "moe" not in report.counts(), str(report)
    assert owner._tp_plan == plan


def test_a_root_module_is_fused_in_place_or_refused_with_the_reason() -> None:
    model = tiny_model("llama")
    mlp = copy.deepcopy(model.model.layers[0].mlp)
    attention = copy.deepcopy(model.model.layers[0].self_attn)
    norm = copy.deepcopy(model.model.norm)
    # Rewriting fusers change the module's own forward: a root takes them.
    assert fusion.fuse(mlp).counts() == {"glu": 1}
    assert fusion.fuse(attention).counts() == {"qkv": 1}
    # The norm fuser keeps the module (a fused forward of its own): a root takes it too.
    before = norm.state_dict()
    x = torch.randn(2, 3, norm.weight.shape[0])
    expected = norm(x)
    assert fusion.fuse(norm).counts() == {"rmsnorm": 1}
    assert type(norm) is type(model.model.norm) and norm.state_dict().keys() == before.keys()
    assert torch.equal(norm(x), expected)
    # A replacing fuser needs the parent's slot: the root MoE block stays, and says why.
    block = copy.deepcopy(tiny_model("qwen3_moe").model.layers[0].mlp)
    report = fusion.fuse(block)
    assert "moe" not in report.counts(), str(report)
    (skipped,) = [s for s in report.skipped if s.fuser == "moe"]
    assert "cannot replace the root module itself" in skipped.reason
    assert str(skipped).startswith("<root> (Qwen3MoeSparseMoeBlock): moe refused")


def test_a_failed_fuse_restores_classes_and_parameter_memory(monkeypatch) -> None:
    """Regression (issue 25: a rollback restored the module's attributes but not a class
    swapped below it, nor Parameters a merge had made views of a stacked weight): a fuser
    that merges, swaps a child's class, then raises leaves the module exactly as it was,
    each Parameter again the sole user of memory of its own."""
    from fusion.runtime.merged import MergedLinear

    class Swapped(nn.Linear):
        pass

    module = hazards.Attention()
    reference = copy.deepcopy(module)
    params = {n: p for n, p in module.named_parameters()}
    real = QKVFuser.fuse

    def fuse_then_fail(self, target, backend):
        real(self, target, backend)
        assert isinstance(target.qkv_proj, MergedLinear) and target.qkv_proj.views_hold()
        target.q_proj.__class__ = Swapped
        raise RuntimeError("injected failure after the merge")

    monkeypatch.setattr(QKVFuser, "fuse", fuse_then_fail)
    report = apply.run(module, fusers=(QKVFuser,))
    assert "qkv" not in report.counts()
    assert any("injected failure" in s.reason for s in report.skipped), str(report)
    assert type(module.q_proj) is nn.Linear and not hasattr(module, "qkv_proj")
    assert "forward" not in module.__dict__
    assert {n: p for n, p in module.named_parameters()} == params  # same objects
    storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
    assert len(storages) == len(params)  # no Parameter shares memory with another
    assert outputs_match(reference, module, 2, 5, 32)


def test_fusing_again_restacks_parameters_that_moved() -> None:
    """`fusion.fuse` on a fused model re-merges a projection whose Parameters stopped
    viewing the stacked weight, where nothing else uses their memory."""
    module = hazards.Attention()
    fusion.fuse(module)
    merged = module.qkv_proj
    module.k_proj.weight.data = module.k_proj.weight.detach().clone()
    assert not merged.views_hold()
    report = fusion.fuse(module)
    assert not report.applied and merged.views_hold()
    with torch.no_grad(), stacked_products():
        out = module(torch.randn(2, 5, 32))
    assert merged.stacked_calls >= 1 and torch.isfinite(out).all()


# --- torch.inference_mode ---


def _loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    loss = model(ids).logits.float().square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_fusing_inside_inference_mode_then_training_is_fusing_outside(arch) -> None:
    """What fusing makes (stacked weights, their views) is made with inference mode off, so
    the model trains afterwards bit for bit as the same model fused outside the mode (which
    `test_numerics`-style tests compare with the unfused one)."""
    ids = token_ids(batch=2, seq=5)
    outside = tiny_model(arch).train()
    inside = copy.deepcopy(outside)
    unfused = copy.deepcopy(outside)
    report = fusion.fuse(outside)
    with torch.inference_mode():
        assert fusion.fuse(inside).counts() == report.counts()
        # fused vs unfused: rounding only (bit-equal on AVX-512 ATen, not under AVX2)
        assert relative_error(inside(ids).logits, unfused(ids).logits) <= 1e-5
    assert not any(t.is_inference() for t in (*inside.parameters(), *inside.buffers()))
    loss_in, grads_in = _loss_and_grads(inside, ids)
    loss_out, grads_out = _loss_and_grads(outside, ids)
    assert torch.equal(loss_in, loss_out) and grads_in.keys() == grads_out.keys()
    assert all(torch.equal(grads_in[n], grads_out[n]) for n in grads_in)


def test_a_model_built_inside_inference_mode_is_refused_untouched() -> None:
    """Its Parameters are inference tensors (no version counter): refused whole, with the
    reason, and it runs (and fails to train) exactly as its unfused twin."""
    with torch.inference_mode():
        model = tiny_model("llama")
        twin = tiny_model("llama")
    modules = [(name, type(m), m) for name, m in model.named_modules()]
    tensors = {name: t for name, t in model.state_dict(keep_vars=True).items()}
    for report in (fusion.plan(model), fusion.fuse(model)):
        assert report.applied == []
        [skipped] = report.skipped
        assert skipped.qualname == "" and "inference tensor" in skipped.reason
        assert "model.embed_tokens.weight" in skipped.reason
    assert [(name, type(m), m) for name, m in model.named_modules()] == modules
    assert all(t is tensors[n] for n, t in model.state_dict(keep_vars=True).items())
    ids = token_ids(batch=1, seq=4)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, twin(ids).logits)
    for m in (model, twin):
        with pytest.raises(RuntimeError, match="Inference tensors cannot be saved"):
            m(ids).logits.sum().backward()
