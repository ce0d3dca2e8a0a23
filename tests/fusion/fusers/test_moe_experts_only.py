"""Experts-only fusion (`fusion.fusers.moe.experts_only`): blocks refused as a whole get their
experts fused alone; parity on tiny real Transformers modules, the unfused state dict, the
experts implementation, and every hazard refused with its reason."""

from __future__ import annotations

import copy
import inspect
import io
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.moe import use_experts_implementation

import corpus
import fusion
from fusion.fusers.moe.experts import experts_child
from fusion.runtime.experts import FusedExperts
from tests.fusion.fusers.helpers import reasons
from tests.fusion.tiny_models import relative_error

# arch -> (the gating program's kernel activation, or None for a replayed program)
EXPERTS_ONLY = {
    "gpt_oss": None,  # biases, transposed, interleaved clamped SwiGLU with alpha/limit
    "aria_text": "silu",  # transposed storage
    "afmoe": "silu",  # the block's router takes an extra argument
    "beam": None,  # the gate upcast to float32 and back
    "deepseek_v4": None,  # clamped SiLU gate and up
    "lfm2_moe": "silu",  # act_fn is a function, not a module
    "inkling2_text": None,  # soft-capped SwiGLU in float32
}


@pytest.fixture(autouse=True)
def _quiet() -> None:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*experts_implementation.*")


def build(arch: str) -> nn.Module:
    return corpus.build(arch, seed=0, dtype=torch.float32, device="cpu").eval()


def blocks(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if experts_child(m) is not None}


def first_block(arch: str) -> nn.Module:
    return next(iter(blocks(build(arch)).values()))


def block_input(block: nn.Module, seed: int = 0) -> torch.Tensor:
    hidden = block.experts.gate_up_proj.shape[1 if block.experts.is_transposed else 2]
    return torch.randn(2, 5, hidden, generator=torch.Generator().manual_seed(seed))


def first(output: object) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


@pytest.mark.parametrize("arch", sorted(EXPERTS_ONLY))
def test_experts_fused_alone_with_block_parity_and_unfused_state_dict(arch: str) -> None:
    model = build(arch)
    fused = copy.deepcopy(model)
    report = fusion.fuse(fused)
    originals = blocks(model)
    applied = [r for r in report.applied if r.fuser == "moe"]
    assert {r.qualname for r in applied} == set(originals), str(report)
    assert all("FusedExperts (experts alone; the block:" in r.description for r in applied)
    assert fused.state_dict().keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(fused.state_dict()[key], value), key
    for name, block in originals.items():
        fused_block = fused.get_submodule(name)
        assert type(fused_block) is type(block)  # the block keeps its own forward
        experts = fused_block.experts
        assert isinstance(experts, FusedExperts)
        assert experts.program.activation == EXPERTS_ONLY[arch]
        for param_name, param in experts.named_parameters():
            assert experts.original._parameters[param_name] is param  # shared, no copy
        # DeepSeek-V4's hash-routed blocks also read the token ids.
        extra = {}
        if "input_ids" in inspect.signature(block.forward).parameters:
            extra["input_ids"] = torch.randint(0, 16, (2, 5))
        for seed in range(3):
            x = block_input(block, seed)
            with torch.no_grad():
                expected, actual = block(x.clone(), **extra), fused_block(x.clone(), **extra)
            if isinstance(expected, tuple):  # (output, router scores): the scores bit for bit
                assert torch.equal(expected[1], actual[1])
            assert relative_error(first(expected), first(actual)) <= 1e-5


@pytest.mark.parametrize("arch", ["gpt_oss", "beam"])
def test_bfloat16_experts_against_float64(arch: str) -> None:
    """A fused experts module errs against float64 no more than the unfused one does (plus
    a dtype floor): rounding, never another function."""
    block = first_block(arch)
    experts = block.experts.to(torch.bfloat16)
    truth_experts = copy.deepcopy(block.experts).double()
    fused = copy.deepcopy(block)
    fusion.fuse(nn.Sequential(fused))
    assert isinstance(fused.experts, FusedExperts)
    x = block_input(block)[0]
    ids = torch.randn(5, experts.num_experts).topk(2, dim=-1).indices
    weights = torch.rand(5, 2)
    with torch.no_grad():
        eager = inspect.unwrap(type(truth_experts).forward)  # grouped_mm has no float64
        truth = eager(truth_experts, x.double(), ids, weights.double())
        unfused = experts(x.bfloat16(), ids, weights.bfloat16())
        actual = fused.experts(x.bfloat16(), ids, weights.bfloat16())
    assert actual.dtype == unfused.dtype == torch.bfloat16
    assert relative_error(truth, actual) <= 2 * relative_error(truth, unfused) + 1e-2


def test_refusing_block_keeps_both_reasons_when_experts_are_not_an_interface() -> None:
    report = fusion.plan(build("longcat_flash"))
    if any(r.fuser == "moe" for r in report.applied):
        # One line's structure: from Transformers 5.25 LongcatFlash's experts are an
        # experts-interface class and the block is fused (corpus/expected/5.25.json).
        pytest.skip("longcat_flash's experts are an experts-interface module on this line")
    reason = next(r.reason for r in report.skipped if r.fuser == "moe")
    assert "not a Transformers experts-interface module; the block as a whole:" in reason


def test_fusing_again_reports_fused_experts_and_changes_nothing() -> None:
    fused = build("aria_text")
    fusion.fuse(fused)
    before = {name: type(m) for name, m in fused.named_modules()}
    again = fusion.fuse(fused)
    assert not [r for r in again.applied if r.fuser == "moe"]
    assert not [r for r in again.skipped if r.fuser == "moe"]
    assert any("already fused (FusedExperts)" in r.reason for r in again.skipped)
    assert before == {name: type(m) for name, m in fused.named_modules()}


def test_plan_reports_experts_only_and_leaves_the_model_alone() -> None:
    model = build("gpt_oss")
    report = fusion.plan(model)
    assert [r.fuser for r in report.applied].count("moe") == len(blocks(model))
    assert not any(isinstance(m, FusedExperts) for m in model.modules())


def test_set_experts_implementation_and_replaced_parameters_reach_the_original() -> None:
    unfused = build("gpt_oss")
    fused = copy.deepcopy(unfused)
    fusion.fuse(fused)
    experts = fused.model.layers[0].mlp.experts
    ids = corpus.make_inputs(unfused, seed=0)
    calls: list[nn.Module] = []
    experts.original.register_forward_pre_hook(lambda module, args: calls.append(module))
    with torch.no_grad():
        fused(**ids)
        assert calls == []  # the fused path
        for model in (fused, unfused):
            model.set_experts_implementation("eager")
        assert torch.allclose(fused(**ids).logits, unfused(**ids).logits, rtol=1e-5, atol=1e-6)
        assert calls  # the original module ran, on the implementation asked for
        # A parameter replaced on the fused module is what the original reads next.
        state = {k: v * 0.5 for k, v in unfused.state_dict().items()}
        unfused.load_state_dict(state)
        fused.load_state_dict(state, assign=True)
        assert torch.allclose(fused(**ids).logits, unfused(**ids).logits, rtol=1e-5, atol=1e-6)
        fused.set_experts_implementation("grouped_mm")
        unfused.set_experts_implementation("grouped_mm")
        calls.clear()
        assert torch.allclose(fused(**ids).logits, unfused(**ids).logits, rtol=1e-5, atol=1e-6)
        assert calls == []


def test_calls_outside_the_covered_form_run_the_original() -> None:
    block = first_block("afmoe")
    fused = copy.deepcopy(block)
    fusion.fuse(nn.Sequential(fused))
    x = block_input(block)[0]
    ids = torch.randn(5, 4).topk(2, dim=-1).indices
    weights = torch.rand(5, 2)
    with torch.no_grad():
        by_keyword = fused.experts(x, top_k_index=ids, top_k_weights=weights)
        mixed = fused.experts(x, ids, weights.double())  # hidden and weights differ: covered
        expected = block.experts(x, ids, weights)
    assert torch.allclose(by_keyword, expected, rtol=1e-5, atol=1e-6)
    assert mixed.dtype == x.dtype


def test_torch_save_and_deepcopy_keep_fused_experts() -> None:
    model = build("gpt_oss")
    fusion.fuse(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(model)
    inputs = corpus.make_inputs(model, seed=0)
    with torch.no_grad():
        out = model(**inputs).logits
        for other in (loaded, copied):
            experts = other.model.layers[0].mlp.experts
            assert isinstance(experts, FusedExperts)
            assert experts.original._parameters["gate_up_proj"] is experts.gate_up_proj
            assert torch.equal(other(**inputs).logits, out)


# --- hazards --------------------------------------------------------------------------------


def refusal(block: nn.Module) -> str:
    report = fusion.plan(nn.Sequential(block))
    assert "moe" not in report.counts(), str(report)
    return reasons(report)


def test_hooked_experts_are_refused() -> None:
    block = first_block("afmoe")
    block.experts.register_forward_hook(lambda *args: None)
    assert "experts has forward hooks" in refusal(block)


def test_hook_inside_the_experts_is_refused() -> None:
    block = first_block("afmoe")
    block.experts.act_fn.register_forward_pre_hook(lambda *args: None)
    assert "experts.act_fn has forward pre hooks" in refusal(block)


def test_experts_with_their_own_call_path_are_refused() -> None:
    block = first_block("afmoe")

    class Logged(type(block.experts)):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs) * 2

    block.experts.__class__ = Logged
    assert "has its own __call__" in refusal(block)


def test_experts_with_an_instance_forward_are_refused() -> None:
    block = first_block("afmoe")
    experts = block.experts
    experts.forward = lambda h, ids, w: type(experts).forward(experts, h, ids, w) * 2
    assert "forward or gating on the instance" in refusal(block)


def test_experts_holding_more_state_are_refused() -> None:
    block = first_block("afmoe")
    block.experts.register_parameter("scale", nn.Parameter(torch.ones(1)))
    assert "experts hold" in refusal(block)


def test_block_reading_an_experts_attribute_is_refused() -> None:
    block = first_block("afmoe")
    original = inspect.unwrap(type(block).forward)

    class Peeking(type(block)):
        def forward(self, hidden_states):
            assert self.experts.num_experts > 0
            return original(self, hidden_states)

    block.__class__ = Peeking
    assert "reads self.experts other than by calling it" in refusal(block)


def test_gating_with_a_random_op_is_refused() -> None:
    block = first_block("afmoe")

    class Noisy(type(block.experts)):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.nn.functional.dropout(self.act_fn(gate), 0.5, True) * up

    block.experts.__class__ = Noisy
    assert "is not one a fused kernel replays" in refusal(block)


def test_gating_reading_a_parameter_is_refused() -> None:
    block = first_block("afmoe")

    class Scaled(type(block.experts)):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return self.act_fn(gate) * up * self.down_proj[0, 0, 0]

    block.experts.__class__ = Scaled
    assert "gating reads module state" in refusal(block)


def test_gating_writing_module_state_is_refused() -> None:
    block = first_block("afmoe")

    class Counting(type(block.experts)):
        def _apply_gate(self, gate_up):
            self.last_width = gate_up.shape[-1]
            gate, up = gate_up.chunk(2, dim=-1)
            return self.act_fn(gate) * up

    block.experts.__class__ = Counting
    assert "gating writes module state" in refusal(block)


def test_eager_forward_other_than_the_interface_is_refused() -> None:
    """A class whose `forward` is a dispatcher of its own (even one wrapping Transformers'
    forward, `__wrapped__` included) is not proven to compute the experts function."""
    block = first_block("afmoe")
    base = type(block.experts)
    eager = inspect.unwrap(base.forward)

    class Doubled(base):
        pass

    def doubled(self, *args, **kwargs):
        return 2 * eager(self, *args, **kwargs)

    def dispatch(self, *args, **kwargs):
        if self.config._experts_implementation == "eager":
            return doubled(self, *args, **kwargs)
        return base.forward(self, *args, **kwargs)

    dispatch.__wrapped__ = doubled
    Doubled.forward = dispatch
    block.experts.__class__ = Doubled
    assert "Doubled.forward is not Transformers' experts dispatcher" in refusal(block)


def test_an_instance_hazard_refuses_that_instance_only() -> None:
    """Instance-level hazards are checked per instance, never while matching the class: the
    odd instance is refused, a plain one of the same class still fuses (in either order)."""
    for odd_first in (True, False):
        plain, odd = first_block("afmoe"), first_block("afmoe")
        odd.experts.forward = lambda h, ids, w: h  # not the experts function
        model = nn.Sequential(odd, plain) if odd_first else nn.Sequential(plain, odd)
        report = fusion.plan(model)
        fused_at = "1" if odd_first else "0"
        assert [r.qualname for r in report.applied if r.fuser == "moe"] == [fused_at]
        assert "forward or gating on the instance" in reasons(report)


def test_whole_block_fusion_refuses_experts_with_an_instance_forward() -> None:
    """FusedMoE calls the experts kernel, bypassing the experts' call: an instance-level
    forward on the experts would be dropped, so the whole block is refused too."""
    model = build("qwen3_moe")
    block = next(iter(blocks(model).values()))
    block.experts.forward = lambda h, ids, w: (
        2 * type(block.experts).forward(block.experts, h, ids, w)
    )
    report = fusion.plan(nn.Sequential(block))
    assert "moe" not in report.counts()
    assert "forward or gating on the instance" in reasons(report)


# --- replayed programs are proven, not sampled (issue 24) ------------------------------------


def routed(experts: nn.Module, tokens: int, top_k: int = 2, seed: int = 0) -> tuple:
    """(hidden [tokens, H], distinct top-k ids, weights) for a direct experts call."""
    hidden = experts.gate_up_proj.shape[1 if experts.is_transposed else 2]
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator)
    ids = torch.randn(tokens, experts.num_experts, generator=generator).topk(top_k, dim=-1).indices
    return x, ids, torch.rand(tokens, top_k, generator=generator)


def fuse_alone(block: nn.Module) -> tuple[nn.Module, str]:
    """A fused copy of `block` (alone in a Sequential) and the plan's refusal reasons."""
    fused = copy.deepcopy(block)
    return fused, reasons(fusion.fuse(nn.Sequential(fused)))


def with_gate(block: nn.Module, gate) -> nn.Module:
    """`block` with its experts' class replaced by a subclass gating with `gate`."""
    base = type(block.experts)
    block.experts.__class__ = type(f"Gated{base.__name__}", (base,), {"_apply_gate": gate})
    return block


def row_branch(self, gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    if gate_up.shape[0] == 1:  # a "decode" variant the 4-row trace never saw
        return self.act_fn(gate) * up * 2
    return self.act_fn(gate) * up


def mode_branch(self, gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    if self.training:
        return self.act_fn(gate) * up * 0.5
    return self.act_fn(gate) * up


def test_gating_branching_on_the_row_count_is_refused_or_exact() -> None:
    block = with_gate(first_block("afmoe"), row_branch)
    fused, why = fuse_alone(block)
    if not isinstance(fused.experts, FusedExperts):
        assert "row count" in why
        return
    for tokens, top_k in ((1, 1), (8, 2)):  # one gated row (grouped_mm gates T*K rows at once)
        x, ids, weights = routed(block.experts, tokens, top_k)
        with torch.no_grad():
            expected, actual = block.experts(x, ids, weights), fused.experts(x, ids, weights)
        assert relative_error(expected, actual) <= 1e-5, (tokens, top_k)


def test_gating_branching_on_training_is_refused_or_exact() -> None:
    block = with_gate(first_block("afmoe"), mode_branch)
    fused, why = fuse_alone(block)
    if not isinstance(fused.experts, FusedExperts):
        assert "training" in why
        return
    x, ids, weights = routed(block.experts, 6)
    for training in (False, True):
        block.train(training)
        fused.train(training)
        with torch.no_grad():
            expected, actual = block.experts(x, ids, weights), fused.experts(x, ids, weights)
        assert relative_error(expected, actual) <= 1e-5, training


@pytest.mark.parametrize(
    ("arch", "name", "value"),
    [
        ("deepseek_v4", "limit", 0.1),  # clamped SiLU reads self.limit
        ("gpt_oss", "limit", 0.1),
        ("gpt_oss", "alpha", 0.5),
        ("afmoe", "act_fn", nn.GELU()),  # the default gating's activation module
    ],
)
def test_attribute_changed_after_fusing_runs_the_original(arch: str, name: str, value) -> None:
    block = first_block(arch)
    fused, _ = fuse_alone(block)
    assert isinstance(fused.experts, FusedExperts)
    x, ids, weights = routed(block.experts, 6)
    with torch.no_grad():
        before = block.experts(x, ids, weights)
        assert relative_error(before, fused.experts(x, ids, weights)) <= 1e-5
        assert fused.experts.guard_failures == 0
        old, fused_old = getattr(block.experts, name), getattr(fused.experts, name)
        setattr(block.experts, name, value)
        setattr(fused.experts, name, copy.deepcopy(value))
        expected, actual = block.experts(x, ids, weights), fused.experts(x, ids, weights)
        assert relative_error(before, expected) > 1e-3  # the change changes the function
        assert torch.equal(actual, expected)  # the original module ran, on the new value
        assert fused.experts.guard_failures == 1
        # Set back (a module: the same object): the fused path again, no further fallback.
        setattr(block.experts, name, old)
        setattr(fused.experts, name, fused_old)
        assert relative_error(before, fused.experts(x, ids, weights)) <= 1e-5
    assert fused.experts.guard_failures == 1


CAPACITY = 20
"""Rows per expert past which the capacity-dropping experts below drop a routed row."""


def capacity_forward(self, hidden_states, top_k_index, top_k_weights):
    """An eager loop that drops every row past `CAPACITY` per expert (not the experts
    function: at 16 tokens no expert reaches the capacity, at 64 most do)."""
    final = torch.zeros_like(hidden_states)
    for expert in range(self.num_experts):
        token_idx, top_k_pos = torch.where(top_k_index == expert)
        token_idx, top_k_pos = token_idx[:CAPACITY], top_k_pos[:CAPACITY]
        gate, up = F.linear(hidden_states[token_idx], self.gate_up_proj[expert]).chunk(2, dim=-1)
        current = F.linear(self.act_fn(gate) * up, self.down_proj[expert])
        current = current * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, current.to(final.dtype))
    return final


def with_capacity(block: nn.Module) -> nn.Module:
    """`block` whose experts carry Transformers' experts decorator over a capacity-dropping
    forward of their own, run eagerly (the configured implementation)."""
    base = type(block.experts)
    capacity = type(f"Capacity{base.__name__}", (base,), {"forward": capacity_forward})
    block.experts.__class__ = use_experts_implementation(capacity)
    block.experts.config._experts_implementation = "eager"
    return block


def test_decorated_experts_with_their_own_computation_are_refused_or_exact() -> None:
    block = with_capacity(first_block("afmoe"))
    fused, why = fuse_alone(block)
    if not isinstance(fused.experts, FusedExperts):
        assert "not a Transformers experts forward" in why
        return
    for tokens in (16, 64):
        x, ids, weights = routed(block.experts, tokens)
        with torch.no_grad():
            expected, actual = block.experts(x, ids, weights), fused.experts(x, ids, weights)
        assert relative_error(expected, actual) <= 1e-5, tokens


def test_whole_block_with_decorated_capacity_experts_is_refused_or_exact() -> None:
    """The whole-block fusion (`FusedMoE`) computes the experts itself: the same proof."""
    model = build("qwen3_moe")
    block = with_capacity(next(iter(blocks(model).values())))
    fused, why = fuse_alone(block)
    if type(fused) is type(block) and not isinstance(fused.experts, FusedExperts):
        assert "not a Transformers experts forward" in why
        return
    hidden = block.experts.gate_up_proj.shape[2]
    x = torch.randn(1, 64, hidden, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert relative_error(first(block(x.clone())), first(fused(x.clone()))) <= 1e-5


def test_the_class_forward_of_a_transformers_experts_class_is_proven() -> None:
    """A subclass that only changes the gating keeps Transformers' forward (the function
    object itself): accepted, and its gating replayed."""

    def doubled_up(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * (up * 2)

    block = with_gate(first_block("afmoe"), doubled_up)
    fused, why = fuse_alone(block)
    assert isinstance(fused.experts, FusedExperts), why
    x, ids, weights = routed(block.experts, 9)
    with torch.no_grad():
        assert (
            relative_error(block.experts(x, ids, weights), fused.experts(x, ids, weights)) <= 1e-5
        )


def outcome(experts: nn.Module, *args: torch.Tensor) -> torch.Tensor | type:
    """The experts' output, or the type of the exception they raise."""
    try:
        with torch.no_grad():
            return experts(*args)
    except Exception as exc:  # the exception type is the outcome compared
        return type(exc)


@pytest.mark.parametrize("arch", ["afmoe", "gpt_oss", "deepseek_v4"])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_out_of_range_ids_behave_as_unfused(arch: str, implementation: str) -> None:
    """id == num_experts is Transformers' "dropped" id (its eager loop skips it); other ids
    outside [0, E) raise in the eager loop, wrap (batched_mm) or read uninitialised rows
    (grouped_mm). Fused: never raises where unfused works; the eager implementation
    exactly; `E` skipped under every implementation; anything else runs the original."""
    block = first_block(arch)
    block.experts.config._experts_implementation = implementation
    fused, why = fuse_alone(block)
    assert isinstance(fused.experts, FusedExperts), why
    experts = block.experts
    num = experts.num_experts
    x, ids, weights = routed(experts, 6)
    calls: list[int] = []
    fused.experts.original.register_forward_pre_hook(lambda *args: calls.append(1))
    for bad in (num, num + 1, -1):
        bad_ids = ids.clone()
        bad_ids[::2, 1] = bad
        expected = outcome(experts, x, bad_ids, weights)
        actual = outcome(fused.experts, x, bad_ids, weights)
        if isinstance(actual, type):  # fused raises only where unfused raises, alike
            assert expected is actual, (bad, actual)
        elif implementation == "eager":
            assert isinstance(expected, torch.Tensor) and torch.equal(actual, expected), bad
        elif bad == num:  # skipped: the contribution of those (token, choice) pairs is 0
            kept = bad_ids != num
            skipped = outcome(experts, x, ids.where(kept, 0), weights.where(kept, 0))
            assert relative_error(skipped, actual) <= 1e-5, bad
        else:  # the original ran: its result is whatever the implementation computes
            assert calls, bad
            if implementation == "batched_mm" and isinstance(expected, torch.Tensor):
                assert torch.equal(actual, expected), bad  # wraps around, deterministically
        calls.clear()


def patch_gate_class(block: nn.Module, fused: nn.Module) -> None:
    """A class-level edit after fusing: the gating function replaced on the class (which
    the fused module's original shares: a deep copy keeps the class)."""

    def halved(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up * 0.5

    type(block.experts)._apply_gate = halved


def hook_activation(block: nn.Module, fused: nn.Module) -> None:
    """A hook on the activation, read through the fused module as the user would."""
    for owner in (block, fused):
        owner.experts.act_fn.register_forward_hook(lambda module, args, out: out * 0.5)


@pytest.mark.parametrize("edit", [patch_gate_class, hook_activation])
def test_gating_edited_after_fusing_runs_the_original(edit) -> None:
    """The replayed program stands for the class's gating and its activation's call: a
    class patch or a hook on the activation after fusing runs the original."""
    block = with_gate(first_block("afmoe"), _default_gate)  # a class of the test's own
    fused, why = fuse_alone(block)
    assert isinstance(fused.experts, FusedExperts), why
    x, ids, weights = routed(block.experts, 6)
    with torch.no_grad():
        before = block.experts(x, ids, weights)
        edit(block, fused)
        expected, actual = block.experts(x, ids, weights), fused.experts(x, ids, weights)
    assert relative_error(before, expected) > 1e-3
    assert relative_error(expected, actual) <= 1e-5
    assert fused.experts.guard_failures == 1


def _default_gate(self, gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return self.act_fn(gate) * up


def test_an_instance_holding_more_state_does_not_refuse_later_instances() -> None:
    """The match cache keys a class by what its children hold (`matches.cache_key`): experts
    refused for a Parameter of their own leave a plain instance of the class, planned
    later in another model, to fuse (it was once refused with the odd instance's reason)."""
    odd = first_block("afmoe")
    odd.experts.register_parameter("scale", nn.Parameter(torch.ones(1)))
    assert "experts hold" in refusal(odd)
    report = fusion.plan(nn.Sequential(first_block("afmoe")))
    assert [r.qualname for r in report.applied if r.fuser == "moe"] == ["0"], str(report)
