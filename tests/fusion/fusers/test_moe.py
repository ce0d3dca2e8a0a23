"""MoE fuser: real Transformers 5 blocks, a Transformers 4 `ModuleList` block, refusals,
block and whole-model parity, checkpoints, and the experts kernel (routers and the routing
premises: `test_moe_routing.py`).

Tiny configs only (hidden 64, 2 layers, 4-8 experts, top-2), built directly, never
downloaded; every weight is random so a dropped term, a wrong expert or a wrong routing
weight shows in the outputs.
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
from fusion.fusers.moe.fuser import MODULELIST_REFUSAL
from fusion.kernels import ops
from fusion.kernels import reference as torch_ref
from fusion.runtime.checkpoint import unfused_state_dict
from fusion.runtime.moe import FusedMoE
from tests.fusion.fusers.helpers import reasons
from tests.fusion.fusers.moe_helpers import HIDDEN, ExpertMLP, SparseMoeV4, randomized
from tests.fusion.tiny_models import randomize_, relative_error, tiny_model, token_ids

COMMON = dict(
    hidden_size=HIDDEN,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=64,
)
FUSED = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    "qwen3_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
    ),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
    # Sigmoid scores, a correction bias for the choice, experts limited to the best 2 of 4
    # groups, renormalised with an epsilon, scaled: reproduced op by op.
    "deepseek_v3": dict(
        num_key_value_heads=4,
        head_dim=8,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        first_k_dense_replace=0,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
}
REFUSED = {
    "gpt_oss": (dict(num_local_experts=4, num_experts_per_tok=2), "returns a tuple"),
}


@pytest.fixture(autouse=True)
def _quiet() -> None:
    # Blocks built outside a model warn that no experts implementation is configured.
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*experts_implementation.*")


def tiny_moe(model_type: str, seed: int = 0, **overrides) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = FUSED.get(model_type) or REFUSED[model_type][0]
    config = AutoConfig.for_model(model_type, **{**COMMON, **extra, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = randomize_(AutoModelForCausalLM.from_config(config), seed).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros would hide a dropped bias
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))
    return model


def moe_blocks(model: nn.Module) -> dict[str, nn.Module]:
    return {
        name: module
        for name, module in model.named_modules()
        if hasattr(module, "experts") and name.count(".") == 3
    }


@pytest.mark.parametrize("model_type", sorted(FUSED))
def test_blocks_fused_with_bit_identical_routing_and_block_parity(model_type: str) -> None:
    model = tiny_moe(model_type)
    fused = copy.deepcopy(model)
    report = fusion.fuse(fused)
    originals = moe_blocks(model)
    assert report.counts()["moe"] == len(originals) == 2, str(report)
    for name, block in originals.items():
        fused_block = fused.get_submodule(name)
        assert isinstance(fused_block, FusedMoE)
        router = block.get_submodule(fused_block.router_name)
        for seed in range(4):
            x = torch.randn(3, 11, HIDDEN, generator=torch.Generator().manual_seed(seed))
            with torch.no_grad():
                _, weights, ids = router(x.reshape(-1, HIDDEN))
                _, fused_weights, fused_ids = fused_block.route(x.reshape(-1, HIDDEN))
                assert torch.equal(ids, fused_ids)  # the same routing decisions
                assert torch.equal(weights, fused_weights) and weights.dtype == fused_weights.dtype
                expected, actual = block(x), fused_block(x)
            assert actual.shape == expected.shape
            assert relative_error(expected, actual) <= 1e-5


def test_qwen2_moe_shared_expert_and_its_gate_found_by_dataflow() -> None:
    fused = tiny_moe("qwen2_moe")
    report = fusion.fuse(fused)
    block = fused.model.layers[0].mlp
    assert (block.shared_name, block.shared_gate_name) == ("shared_expert", "shared_expert_gate")
    record = next(r for r in report.applied if r.fuser == "moe")
    assert "shared_expert (gated by shared_expert_gate)" in record.description
    # The shared expert stays a child, so the GLU fuser still merges its projections.
    assert hasattr(block.shared_expert, "gate_up_proj")


def _float64(model: nn.Module) -> nn.Module:
    """A float64 copy on Transformers' eager experts loop (grouped_mm has no float64 kernel)."""
    reference = copy.deepcopy(model).to(torch.float64)
    reference.set_experts_implementation("eager")
    return reference


@pytest.mark.parametrize("model_type", sorted(FUSED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_model_parity_against_float64(model_type: str, dtype: torch.dtype) -> None:
    model = tiny_moe(model_type)
    fused = copy.deepcopy(model)
    assert fusion.fuse(fused).counts()["moe"] == 2
    ids = token_ids()
    with torch.no_grad():
        truth = _float64(model)(ids).logits
        unfused = copy.deepcopy(model).to(dtype)(ids).logits.double()
        out = fused.to(dtype)(ids).logits.double()
    assert torch.isfinite(out).all()
    unfused_error, fused_error = relative_error(truth, unfused), relative_error(truth, out)
    assert fused_error <= 2 * unfused_error + (1e-3 if dtype != torch.float32 else 1e-6), (
        fused_error,
        unfused_error,
    )


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_blocks_refused_as_a_whole_say_why_and_fuse_their_experts_alone(model_type: str) -> None:
    model = tiny_moe(model_type)
    report = fusion.plan(model)
    applied = [r for r in report.applied if r.fuser == "moe"]
    assert len(applied) == len(moe_blocks(model)) == 2, str(report)
    for record in applied:
        assert "-> FusedExperts (experts alone; the block:" in record.description
        assert REFUSED[model_type][1] in record.description


def test_output_router_logits_still_recorded() -> None:
    """Transformers records router logits with hooks on the router; a hooked router is called
    (its outputs were proven identical to the fused routing), so the hooks still fire."""
    model = tiny_moe("mixtral")
    fused = copy.deepcopy(model)
    fusion.fuse(fused)
    ids = token_ids()
    with torch.no_grad():
        a = model(ids, output_router_logits=True)
        b = fused(ids, output_router_logits=True)
    assert len(a.router_logits) == len(b.router_logits) == 2
    assert torch.equal(a.router_logits[0], b.router_logits[0])  # layer 0 sees identical inputs
    assert torch.allclose(a.aux_loss, b.aux_loss, rtol=1e-5)


def test_training_mode_runs_the_original_block_when_it_reads_training() -> None:
    """Mixtral jitters router inputs in training mode, which FusedMoE does not reproduce:
    there it runs the original block (sharing its children), so training computes exactly
    what the unfused model computes, gradients reach the shared expert weights, and eval mode
    is fused again."""
    model = tiny_moe("mixtral")
    model.config.router_jitter_noise = 0.1
    for layer in model.model.layers:
        layer.mlp.jitter_noise = 0.1
    fused = copy.deepcopy(model)
    fusion.fuse(fused)
    block, original = fused.model.layers[0].mlp, model.model.layers[0].mlp
    assert block.training_sensitive and block.eager is not None
    assert "training=original block" in repr(block)
    x = torch.randn(1, 5, HIDDEN)
    block.train()
    original.train()
    torch.manual_seed(7)
    got = block(x.clone())  # Mixtral's jitter scales its input in place
    torch.manual_seed(7)
    want = original(x.clone())
    assert torch.equal(got, want)
    got.sum().backward()
    assert block.experts.gate_up_proj.grad is not None
    block.eval()
    original.eval()
    with torch.no_grad():
        assert relative_error(original(x), block(x)) <= 1e-5
    assert "eager" not in dict(block.named_modules())  # not a submodule: no duplicate state
    assert len(block.state_dict()) == len(original.state_dict())


# --- Transformers 4 style: a ModuleList of expert MLPs and the routing in the block ----------


class SparseMoeV4Tuple(SparseMoeV4):
    """The real Transformers 4 block also returns the router logits, through a name."""

    def forward(self, hidden_states):
        hidden = super().forward(hidden_states)
        result = (hidden, self.gate(hidden_states.view(-1, self.hidden_dim)))
        return result


def test_transformers4_modulelist_block_is_refused_and_its_experts_fused_alone() -> None:
    """Regression (the 4.57 conformance run: optimizer-before-fuse, parameters and
    lora-after-fuse failed on Qwen3-MoE, OLMoE, FlexOlmo): packing a ModuleList of experts
    replaced their Parameters, so an optimizer built before fusing trained tensors the fused
    block never read. Now the block is refused (the reason says why), each expert MLP is
    merged by `glu` (its Parameters kept), and the model trains as the unfused one."""
    model = nn.Sequential(randomized(SparseMoeV4()))
    fused = copy.deepcopy(model)
    params = dict(fused.named_parameters())
    optimizer = torch.optim.AdamW(fused.parameters(), lr=1e-2, eps=1.0)
    report = fusion.fuse(fused)
    assert "moe" not in report.counts()
    assert MODULELIST_REFUSAL in reasons(report)
    assert sorted(r.qualname for r in report.applied if r.fuser == "glu") == [
        f"0.experts.{e}" for e in range(8)
    ]
    assert isinstance(fused[0].experts, nn.ModuleList)
    assert all(p is params[name] for name, p in fused.named_parameters())
    reference = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1.0)
    x = torch.randn(2, 17, HIDDEN, generator=torch.Generator().manual_seed(0))
    for net, opt in ((model, reference), (fused, optimizer)):
        for _ in range(2):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(params[name], p, rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():
        assert relative_error(model(x), fused(x)) <= 1e-5


def test_plan_reports_what_fuse_does_for_modulelist_experts() -> None:
    model = nn.Sequential(randomized(SparseMoeV4()), randomized(ExpertMLP(HIDDEN, 32)))
    planned = fusion.plan(model)
    fused = fusion.fuse(copy.deepcopy(model))
    as_pairs = lambda report: [(r.qualname, r.fuser) for r in report.applied]  # noqa: E731
    assert as_pairs(planned) == as_pairs(fused), str(planned)
    assert ("1", "glu") in as_pairs(planned) and ("0", "moe") not in as_pairs(planned)


class SparseMoeV4Jitter(SparseMoeV4):
    def forward(self, hidden_states):
        if self.training:
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(0.9, 1.1)
        return super().forward(hidden_states)


def test_transformers4_checkpoint_round_trip_bit_identical() -> None:
    unfused = nn.Sequential(randomized(SparseMoeV4(), seed=1))
    fused = nn.Sequential(randomized(SparseMoeV4(), seed=2))
    fusion.fuse(fused)
    fused.load_state_dict(unfused.state_dict())  # strict: every per-expert key maps
    exported, original = unfused_state_dict(fused), unfused.state_dict()
    assert set(exported) == set(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)
    x = torch.randn(1, 9, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert relative_error(unfused(x), fused(x)) <= 1e-5


class SparseMoeV4Shared(SparseMoeV4):
    """A Transformers 4 block plus Qwen2-MoE's gated shared expert, returning the sum."""

    def __init__(self, gated: bool = True) -> None:
        super().__init__()
        self.shared_expert = ExpertMLP(HIDDEN, 48)
        self.shared_expert_gate = nn.Linear(HIDDEN, 1, bias=False) if gated else None

    def forward(self, hidden_states):
        routed = super().forward(hidden_states)
        x = hidden_states.view(-1, self.hidden_dim)
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared = F.sigmoid(self.shared_expert_gate(x)) * shared
        return routed + shared.view(hidden_states.shape)


class SparseMoeV4ScaledShared(SparseMoeV4Shared):
    def forward(self, hidden_states):
        routed = SparseMoeV4.forward(self, hidden_states)
        x = hidden_states.view(-1, self.hidden_dim)
        return routed + 2 * self.shared_expert(x).view(hidden_states.shape)


class SparseMoeV4SharedTwice(SparseMoeV4Shared):
    def forward(self, hidden_states):
        routed = SparseMoeV4.forward(self, hidden_states)
        x = hidden_states.view(-1, self.hidden_dim)
        return routed + self.shared_expert(self.shared_expert(x)).view(hidden_states.shape)


@pytest.mark.parametrize("gated", [True, False])
def test_transformers4_block_with_a_shared_expert_is_refused_too(gated: bool) -> None:
    """`routed + [sigmoid(gate(x)) *] shared(x)` after the expert loop: refused as every
    Transformers 4 block is; the shared expert's own GLU is fused, a dry run says the same,
    the output matches and unfused checkpoints round-trip."""
    model = nn.Sequential(randomized(SparseMoeV4Shared(gated), seed=4)).eval()
    fused = copy.deepcopy(model)
    report = fusion.fuse(fused)
    pairs = [(r.qualname, r.fuser) for r in report.applied]
    assert ("0.shared_expert", "glu") in pairs and ("0", "moe") not in pairs, str(report)
    assert MODULELIST_REFUSAL in reasons(report)
    assert pairs == [(r.qualname, r.fuser) for r in fusion.plan(model).applied]
    x = torch.randn(2, 9, HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert relative_error(model(x), fused(x)) <= 1e-5
    other = nn.Sequential(randomized(SparseMoeV4Shared(gated), seed=6)).eval()
    fusion.fuse(other)
    other.load_state_dict(model.state_dict())
    exported = unfused_state_dict(other)
    assert set(exported) == set(model.state_dict())
    assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "block",
    [SparseMoeV4Jitter, SparseMoeV4ScaledShared, SparseMoeV4SharedTwice, SparseMoeV4Tuple],
)
def test_every_transformers4_block_is_refused_for_the_same_reason(block: type) -> None:
    """Whatever else a Transformers 4 block does (training-mode jitter, other shared terms, a
    tuple through a name), it is refused before any of it is read, for its ModuleList; the
    fused model still computes the unfused outputs, in eval and in training mode."""
    model = nn.Sequential(randomized(block())).eval()
    fused = copy.deepcopy(model)
    report = fusion.fuse(fused)
    assert "moe" not in report.counts()
    assert MODULELIST_REFUSAL in reasons(report)
    x = torch.randn(1, 3, HIDDEN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model(x), fused(x)
    for w, g in zip(
        want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)
    ):
        assert relative_error(w, g) <= 1e-5
    fused.train()
    assert fused(x)[0].shape[-1] == HIDDEN


def test_partial_checkpoint_of_modulelist_experts_loads_like_stock() -> None:
    """Regression (a partial dict raised KeyError): as for an unfused model, `strict=True`
    raises naming the missing per-expert key, `strict=False` loads every present key and
    reports the missing one under its unfused name, keeping its current value."""
    fused = nn.Sequential(randomized(SparseMoeV4(), seed=1))
    fusion.fuse(fused)
    before = fused.state_dict()["0.experts.3.w2.weight"].clone()
    source = nn.Sequential(randomized(SparseMoeV4(), seed=2))
    state = source.state_dict()
    del state["0.experts.3.w2.weight"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\).*"0\.experts\.3\.w2\.weight"'):
        fused.load_state_dict(dict(state))
    result = fused.load_state_dict(dict(state), strict=False)
    assert result.missing_keys == ["0.experts.3.w2.weight"] and not result.unexpected_keys
    after = fused.state_dict()
    assert torch.equal(after["0.experts.3.w2.weight"], before)
    assert all(torch.equal(after[k], v) for k, v in state.items())


# --- the experts kernel -------------------------------------------------------------------


def naive_experts(x, gate_up, down, ids, weights):
    """Per (token, choice): the Transformers eager function, one row at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = F.linear(x[t : t + 1], gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, down[e]) * weights[t, k]
            out[t] += y.to(x.dtype)[0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weights_dtype", [torch.float32, "same"])
def test_moe_experts_kernel_matches_the_eager_function(dtype, weights_dtype) -> None:
    g = torch.Generator().manual_seed(0)
    tokens, experts, inter, top_k = 37, 6, 16, 2
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    gate_up = (0.2 * torch.randn(experts, 2 * inter, HIDDEN, generator=g)).to(dtype)
    down = (0.2 * torch.randn(experts, HIDDEN, inter, generator=g)).to(dtype)
    ids = torch.randint(0, experts - 1, (tokens, top_k), generator=g)  # expert 5 gets nothing
    w = torch.rand(tokens, top_k, generator=g).to(
        dtype if weights_dtype == "same" else torch.float32
    )
    out = torch_ref.moe_experts(x, gate_up, down, ids, w, "silu")
    expected = naive_experts(x, gate_up, down, ids, w)
    assert out.dtype == dtype and out.shape == expected.shape
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert relative_error(expected, out) <= tolerance


def test_moe_experts_kernel_empty_input() -> None:
    x = torch.empty(0, HIDDEN)
    out = torch_ref.moe_experts(
        x,
        torch.randn(4, 8, HIDDEN),
        torch.randn(4, HIDDEN, 4),
        torch.empty(0, 2, dtype=torch.long),
        torch.empty(0, 2),
        "silu",
    )
    assert out.shape == (0, HIDDEN)


def test_set_experts_implementation_is_honoured_after_fusing(monkeypatch) -> None:
    """`set_experts_implementation` on a fused model: each FusedMoE then calls the experts
    module (which dispatches to the chosen implementation), routing still fused, outputs
    identical to the unfused model's on that implementation; setting the fuse-time choice
    back returns to the fused kernel. (The kernel is what is spied on: patching the experts
    class's `forward` is itself an edit the fused block honours, see below.)"""
    unfused = tiny_model("qwen3_moe", seed=3)
    fused = copy.deepcopy(unfused)
    fusion.fuse(fused)
    block = fused.model.layers[0].mlp
    assert block.fused_with == unfused.config._experts_implementation == "grouped_mm"
    calls = []
    kernel = ops.moe_experts

    def spy(*args, **kwargs):
        calls.append(args[1])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(ops, "moe_experts", spy)
    ids = token_ids()
    with torch.no_grad():
        fused(ids)
        assert len(calls) == 2  # the fused kernel, once per block
        for model in (fused, unfused):
            model.set_experts_implementation("eager")
        calls.clear()
        assert torch.equal(fused(ids).logits, unfused(ids).logits)
        assert calls == [] and block.guard_failures == 1
        fused.set_experts_implementation("grouped_mm")
        fused(ids)
        assert len(calls) == 2 and block.guard_failures == 1


def edit_act_fn(model: nn.Module) -> None:
    for layer in model.model.layers:
        layer.mlp.experts.act_fn = nn.GELU()


def edit_class_forward(model: nn.Module) -> None:
    experts = model.model.layers[0].mlp.experts
    base = type(experts)

    def halved(self, *args, **kwargs):
        return base.forward(self, *args, **kwargs) * 0.5

    for layer in model.model.layers:
        layer.mlp.experts.__class__ = type("Halved", (base,), {"forward": halved})


def hook_experts(model: nn.Module) -> None:
    for layer in model.model.layers:
        layer.mlp.experts.register_forward_hook(lambda module, args, out: out * 0.5)


def shard_experts(model: nn.Module) -> None:
    """What a tensor-parallel plan applied after fusing does to the experts' weights: each
    keeps half of every expert's intermediate width (gate rows, up rows, down columns)."""
    for layer in model.model.layers:
        experts = layer.mlp.experts
        gate, up = experts.gate_up_proj.detach().chunk(2, dim=1)
        half = gate.shape[1] // 2
        experts.gate_up_proj = nn.Parameter(torch.cat([gate[:, :half], up[:, :half]], dim=1))
        experts.down_proj = nn.Parameter(experts.down_proj.detach()[:, :, :half].contiguous())


@pytest.mark.parametrize("edit", [edit_act_fn, edit_class_forward, hook_experts, shard_experts])
def test_experts_edited_after_fusing_are_called_by_the_fused_block(edit) -> None:
    """What the experts kernel took from the experts module at fuse time (its activation,
    class, hooks: none) is guarded per call: an edit after fusing makes the fused block call
    the experts module itself, as the unfused block does (routing still fused)."""
    unfused = tiny_model("qwen3_moe", seed=3)
    fused = copy.deepcopy(unfused)
    fusion.fuse(fused)
    ids = token_ids()
    with torch.no_grad():
        before = unfused(ids).logits
        assert relative_error(before, fused(ids).logits) <= 1e-5
        edit(unfused)
        edit(fused)
        expected, actual = unfused(ids).logits, fused(ids).logits
    assert relative_error(before, expected) > 1e-4  # the edit changes the function
    assert relative_error(expected, actual) <= 1e-5
    assert fused.model.layers[0].mlp.guard_failures == 1
