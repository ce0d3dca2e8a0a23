"""`fusion.runtime.merged`: the fused modules hold exactly the state they replace and compute the
function of the originals."""

from __future__ import annotations

import contextlib
import copy
import io

import pytest
import torch
from torch import nn

from fusion.kernels.policy import POLICY
from fusion.runtime.merged import ActAndMul, FusedRMSNorm, MergedLinear
from tests.fusion.dynamo_graphs import compiled_call_targets
from tests.fusion.merged_paths import stacked_products


def _linears(bias: tuple[bool, ...] = (False, False, False)) -> dict[str, nn.Linear]:
    torch.manual_seed(0)
    sizes = (8, 4, 4)
    return {name: nn.Linear(6, n, bias=b) for name, n, b in zip("qkv", sizes, bias)}


def test_merged_linear_is_the_concatenated_projections() -> None:
    linears = _linears((True, False, True))
    expected = copy.deepcopy(linears)
    merged = MergedLinear.from_linears(linears)
    x = torch.randn(3, 6)
    want = torch.cat([lin(x) for lin in expected.values()], dim=-1)
    with torch.no_grad():
        torch.testing.assert_close(merged(x), want, rtol=1e-6, atol=1e-6)
        assert (merged.stacked_calls, merged.shard_calls) == (0, 1)  # nothing measured
        with stacked_products():
            torch.testing.assert_close(merged(x), want, rtol=1e-6, atol=1e-6)
    assert merged.stacked_calls == 1
    assert merged.output_sizes == [8, 4, 4] and merged.shard_bias == (True, False, True)
    assert not merged.stacked_bias[8:12].any()  # the bias-less shard's exact zeros


def test_shards_keep_their_parameters_as_views_of_the_stacked_weight() -> None:
    """Same Parameter objects, values, requires_grad and attributes; each now rows of the
    stacked weight, so an in-place write to one is what the stacked GEMM reads."""
    linears = _linears((True, False, True))
    params = {n: (lin.weight, lin.bias) for n, lin in linears.items()}
    values = {n: lin.weight.detach().clone() for n, lin in linears.items()}
    linears["k"].weight.requires_grad_(False)
    linears["q"].weight.tag = "set-by-user"
    merged = MergedLinear.from_linears(linears)
    assert merged._modules == {} and merged._parameters == {}  # the children stay the parent's
    for name, lin in linears.items():
        assert (lin.weight, lin.bias) == params[name] and torch.equal(lin.weight, values[name])
    assert not linears["k"].weight.requires_grad and linears["q"].weight.tag == "set-by-user"
    assert merged.views_hold()
    with torch.no_grad():
        linears["k"].weight.mul_(-2.0)
    assert torch.equal(merged.stacked_weight[8:12], linears["k"].weight)


def test_gradients_are_the_unfused_ones_in_each_parameter() -> None:
    """A recorded gradient takes the shards apart: each Parameter gets exactly the gradient
    its own projection gives (no gradient to a frozen one, none to a synthesised bias)."""
    linears = _linears((True, False, True))
    reference = copy.deepcopy(linears)
    linears["k"].weight.requires_grad_(False)
    reference["k"].weight.requires_grad_(False)
    merged = MergedLinear.from_linears(linears)
    x = torch.randn(5, 6)
    merged(x).square().sum().backward()
    torch.cat([lin(x) for lin in reference.values()], dim=-1).square().sum().backward()
    assert merged.shard_calls == 1 and merged.stacked_calls == 0
    for name, lin in linears.items():
        for mine, theirs in (
            (lin.weight, reference[name].weight),
            (lin.bias, reference[name].bias),
        ):
            if theirs is None or theirs.grad is None:
                assert mine is None or mine.grad is None
            else:
                assert torch.equal(mine.grad, theirs.grad)


@pytest.mark.parametrize(
    "change",
    ["assign-data", "new-parameter", "to-one-child", "functional-call"],
)
def test_a_broken_view_computes_each_shard_from_its_current_parameters(change: str) -> None:
    linears = _linears((True, False, True))
    merged = MergedLinear.from_linears(linears)
    x = torch.randn(3, 6)
    new = torch.randn(4, 6)
    if change == "assign-data":
        linears["k"].weight.data = new
    elif change == "new-parameter":
        linears["k"].weight = nn.Parameter(new)
    elif change == "to-one-child":
        linears["k"].to(torch.float64)
        linears["k"].weight.data = new.double()
    assert change == "functional-call" or not merged.views_hold()
    with torch.no_grad():
        if change == "functional-call":
            got = torch.func.functional_call(linears["k"], {"weight": new}, (x,))
            replaced = torch.func.functional_call(
                merged, {}, (x,)
            )  # merged holds no parameters of its own: unchanged call
            assert torch.equal(replaced, merged(x))
            return
        if change == "to-one-child":
            with pytest.raises(RuntimeError):
                merged(x)  # mixed dtypes, as the unfused projections would raise
            return
        got = merged(x)
    want = torch.cat([lin(x) for lin in linears.values()], dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert merged.shard_calls == 1


def test_a_call_no_kernel_is_chosen_for_skips_the_views(monkeypatch) -> None:
    """Where the policy could choose (not idle) but names no kernel for this call's shape
    and rows, the shards are computed apart on their current Parameters without checking
    the views (only a chosen stacked kernel reads them): same result, broken view or not;
    where it names the stacked kernel, the views are checked and a broken one computes
    apart too."""
    linears = _linears((True, False, True))
    merged = MergedLinear.from_linears(linears)
    checked = []
    real = MergedLinear.views_hold
    monkeypatch.setattr(MergedLinear, "views_hold", lambda self: checked.append(1) or real(self))
    monkeypatch.setattr(POLICY, "idle", lambda op, backend: False)
    monkeypatch.setattr(POLICY, "choose", lambda op, shape, dtype, rows, backend: ())
    POLICY.forget()  # the suite's autouse fixture resets the policy afterwards
    x = torch.randn(3, 6)
    with torch.no_grad():
        want = torch.cat([lin(x) for lin in linears.values()], dim=-1)
        torch.testing.assert_close(merged(x), want, rtol=1e-6, atol=1e-6)
        linears["k"].weight.data = torch.randn(4, 6)  # the view breaks
        want = torch.cat([lin(x) for lin in linears.values()], dim=-1)
        torch.testing.assert_close(merged(x), want, rtol=1e-6, atol=1e-6)
        assert checked == [] and (merged.stacked_calls, merged.shard_calls) == (0, 2)
        with stacked_products():
            torch.testing.assert_close(merged(x), want, rtol=1e-6, atol=1e-6)
    assert checked and (merged.stacked_calls, merged.shard_calls) == (0, 3)


def test_restack_moves_only_memory_nothing_else_uses() -> None:
    linears = _linears()
    merged = MergedLinear.from_linears(linears)
    linears["q"].weight.data = torch.randn(8, 6)
    alias = linears["q"].weight.detach()  # someone else holds q's memory
    assert not merged.restack() and merged.stacked_weight is None
    del alias
    assert merged.restack() and merged.views_hold()
    held = linears["v"].weight.detach()
    linears["q"].weight.data = torch.randn(8, 6)
    assert not merged.restack()  # v's memory is also someone else's now
    del held
    assert merged.restack()


def test_conversion_deepcopy_and_save_keep_the_views() -> None:
    linears = _linears((True, False, True))
    holder = nn.Module()
    for name, lin in linears.items():
        holder.add_module(name, lin)
    holder.merged = MergedLinear.from_linears(linears)
    holder.to(torch.float64)  # the children convert first, then the merged module restacks
    assert holder.merged.views_hold() and holder.merged.stacked_weight.dtype == torch.float64
    copied = copy.deepcopy(holder)
    assert copied.merged.shards[0] is copied.q and copied.merged.views_hold()
    assert copied.q.weight.data_ptr() != holder.q.weight.data_ptr()
    buffer = io.BytesIO()
    torch.save(holder, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.merged.views_hold() and loaded.merged.shards[1] is loaded.k


def test_merged_linear_refuses_shared_memory() -> None:
    linears = _linears()
    alias = linears["q"].weight.detach()
    with pytest.raises(ValueError, match=r"q\.weight shares its memory"):
        MergedLinear.from_linears(linears)
    del alias


def test_act_and_mul() -> None:
    x = torch.randn(2, 8)
    got = ActAndMul("silu", backend="torch")(x)
    assert torch.equal(got, nn.functional.silu(x[:, :4]) * x[:, 4:])
    # the two shards' outputs, computed apart: the same bits without a concatenation
    assert torch.equal(ActAndMul("silu")(x[:, :4].clone(), x[:, 4:].clone()), got)


@pytest.mark.parametrize("stacked", [True, False], ids=["one-product", "apart"])
def test_pieces_are_laid_out_as_asked(stacked: bool) -> None:
    """One stacked product: split views, `.contiguous()` where asked, and copies of their
    own (not views, standard strides) where `fresh`; shards apart: each shard's own output
    (fresh and contiguous already), never a view of a concatenation. Values always equal."""
    linears = _linears()
    expected = copy.deepcopy(linears)
    merged = MergedLinear.from_linears(linears)
    x = torch.randn(2, 3, 6)
    with torch.no_grad(), stacked_products() if stacked else contextlib.nullcontext():
        q, k, v = merged.pieces(x, ("view", "contiguous", "fresh"))
        outputs = merged.outputs(x)
        for piece, lin in zip((q, k, v), expected.values()):
            torch.testing.assert_close(piece, lin(x), rtol=1e-6, atol=1e-6)
    assert len(outputs) == (1 if stacked else 3)
    assert (merged.stacked_calls, merged.shard_calls) == ((2, 0) if stacked else (0, 2))
    if stacked:
        assert q._base is not None and not q.is_contiguous()  # a view of the one output
        assert k.is_contiguous()
    else:
        assert q._base is None and q.is_contiguous()
    assert v._base is None and v.is_contiguous() and v.stride() == (12, 4, 1)


def test_fused_rms_norm_refuses_unproven_dtypes() -> None:
    weight = nn.Parameter(torch.ones(8))
    norm = FusedRMSNorm(weight, 1e-6, verified=frozenset({(torch.float32, torch.float32)}))
    assert norm.weight is weight  # the replaced module's own Parameter, never a copy
    assert norm(torch.randn(2, 8)).shape == (2, 8)
    with pytest.raises(TypeError, match="proven equal"):
        norm(torch.randn(2, 8, dtype=torch.float64))


def _holder(merged: MergedLinear) -> nn.Module:
    """A parent holding `merged`'s shards and then `merged`, as a fused module does."""
    holder = nn.Module()
    for name, shard in zip(merged.shard_names, merged.shards):
        holder.add_module(name, shard)
    holder.add_module("merged", merged)
    return holder


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

    from fusion.kernels import onednn as onednn_backend

    monkeypatch.setattr(onednn_backend, "ROW_MIN_ELEMENTS", 0)

    merged = _merged(sizes, k, bias)
    worst = 0.0
    with torch.no_grad():
        for seed in range(4):
            x = torch.randn(1, 1, k, generator=torch.Generator().manual_seed(seed))
            stacked, stacked_bias = merged.stacked_weight, merged.stacked_bias
            b = None if stacked_bias is None else stacked_bias.double()
            ref = F.linear(x.double(), stacked.double(), b)
            got, mkl = merged(x), F.linear(x, stacked, stacked_bias)
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
    from fusion.kernels import onednn as onednn_backend

    with torch.no_grad():  # below the size threshold (a speed rule): never taken
        assert not onednn_backend.row_linear_applies(torch.zeros(24), torch.zeros(48, 24), None)
    monkeypatch.setattr(onednn_backend, "ROW_MIN_ELEMENTS", 0)
    POLICY.use("eligible")  # eligibility under test; the autouse fixture restores "measured"
    calls = []
    real = onednn_backend.row_linear
    monkeypatch.setattr(onednn_backend, "row_linear", lambda *a: calls.append(1) or real(*a))
    merged = _merged((32, 16), 24, bias=True)
    holder = _holder(merged)
    with torch.no_grad():
        stacked = merged.stacked_weight
        expected_one = int(onednn_backend.row_linear_applies(torch.zeros(24), stacked, None))
        merged(torch.randn(1, 24))
        assert len(calls) == expected_one
        merged(torch.randn(2, 24))
        holder.to(torch.bfloat16)
        merged(torch.randn(1, 24, dtype=torch.bfloat16))
    assert len(calls) == expected_one
    holder.float()
    merged(torch.randn(1, 24)).sum().backward()  # records a gradient
    assert len(calls) == expected_one
    assert merged.shards[0].weight.grad is not None
    if onednn_backend.cpu_capability() in onednn_backend.ROW_CAPABILITIES:
        assert expected_one == 1  # an AVX-512 machine takes it


def test_one_row_product_sees_every_weight_write(monkeypatch) -> None:
    """No copy of the weight is kept: writes through `.data`, `copy_`, `set_` and numpy
    after a first forward all show in the next one-row forward."""
    from fusion.kernels import onednn as onednn_backend

    monkeypatch.setattr(onednn_backend, "ROW_MIN_ELEMENTS", 0)
    merged = _merged((16, 8), 12, bias=False)
    x = torch.randn(1, 12)
    with torch.no_grad():
        merged(x)
        for shard in merged.shards:
            new = torch.randn_like(shard.weight)
            for write in (
                lambda w, new=new: w.data.copy_(new),
                lambda w: w.data.mul_(2.0),
                lambda w: w.detach().numpy().__setitem__((slice(None), 0), 3.0),
                lambda w, new=new: w.set_(new.clone()),  # last: the view breaks, shards apart
            ):
                write(shard.weight)
                want = torch.cat([x @ s.weight.t() for s in merged.shards], dim=-1)
                torch.testing.assert_close(merged(x), want, rtol=1e-5, atol=1e-6)


def test_several_rows_take_one_gemm_per_shard_on_cpu(monkeypatch) -> None:
    """Several float32 rows on a CPU without gradient: one GEMM per shard on row views of
    the stacked weight, bit-identical to the unfused projections' `F.linear` (with and
    without bias, 2-D and 3-D inputs) and seeing weight writes; one shard only, the
    stacked GEMM; with a gradient recorded, each shard's own `F.linear`."""
    import torch.nn.functional as F

    def unfused(merged, x):
        return torch.cat([F.linear(x, s.weight, s.bias) for s in merged.shards], dim=-1)

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
                assert seen == [tuple(s.weight.shape) for s in m.shards]
                assert got.shape == want.shape and torch.equal(got, want)
                seen.clear()
        x = torch.randn(3, 5, 16)
        merged.shards[1].weight.data.mul_(-1.0)  # a write through .data: seen next call
        assert torch.equal(merged(x), unfused(merged, x))
        monkeypatch.setattr(F, "linear", spy)
        _merged((40,), 16, bias=False)(x)
    assert seen == [(40, 16)]
    seen.clear()
    merged(x).sum().backward()  # with a gradient: each shard's own F.linear
    assert seen == [(24, 16), (8, 16), (8, 16)] and merged.shards[0].weight.grad is not None


@pytest.mark.parametrize("bias", [False, True])
def test_compiled_merged_linear_makes_the_eager_choices(bias: bool) -> None:
    """Under torch.compile a merged projection is one `fusion::stacked_product` node (which
    makes the eager stacked choice when it runs) where a kernel could win for the call, and
    its shards apart (the unfused calls, for Inductor) where nothing was measured to win for
    its shape, dtype and row bucket (`KernelPolicy.traced_reference`); an unanswered key
    traces the node. Values equal the eager module's throughout."""
    from tests.fusion.policy_tables import WIN, entry, table

    merged = _merged((64, 16, 16), 32, bias=bias).eval()
    shape = merged.kernel_shape

    def traced(rows: int) -> list[str]:
        x = torch.randn(1, rows, 32)
        with torch.no_grad():
            out, targets = compiled_call_targets(merged, x)
            torch.testing.assert_close(out, merged(x), rtol=1e-5, atol=1e-6)
        return targets

    def apart(targets: list[str]) -> bool:
        return sum("linear" in t for t in targets) == 3 and not any("fusion" in t for t in targets)

    assert POLICY.own_wins[("stacked", shape, "auto")] is None  # watched, not answered
    assert traced(1) == ["fusion.stacked_product"] == traced(5)
    POLICY.set_table(table())  # nothing measured: the shards apart at every row count
    assert apart(traced(1)) and apart(traced(5))
    POLICY.set_table(table(entry("stacked", shape, 1, stacked=WIN)))  # won at one row
    assert traced(1) == ["fusion.stacked_product"]
    assert apart(traced(5))


@pytest.mark.parametrize("change", ["assign-data", "new-parameter", "drop-bias", "restack"])
def test_the_compiled_stacked_product_checks_the_views_when_it_runs(
    change: str, monkeypatch
) -> None:
    """Dynamo guards neither a Parameter's `.data` nor an address: after compiling, a shard
    whose weight no longer is its rows of the stacked weight (or a shard stacked with a
    bias that has none now) makes the `fusion::stacked_product` node compute the shards'
    own products, so the compiled module still computes the unfused function, with the
    one-row kernel pinned on (`eligible`, any size). Traced through AOT (its fake
    implementation)."""
    from fusion.kernels import onednn as onednn_backend
    from fusion.kernels import ops

    monkeypatch.setattr(onednn_backend, "ROW_MIN_ELEMENTS", 0)
    onednn_backend.resolve_machine()
    if not onednn_backend.row_machine_known_ok():
        pytest.skip("this machine's oneDNN has no one-row product to stack (resolve_machine)")
    ran: list[str] = []
    real = ops._fast_product
    monkeypatch.setattr(ops, "_fast_product", lambda k, *a: ran.append(k) or real(k, *a))
    POLICY.use("eligible")
    linears = _linears((True, False, True))
    merged = MergedLinear.from_linears(linears).eval()
    x = torch.randn(1, 6)
    torch._dynamo.reset()
    compiled = torch.compile(merged, backend="aot_eager", fullgraph=True)

    def want() -> torch.Tensor:
        return torch.cat([lin(x) for lin in linears.values()], dim=-1)

    with torch.no_grad():
        torch.testing.assert_close(compiled(x), want(), rtol=1e-5, atol=1e-6)
        assert "onednn-row" in ran  # the kernel ran on the stacked weight
        if change == "assign-data":
            linears["k"].weight.data = torch.randn(4, 6)
        elif change == "new-parameter":
            linears["k"].weight = nn.Parameter(torch.randn(4, 6))
        elif change == "drop-bias":
            linears["v"].bias = None
        else:
            linears["k"].weight.data = torch.randn(4, 6)
            assert merged.restack()  # a new stacked weight, its rows the Parameters again
        assert change == "restack" or not merged.views_hold()
        torch.testing.assert_close(compiled(x), want(), rtol=1e-5, atol=1e-6)


def test_stacked_views_hold_is_the_views_by_memory_alone() -> None:
    """`ops.stacked_views_hold` on a stacked weight and its rows: true as stacked, false for
    rows out of order, a copy, another dtype, a shard bias where it was stacked without one
    and none where it was stacked with one."""
    from fusion.kernels.ops import stacked_views_hold

    weight, bias = torch.randn(10, 6), torch.randn(10)
    rows = [weight[:6], weight[6:8], weight[8:]]
    biases = [bias[:6], None, bias[8:]]
    flags = [True, False, True]
    assert stacked_views_hold(weight, bias, rows, biases, flags)
    assert not stacked_views_hold(weight, bias, [rows[1], rows[0], rows[2]], biases, flags)
    assert not stacked_views_hold(weight, bias, [rows[0].clone(), *rows[1:]], biases, flags)
    assert not stacked_views_hold(
        weight.double(), bias.double(), [r.double() for r in rows], biases, flags
    )
    assert not stacked_views_hold(weight, bias, rows, [bias[:6], bias[6:8], bias[8:]], flags)
    assert not stacked_views_hold(weight, bias, rows, [bias[:6], None, None], flags)
    assert not stacked_views_hold(weight, None, rows, biases, flags)
    assert not stacked_views_hold(weight, bias, rows[:2], biases[:2], flags[:2])


def test_row_linear_operator_reads_settings_when_it_runs(monkeypatch) -> None:
    """The operator's choice is made per call: with oneDNN disabled it is `F.linear`."""
    import torch.nn.functional as F

    from fusion.kernels import onednn as onednn_backend

    monkeypatch.setattr(onednn_backend, "ROW_MIN_ELEMENTS", 0)
    weight, x = torch.randn(48, 32), torch.randn(1, 32)
    taken: list[bool] = []
    real = onednn_backend.row_linear_applies
    monkeypatch.setattr(
        onednn_backend, "row_linear_applies", lambda *a: taken.append(real(*a)) or taken[-1]
    )
    POLICY.use("eligible")
    operator = torch.ops.fusion.linear_product
    with torch.backends.mkldnn.flags(enabled=False):
        assert torch.equal(
            operator(x, weight, None, "linear", [48, 32], "auto"), F.linear(x, weight)
        )
    assert taken == [False]


def test_one_row_product_width_rule_depends_on_threads(monkeypatch) -> None:
    """With one thread a long reduction stays on MKL (oneDNN measured slower there); with
    two threads it takes the one-row product."""
    from fusion.kernels import onednn as onednn_backend

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


@pytest.mark.parametrize(
    "pair",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.float32),
        (torch.float32, None),
        (torch.bfloat16, None),
    ],
)
def test_fused_norm_forward_is_the_reference_bit_for_bit(pair) -> None:
    """`FusedRMSNorm.forward` takes `torch.rms_norm` directly on CPU where it can (the
    float32 shortcut, then `torch_ref.aten_norm`, e.g. the half-precision weight-after-cast
    order as `weight * torch.rms_norm(x, None)`):
    every variant, at model widths, is `torch_ref.rms_norm` exactly."""
    import itertools

    from fusion.kernels import reference as torch_ref
    from fusion.kernels.norm_variant import NormVariant

    dtype, wdtype = pair
    generator = torch.Generator().manual_seed(2)
    for flags, shape in itertools.product(
        itertools.product((0.0, 1.0), (True, False), (True, False), (False, True)),
        ((1, 16, 1024), (1, 16, 16, 128), (3, 2048), (1, 7)),
    ):
        variant = NormVariant(*flags)
        x = (3 * torch.randn(*shape, generator=generator)).to(dtype)
        weight = None
        if wdtype is not None:
            weight = nn.Parameter(
                (0.3 * torch.randn(shape[-1], generator=generator) + 1).to(wdtype)
            )
        norm = FusedRMSNorm(weight, 1e-6, variant=variant, verified=frozenset({pair}))
        with torch.no_grad():
            got = norm(x)
            want = torch_ref.rms_norm(x, weight, 1e-6, variant=variant)
        assert got.dtype == want.dtype and torch.equal(got, want), (variant, shape)


# -- issue 43: every shard premise holds for the stacked product -----------------------------


def _unfused_cat(linears: dict[str, nn.Linear], x: torch.Tensor) -> torch.Tensor:
    return torch.cat([lin(x) for lin in linears.values()], dim=-1)


@pytest.mark.parametrize("bias", [(True, False, True), (False, False, False)])
def test_a_bias_added_to_a_shard_without_one_is_not_dropped_on_the_stacked_path(bias) -> None:
    """The stacked bias holds zeros for `k` (or there is no stacked bias at all): a bias
    given to `k` after merging is read by the unfused `F.linear`, so the stacked product
    must not run; the shards computed apart read it."""
    linears = _linears(bias)
    merged = MergedLinear.from_linears(linears)
    linears["k"].bias = nn.Parameter(torch.randn(4))
    assert not merged.views_hold() and not merged.restack()  # stays apart: correct
    x = torch.randn(3, 6)
    with torch.no_grad(), stacked_products():
        torch.testing.assert_close(merged(x), _unfused_cat(linears, x), rtol=1e-6, atol=1e-6)
    assert (merged.stacked_calls, merged.shard_calls) == (0, 1)


@pytest.mark.parametrize("change", ["instance weight", "instance bias", "buffer bias"])
def test_weights_the_lookup_finds_elsewhere_are_read_on_every_path(change: str) -> None:
    """`nn.Linear.forward` reads `self.weight` / `self.bias`: an instance attribute set
    through `object.__setattr__` (found before `_parameters`), or a bias re-registered as a
    buffer, is what it computes with, on the stacked path (the views no longer hold) and on
    the shards' own path alike."""
    linears = _linears((True, False, True))
    merged = MergedLinear.from_linears(linears)
    k = linears["k"]
    if change == "instance weight":
        object.__setattr__(k, "weight", nn.Parameter(torch.randn(4, 6)))
    elif change == "instance bias":
        object.__setattr__(k, "bias", torch.randn(4))
    else:
        del k.bias
        k.register_buffer("bias", torch.randn(4))
    assert not merged.views_hold() and not merged.restack()
    x = torch.randn(3, 6)
    with torch.no_grad():
        want = _unfused_cat(linears, x)
        torch.testing.assert_close(merged(x), want, rtol=1e-6, atol=1e-6)
        with stacked_products():
            torch.testing.assert_close(merged(x), want, rtol=1e-6, atol=1e-6)
    assert merged.stacked_calls == 0


def test_each_shard_premise_is_checked_on_the_stacked_path() -> None:
    """Weight and bias of every shard: a swapped Parameter, a changed dtype or shape
    (`.data =`), each breaks the views; restoring the original Parameter restores them."""
    linears = _linears((True, False, True))
    merged = MergedLinear.from_linears(linears)
    for name, attr in (("q", "bias"), ("v", "bias"), ("k", "weight"), ("v", "weight")):
        lin = linears[name]
        param = getattr(lin, attr)
        for new in (param.detach().double(), param.detach()[:1].clone(), param.detach().clone()):
            saved = param.data
            param.data = new
            assert not merged.views_hold(), (name, attr, new.dtype, new.shape)
            param.data = saved
            assert merged.views_hold()


def test_complex_weights_are_never_stacked() -> None:
    """A conjugate bit would not move the data pointer: complex shards stay apart."""
    linears = {n: nn.Linear(4, 2, bias=False, dtype=torch.complex64) for n in ("a", "b")}
    with pytest.raises(ValueError, match="real tensor"):
        MergedLinear.from_linears(linears)
