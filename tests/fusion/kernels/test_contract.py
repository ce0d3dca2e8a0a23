"""`fusion.kernels.contract` (issue 24): a CPU fast path (the native kernel, oneDNN's one-row
product, the experts' GEMMs, MergedLinear's per-shard products) runs only where PyTorch itself
would run the plain dense kernel; under autocast, a `__torch_function__` or
`__torch_dispatch__` subclass or mode, a functorch transform or a reduced float32 matmul
precision, the fused modules compute exactly what the unfused ones compute.

Each fast path is forced on for test-sized operands (`native_helpers`), so the tests run on
any machine (the AVX-512 and size rules are speed rules); a spy records which path ran."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from fusion import kernels
from fusion.kernels import contract, ops
from fusion.kernels import reference as torch_ref
from fusion.runtime.merged import FusedRMSNorm
from tests.fusion.dynamo_graphs import compiled_call_targets
from tests.fusion.kernels.contract_helpers import (
    K,
    PlusOneMode,
    linear_pair,
    merged_pair,
    mkldnn_matmul_bf16,
    plus_one_on_linear,
)
from tests.fusion.kernels.native_helpers import (
    force_native_off,
    force_native_on,
    force_onednn_row_on,
)

# --------------------------------------------------------------------------------------------
# Ambient state the fast paths must obey


class PlusOneTensor(torch.Tensor):
    """An input whose class overrides `F.linear` through `__torch_function__`."""

    __torch_function__ = classmethod(plus_one_on_linear)


class PlusOneParameter(nn.Parameter):
    """A weight (assignable after fusing) whose class overrides `F.linear`."""

    __torch_function__ = classmethod(plus_one_on_linear)


_MATMULS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
}


class PlusOneDispatchMode(TorchDispatchMode):
    """A `__torch_dispatch__` mode under which every ATen matmul adds 1.0."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out + 1.0 if func in _MATMULS else out


class PlusOneWrapper(torch.Tensor):
    """A `__torch_dispatch__` wrapper subclass whose ATen matmuls add 1.0 (results plain)."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), dtype=elem.dtype, device=elem.device
        )

    def __init__(self, elem: torch.Tensor) -> None:
        self.elem = elem

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t.elem if isinstance(t, PlusOneWrapper) else t

        out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs or {}))
        return out + 1.0 if func in _MATMULS else out


def _legacy_medium() -> None:
    torch.set_float32_matmul_precision("medium")


def _legacy_high() -> None:
    torch.set_float32_matmul_precision("high")


def _mkldnn_all_bf16() -> None:
    torch.backends.mkldnn.fp32_precision = "bf16"


def _generic_tf32() -> None:
    torch.backends.fp32_precision = "tf32"


REDUCED_PRECISION = [
    _legacy_medium,
    _legacy_high,
    mkldnn_matmul_bf16,
    _mkldnn_all_bf16,
    _generic_tf32,
]


# --------------------------------------------------------------------------------------------
# Fast paths forced on, and a spy on them


@pytest.fixture(params=["native", "onednn_row"])
def fast_path(request, monkeypatch) -> str:
    """One CPU decode path forced on for test-sized operands, the other off."""
    if request.param == "native":
        force_native_on(monkeypatch)
    else:
        force_native_off()
        force_onednn_row_on(monkeypatch)
    return request.param


def _rows(path: str) -> tuple[int, ...]:
    """Input rows each path takes: the native kernel 1 to its row limit, oneDNN one."""
    return (1, 4, 16) if path == "native" else (1,)


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor) if type(t) is not torch.Tensor else t


# --------------------------------------------------------------------------------------------
# The predicate itself


def test_plain_state_is_plain_and_the_fast_path_runs(fast_path: str, taken: list[str]) -> None:
    """The control: plain tensors, no ambient state: the predicate says None and the fast
    path runs (so the refusals below are the predicate's doing)."""
    linear, row = linear_pair()
    x = torch.randn(1, K)
    assert contract.plain_dense("cpu", x, linear.weight, linear.bias) is None
    with torch.no_grad():
        torch.testing.assert_close(row(x), linear(x), rtol=1e-5, atol=1e-5)
    assert taken == [fast_path]


def test_each_rule_names_its_reason() -> None:
    """Every refusal is a reason string naming what PyTorch would do differently."""
    x, w = torch.randn(2, K), torch.randn(8, K)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "autocast" in contract.plain_dense("cpu", x, w)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert contract.plain_dense("cpu", x, w) is None
    assert "subclass" in contract.plain_dense("cpu", x.as_subclass(PlusOneTensor), w)
    assert "subclass" in contract.plain_dense("cpu", x, PlusOneParameter(w))
    assert contract.plain_dense("cpu", x, nn.Parameter(w), None) is None
    with PlusOneMode():
        assert "__torch_function__ mode" in contract.plain_dense("cpu", x, w)
    with PlusOneDispatchMode():
        assert "__torch_dispatch__ mode" in contract.plain_dense("cpu", x, w)
    assert "layout" in contract.plain_dense("cpu", x.to_sparse(), w)
    assert "device" in contract.plain_dense("cpu", x.to("meta"), w)
    assert "no known numerics settings" in contract.plain_dense("mps")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast has no state for meta
        assert "autocast state unknown" in contract.plain_dense("meta")
    seen: list[str | None] = []
    torch.func.vmap(lambda row: seen.append(contract.plain_dense("cpu", row, w)) or row)(x)
    assert seen and "functorch" in seen[0]


def test_device_context_is_plain(fast_path: str, taken: list[str]) -> None:
    """`with torch.device(...)` (and `torch.set_default_device`) is a `__torch_function__`
    mode that only fills in the device of factory calls: `F.linear` under it is the plain
    kernel, so the fast path still runs."""
    linear, row = linear_pair()
    x = torch.randn(1, K)
    with torch.no_grad(), torch.device("cpu"):
        assert contract.plain_dense("cpu", x, linear.weight) is None
        torch.testing.assert_close(row(x), linear(x), rtol=1e-5, atol=1e-5)
    assert taken == [fast_path]


@pytest.mark.parametrize("setting", REDUCED_PRECISION, ids=lambda f: f.__name__.strip("_"))
def test_reduced_matmul_precision_is_not_plain(setting, restore_precision) -> None:
    """A float32 matmul precision below 'highest' (legacy or per-backend spelling) changes
    what the dense kernel computes (bf16 or tf32 inside oneDNN on machines that have it)."""
    x, w = torch.randn(2, K), torch.randn(8, K)
    assert contract.plain_dense("cpu", x, w) is None
    setting()
    assert "precision" in contract.plain_dense("cpu", x, w)


def test_unreadable_settings_fail_closed(monkeypatch) -> None:
    """A torch whose precision getter fails (renamed, or a state it refuses to report):
    unknown state, so not plain."""

    def broken(*_args):
        raise RuntimeError("mixed legacy and new APIs")

    monkeypatch.setattr(torch._C, "_get_fp32_precision_getter", broken)
    assert "precision" in contract.plain_dense("cpu", torch.randn(2, K), torch.randn(8, K))


# --------------------------------------------------------------------------------------------
# Defect 1: CPU autocast


def test_row_linear_under_cpu_autocast_is_the_unfused_linear(
    fast_path: str, taken: list[str]
) -> None:
    """Under `torch.autocast("cpu", bfloat16)` an `nn.Linear` returns bfloat16: so does the
    fused linear (its `LinearForward`), with the same values (it runs the same `F.linear`)."""
    linear, row = linear_pair()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for rows in _rows(fast_path):
            x = torch.randn(rows, K)
            want, got = linear(x), row(x)
            assert got.dtype == want.dtype == torch.bfloat16
            assert torch.equal(got, want)
    assert taken == []


def test_merged_linear_under_cpu_autocast_is_the_unfused_linears(
    fast_path: str, taken: list[str]
) -> None:
    """A merged q/k/v under CPU autocast returns what the three projections return under it:
    bfloat16, the same values (to bfloat16 rounding of one GEMM against three)."""
    unfused, merged = merged_pair()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for rows in _rows(fast_path):
            x = torch.randn(1, rows, K)
            want, got = unfused(x), merged(x)
            assert got.dtype == want.dtype == torch.bfloat16
            torch.testing.assert_close(got, want)
    assert taken == []


def _bf16_linear_pair(seed: int = 0) -> tuple[nn.Linear, nn.Linear]:
    """`linear_pair` in bfloat16 (a bf16 model's projection and its fused twin)."""
    linear, row = linear_pair(seed)
    return linear.to(torch.bfloat16), row.to(torch.bfloat16)


def test_bfloat16_modules_obey_the_ambient_state(monkeypatch, taken: list[str]) -> None:
    """The native kernel's bf16 path (a bf16 model's projections) is the dense kernel's
    stand-in on the same terms as float32: taken in plain state (within a bf16 rounding of
    `F.linear`), and refused, so the unfused call runs with its exact result, under
    autocast to another dtype, a `__torch_function__` mode, a subclass input and a
    `__torch_dispatch__` mode."""
    force_native_on(monkeypatch)
    linear, row = _bf16_linear_pair()
    with torch.no_grad():
        for rows in (1, 4, 16):
            x = torch.randn(rows, K).bfloat16()
            want, got = linear(x), row(x)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7)
        assert taken == ["native"] * 3
        taken.clear()
        x = torch.randn(4, K).bfloat16()
        with torch.autocast("cpu", dtype=torch.float16):
            got, want = row(x), linear(x)
            assert got.dtype == want.dtype == torch.float16 and torch.equal(got, want)
        with PlusOneMode():
            assert torch.equal(row(x), linear(x))
        with PlusOneDispatchMode():
            assert torch.equal(row(x), linear(x))
        sub = x.as_subclass(PlusOneTensor)
        assert torch.equal(_plain(row(sub)), _plain(linear(sub)))
    assert taken == []


# --------------------------------------------------------------------------------------------
# Defect 2: subclasses and modes


def test_a_subclass_input_runs_its_override(fast_path: str, taken: list[str]) -> None:
    """An input whose class overrides `F.linear` (`__torch_function__`): the override runs,
    in a fused linear and `MergedLinear` as in the unfused projections."""
    linear, row = linear_pair()
    unfused, merged = merged_pair()
    with torch.no_grad():
        for rows in _rows(fast_path):
            x = torch.randn(rows, K).as_subclass(PlusOneTensor)
            assert torch.equal(_plain(row(x)), _plain(linear(x)))
            torch.testing.assert_close(_plain(merged(x)), _plain(unfused(x)))
    assert taken == []


def test_a_subclass_weight_set_after_fusing_runs_its_override(
    fast_path: str, taken: list[str]
) -> None:
    """A weight replaced after fusing by a Parameter whose class overrides `F.linear`: the
    override runs (one row and several; MergedLinear's per-shard products included)."""
    linear, row = linear_pair()
    _, merged = merged_pair()
    for module in (linear, row):
        module.weight = PlusOneParameter(module.weight.detach().clone(), requires_grad=False)
    for shard in merged.shards:  # the view of the stacked weight breaks: shards apart
        shard.weight = PlusOneParameter(shard.weight.detach().clone(), requires_grad=False)
    with torch.no_grad():
        for rows in _rows(fast_path):
            x = torch.randn(rows, K)
            assert torch.equal(_plain(row(x)), _plain(linear(x)))
            want = torch.cat(
                [
                    F.linear(x, s.weight.as_subclass(torch.Tensor), s.bias) + 1.0
                    for s in merged.shards
                ],
                dim=-1,
            )
            torch.testing.assert_close(_plain(merged(x)), want)
    assert taken == []


def test_a_torch_function_mode_is_obeyed(fast_path: str, taken: list[str]) -> None:
    """A `TorchFunctionMode` active around the forward sees the fused modules' `F.linear`."""
    linear, row = linear_pair()
    unfused, merged = merged_pair()
    with torch.no_grad(), PlusOneMode():
        for rows in _rows(fast_path):
            x = torch.randn(rows, K)
            assert torch.equal(row(x), linear(x))
            torch.testing.assert_close(merged(x), unfused(x))
    assert taken == []


def test_a_torch_dispatch_mode_is_obeyed(fast_path: str, taken: list[str]) -> None:
    """A `TorchDispatchMode` active around the forward sees the fused modules' ATen matmul."""
    linear, row = linear_pair()
    unfused, merged = merged_pair()
    with torch.no_grad(), PlusOneDispatchMode():
        for rows in _rows(fast_path):
            x = torch.randn(rows, K)
            assert torch.equal(row(x), linear(x))
            torch.testing.assert_close(merged(x), unfused(x))
    assert taken == []


def test_a_torch_dispatch_subclass_is_obeyed(fast_path: str, taken: list[str]) -> None:
    """An input that is a `__torch_dispatch__` wrapper subclass: its matmul override runs."""
    linear, row = linear_pair()
    with torch.no_grad():
        for rows in _rows(fast_path):
            x = PlusOneWrapper(torch.randn(rows, K))
            assert torch.equal(_plain(row(x)), _plain(linear(x)))
    assert taken == []


def test_a_functorch_transform_is_obeyed(fast_path: str, taken: list[str]) -> None:
    """Under `torch.func.vmap` the operands are batched tensors (plain `torch.Tensor` by
    type): the fused module computes each sample as the unfused one does."""
    linear, row = linear_pair()
    x = torch.randn(3, 1, K)
    with torch.no_grad():
        got = torch.func.vmap(row)(x)
        want = torch.stack([linear(sample) for sample in x])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert taken == []


# --------------------------------------------------------------------------------------------
# Defect 3: numerics settings


@pytest.mark.parametrize("setting", REDUCED_PRECISION, ids=lambda f: f.__name__.strip("_"))
def test_reduced_matmul_precision_takes_f_linear(
    fast_path: str, taken: list[str], setting, restore_precision
) -> None:
    """Under a reduced float32 matmul precision the fused modules run `F.linear` (which
    follows the setting), never a kernel that ignores it. On an AVX2 CPU both compute the
    same numbers, so the spy is the check."""
    linear, row = linear_pair()
    unfused, merged = merged_pair()
    setting()
    with torch.no_grad():
        for rows in _rows(fast_path):
            x = torch.randn(rows, K)
            assert torch.equal(row(x), linear(x))
            torch.testing.assert_close(merged(x), unfused(x))
    assert taken == []


# --------------------------------------------------------------------------------------------
# A backend with kernels of its own (as the GPU backends have), behind `fusion.kernels.ops`

MARK = 7.0


class MarkedKernels:
    """Every op returns `MARK`s: where the reference runs instead, the mark is absent."""

    name = "marked"
    interpreted = False
    delegated: frozenset[str] = frozenset()
    auto_pick = False

    def supports(self, device: torch.device) -> bool:
        return True

    def rms_norm(self, x, weight, eps, **flags):
        return torch.full_like(x, MARK)

    def add_rms_norm(self, a, b, weight, eps, **flags):
        total = a + b
        return total, torch.full_like(total, MARK)

    def act_and_mul(self, x, activation):
        return torch.full_like(x[..., : x.shape[-1] // 2], MARK)

    def moe_experts(self, hidden, gate_up, down, topk_ids, topk_weights, activation):
        return torch.full_like(hidden, MARK)


@pytest.fixture
def marked() -> str:
    """`MarkedKernels` installed as backend 'marked' for one test (the suite's autouse
    fixture uninstalls it)."""
    kernels.REGISTRY.install("marked", MarkedKernels())
    return "marked"


def _marked_calls(backend: str, x: torch.Tensor) -> list[torch.Tensor]:
    """Each op of `fusion.kernels.ops` on `backend` (norms, act-and-mul, experts)."""
    weight = torch.randn(x.shape[-1])
    gate_up, down = torch.randn(4, 2 * 8, x.shape[-1]), torch.randn(4, x.shape[-1], 8)
    ids, routing = torch.zeros(x.shape[0], 1, dtype=torch.long), torch.ones(x.shape[0], 1)
    return [
        ops.rms_norm(backend, x, weight, 1e-6),
        ops.add_rms_norm(backend, x, x, weight, 1e-6)[1],
        ops.act_and_mul(backend, x, "silu"),
        ops.moe_experts(backend, x, gate_up, down, ids, routing, "silu"),
    ]


def _is_marked(t: torch.Tensor) -> bool:
    return bool((_plain(t) == MARK).all())


def test_backend_kernels_run_only_where_the_contract_holds(marked: str, restore_precision) -> None:
    """`ops` hands a backend's own kernels (not the reference's torch ops) only calls where
    PyTorch would run its plain kernels; under autocast, a subclass or a mode the torch
    reference runs. A matmul precision setting refuses the experts (a product) only."""
    x = torch.randn(3, 32)
    with torch.no_grad():
        assert all(_is_marked(t) for t in _marked_calls(marked, x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not any(_is_marked(t) for t in _marked_calls(marked, x))
        with PlusOneMode():
            assert not any(_is_marked(t) for t in _marked_calls(marked, x))
        assert not any(_is_marked(t) for t in _marked_calls(marked, x.as_subclass(PlusOneTensor)))
        mkldnn_matmul_bf16()
        assert [_is_marked(t) for t in _marked_calls(marked, x)] == [True, True, True, False]


def test_compiled_backend_kernels_follow_the_contract(marked: str) -> None:
    """While Dynamo traces: a backend's kernel becomes its operator, except under autocast
    (then the reference's ops are traced, and autocast applies to them)."""
    norm = FusedRMSNorm(
        nn.Parameter(torch.ones(32)),
        1e-6,
        verified=frozenset({(torch.float32, torch.float32)}),
        backend=marked,
    )
    x = torch.randn(3, 32)
    out, targets = compiled_call_targets(norm, x)
    assert "fusion.rms_norm" in targets and _is_marked(out)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, targets = compiled_call_targets(norm, x)
    assert "fusion.rms_norm" not in targets and not _is_marked(out)


# --------------------------------------------------------------------------------------------
# The MoE experts


def _mixtral_experts(hidden: int = 256, inter: int = 192, experts: int = 8) -> MixtralExperts:
    config = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts)
    config._experts_implementation = "eager"
    module = MixtralExperts(config).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=g) * 0.06)
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=g) * 0.07)
    return module


def _routing(tokens: int, experts: int = 8, top_k: int = 2):
    g = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, 256, generator=g)
    weights, ids = torch.topk(torch.randn(tokens, experts, generator=g).softmax(-1), top_k)
    return hidden, ids, weights


@pytest.mark.parametrize("backend", ["native", "onednn"])
@pytest.mark.parametrize("tokens", [1, 6, 160])
def test_moe_experts_under_cpu_autocast_are_the_unfused_experts(
    monkeypatch, taken: list[str], backend: str, tokens: int
) -> None:
    """Transformers' expert loop under CPU autocast runs its GEMMs in bfloat16 and sums in
    float32; the fused experts (any CPU backend, through `ops.moe_experts`) compute the
    same: no float32 fast path, the same dtype and values."""
    force_native_on(monkeypatch)
    if kernels.available_backends("cpu").count(backend) == 0:
        pytest.skip(f"backend {backend} is not available here")
    module = _mixtral_experts()
    hidden, ids, weights = _routing(tokens)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = module(hidden, ids, weights)
        got = ops.moe_experts(
            backend, hidden, module.gate_up_proj, module.down_proj, ids, weights, "silu"
        )
        ref = torch_ref.moe_experts(
            hidden, module.gate_up_proj, module.down_proj, ids, weights, "silu"
        )
    assert got.dtype == want.dtype == ref.dtype == hidden.dtype
    torch.testing.assert_close(ref, want)
    torch.testing.assert_close(got, want)
    assert taken == []


@pytest.mark.parametrize("setting", [_legacy_medium, mkldnn_matmul_bf16])
def test_moe_experts_under_reduced_precision_take_the_reference(
    monkeypatch, taken: list[str], setting, restore_precision
) -> None:
    """The experts' native GEMMs are refused under a reduced matmul precision too."""
    force_native_on(monkeypatch)
    module = _mixtral_experts()
    hidden, ids, weights = _routing(6)
    setting()
    with torch.no_grad():
        for backend in ("native", "onednn"):
            if backend not in kernels.available_backends("cpu"):
                continue
            got = ops.moe_experts(
                backend, hidden, module.gate_up_proj, module.down_proj, ids, weights, "silu"
            )
            torch.testing.assert_close(got, module(hidden, ids, weights))
    assert taken == []
