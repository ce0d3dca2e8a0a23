"""MoE fuser, routing: which routers are reproduced exactly and which refuse, and the routing
premises the router's proof read, guarded per call (a router edited, replaced or hooked after
fusing runs the original block).

Tiny configs only, built directly, never downloaded; every weight is random so a wrong expert
or a wrong routing weight shows in the outputs.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusion
from fusion.runtime.experts import FusedExperts
from fusion.runtime.moe import FusedMoE
from tests.fusion.fusers.helpers import reasons
from tests.fusion.fusers.moe_helpers import HIDDEN, qwen3_block
from tests.fusion.tiny_models import relative_error, tiny_model, token_ids


@pytest.fixture(autouse=True)
def _quiet() -> None:
    # Blocks built outside a model warn that no experts implementation is configured.
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*experts_implementation.*")


# --- routers: what is reproduced exactly and what refuses ---------------------------------


def with_router(block: nn.Module, forward, **state) -> nn.Module:
    """`block` with its router's class replaced by one whose forward is `forward`."""
    router = block.gate
    router.__class__ = type("CustomTopKRouter", (type(router),), {"forward": forward})
    for name, value in state.items():
        if isinstance(value, nn.Parameter):
            router.register_parameter(name, value)
        else:
            router.register_buffer(name, value)
    return block


def sigmoid_scaled_router(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    scores = logits.sigmoid()
    top_value, top_index = torch.topk(scores, self.top_k, dim=-1)
    top_value = top_value / (top_value.sum(dim=-1, keepdim=True) + 1e-20)
    top_value = top_value * 2.5
    return logits, top_value, top_index


def biased_router(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight, self.bias)
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    top_value, top_index = torch.topk(probs, self.top_k, dim=-1)
    return logits, top_value.to(logits.dtype), top_index


def corrected_router(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    scores = logits.sigmoid()
    top_index = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1)[1]
    top_value = scores.gather(1, top_index)
    return logits, top_value, top_index


def test_sigmoid_router_with_renorm_eps_and_scaling_is_reproduced_exactly() -> None:
    block = with_router(qwen3_block(), sigmoid_scaled_router)
    holder = nn.Sequential(block)
    fused = copy.deepcopy(holder)
    report = fusion.fuse(fused)
    assert report.counts() == {"moe": 1}, reasons(report)
    kinds = [(s.kind, s.value) for s in fused[0].spec.steps]
    assert kinds == [("sigmoid", None), ("topk", 2), ("renorm", 1e-20), ("scale", 2.5)]
    x = torch.randn(2, 7, HIDDEN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert relative_error(holder(x), fused(x)) <= 1e-5


def biased_weights_router(self, hidden_states):
    """The correction bias leaks into the routing weights (not DeepSeek's choice-only use)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    choice = logits.sigmoid() + self.e_score_correction_bias
    top_value, top_index = torch.topk(choice, self.top_k, dim=-1)
    return logits, top_value, top_index


def two_topk_router(self, hidden_states):
    """Two top-k ops in a form that is not group-limited routing."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    floor = torch.topk(probs, 4, dim=-1)[0][:, -1:]
    top_value, top_index = torch.topk(probs - floor, self.top_k, dim=-1)
    return logits, top_value, top_index


def test_correction_bias_for_the_choice_only_is_reproduced_exactly() -> None:
    bias = 0.3 * torch.randn(8, generator=torch.Generator().manual_seed(7))
    block = with_router(qwen3_block(), corrected_router, e_score_correction_bias=bias)
    holder = nn.Sequential(block)
    fused = copy.deepcopy(holder)
    report = fusion.fuse(fused)
    assert report.counts() == {"moe": 1}, reasons(report)
    [select] = [s for s in fused[0].spec.steps if s.kind == "select"]
    assert (select.bias, select.groups) == ("e_score_correction_bias", None)
    x = torch.randn(4, 9, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, weights, ids = block.gate(x.reshape(-1, HIDDEN))
        _, fused_weights, fused_ids = fused[0].route(x.reshape(-1, HIDDEN))
        assert torch.equal(ids, fused_ids) and torch.equal(weights, fused_weights)
        # The bias matters: without it, other experts would be chosen for some tokens.
        plain = torch.topk(F.linear(x.reshape(-1, HIDDEN), block.gate.weight).sigmoid(), 2)[1]
        assert not torch.equal(plain.sort(-1).values, ids.sort(-1).values)
        assert relative_error(holder(x), fused(x)) <= 1e-5


@pytest.mark.parametrize(
    ("forward", "state", "reason"),
    [
        (biased_router, {"bias": nn.Parameter(torch.zeros(8))}, "bias"),
        (
            biased_weights_router,
            {"e_score_correction_bias": torch.zeros(8)},
            "correction bias is added to the scores that are also the routing weights",
        ),
        (two_topk_router, {}, "grouped top-k routing"),
    ],
)
def test_router_refusals(forward, state, reason: str) -> None:
    """The block is refused as a whole (its router is not reproduced), so it keeps its own
    forward and router; only its experts are fused alone, and the report says why."""
    block = with_router(qwen3_block(), forward, **state)
    holder = nn.Sequential(block)
    fused = copy.deepcopy(holder)
    report = fusion.fuse(fused)
    [record] = [r for r in report.applied if r.fuser == "moe"]
    assert "experts alone" in record.description and reason in record.description
    assert type(fused[0]) is type(block) and isinstance(fused[0].experts, FusedExperts)
    x = torch.randn(2, 7, HIDDEN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert relative_error(holder(x), fused(x)) <= 1e-5


def test_unused_stateful_child_refuses_the_whole_block() -> None:
    block = qwen3_block()
    block.extra = nn.Linear(HIDDEN, HIDDEN)  # never run by the block, nor by a FusedMoE
    report = fusion.plan(nn.Sequential(block))
    [record] = [r for r in report.applied if r.fuser == "moe"]
    assert "child extra holds state" in record.description
    assert "experts alone" in record.description


def test_instances_with_different_top_k_get_their_own_routing() -> None:
    model = nn.Sequential(qwen3_block(), qwen3_block())
    model[1].gate.top_k = 3
    fused = copy.deepcopy(model)
    report = fusion.fuse(fused)
    assert report.counts() == {"moe": 2}, reasons(report)
    assert (fused[0].spec.top_k, fused[1].spec.top_k) == (2, 3)
    x = torch.randn(1, 6, HIDDEN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for a, b in zip(model, fused):
            assert relative_error(a(x), b(x)) <= 1e-5


def test_hooked_experts_are_refused() -> None:
    block = qwen3_block()
    block.experts.register_forward_hook(lambda *args: None)
    report = fusion.plan(nn.Sequential(block))
    assert "moe" not in report.counts() and "hooks" in reasons(report)


# -- routing premises: what the router's proof read, guarded per call ----------------------


def _routers(model: nn.Module) -> list[nn.Module]:
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def _set_on_routers(name: str, value: object):
    def edit(model: nn.Module) -> None:
        for router in _routers(model):
            setattr(router, name, value(getattr(router, name)) if callable(value) else value)

    edit.__name__ = f"router.{name}"
    return edit


def _halving_forward(model: nn.Module) -> None:
    """An instance-level forward on each router: the routing weights halved."""
    for router in _routers(model):
        base = type(router).forward

        def forward(x, router=router, base=base):
            logits, weights, ids = base(router, x)
            return logits, weights * 0.5, ids

        router.forward = forward


ROUTER_EDITS = [
    _set_on_routers("top_k", 1),
    _set_on_routers("norm_topk_prob", lambda flag: not flag),
    _halving_forward,
]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize(
    "edit", [*ROUTER_EDITS, "class forward", "scaling"], ids=lambda e: getattr(e, "__name__", e)
)
def test_router_edited_after_fusing_runs_the_original_block(model_type, edit, monkeypatch):
    """Every attribute the routing proof read is guarded (recorded as it was read, not
    listed): `top_k`, `norm_topk_prob`, DeepSeek's `routed_scaling_factor` by value, the
    router's forward by method resolution (an instance forward, a class patch). After such
    an edit the fused block runs the original block, which computes what the unfused one
    now does, bit for bit. (On main before the guards: logits 0.008-0.09 apart.)"""
    unfused = tiny_model(model_type, seed=3)
    fused = copy.deepcopy(unfused)
    fusion.fuse(fused)
    blocks = [m for m in fused.modules() if isinstance(m, FusedMoE)]
    assert blocks
    if edit == "class forward":
        cls = type(_routers(unfused)[0])
        base = cls.forward

        def halved(self, x):
            logits, weights, ids = base(self, x)
            return logits, weights * 0.5, ids

        def edit(model: nn.Module) -> None:
            monkeypatch.setattr(cls, "forward", halved)

    elif edit == "scaling":
        if model_type != "deepseek_v3":
            pytest.skip("only DeepSeek's router scales its weights")
        edit = _set_on_routers("routed_scaling_factor", 1.0)
    ids = token_ids()
    with torch.no_grad():
        before = unfused(ids).logits
        # fused experts round as grouped GEMMs (bit-equal on AVX-512 ATen, not under AVX2)
        assert relative_error(before, fused(ids).logits) <= 1e-5
        edit(unfused)
        edit(fused)
        expected, actual = unfused(ids).logits, fused(ids).logits
    assert relative_error(before, expected) > 1e-4  # the edit changes the function
    assert torch.equal(expected, actual)
    assert all(block.guard_failures == 1 for block in blocks)
    assert "changed since fusing" in str(blocks[0].last_failure)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_router_replaced_after_fusing_is_the_one_the_original_block_calls(model_type) -> None:
    """A router put in the fused block's slot (here one with another top-k) fails the guard on
    the block's child read; the original block then runs with the fused block's children."""
    unfused = tiny_model(model_type, seed=3)
    fused = copy.deepcopy(unfused)
    fusion.fuse(fused)
    ids = token_ids()

    def replace(model: nn.Module) -> None:
        for layer in model.model.layers:
            if hasattr(layer.mlp, "experts"):
                router = copy.deepcopy(layer.mlp.gate)
                router.top_k = 1
                layer.mlp.gate = router

    with torch.no_grad():
        replace(unfused)
        replace(fused)
        assert torch.equal(unfused(ids).logits, fused(ids).logits)


def test_routing_premises_are_what_the_proof_read() -> None:
    """The reads guarded are derived from the traces, not listed: DeepSeek's router reads its
    group sizes and correction bias (by presence: read by name per call), Qwen3's does not."""
    qwen = tiny_model("qwen3_moe", seed=3)
    deepseek = tiny_model("deepseek_v3", seed=3)
    fusion.fuse(qwen)
    fusion.fuse(deepseek)
    qwen_block = next(m for m in qwen.modules() if isinstance(m, FusedMoE))
    deepseek_block = next(m for m in deepseek.modules() if isinstance(m, FusedMoE))

    def names(block: FusedMoE) -> set[tuple[str, str, str]]:
        return {(type(o).__name__, n, kind) for o, n, kind, *_ in block.routing_guard.checks}

    qwen_reads, deepseek_reads = names(qwen_block), names(deepseek_block)
    router = "Qwen3MoeTopKRouter"
    assert {(router, "top_k", "value"), (router, "norm_topk_prob", "value")} <= qwen_reads
    assert {(router, "forward", "method"), (router, "weight", "parameter")} <= qwen_reads
    assert ("FusedMoE", "gate", "child") in qwen_reads
    assert ("Qwen3MoeSparseMoeBlock", "forward", "method") in qwen_reads
    assert not any(name == "num_group" for _, name, _ in qwen_reads)
    router = "DeepseekV3TopkRouter"
    assert {(router, n, "value") for n in ("num_group", "topk_group", "routed_scaling_factor")} <= (
        deepseek_reads
    )
    assert (router, "e_score_correction_bias", "buffer") in deepseek_reads


def test_a_router_with_an_instance_forward_at_fuse_time_is_refused() -> None:
    """The routing program is read from the router's class forward: an instance-level forward
    there (which the unfused block calls) refuses the whole-block fusion, saying so; the
    experts are fused alone."""
    model = tiny_model("qwen3_moe", seed=3)
    _halving_forward(model)
    reference = copy.deepcopy(model)
    report = fusion.fuse(model)
    assert not any(isinstance(m, FusedMoE) for m in model.modules())
    assert any(isinstance(m, FusedExperts) for m in model.modules())
    described = " | ".join(a.description for a in report.applied if a.fuser == "moe")
    assert "gate has an instance-level forward" in described
    ids = token_ids()
    with torch.no_grad():
        assert relative_error(reference(ids).logits, model(ids).logits) <= 1e-5


def test_an_instance_whose_router_reads_differ_is_matched_on_its_own() -> None:
    """Two blocks of one signature: the second's router is of a subclass whose forward the
    class-level match never read (a router's own class is not in the signature). Its routing
    keys differ, so it is matched again for itself, never given the first block's program."""
    model = tiny_model("qwen3_moe", seed=3)
    router = model.model.layers[1].mlp.gate
    base = type(router)

    def halved(self, x):
        logits, weights, ids = base.forward(self, x)
        return logits, weights * 0.5, ids

    router.__class__ = type("HalvedRouter", (base,), {"forward": halved})
    reference = copy.deepcopy(model)
    fusion.fuse(model)
    assert isinstance(model.model.layers[0].mlp, FusedMoE)
    ids = token_ids()
    with torch.no_grad():
        assert relative_error(reference(ids).logits, model(ids).logits) <= 1e-5
