"""`add_rms_norm`: the residual add and the RMSNorm of the sum, on every backend.

The function is defined as `(a + b, rms_norm(a + b))`: each backend must return PyTorch's own
sum bit for bit, and its normalised value bit for bit equal to its own `rms_norm` of that sum
(the fused call may not change what `FusedRMSNorm` computes). On a CPU-only machine Triton
runs in its interpreter (`TRITON_INTERPRET=1`, set here before triton is first imported).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before fusion imports triton

from fusion import kernels
from fusion.kernels import ops
from fusion.kernels import reference as torch_ref
from fusion.kernels.norm_variant import DEFAULT_VARIANT, NormVariant
from fusion.runtime.merged import FusedRMSNorm

GEMMA = NormVariant(offset=1.0, weight_after_cast=False)
VARIANTS = [
    pytest.param(DEFAULT_VARIANT, id="llama"),
    pytest.param(GEMMA, id="gemma"),
    pytest.param(NormVariant(upcast=False), id="no-upcast"),
    pytest.param(NormVariant(cast_to_weight=True), id="t5"),
    pytest.param(NormVariant(weight_after_cast=False), id="weight-before"),
]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _pair(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    a = (3 * torch.randn(*shape, generator=generator)).to(dtype)
    b = torch.randn(*shape, generator=generator).to(dtype)
    return a, b


def _weight(width: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(width)
    return (1 + 0.1 * torch.randn(width, generator=generator)).to(dtype)


def _backend_names() -> list:
    params = [pytest.param("torch", id="torch")]
    for name in ("onednn", "triton"):
        if name in kernels.available_backends("cpu"):
            params.append(
                pytest.param(name, id=name, marks=pytest.mark.slow if name == "triton" else ())
            )
        else:
            reason = f"the {name} backend is not available on this machine's CPU"
            if name == "triton":
                reason += " (needs triton, imported with TRITON_INTERPRET=1 when there is no GPU)"
            params.append(pytest.param(name, id=name, marks=pytest.mark.skip(reason=reason)))
    return params


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_the_add_then_the_norm(variant, dtype) -> None:
    a, b = _pair((2, 3, 40), dtype)
    for weight in (_weight(40, dtype), _weight(40, torch.float32), None):
        total, normed = torch_ref.add_rms_norm(a, b, weight, 1e-6, variant=variant)
        assert torch.equal(total, a + b) and total.dtype == (a + b).dtype
        expected = torch_ref.rms_norm(a + b, weight, 1e-6, variant=variant)
        assert normed.dtype == expected.dtype and torch.equal(normed, expected)


def test_reference_keeps_pytorch_promotion_and_broadcasting() -> None:
    a = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    b = torch.randn(8, dtype=torch.float32)
    total, normed = torch_ref.add_rms_norm(a, b, None, 1e-6)
    assert total.dtype == torch.float32 and total.shape == (2, 3, 8)
    assert torch.equal(total, a + b)
    assert torch.equal(normed, torch_ref.rms_norm(a + b, None, 1e-6))


@pytest.mark.parametrize("name", _backend_names())
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("width", [40, 64])
def test_backend_equals_its_own_add_then_norm(name, variant, width) -> None:
    """Bit for bit: the sum PyTorch's, the norm the backend's own `rms_norm` of that sum."""
    backend = kernels.get(name, "cpu")
    for dtype in DTYPES:
        a, b = _pair((3, 5, width), dtype, seed=width)
        a_before, b_before = a.clone(), b.clone()
        for weight in (_weight(width, dtype), _weight(width, torch.float32), None):
            total, normed = backend.add_rms_norm(a, b, weight, 1e-6, variant=variant)
            expected = backend.rms_norm(a + b, weight, 1e-6, variant=variant)
            assert torch.equal(total, a + b), f"{name} sum {dtype}"
            assert normed.dtype == expected.dtype, f"{name} dtype {dtype} {variant}"
            assert torch.equal(normed, expected), f"{name} norm {dtype} {variant}"
            assert total.data_ptr() not in (a.data_ptr(), b.data_ptr())
        assert torch.equal(a, a_before) and torch.equal(b, b_before), "wrote to its inputs"


@pytest.mark.slow
def test_triton_two_pass_rows_match(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row too long for one pass recomputes the sum in its second pass: the same bits."""
    if "triton" not in kernels.available_backends("cpu"):
        pytest.skip("triton's interpreter is not available here (needs TRITON_INTERPRET=1)")
    from fusion.kernels.triton import host

    monkeypatch.setattr(host, "MAX_SINGLE_PASS", 32)
    backend = kernels.get("triton", "cpu")
    for dtype in DTYPES:
        a, b = _pair((4, 100), dtype)
        weight = _weight(100, dtype)
        total, normed = backend.add_rms_norm(a, b, weight, 1e-6, variant=GEMMA)
        assert torch.equal(total, a + b)
        expected = backend.rms_norm(a + b, weight, 1e-6, variant=GEMMA)
        assert torch.equal(normed, expected)


@pytest.mark.slow
def test_triton_leaves_what_it_cannot_imitate_to_the_reference() -> None:
    """Mixed dtypes, broadcasting and strided inputs: exactly the reference's result."""
    if "triton" not in kernels.available_backends("cpu"):
        pytest.skip("triton's interpreter is not available here (needs TRITON_INTERPRET=1)")
    backend = kernels.get("triton", "cpu")
    base = torch.randn(4, 16)
    cases = [
        (base.bfloat16(), torch.randn(4, 16)),  # promotion
        (base, torch.randn(16)),  # broadcasting
        (base.t(), torch.randn(16, 4)),  # strided
        (torch.empty(0, 16), torch.empty(0, 16)),  # empty
    ]
    for a, b in cases:
        weight = _weight(a.shape[-1], torch.float32)
        got = backend.add_rms_norm(a, b, weight, 1e-6)
        want = torch_ref.add_rms_norm(a, b, weight, 1e-6)
        for x, y in zip(got, want):
            assert x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride()
            assert torch.equal(x, y)


def test_onednn_declares_the_op_delegated() -> None:
    if "onednn" not in kernels.available_backends("cpu"):
        pytest.skip("oneDNN is not available in this torch build")
    assert "add_rms_norm" in kernels.get("onednn", "cpu").delegated


def test_operator_compiles_fullgraph_and_matches_eager() -> None:
    a, b = _pair((2, 3, 16), torch.float32)
    weight = _weight(16, torch.float32)

    def step(
        a: torch.Tensor, b: torch.Tensor, w: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.add_rms_norm("torch", a, b, w, 1e-6, variant=GEMMA)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    got, want = compiled(a, b, weight), step(a, b, weight)
    assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_fake_implementation_gives_the_reference_meta() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(2, 8, dtype=torch.bfloat16)
        b = torch.empty(2, 8, dtype=torch.bfloat16)
        w = torch.empty(8, dtype=torch.float32)
        total, normed = torch.ops.fusion.add_rms_norm(
            a, b, w, 1e-6, 0.0, True, True, False, "torch"
        )
        assert total.dtype == torch.bfloat16 and total.shape == (2, 8)
        assert normed.dtype == torch.float32 and normed.shape == (2, 8)


def _fused_norm(dtype: torch.dtype, variant: NormVariant = DEFAULT_VARIANT) -> FusedRMSNorm:
    weight = torch.nn.Parameter(_weight(24, dtype))
    verified = frozenset((d, dtype) for d in DTYPES)
    return FusedRMSNorm(weight, 1e-5, variant=variant, verified=verified, backend="torch")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_forward_equals_the_add_then_the_module(variant, dtype) -> None:
    norm = _fused_norm(dtype, variant)
    a, b = _pair((2, 5, 24), dtype)
    total, normed = norm.add_forward(a, b)
    assert torch.equal(total, a + b)
    assert torch.equal(normed, norm(a + b))


def test_add_forward_outside_the_kernel_runs_the_module() -> None:
    """Broadcasting and an unverified dtype pair take `a + b` then `self(s)`: the latter
    raises FusedRMSNorm's TypeError exactly where the module alone would."""
    norm = _fused_norm(torch.float32)
    a = torch.randn(2, 24)
    total, normed = norm.add_forward(a, torch.randn(24))
    assert total.shape == (2, 24) and torch.equal(normed, norm(total))
    seen = []
    norm.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    with pytest.raises(TypeError, match="proven equal"):
        norm.add_forward(a.double(), a.double())
    assert len(seen) == 0  # the module's forward raised before its hook
