"""`fusion.kernels.ops`: the kernels as registered operators, so compiled fused models trace
fullgraph; eager calls skip the operator's dispatch cost."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import fusion
from fusion.kernels import ops
from fusion.kernels import reference as torch_ref
from fusion.kernels.policy import POLICY
from tests.fusion.tiny_models import tiny_model, token_ids


def _moe_args(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 16, generator=g).to(dtype)
    gate_up = torch.randn(4, 24, 16, generator=g).to(dtype)
    down = torch.randn(4, 16, 12, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(7)])
    weights = torch.rand(7, 2, generator=g)
    return hidden, gate_up, down, ids, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_operators_pass_opcheck(dtype: torch.dtype) -> None:
    """Schema, fake (meta) implementation and dispatch of every operator agree with the
    real kernels (torch.library.opcheck), in float32 and bfloat16."""
    x = torch.randn(3, 8).to(dtype)
    w = (1 + 0.1 * torch.randn(8)).to(dtype)
    for variant in ((0.0, True, True, False), (1.0, True, False, False), (0.0, False, True, True)):
        torch.library.opcheck(torch.ops.fusion.rms_norm, (x, w, 1e-6, *variant, "torch"))
    torch.library.opcheck(
        torch.ops.fusion.rms_norm, (x, None, 1e-6, 0.0, True, True, False, "torch")
    )
    torch.library.opcheck(torch.ops.fusion.act_and_mul, (x, "silu", "torch"))
    torch.library.opcheck(torch.ops.fusion.moe_experts, (*_moe_args(dtype), "silu", "torch"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["reference", "eligible"])
def test_product_operators_pass_opcheck(dtype: torch.dtype, mode: str) -> None:
    """The two inference-only products (no autograd kernel of ours, `_product_operator`):
    schema, fake implementation and dispatch agree with the real call, whether the policy
    names the reference or lets a fast kernel run; and each computes its function."""
    POLICY.use(mode)
    try:
        x, weight, bias = torch.randn(1, 16).to(dtype), torch.randn(24, 16).to(dtype), None
        args = (x, weight, bias, "linear", [24, 16], "auto")
        torch.library.opcheck(torch.ops.fusion.linear_product, args)
        got = torch.ops.fusion.linear_product(*args)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, weight))
        shards = list(weight.split([8, 16]))
        stacked = (x, weight, None, shards, [None, None], [False, False], [24, 16], "auto")
        torch.library.opcheck(torch.ops.fusion.stacked_product, stacked)
        got = torch.ops.fusion.stacked_product(*stacked)
        want = torch.cat([torch.nn.functional.linear(x, w) for w in shards], -1)
        torch.testing.assert_close(got, want)
    finally:
        POLICY.reset()


def test_operators_compute_the_kernels() -> None:
    args = _moe_args()
    want = torch_ref.moe_experts(*args, "silu")
    assert torch.equal(torch.ops.fusion.moe_experts(*args, "silu", "torch"), want)
    x = torch.randn(2, 8)
    assert torch.equal(
        torch.ops.fusion.act_and_mul(x, "gelu_tanh", "torch"), torch_ref.act_and_mul(x, "gelu_tanh")
    )


def test_eager_calls_skip_the_operator(monkeypatch) -> None:
    """Eager mode calls the backend directly (no ~7 us dispatch per call)."""
    monkeypatch.setattr(torch.ops.fusion, "act_and_mul", None, raising=False)
    x = torch.randn(2, 8)
    assert torch.equal(ops.act_and_mul("torch", x, "silu"), torch_ref.act_and_mul(x, "silu"))


def test_training_while_compiling_uses_differentiable_kernels(monkeypatch) -> None:
    # The operator path, as while Dynamo traces. Patched at ops' own decision point:
    # patching `torch.compiler.is_compiling` itself, if Dynamo first initialises meanwhile,
    # makes Dynamo treat the real function as a skipped one in every later test.
    monkeypatch.setattr(ops, "_use_operator", lambda: True)
    args = list(_moe_args())
    args[1] = args[1].requires_grad_(True)
    out = ops.moe_experts("torch", *args, "silu")
    out.sum().backward()
    assert args[1].grad is not None


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "gemma2"])
def test_fused_models_compile_fullgraph(model_type: str) -> None:
    """Fused MoE (data-dependent routing inside the kernel), MLA and offset-norm models trace
    fullgraph (Dynamo) and give the eager fused logits."""
    unfused = tiny_model(model_type, seed=2)
    fused = copy.deepcopy(unfused)
    fusion.fuse(fused)
    ids = token_ids()
    torch._dynamo.reset()
    compiled = torch.compile(fused, fullgraph=True, backend="eager")
    with torch.no_grad():
        got, want = compiled(ids).logits, fused(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_compiled_fused_models_do_not_recompile(model_type: str) -> None:
    """Per-call backend dispatch (`kernels.get(self.backend, device)`) costs no recompile:
    one frame compiled, and a second call on new token values (same shapes) runs with
    `error_on_recompile` set, dense and MoE."""
    from torch._dynamo.testing import CompileCounter

    fused = tiny_model(model_type, seed=3)
    fusion.fuse(fused)
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(fused, fullgraph=True, backend=counter)
    with torch.no_grad():
        first = compiled(token_ids(seed=0)).logits
        with torch._dynamo.config.patch(error_on_recompile=True):
            second = compiled(token_ids(seed=1)).logits
            torch.testing.assert_close(second, fused(token_ids(seed=1)).logits)
    assert counter.frame_count == 1
    assert not torch.equal(first, second)
    torch._dynamo.reset()


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_compiled_training_step_uses_the_operators(model_type: str) -> None:
    """With gradients, a fused model compiles fullgraph through AOT autograd (the operators'
    registered derivatives) and gives the eager fused model's loss and gradients."""
    fused = tiny_model(model_type, seed=4)
    fusion.fuse(fused)
    twin = copy.deepcopy(fused)
    ids = token_ids(seed=2)
    torch._dynamo.reset()
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    compiled(ids, labels=ids).loss.backward()
    fused(ids, labels=ids).loss.backward()
    grads = dict(twin.named_parameters())
    checked = 0
    for name, param in fused.named_parameters():
        if param.grad is None:
            assert grads[name].grad is None, name
            continue
        torch.testing.assert_close(grads[name].grad, param.grad, rtol=1e-4, atol=1e-6, msg=name)
        checked += 1
    assert checked > 10
    torch._dynamo.reset()


def test_a_kept_choice_answers_only_in_its_epoch_and_for_its_call(monkeypatch) -> None:
    """`ops.chosen_for`: a product site's memo answers for the same dtype, row count and
    thread count while the policy's answers stand; a new table or mode (a new epoch),
    another call shape or thread count, a copied or unpickled memo, and a recording policy
    all ask the policy again, and get its current answer."""
    asked: list[int] = []
    answer = [("native",)]
    monkeypatch.setattr(
        POLICY, "choose", lambda op, shape, dtype, rows, backend: asked.append(rows) or answer[0]
    )
    POLICY.forget()
    x = torch.randn(1, 8)
    memo, kernels = ops.chosen_for(None, "linear", (4, 8), "auto", x, 8)
    assert kernels == ("native",) and len(asked) == 1
    assert ops.chosen_for(memo, "linear", (4, 8), "auto", x, 8) == (memo, ("native",))
    assert len(asked) == 1  # kept
    answer[0] = ()
    POLICY.forget()  # what `use` and `set_table` do
    assert ops.chosen_for(memo, "linear", (4, 8), "auto", x, 8)[1] == () and len(asked) == 2
    memo, _ = ops.chosen_for(None, "linear", (4, 8), "auto", x, 8)
    for other in (torch.randn(3, 8), x.double()):
        ops.chosen_for(memo, "linear", (4, 8), "auto", other, 8)
    assert len(asked) == 5
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        ops.chosen_for(memo, "linear", (4, 8), "auto", x, 8)
    finally:
        torch.set_num_threads(threads)
    assert len(asked) == 6
    for copied in (copy.deepcopy(memo), pickle.loads(pickle.dumps(memo))):
        ops.chosen_for(copied, "linear", (4, 8), "auto", x, 8)
    assert len(asked) == 8
    with POLICY.recording_asks():
        ops.chosen_for(memo, "linear", (4, 8), "auto", x, 8)
    assert len(asked) == 9
