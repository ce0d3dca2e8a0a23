"""The oneDNN MoE experts backend: same function as the reference, MKL-class rounding, and a
fallback to the reference wherever oneDNN might compute something else."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fusion
from fusion import kernels, numerics
from fusion.kernels import onednn as onednn_backend
from fusion.kernels import reference as torch_ref
from fusion.kernels.native import gemm as native_gemm
from tests.fusion.kernels.native_helpers import force_native_on

BACKEND = onednn_backend.create()
pytestmark = pytest.mark.skipif(
    BACKEND is None, reason="oneDNN (torch.backends.mkldnn) is not available in this torch build"
)


def _experts(tokens: int, hidden: int, inter: int, experts: int, top_k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return x, gate_up, down, ids, weights


def _float64(x, gate_up, down, ids, weights, activation="silu"):
    return torch_ref.moe_experts(
        x.double(), gate_up.double(), down.double(), ids, weights.double(), activation
    )


@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "experts", "top_k"),
    [
        (4, 64, 32, 4, 2),  # every expert small: one grouped_mm per projection
        (512, 512, 256, 8, 2),  # every expert on oneDNN
        (96, 256, 512, 8, 2),  # a mix: skewed routing leaves some experts on mm
        (300, 384, 200, 6, 3),  # widths that are not multiples of the reduction block
        (4, 64, 130, 4, 2),  # rows of 520 bytes: grouped_mm refuses them, mm runs (regression)
    ],
)
@pytest.mark.parametrize("activation", sorted(torch_ref.ACTIVATIONS))
def test_moe_experts_match_the_reference(tokens, hidden, inter, experts, top_k, activation):
    """The same function as `torch_ref.moe_experts`, and no less accurate: against a float64
    reference the backend's error is within 1.5x of the reference kernel's (plus float32's
    unit roundoff, for outputs the reference happens to get exact)."""
    x, gate_up, down, ids, weights = _experts(tokens, hidden, inter, experts, top_k)
    if tokens == 96:  # skew the routing so some experts get few rows, some many
        ids = torch.where(torch.arange(tokens)[:, None] < 64, ids % 2, ids)
    got = BACKEND.moe_experts(x, gate_up, down, ids, weights, activation)
    ref = torch_ref.moe_experts(x, gate_up, down, ids, weights, activation)
    exact = _float64(x, gate_up, down, ids, weights, activation)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert numerics.relative_error(got, exact) <= 1.5 * numerics.relative_error(ref, exact) + 6e-8


LAMBDA = 6.5
"""Probabilistic rounding-error bound factor (Higham and Mary, 2019): a sum of n products
with independent rounding errors errs by more than LAMBDA * sqrt(n) * u * sum|x_i w_i| with
probability below 2 exp(-LAMBDA^2 / 2), about 1e-9 per output element."""


@pytest.mark.parametrize("k", [128, 200, 512, 1024, 4096])
@pytest.mark.parametrize("rows", [4, 64])
def test_blocked_linear_rounds_like_mm(k: int, rows: int) -> None:
    """`linear` sums in `K_BLOCK` blocks, so each output is a sum of at most
    `K_BLOCK + ceil(K / K_BLOCK)` rounded additions: its float32 error is bounded by the
    probabilistic bound for that many terms (`LAMBDA`), derived from the reduction length
    and float32's unit roundoff, not fitted to one CPU's MKL."""
    u = torch.finfo(torch.float32).eps / 2
    terms = onednn_backend.K_BLOCK + -(-k // onednn_backend.K_BLOCK)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(rows, k, generator=g)
        w = torch.randn(384, k, generator=g)
        exact = x.double() @ w.double().t()
        magnitude = x.double().abs() @ w.double().abs().t()
        bound = LAMBDA * terms**0.5 * u * magnitude + u * exact.abs()
        error = (onednn_backend.linear(x, w).double() - exact).abs()
        assert bool((error <= bound).all()), float((error / bound).max())


def test_strided_input_columns_give_the_same_bits() -> None:
    """`linear` hands oneDNN strided column slices; that is bit-identical to contiguous ones."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4 * 16, 700, generator=g)[::4]  # row-strided as well
    w = torch.randn(96, 700, generator=g)
    assert torch.equal(onednn_backend.linear(x, w), onednn_backend.linear(x.contiguous(), w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_dtypes_take_the_reference(dtype: torch.dtype) -> None:
    """Only float32 goes to oneDNN; every other dtype gets the reference's exact bits."""
    x, gate_up, down, ids, weights = (
        t.to(dtype) if t.is_floating_point() else t for t in _experts(64, 256, 128, 4, 2)
    )
    assert not BACKEND.uses_onednn(x, gate_up, down, weights)
    got = BACKEND.moe_experts(x, gate_up, down, ids, weights, "silu")
    assert torch.equal(got, torch_ref.moe_experts(x, gate_up, down, ids, weights, "silu"))


def test_autograd_takes_the_reference() -> None:
    """oneDNN's ops have no derivative: while autograd records, the reference runs (same bits,
    and gradients flow to the expert weights)."""
    x, gate_up, down, ids, weights = _experts(256, 256, 128, 4, 2)
    gate_up.requires_grad_(True)
    got = BACKEND.moe_experts(x, gate_up, down, ids, weights, "silu")
    want = torch_ref.moe_experts(x, gate_up, down, ids, weights, "silu")
    assert torch.equal(got, want)
    got.sum().backward()
    assert gate_up.grad is not None and gate_up.grad.abs().sum() > 0
    with torch.no_grad():
        assert BACKEND.uses_onednn(x, gate_up, down, weights)


def test_disabled_or_reduced_precision_onednn_takes_the_reference() -> None:
    """With `torch.backends.mkldnn` disabled, or its float32 math allowed to round to bf16
    (which `mm` itself then follows), the reference runs: the fused block computes what the
    unfused `mm` computes under the same setting."""
    args = _experts(512, 512, 256, 4, 2)  # hidden > 256: oneDNN's bits differ from MKL's
    with torch.backends.mkldnn.flags(enabled=False):
        want = torch_ref.moe_experts(*args, "silu")
        assert torch.equal(BACKEND.moe_experts(*args, "silu"), want)
    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision
    try:
        matmul.fp32_precision = "bf16"
        assert not onednn_backend.strict_fp32()
        want = torch_ref.moe_experts(*args, "silu")
        assert torch.equal(BACKEND.moe_experts(*args, "silu"), want)
    finally:
        matmul.fp32_precision = before
    assert onednn_backend.strict_fp32()
    want = torch_ref.moe_experts(*args, "silu")
    assert not torch.equal(BACKEND.moe_experts(*args, "silu"), want)  # oneDNN again


def _write_data(t: torch.Tensor) -> None:
    t.data.mul_(-0.5)  # an EMA / weight-merging spelling: bypasses the version counter


def _write_detached(t: torch.Tensor) -> None:
    t.detach().mul_(-0.5)


def _write_numpy(t: torch.Tensor) -> None:
    t.detach().numpy()[...] *= -0.5  # through the storage: no torch op records it


def _write_in_place(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.mul_(-0.5)


def _write_copy(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.copy_(t * -0.5)


def _write_set(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.set_((t * -0.5).contiguous())


@pytest.mark.parametrize(
    "write",
    [_write_data, _write_detached, _write_numpy, _write_in_place, _write_copy, _write_set],
    ids=lambda f: f.__name__.removeprefix("_write_"),
)
def test_weight_writes_by_any_spelling_are_seen(write) -> None:
    """Regression (stale expert weights): the backend once kept oneDNN-packed copies keyed by
    the version counter, which `p.data` writes do not move, so after such a write it
    computed with the old weights. After a first call on a oneDNN-sized problem, a write to
    the weights by any spelling is seen by the next call."""
    backend = onednn_backend.create()
    x, gate_up, down, ids, weights = _experts(512, 256, 256, 4, 2)
    assert backend.uses_onednn(x, gate_up, down, weights)
    first = backend.moe_experts(x, gate_up, down, ids, weights, "silu")
    assert numerics.relative_error(first, _float64(x, gate_up, down, ids, weights)) < 1e-5
    for tensor in (gate_up, down):
        write(tensor)
        exact = _float64(x, gate_up, down, ids, weights)
        got = backend.moe_experts(x, gate_up, down, ids, weights, "silu")
        assert numerics.relative_error(got, exact) < 1e-5


def test_fused_model_sees_data_writes_after_the_first_forward() -> None:
    """The defect as a user met it: a fused MoE block on the oneDNN path, then
    `with torch.no_grad(): p.data.mul_(3)` on every parameter of both copies: fused and
    unfused outputs still agree."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(
        hidden_size=256, intermediate_size=512, num_local_experts=4, num_experts_per_tok=2
    )
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(config).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.05)
    holder = nn.Sequential(copy.deepcopy(block))
    assert fusion.fuse(holder, backend="onednn").counts() == {"moe": 1}
    x = torch.randn(1, 256, 256)  # ~128 rows per expert: the oneDNN path
    with torch.no_grad():
        assert numerics.relative_error(holder[0](x), block(x).double()) < 1e-5
        for model in (block, holder):
            for param in model.parameters():
                param.data.mul_(3.0)
        assert numerics.relative_error(holder[0](x), block(x).double()) < 1e-5


def test_backend_holds_no_weight_state() -> None:
    """Coherence by construction: nothing derived from a weight outlives a call."""
    backend = onednn_backend.create()
    args = _experts(512, 256, 256, 4, 2)
    backend.moe_experts(*args, "silu")
    assert vars(backend) == {"auto_pick": backend.auto_pick}


def test_auto_is_the_reference_on_cpu_and_onednn_stays_available_by_name() -> None:
    """On a CPU `auto` resolves to the reference backend (its fast kernels are chosen per
    op by the kernel policy, by measurement); `onednn` stays available by name, and its
    `auto_pick` (what `eligible` mode honours) holds only on AVX-512."""
    assert "onednn" in kernels.available_backends("cpu")
    assert kernels.get("auto", "cpu").name == "torch"
    avx512 = onednn_backend.cpu_capability() in onednn_backend.AUTO_CAPABILITIES
    assert kernels.get("onednn", "cpu").auto_pick == avx512


def test_compiling_takes_the_reference_without_reading_settings() -> None:
    """Under `torch.compile` the backend answers "reference" before touching
    `torch.backends.mkldnn` (Dynamo cannot trace those settings' `__getattr__`, so reading
    them would break a fullgraph trace). A real trace, not a patched `is_compiling`:
    patching that while Dynamo first initialises makes later traces in the process fail."""
    x, gate_up, down, _ids, weights = _experts(512, 256, 256, 4, 2)

    def probe(x, gate_up, down, weights):
        return x * 2 if BACKEND.uses_onednn(x, gate_up, down, weights) else x * 3

    assert torch.equal(probe(x, gate_up, down, weights), x * 2)  # eager: oneDNN
    compiled = torch.compile(probe, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x, gate_up, down, weights), x * 3)


def test_fused_mixtral_block_passes_the_parity_oracle() -> None:
    """A Mixtral block at a size that runs oneDNN (hidden 512, intermediate 1024, 64 tokens),
    fused with `auto`: its float32 error against float64 passes `fusion.numerics.compare`
    against the unfused block's, on several seeds."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(
        hidden_size=512, intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2
    )
    config._experts_implementation = "eager"
    for seed in range(3):
        torch.manual_seed(seed)
        block = MixtralSparseMoeBlock(config).eval()
        with torch.no_grad():
            for param in block.parameters():
                param.normal_(0.0, 0.02)
        holder = nn.Sequential(copy.deepcopy(block))
        report = fusion.fuse(holder)
        assert report.counts() == {"moe": 1}, str(report)
        reference = copy.deepcopy(block).double()
        x = torch.randn(1, 64, 512)
        with torch.no_grad():
            verdict = numerics.compare(
                holder[0](x), block(x), reference(x.double()), dtype=torch.float32
            )
        assert verdict.status == "pass", verdict


@settings(deadline=None, max_examples=60)
@given(
    tokens=st.integers(1, 160),
    hidden=st.sampled_from([16, 100, 128, 129, 384, 520]),
    inter=st.sampled_from([8, 64, 130, 256]),
    experts=st.integers(1, 9),
    data=st.data(),
)
def test_moe_experts_pass_the_parity_oracle_on_random_shapes(
    tokens: int, hidden: int, inter: int, experts: int, data: st.DataObject
) -> None:
    """Any shape and routing (skewed, with idle experts, crossing `MIN_ROWS` and `K_BLOCK`
    boundaries): against float64 the backend's float32 error passes `fusion.numerics.judge`
    against the reference kernel's, the rule the harness applies to every fused module."""
    top_k = data.draw(st.integers(1, experts), label="top_k")
    hot = data.draw(st.integers(1, experts), label="experts in use")
    x, gate_up, down, ids, weights = _experts(tokens, hidden, inter, experts, top_k, seed=tokens)
    ids = torch.argsort(torch.rand(tokens, experts, generator=torch.Generator().manual_seed(1)))
    ids = torch.where(ids[:, :top_k] < hot, ids[:, :top_k], ids[:, :top_k] % hot)
    if top_k > hot:  # ids of one token must differ: spread the rest over idle experts
        ids = torch.argsort(torch.rand(tokens, experts), dim=-1)[:, :top_k]
    activation = data.draw(st.sampled_from(sorted(torch_ref.ACTIVATIONS)), label="activation")
    with torch.no_grad():
        got = BACKEND.moe_experts(x, gate_up, down, ids, weights, activation)
        ref = torch_ref.moe_experts(x, gate_up, down, ids, weights, activation)
    exact = _float64(x, gate_up, down, ids, weights, activation)
    verdict = numerics.judge(
        numerics.relative_error(got, exact), numerics.relative_error(ref, exact), torch.float32
    )
    assert verdict.status == "pass", verdict


@pytest.mark.parametrize("activation", sorted(torch_ref.ACTIVATIONS))
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 1), (1, 4), (2, 4)])
def test_decode_rows_take_the_one_row_product(
    monkeypatch, activation: str, tokens: int, top_k: int
) -> None:
    """At most `ROW_MAX_ROWS` rows per selected expert (decode): each row's GEMMs are
    oneDNN's one-row product where the machine takes it, computing the reference's function
    with no more error against float64 (1.5x the reference's, as for every path here)."""
    # the native kernel, where it is on, takes few rows first (its own test, below)
    monkeypatch.setattr(native_gemm, "MIN_ELEMENTS", 1 << 30)
    taken: list[tuple[int, ...]] = []
    real = onednn_backend.row_linear

    def spy(x, weight, bias):
        taken.append(tuple(weight.shape))
        return real(x, weight, bias)

    monkeypatch.setattr(onednn_backend, "row_linear", spy)
    x, gate_up, down, ids, weights = _experts(tokens, 512, 512, 8, top_k, seed=3)
    got = BACKEND.moe_experts(x, gate_up, down, ids, weights, activation)
    ref = torch_ref.moe_experts(x, gate_up, down, ids, weights, activation)
    exact = _float64(x, gate_up, down, ids, weights, activation)
    assert got.shape == ref.shape
    assert numerics.relative_error(got, exact) <= 1.5 * numerics.relative_error(ref, exact) + 6e-8
    onednn_backend.resolve_machine()
    if onednn_backend.cpu_capability() in onednn_backend.ROW_CAPABILITIES:
        assert onednn_backend.row_machine_known_ok()  # an AVX-512 machine takes it
        assert sorted(taken) == sorted([(1024, 512), (512, 512)] * tokens * top_k)
    else:
        assert taken == []


@pytest.mark.parametrize(
    "write",
    [_write_data, _write_detached, _write_numpy, _write_in_place, _write_copy, _write_set],
    ids=lambda f: f.__name__.removeprefix("_write_"),
)
def test_decode_rows_see_weight_writes(write) -> None:
    """The one-row path keeps nothing either: a write by any spelling after a first
    decode call is seen by the next."""
    x, gate_up, down, ids, weights = _experts(1, 512, 512, 8, 2, seed=4)
    BACKEND.moe_experts(x, gate_up, down, ids, weights, "silu")
    for tensor in (gate_up, down):
        write(tensor)
        got = BACKEND.moe_experts(x, gate_up, down, ids, weights, "silu")
        assert numerics.relative_error(got, _float64(x, gate_up, down, ids, weights)) < 1e-5


@pytest.mark.parametrize("activation", sorted(torch_ref.ACTIVATIONS))
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 2), (5, 4), (16, 8), (40, 8)])
def test_few_rows_per_expert_take_the_native_kernel(
    monkeypatch, activation: str, tokens: int, top_k: int
) -> None:
    """Up to the machine's row limit (`native_gemm.rows_ok`) per expert: both GEMMs of every selected expert run
    the native kernel (once per expert, not per row), computing the reference's function
    with no more error against float64 (1.5x the reference's, as for every path here)."""
    force_native_on(monkeypatch)
    taken: list[tuple[int, ...]] = []
    real = native_gemm.run
    monkeypatch.setattr(
        native_gemm, "run", lambda f, x, w, *a: taken.append(tuple(w.shape)) or real(f, x, w, *a)
    )
    x, gate_up, down, ids, weights = _experts(tokens, 256, 192, 8, top_k, seed=tokens)
    with torch.no_grad():
        got = BACKEND.moe_experts(x, gate_up, down, ids, weights, activation)
        ref = torch_ref.moe_experts(x, gate_up, down, ids, weights, activation)
    exact = _float64(x, gate_up, down, ids, weights, activation)
    assert got.shape == ref.shape
    assert numerics.relative_error(got, exact) <= 1.5 * numerics.relative_error(ref, exact) + 6e-8
    active = len(set(ids.flatten().tolist()))
    assert sorted(taken) == sorted([(384, 256), (256, 192)] * active)


def test_native_experts_see_weight_writes_and_refuse_gradients(monkeypatch) -> None:
    """Nothing is kept between calls: writes through `.data` and numpy after a first call
    are seen by the next; with a gradient recorded the reference runs (and trains)."""
    force_native_on(monkeypatch)
    x, gate_up, down, ids, weights = _experts(6, 256, 192, 8, 4, seed=9)
    with torch.no_grad():
        BACKEND.moe_experts(x, gate_up, down, ids, weights, "silu")
        gate_up.data.mul_(0.5)
        down.detach().numpy()[:, :, 0] = 2.0
        got = BACKEND.moe_experts(x, gate_up, down, ids, weights, "silu")
        ref = torch_ref.moe_experts(x, gate_up, down, ids, weights, "silu")
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    calls: list[int] = []
    monkeypatch.setattr(native_gemm, "run", lambda *a: calls.append(1))
    gate_up.requires_grad_(True)
    BACKEND.moe_experts(x, gate_up, down, ids, weights, "silu").sum().backward()
    assert calls == [] and gate_up.grad is not None


def test_backend_probe_runs_on_cpu_under_a_meta_default_device() -> None:
    """The backend may first be created while a model is built on meta: its probe still
    computes on CPU memory, so the backend is not lost for the process."""
    with torch.device("meta"):
        backend = onednn_backend.create()
    assert backend is not None
