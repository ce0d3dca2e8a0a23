"""`fusion.modules`: the fused modules hold exactly the state they replace and compute the
function of the originals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusion.modules import ActAndMul, FusedRMSNorm, MergedLinear
from tests.fusion.dynamo_graphs import compiled_call_targets


def _linears(bias: tuple[bool, ...] = (False, False, False)) -> dict[str, nn.Linear]:
    torch.manual_seed(0)
    sizes = (8, 4, 4)
    return {name: nn.Linear(6, n, bias=b) for name, n, b in zip("qkv", sizes, bias)}


def test_merged_linear_is_the_concatenated_projections() -> None:
    linears = _linears((True, False, True))
    merged = MergedLinear.from_linears(linears)
    x = torch.randn(3, 6)
    want = torch.cat([lin(x) for lin in linears.values()], dim=-1)
    torch.testing.assert_close(merged(x), want, rtol=1e-6, atol=1e-6)
    assert merged.output_sizes == [8, 4, 4] and merged.shard_bias == (True, False, True)
    assert not merged.bias.detach()[8:12].any()  # the bias-less shard's exact zeros


def test_merged_linear_carries_the_shards_state() -> None:
    linears = _linears()
    for lin in linears.values():
        lin.weight.requires_grad_(False)
        lin.weight.tag = "frozen-by-user"
    merged = MergedLinear.from_linears(linears)
    assert not merged.weight.requires_grad and merged.weight.tag == "frozen-by-user"


def test_mixed_bias_zero_slices_take_no_gradient() -> None:
    """The zero slices stand in for absent biases: no gradient reaches them (a step would
    otherwise give a bias-less projection a bias); the others' gradients are untouched."""
    merged = MergedLinear.from_linears(_linears((True, False, True)))
    merged(torch.randn(5, 6)).square().sum().backward()
    grad = merged.bias.grad
    assert not grad[8:12].any() and grad[:8].abs().sum() > 0 and grad[12:].abs().sum() > 0


def test_merged_linear_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        MergedLinear(4, [2, 2], ["a"], [False, False])


def test_act_and_mul() -> None:
    x = torch.randn(2, 8)
    got = ActAndMul("silu", backend="torch")(x)
    assert torch.equal(got, nn.functional.silu(x[:, :4]) * x[:, 4:])


def test_fused_rms_norm_refuses_unproven_dtypes() -> None:
    weight = nn.Parameter(torch.ones(8))
    norm = FusedRMSNorm(weight, 1e-6, verified=frozenset({(torch.float32, torch.float32)}))
    assert norm.weight is weight  # the replaced module's own Parameter, never a copy
    assert norm(torch.randn(2, 8)).shape == (2, 8)
    with pytest.raises(TypeError, match="proven equal"):
        norm(torch.randn(2, 8, dtype=torch.float64))


def _merged(out_sizes: tuple[int, ...], k: int, bias: bool, seed: int = 0) -> MergedLinear:
    torch.manual_seed(seed)
    linears = {f"p{i}": nn.Linear(k, n, bias=bias) for i, n in enumerate(out_sizes)}
    return MergedLinear.from_linears(linears)


@pytest.mark.parametrize(("sizes", "k"), [((64, 32), 48), ((512, 128, 128), 256), ((768,), 1024)])
@pytest.mark.parametrize("bias", [False, True])
def test_one_row_product_is_linear_and_no_less_accurate(sizes, k, bias, monkeypatch) -> None:
    """One row (decode): what MergedLinear returns equals `F.linear` up to rounding, and its
    error against float64 stays within MKL's (plus a rounding-noise margin), over seeds.
    The size threshold (a speed rule) is lowered so these small weights take the path."""
    import torch.nn.functional as F

    from fusion.kernels import onednn_backend

    monkeypatch.setattr(onednn_backend, "ROW_MIN_ELEMENTS", 0)

    merged = _merged(sizes, k, bias)
    worst = 0.0
    with torch.no_grad():
        for seed in range(4):
            x = torch.randn(1, 1, k, generator=torch.Generator().manual_seed(seed))
            b = None if merged.bias is None else merged.bias.double()
            ref = F.linear(x.double(), merged.weight.double(), b)
            got, mkl = merged(x), F.linear(x, merged.weight, merged.bias)
            assert got.shape == mkl.shape == (1, 1, sum(sizes)) and got.dtype == torch.float32
            scale = ref.abs().max().item()
            err_got = (got.double() - ref).abs().max().item() / scale
            err_mkl = (mkl.double() - ref).abs().max().item() / scale
            # a rounding-noise floor of two float32 ulps: tiny reductions err ~1 ulp either way
            worst = max(worst, err_got / max(err_mkl, 2 * torch.finfo(torch.float32).eps))
            torch.testing.assert_close(got, mkl, rtol=1e-5, atol=1e-6 * scale)
    assert worst <= 1.5


def test_one_row_product_is_taken_only_where_it_applies(monkeypatch) -> None:
    """The oneDNN one-row product runs for one float32 row without gradient (on an AVX-512
    machine); several rows, bfloat16 and recorded gradients keep `F.linear`."""
    from fusion.kernels import onednn_backend

    with torch.no_grad():  # below the size threshold (a speed rule): never taken
        assert not onednn_backend.row_linear_applies(torch.zeros(24), torch.zeros(48, 24), None)
    monkeypatch.setattr(onednn_backend, "ROW_MIN_ELEMENTS", 0)
    calls = []
    real = onednn_backend.row_linear
    monkeypatch.setattr(onednn_backend, "row_linear", lambda *a: calls.append(1) or real(*a))
    merged = _merged((32, 16), 24, bias=True)
    with torch.no_grad():
        expected_one = int(onednn_backend.row_linear_applies(torch.zeros(24), merged.weight, None))
        merged(torch.randn(1, 24))
        assert len(calls) == expected_one
        merged(torch.randn(2, 24))
        merged.to(torch.bfloat16)(torch.randn(1, 24, dtype=torch.bfloat16))
    assert len(calls) == expected_one
    merged.float()(torch.randn(1, 24)).sum().backward()  # records a gradient
    assert len(calls) == expected_one
    assert merged.weight.grad is not None
    if onednn_backend.cpu_capability() in onednn_backend.ROW_CAPABILITIES:
        assert expected_one == 1  # an AVX-512 machine takes it


def test_one_row_product_sees_every_weight_write(monkeypatch) -> None:
    """No copy of the weight is kept: writes through `.data`, `copy_`, `set_` and numpy
    after a first forward all show in the next one-row forward."""
    from fusion.kernels import onednn_backend

    monkeypatch.setattr(onednn_backend, "ROW_MIN_ELEMENTS", 0)
    merged = _merged((16, 8), 12, bias=False)
    x = torch.randn(1, 12)
    with torch.no_grad():
        merged(x)
        new = torch.randn_like(merged.weight)
        for write in (
            lambda w: w.data.copy_(new),
            lambda w: w.data.mul_(2.0),
            lambda w: w.set_(new.clone()),
            lambda w: w.detach().numpy().__setitem__((slice(None), 0), 3.0),
        ):
            write(merged.weight)
            torch.testing.assert_close(merged(x), x @ merged.weight.t(), rtol=1e-5, atol=1e-6)


def test_several_rows_take_one_gemm_per_shard_on_cpu(monkeypatch) -> None:
    """Several float32 rows on a CPU without gradient: one GEMM per shard on row views of
    the stacked weight, bit-identical to the unfused projections' `F.linear` (with and
    without bias, 2-D and 3-D inputs) and seeing weight writes; with a gradient recorded,
    or one shard only, the stacked GEMM."""
    import torch.nn.functional as F

    def unfused(merged, x):
        weights = merged.weight.split(merged.output_sizes)
        biases = merged.bias.split(merged.output_sizes) if merged.bias is not None else None
        return torch.cat(
            [
                F.linear(x, w, None if biases is None else b)
                for w, b in zip(weights, biases or weights)
            ],
            dim=-1,
        )

    seen: list[tuple[int, ...]] = []
    real_linear = F.linear

    def spy(inp, weight, bias=None):
        seen.append(tuple(weight.shape))
        return real_linear(inp, weight, bias)

    merged = _merged((24, 8, 8), 16, bias=True)
    with torch.no_grad():
        for x in (torch.randn(3, 5, 16), torch.randn(7, 16)):
            for m in (merged, _merged((24, 8, 8), 16, bias=False)):
                want = unfused(m, x)
                monkeypatch.setattr(F, "linear", spy)
                got = m(x)
                monkeypatch.setattr(F, "linear", real_linear)
                assert seen == [tuple(w.shape) for w in m.weight.split(m.output_sizes)]
                assert got.shape == want.shape and torch.equal(got, want)
                seen.clear()
        x = torch.randn(3, 5, 16)
        merged.weight.data[24:32].mul_(-1.0)  # a write through .data: seen next call
        assert torch.equal(merged(x), unfused(merged, x))
        monkeypatch.setattr(F, "linear", spy)
        _merged((40,), 16, bias=False)(x)
    assert seen == [(40, 16)]
    seen.clear()
    merged(x).sum().backward()
    assert seen == [(40, 16)] and merged.weight.grad is not None


@pytest.mark.parametrize("bias", [False, True])
def test_compiled_merged_linear_makes_the_eager_choices(monkeypatch, bias: bool) -> None:
    """Under torch.compile: one row goes through the `fusion::decode_linear` operator (which
    makes the eager one-row choice when it runs) where the machine takes the one-row
    product, several rows take one linear per shard; values equal the eager module's."""
    from fusion.kernels import onednn_backend

    monkeypatch.setattr(onednn_backend, "ROW_MIN_ELEMENTS", 0)
    merged = _merged((64, 16, 16), 32, bias=bias).eval()
    with torch.no_grad():
        for rows in (1, 5):
            x = torch.randn(1, rows, 32)
            out, targets = compiled_call_targets(merged, x)
            torch.testing.assert_close(out, merged(x), rtol=1e-5, atol=1e-6)
            linears = sum("linear" in t and "decode_linear" not in t for t in targets)
            if rows == 1 and onednn_backend.row_machine_known_ok():
                assert any("fusion.decode_linear" in t for t in targets), targets
            elif rows > 1:
                assert linears == 3, targets


def test_row_linear_operator_reads_settings_when_it_runs(monkeypatch) -> None:
    """The operator's choice is made per call: with oneDNN disabled it is `F.linear`."""
    import torch.nn.functional as F

    from fusion.kernels import onednn_backend, ops

    monkeypatch.setattr(onednn_backend, "ROW_MIN_ELEMENTS", 0)
    weight, x = torch.randn(48, 32), torch.randn(1, 32)
    taken: list[bool] = []
    real = onednn_backend.row_linear_applies
    monkeypatch.setattr(
        onednn_backend, "row_linear_applies", lambda *a: taken.append(real(*a)) or taken[-1]
    )
    with torch.backends.mkldnn.flags(enabled=False):
        assert torch.equal(ops.decode_linear(x, weight, None), F.linear(x, weight))
    assert taken == [False]


def test_one_row_product_width_rule_depends_on_threads(monkeypatch) -> None:
    """With one thread a long reduction stays on MKL (oneDNN measured slower there); with
    two threads it takes the one-row product."""
    from fusion.kernels import onednn_backend

    monkeypatch.setattr(onednn_backend, "ROW_MIN_ELEMENTS", 0)
    monkeypatch.setattr(onednn_backend, "ROW_MAX_K_ONE_THREAD", 16)
    x, weight = torch.randn(1, 32), torch.randn(8, 32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.no_grad():
            assert not onednn_backend.row_linear_applies(x, weight, None)
            assert onednn_backend.row_linear_applies(
                x[:, :16], weight[:, :16].contiguous(), None
            ) == (onednn_backend.cpu_capability() in onednn_backend.ROW_CAPABILITIES)
            torch.set_num_threads(2)
            assert onednn_backend.row_linear_applies(x, weight, None) == (
                onednn_backend.cpu_capability() in onednn_backend.ROW_CAPABILITIES
            )
    finally:
        torch.set_num_threads(threads)
