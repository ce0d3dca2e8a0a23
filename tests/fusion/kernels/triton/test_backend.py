"""Parity of every kernel backend with the torch reference, Triton's interpreter included.

Each test is parametrized over (backend, device) for every backend `fusion.kernels` lists as
available on every device here, except the reference itself. On a CPU-only machine the Triton
backend runs in Triton's interpreter: `TRITON_INTERPRET=1` must be in the environment before
triton is first imported, so this module sets it (when nothing has imported triton yet and
there is no GPU) before it asks the registry. Where that is too late, or triton or vLLM is
missing, the backend's parameter is skipped with the reason.

Tolerances are a few units in the last place of the dtype: backends differ from the reference
only in reduction order and transcendental rounding (the Triton kernels round intermediates
exactly where the reference's ops do).
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before fusion imports triton (see above)

from hypothesis import given, settings
from hypothesis import strategies as st

from fusion import kernels
from fusion.kernels import reference as torch_ref
from fusion.kernels.norm_variant import DEFAULT_VARIANT, NormVariant

ROOT = Path(__file__).resolve().parents[4]
DEVICES = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _backend_params() -> list:
    """(backend name, device) parameters: every available non-reference backend on every
    device it supports, and a skipped parameter (with the reason) for each one that is not."""
    params = []
    for device in DEVICES:
        marks = [pytest.mark.gpu] if device == "cuda" else []
        for name in kernels.available_backends(device):
            if name != "torch":
                params.append(pytest.param(name, device, id=f"{name}-{device}", marks=marks))
    listed = {p.values[0] for p in params}
    if "triton" not in listed:
        if not HAS_TRITON:
            reason = "triton is not installed (`pip install triton`)"
        elif not torch.cuda.is_available():
            reason = (
                "no GPU, and triton was imported before TRITON_INTERPRET=1 was set: "
                "run with TRITON_INTERPRET=1 in the environment"
            )
        else:
            reason = "the triton backend failed to initialise on this machine"
        params.append(pytest.param("triton", "cpu", id="triton", marks=pytest.mark.skip(reason)))
    if "vllm" not in listed:
        reason = (
            "vllm is not installed (optional)"
            if not HAS_VLLM
            else "vllm imports but its CUDA ops are unavailable here (no GPU or no `_C`)"
        )
        params.append(pytest.param("vllm", "cuda", id="vllm", marks=pytest.mark.skip(reason)))
    return params


BACKENDS = _backend_params()

TOLERANCE = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=2e-6, atol=2e-6),
    torch.float16: dict(rtol=3e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=2.4e-2, atol=1.6e-2),
}
"""Per output dtype: a few units in the last place (bf16 2^-8, fp16 2^-11 per ulp)."""

CPU_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
GPU_DTYPES = [torch.bfloat16, torch.float16]
"""On the GPU the half dtypes (float32 is covered under the interpreter; each dtype is a
separate compile of every variant)."""

GEMMA = NormVariant(offset=1.0, weight_after_cast=False)
"""Gemma's norm: `1 + weight`, applied before the cast back (Llama's is the default)."""


def _variant_id(v: NormVariant) -> str:
    return (
        f"off{v.offset:g}-up{int(v.upcast)}-wac{int(v.weight_after_cast)}"
        f"-c2w{int(v.cast_to_weight)}"
    )


RMS_VARIANTS = [
    pytest.param(variant, weight, id=f"{_variant_id(variant)}-{weight}")
    for offset in (0.0, 1.0)
    for upcast in (True, False)
    for after, cast in ((True, False), (True, True), (False, False))
    for variant in [NormVariant(offset, upcast, after, cast)]
    for weight in ("same", "fp32", "none")
    if not (cast and weight == "none")
]
"""Every RMSNorm variant the norm fuser matches: offset (Gemma), statistics upcast or not,
weight applied after the cast back to the input's dtype (Llama) or to the weight's (T5), or
before it (Gemma); weight of the input dtype, float32, or none."""


def _less_precise(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if torch.finfo(a).eps >= torch.finfo(b).eps else b


def _precision(
    dtype: torch.dtype, variant: NormVariant, weight: torch.Tensor | None = None
) -> torch.dtype:
    """The dtype that bounds a norm's accuracy: the compute dtype (float32 with upcast, even
    for a float64 input) or the dtype the normalised value is rounded to, whichever is less
    precise: the input's, or the weight's for T5's cast (which keeps a float32 result of a
    bfloat16 input at float32 accuracy)."""
    compute = torch.float32 if variant.upcast else dtype
    if weight is not None and variant.weight_after_cast and variant.cast_to_weight:
        return _less_precise(compute, weight.dtype)
    return _less_precise(compute, dtype)


def _dtypes(device: str) -> list[torch.dtype]:
    return GPU_DTYPES if device == "cuda" else CPU_DTYPES


def _backend(name: str, device: str) -> kernels.Kernels:
    return kernels.get(name, device)


def _close(
    actual: torch.Tensor, expected: torch.Tensor, what: str, precision: torch.dtype | None = None
) -> None:
    """Same dtype, shape and NaN positions, values within a few ulps of `precision` (the
    dtype the result was computed in; default: its own dtype)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert torch.equal(actual.isnan(), expected.isnan()), f"{what}: NaN positions differ"
    torch.testing.assert_close(
        actual,
        expected,
        equal_nan=True,
        msg=lambda m: f"{what}: {m}",
        **TOLERANCE[precision or actual.dtype],
    )


def _close_act(actual: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, what: str) -> None:
    """`_close` for act-and-mul, plus the reference's own cancellation error as slack: GELU's
    `1 + erf(x)` / `1 + tanh(x)` cancel in the negative tail, so either side may be off by an
    ulp of 1 relative to `|gate * up|` there (about 1e-7 * 64 for the float32 test data)."""
    d = x.shape[-1] // 2
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    slack = 4 * torch.finfo(compute).eps * (x[..., :d].double() * x[..., d:].double()).abs()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    assert torch.equal(actual.isnan(), expected.isnan()), f"{what}: NaN positions differ"
    tol = TOLERANCE[actual.dtype]
    a, e = actual.double().nan_to_num(0.0), expected.double().nan_to_num(0.0)
    a, e = torch.where(a == e, 0.0, a), torch.where(a == e, 0.0, e)  # equal infinities
    bound = tol["atol"] + tol["rtol"] * e.abs() + slack
    excess = (a - e).abs() - bound
    assert not (excess > 0).any(), f"{what}: max excess {excess.max().item():.3g} over the bound"


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, device: str, *, strided: bool, seed: int):
    """A random input of `shape`; `strided`: a column slice of a wider tensor (row stride
    larger than the row, so the kernel's stride handling is exercised)."""
    g = torch.Generator().manual_seed(seed)
    if strided:
        wide = torch.randn(*shape[:-1], shape[-1] + 5, generator=g) * 2
        return wide.to(dtype=dtype, device=device)[..., 3 : 3 + shape[-1]]
    return (torch.randn(*shape, generator=g) * 2).to(dtype=dtype, device=device)


def _weight(kind: str, n: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    g = torch.Generator().manual_seed(seed + 1)
    w = 1.0 + 0.3 * torch.randn(n, generator=g)
    return w.to(dtype=dtype if kind == "same" else torch.float32, device=device)


RMS_SHAPES = [
    pytest.param((1, 7), False, id="1x7"),
    pytest.param((3, 5, 64), False, id="3x5x64"),
    pytest.param((2, 4, 8, 128), False, id="per-head-128"),
    pytest.param((6, 300), True, id="strided-300"),
    pytest.param((2, 20000), False, id="two-pass-20000"),
]


@pytest.mark.parametrize(("name", "device"), BACKENDS)
@pytest.mark.parametrize(("variant", "weight_kind"), RMS_VARIANTS)
@pytest.mark.parametrize(("shape", "strided"), RMS_SHAPES)
def test_rms_norm_matches_reference(name, device, variant, weight_kind, shape, strided) -> None:
    backend = _backend(name, device)
    for dtype in _dtypes(device):
        x = _inputs(shape, dtype, device, strided=strided, seed=len(shape))
        w = _weight(weight_kind, shape[-1], dtype, device, seed=shape[-1])
        x_before = x.clone()
        expected = torch_ref.rms_norm(x, w, 1e-6, variant=variant)
        actual = backend.rms_norm(x, w, 1e-6, variant=variant)
        precision = _precision(dtype, variant, w)
        _close(actual, expected, f"{name} rms_norm {dtype} {variant}", precision)
        assert torch.equal(x, x_before), "the kernel wrote to its input"


@pytest.mark.parametrize(("name", "device"), BACKENDS)
@pytest.mark.parametrize("root", ["div_sqrt", "recip_sqrt"])
def test_a_non_rsqrt_root_is_the_reference_bit_for_bit(name, device, root) -> None:
    """A backend's kernel multiplies by `rsqrt`: for another spelling of the root
    (`NormVariant.fast` false) it declines, and the reference's own ops run."""
    backend = _backend(name, device)
    variant = NormVariant(root=root)
    for dtype in _dtypes(device):
        x = _inputs((6, 96), dtype, device, strided=False, seed=3)
        w = _weight("same", 96, dtype, device, seed=4)
        expected = torch_ref.rms_norm(x, w, 1e-6, variant=variant)
        assert torch.equal(backend.rms_norm(x, w, 1e-6, variant=variant), expected)
        total, norm = backend.add_rms_norm(x, x, w, 1e-6, variant=variant)
        assert torch.equal(norm, torch_ref.rms_norm(total, w, 1e-6, variant=variant))


ACT_SHAPES = [
    pytest.param((1, 2), False, id="1x2"),
    pytest.param((3, 5, 74), False, id="3x5x74"),
    pytest.param((4, 4200), False, id="4x4200"),
    pytest.param((5, 2 * 300), True, id="strided-600"),
]


@pytest.mark.parametrize(("name", "device"), BACKENDS)
@pytest.mark.parametrize("activation", sorted(torch_ref.ACTIVATIONS))
@pytest.mark.parametrize(("shape", "strided"), ACT_SHAPES)
def test_act_and_mul_matches_reference(name, device, activation, shape, strided) -> None:
    backend = _backend(name, device)
    for dtype in _dtypes(device):
        x = _inputs(shape, dtype, device, strided=strided, seed=shape[-1]) * 2
        x_before = x.clone()
        expected = torch_ref.act_and_mul(x, activation)
        actual = backend.act_and_mul(x, activation)
        _close_act(actual, expected, x, f"{name} act_and_mul {activation} {dtype}")
        assert torch.equal(x, x_before), "the kernel wrote to its input"


@pytest.mark.parametrize(("name", "device"), BACKENDS)
def test_special_values_propagate(name, device) -> None:
    """NaN and inf go where the reference puts them; extreme gates saturate, never NaN."""
    backend = _backend(name, device)
    for dtype in _dtypes(device):
        x = torch.randn(4, 16).to(dtype=dtype, device=device)
        x[1, 3] = math.nan
        x[2, 5] = math.inf
        x[3] = torch.tensor([-1e4, 1e4, -100.0, 100.0] * 4, dtype=dtype)
        for activation in torch_ref.ACTIVATIONS:
            _close(
                backend.act_and_mul(x, activation),
                torch_ref.act_and_mul(x, activation),
                f"{name} act_and_mul {activation} {dtype} special values",
            )
        w = torch.ones(16, dtype=dtype, device=device)
        for upcast in (True, False):
            variant = NormVariant(upcast=upcast)
            # `upcast` computes the statistics in float32 (as HF's RMSNorm does), for float64
            # inputs too: judged at float32's precision there (at float64's, ~10% of random
            # inputs failed on one float32 rounding of the variance)
            _close(
                backend.rms_norm(x, w, 1e-6, variant=variant),
                torch_ref.rms_norm(x, w, 1e-6, variant=variant),
                f"{name} rms_norm {dtype} special values",
                torch.float32 if upcast and dtype == torch.float64 else None,
            )


@pytest.mark.parametrize(("name", "device"), BACKENDS)
def test_inputs_outside_the_kernels_get_the_reference(name, device) -> None:
    """Empty inputs, a scalar, a mismatched weight and an unknown activation behave exactly
    as the reference does (a result, or the same exception)."""
    backend = _backend(name, device)
    empty = torch.empty(0, 8, device=device)
    assert backend.rms_norm(empty, None, 1e-6).shape == (0, 8)
    assert backend.act_and_mul(empty, "silu").shape == (0, 4)
    scalar = torch.tensor(3.0, device=device)
    _close(
        backend.rms_norm(scalar, None, 1e-6),
        torch_ref.rms_norm(scalar, None, 1e-6),
        "scalar",
    )
    odd = torch.randn(2, 7, device=device)
    with pytest.raises(RuntimeError):
        torch_ref.act_and_mul(odd, "silu")
    with pytest.raises(RuntimeError):
        backend.act_and_mul(odd, "silu")
    with pytest.raises(KeyError):
        torch_ref.act_and_mul(odd, "relu")
    with pytest.raises(KeyError):
        backend.act_and_mul(torch.randn(2, 8, device=device), "relu")
    with pytest.raises(RuntimeError):
        torch_ref.rms_norm(torch.randn(2, 8), torch.ones(5), 1e-6)
    with pytest.raises(RuntimeError):
        backend.rms_norm(torch.randn(2, 8, device=device), torch.ones(5, device=device), 1e-6)


@pytest.mark.parametrize(("name", "device"), BACKENDS)
@settings(max_examples=40)
@given(
    rows=st.integers(1, 5),
    cols=st.integers(1, 300),
    dtype_index=st.integers(0, 2),
    offset=st.sampled_from([0.0, 1.0]),
    upcast=st.booleans(),
    after=st.booleans(),
    cast=st.booleans(),
    weight_kind=st.sampled_from(["same", "fp32", "none"]),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_property(
    name, device, rows, cols, dtype_index, offset, upcast, after, cast, weight_kind, scale, seed
) -> None:
    """Any row length (odd, tiny, not a power of two), any variant, scales far from 1."""
    dtype = _dtypes(device)[dtype_index % len(_dtypes(device))]
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g) * scale).to(dtype=dtype, device=device)
    w = _weight(weight_kind, cols, dtype, device, seed)
    variant = NormVariant(offset, upcast, after, cast)
    _close(
        _backend(name, device).rms_norm(x, w, 1e-6, variant=variant),
        torch_ref.rms_norm(x, w, 1e-6, variant=variant),
        f"{name} rms_norm {dtype} {variant} scale {scale}",
        _precision(dtype, variant, w),
    )


# --- MoE experts -------------------------------------------------------------------------------

MOE_SHAPES = [
    # (tokens, hidden, intermediate, experts, top-k): decode, uneven blocks, every expert hit
    # by one token, few experts with many rows each (several row blocks per expert)
    pytest.param(1, 64, 32, 16, 8, id="T1-E16-top8"),
    pytest.param(5, 32, 16, 4, 2, id="T5-E4-top2"),
    pytest.param(17, 48, 40, 8, 3, id="T17-E8-top3"),
    pytest.param(70, 40, 24, 3, 1, id="T70-E3-top1"),
]


def _moe_inputs(tokens, hidden, inter, experts, top_k, dtype, weight_dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    probs = torch.randn(tokens, experts, generator=g).softmax(-1)
    weights, ids = torch.topk(probs, top_k)
    to = dict(device=device)
    return (
        x.to(dtype=dtype, **to),
        gate_up.to(dtype=dtype, **to),
        down.to(dtype=dtype, **to),
        ids.to(**to),
        weights.to(dtype=weight_dtype, **to),
    )


def _close_moe(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Same dtype and shape; values within a few ulps of the dtype relative to the output's
    scale (GEMM accumulation order differs, and a one-ulp change of an intermediate moves
    the sums over hidden and intermediate by an ulp of their magnitude)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    eps = torch.finfo(expected.dtype).eps
    scale = expected.abs().max().item()
    torch.testing.assert_close(
        actual, expected, rtol=8 * eps, atol=8 * eps * scale, msg=lambda m: f"{what}: {m}"
    )


@pytest.mark.parametrize(("name", "device"), BACKENDS)
@pytest.mark.parametrize("activation", sorted(torch_ref.ACTIVATIONS))
@pytest.mark.parametrize(("tokens", "hidden", "inter", "experts", "top_k"), MOE_SHAPES)
def test_moe_experts_matches_reference(
    name, device, activation, tokens, hidden, inter, experts, top_k
) -> None:
    backend = _backend(name, device)
    for dtype in [d for d in _dtypes(device) if d != torch.float64]:
        for weight_dtype in (torch.float32, dtype):
            args = _moe_inputs(tokens, hidden, inter, experts, top_k, dtype, weight_dtype, device)
            before = [a.clone() for a in args]
            expected = torch_ref.moe_experts(*args, activation)
            actual = backend.moe_experts(*args, activation)
            _close_moe(actual, expected, f"{name} moe {activation} {dtype} weights {weight_dtype}")
            assert all(torch.equal(a, b) for a, b in zip(args, before)), "an input was written"


@pytest.mark.parametrize(("name", "device"), BACKENDS)
def test_moe_experts_strided_weights_and_int32_ids(name, device) -> None:
    """Expert weights that are transposed views (strides, not layout, describe them) and
    int32 expert ids give the reference's result."""
    dtype = _dtypes(device)[0]
    x, gate_up, down, ids, weights = _moe_inputs(9, 32, 24, 5, 2, dtype, torch.float32, device)
    gate_up_t = gate_up.transpose(1, 2).contiguous().transpose(1, 2)
    down_t = down.transpose(1, 2).contiguous().transpose(1, 2)
    assert not gate_up_t.is_contiguous() and torch.equal(gate_up_t, gate_up)
    expected = torch_ref.moe_experts(x, gate_up, down, ids, weights, "silu")
    actual = _backend(name, device).moe_experts(
        x, gate_up_t, down_t, ids.to(torch.int32), weights, "silu"
    )
    _close_moe(actual, expected, f"{name} moe strided")


@pytest.mark.parametrize(("name", "device"), BACKENDS)
def test_moe_experts_edges_behave_as_the_reference(name, device) -> None:
    """No tokens gives zeros; expert ids out of range and unknown activations raise as the
    reference raises; an expert nobody routes to contributes nothing."""
    backend = _backend(name, device)
    x, gate_up, down, ids, weights = _moe_inputs(
        4, 16, 8, 6, 2, torch.float32, torch.float32, device
    )
    empty = backend.moe_experts(x[:0], gate_up, down, ids[:0], weights[:0], "silu")
    assert empty.shape == (0, 16)
    for bad in (ids.clone().fill_(6), ids.clone().fill_(-1)):
        with pytest.raises((IndexError, RuntimeError)):
            torch_ref.moe_experts(x, gate_up, down, bad, weights, "silu")
        with pytest.raises((IndexError, RuntimeError)):
            backend.moe_experts(x, gate_up, down, bad, weights, "silu")
    with pytest.raises(KeyError):
        backend.moe_experts(x, gate_up, down, ids, weights, "relu")
    one_expert = torch.zeros_like(ids)
    one_expert[:, 1] = 3
    _close_moe(
        backend.moe_experts(x, gate_up, down, one_expert, weights, "gelu"),
        torch_ref.moe_experts(x, gate_up, down, one_expert, weights, "gelu"),
        f"{name} moe two experts of six",
    )


# --- registry behaviour ------------------------------------------------------------------------


def test_triton_supports_exactly_one_device_kind() -> None:
    """Interpreted: CPU only (never CUDA); compiled: CUDA only. `auto` never picks the
    interpreter, so fused models on CPU keep the reference's speed."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from fusion.kernels import triton as triton_kernels

    backend = triton_kernels.create()
    if backend is None:
        assert not triton_kernels.INTERPRETED and not torch.cuda.is_available()
        assert "triton" not in kernels.available_backends()
        return
    if triton_kernels.INTERPRETED:
        assert backend.supports(torch.device("cpu"))
        assert not backend.supports(torch.device("cuda"))
        assert kernels.get("auto", "cpu").name in {"onednn", "native", "torch"}
    else:
        assert backend.supports(torch.device("cuda"))
        assert not backend.supports(torch.device("cpu"))
        assert kernels.get("auto", "cpu").name in {"onednn", "native", "torch"}
        assert kernels.get("auto", "cuda").name in {"vllm", "triton"}


def test_vllm_backend_absent_without_vllm() -> None:
    """vLLM is optional: where it does not import, the registry has no `vllm` backend and
    nothing else changes."""
    if HAS_VLLM:
        pytest.skip("vllm is installed here")
    from fusion.kernels import vllm as vllm_backend

    assert vllm_backend.create() is None
    assert "vllm" not in kernels.available_backends()
    with pytest.raises(ValueError, match="vllm"):
        kernels.get("vllm", "cpu")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fused_model_on_the_interpreter_in_a_fresh_process() -> None:
    """End to end in a process that sets TRITON_INTERPRET=1 before anything imports triton:
    the registry lists `triton` for CPU, `auto` still picks a non-interpreted backend, and tiny Llama, Gemma-2
    and Qwen3-MoE models fused with `backend="triton"` (norms, act-and-mul, MoE experts on the
    Triton kernels) give the unfused logits."""
    script = textwrap.dedent(
        """
        import copy, torch
        import fusion
        from fusion import kernels
        from transformers import AutoConfig, AutoModelForCausalLM
        from tests.fusion.tiny_models import COMMON, randomize_, tiny_model, token_ids
        assert "triton" in kernels.available_backends("cpu"), kernels.available_backends("cpu")
        assert kernels.get("auto", "cpu").name in {"onednn", "native", "torch"}
        moe = AutoConfig.for_model(
            "qwen3_moe", **COMMON, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
        moe._attn_implementation = "eager"
        qwen3_moe = randomize_(AutoModelForCausalLM.from_config(moe)).eval()
        for model in (tiny_model("llama"), tiny_model("gemma2"), qwen3_moe):
            fused = copy.deepcopy(model)
            report = fusion.fuse(fused, backend="triton")
            assert report.applied, str(report)
            ids = token_ids()
            with torch.no_grad():
                a, b = model(ids).logits, fused(ids).logits
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        print("ok")
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("ok")


# --- GPU only ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "name", [n for n in ("triton", "vllm") if n in kernels.available_backends("cuda")]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 16, 512, 4096])
@pytest.mark.parametrize("hidden", [2048, 4096, 5120, 16384, 18432])
def test_gpu_real_shapes(name, dtype, tokens, hidden) -> None:
    """Model-sized rows on the GPU (Llama/Gemma widths; 18432 takes the two-pass path):
    Llama and Gemma norms and SiLU-and-mul match the reference."""
    backend = kernels.get(name, "cuda")
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
    for variant in (DEFAULT_VARIANT, GEMMA):
        _close(
            backend.rms_norm(x, w, 1e-6, variant=variant),
            torch_ref.rms_norm(x, w, 1e-6, variant=variant),
            f"{name} rms_norm {variant}",
        )
    _close(backend.act_and_mul(x, "silu"), torch_ref.act_and_mul(x, "silu"), f"{name} silu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "name", [n for n in ("triton", "vllm") if n in kernels.available_backends("cuda")]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 16, 512])
@pytest.mark.parametrize(
    ("hidden", "inter", "experts", "top_k"),
    [(2048, 1024, 64, 8), (2048, 768, 128, 8), (1024, 2048, 8, 2)],
    ids=["olmoe", "qwen3-30b-a3b", "mixtral-like"],
)
def test_gpu_moe_real_shapes(name, dtype, tokens, hidden, inter, experts, top_k) -> None:
    """MoE experts at real widths on the GPU match the reference (bf16 and fp16)."""
    args = _moe_inputs(tokens, hidden, inter, experts, top_k, dtype, torch.float32, "cuda")
    _close_moe(
        kernels.get(name, "cuda").moe_experts(*args, "silu"),
        torch_ref.moe_experts(*args, "silu"),
        f"{name} moe {dtype} T{tokens}",
    )
