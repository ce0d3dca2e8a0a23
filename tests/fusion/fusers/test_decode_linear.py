"""The decode_linear fuser: plain linears take oneDNN's one-row product at decode behind
their forward, keeping their class, parameters, names and place; anything not exactly a
plain linear is refused."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusion
from fusion import numerics
from fusion.kernels import onednn as onednn_backend
from fusion.kernels import ops
from fusion.kernels.native import gemm as native_gemm
from fusion.kernels.policy import POLICY
from fusion.runtime.linear_forward import LinearForward, linear_forward
from tests.fusion.kernels.native_helpers import force_native_on
from tests.fusion.policy_tables import WIN, entry, table


@pytest.fixture(autouse=True)
def _small_threshold(monkeypatch):
    """Test-sized weights take the path (the threshold is a speed rule, not a safety one).
    The native kernel keeps its threshold here (these tests watch oneDNN's one-row product)
    except where a test lowers it."""
    monkeypatch.setattr(onednn_backend, "ROW_MIN_ELEMENTS", 32 * 48)
    monkeypatch.setattr(native_gemm, "MIN_ELEMENTS", native_gemm.MIN_ELEMENTS)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 4)).eval()


def test_large_plain_linears_keep_their_class_and_get_the_forward() -> None:
    model = _model()
    params = {name: p for name, p in model.named_parameters()}
    report = fusion.fuse(model)
    assert [(r.qualname, r.fuser) for r in report.applied] == [
        ("0", "decode_linear"),
        ("2", "decode_linear"),
    ]
    assert not any(s.qualname == "3" for s in report.skipped)  # below the threshold: silent
    assert all(type(m) is nn.Linear for m in (model[0], model[2], model[3]))
    assert isinstance(model[0].forward, LinearForward) and linear_forward(model[3]) is None
    assert all(p is params[name] for name, p in model.named_parameters())


def test_fusing_again_reports_already_fused() -> None:
    model = _model()
    fusion.fuse(model)
    forward = model[0].forward
    report = fusion.fuse(model)
    assert not report.applied and model[0].forward is forward
    reasons = {s.qualname: s.reason for s in report.skipped}
    assert "already fused" in reasons["0"] and "already fused" in reasons["2"], reasons


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_quantize_dynamic_quantizes_every_linear_as_unfused() -> None:
    """Regression (issue 43: a class swap hid the projections from type-keyed tools):
    `quantize_dynamic(model, {nn.Linear})` after fusing quantizes the same modules as on
    the unfused model, with the same values, and the installed forwards leave with the
    float modules it replaced."""
    model = _model()
    fused = copy.deepcopy(model)
    fusion.fuse(fused)
    x = torch.randn(3, 48)
    with torch.no_grad():
        fused(x)
    quantized = [
        torch.ao.quantization.quantize_dynamic(m, {nn.Linear}, dtype=torch.qint8)
        for m in (model, fused)
    ]
    kinds = [[type(m) for m in q] for q in quantized]
    assert kinds[0] == kinds[1] and kinds[0][0] is not nn.Linear
    assert not any("forward" in m.__dict__ for m in quantized[1].modules())
    with torch.no_grad():
        assert torch.equal(quantized[0](x), quantized[1](x))


def test_a_class_or_forward_patch_after_fusing_is_obeyed(monkeypatch) -> None:
    """A patch of `nn.Linear.forward`, of `F.linear`, or a class change of the module after
    fusing reaches the call as on the unfused model (the forward falls back, counted)."""
    POLICY.use("eligible")
    model = _model()
    fusion.fuse(model)
    x = torch.randn(1, 48)
    forward = model[0].forward
    real = nn.Linear.forward
    monkeypatch.setattr(nn.Linear, "forward", lambda self, x: real(self, x) * 2)
    with torch.no_grad():
        torch.testing.assert_close(model[0](x), 2 * F.linear(x, model[0].weight, model[0].bias))
    assert forward.guard_failures == 1 and "nn.Linear.forward" in forward.last_failure
    monkeypatch.undo()
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: torch.zeros(()))
    with torch.no_grad():
        assert torch.equal(model[0](x), torch.zeros(()))
    assert "functional.linear" in forward.last_failure
    monkeypatch.undo()
    model[0].__class__ = _Subclass
    with torch.no_grad():
        assert torch.equal(model[0](x), torch.ones(1, 64))
    assert forward.guard_failures == 3 and "_Subclass" in forward.last_failure
    model[0].__class__ = nn.Linear
    with torch.no_grad():
        torch.testing.assert_close(model[0](x), F.linear(x, model[0].weight, model[0].bias))
    assert forward.guard_failures == 3


def test_same_function_one_row_and_many() -> None:
    model = _model()
    fused = copy.deepcopy(model)
    fusion.fuse(fused)
    with torch.no_grad():
        for shape in ((1, 48), (1, 1, 48), (5, 48), (2, 3, 48)):
            x = torch.randn(*shape, dtype=torch.float64).float()
            got, want = fused(x), model(x)
            exact = model.double()(x.double())
            model.float()
            if x.numel() == x.shape[-1]:  # one row: oneDNN, no less accurate than MKL
                err = numerics.relative_error(got, exact)
                assert err <= 2 * numerics.relative_error(want, exact) + 1e-7
            else:
                assert torch.equal(got, want)  # several rows: F.linear itself


def test_row_path_taken_and_weight_writes_seen(monkeypatch) -> None:
    # The eligibility rules are under test, not a measurement: with nothing measured the
    # default policy runs F.linear everywhere, and this test would pass vacuously off AVX-512
    # and fail on it.
    POLICY.use("eligible")  # the suite's autouse fixture restores the default
    taken: list[tuple[int, ...]] = []
    real = onednn_backend.row_linear
    monkeypatch.setattr(
        onednn_backend, "row_linear", lambda x, w, b: taken.append(tuple(w.shape)) or real(x, w, b)
    )
    model = _model()
    fusion.fuse(model)
    x = torch.randn(1, 48)
    with torch.no_grad():
        model(x)
        model[0].weight.data.mul_(-2.0)  # a write no version counter sees
        want = F.linear(x, model[0].weight, model[0].bias)
        torch.testing.assert_close(model[0](x), want, rtol=1e-5, atol=1e-6)
    onednn_backend.resolve_machine()
    if onednn_backend.cpu_capability() in onednn_backend.ROW_CAPABILITIES:
        assert (64, 48) in taken
    else:
        assert taken == []


class _Subclass(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ones(*x.shape[:-1], self.out_features)


def test_refusals_name_the_reason() -> None:
    model = _model()
    model[0].register_forward_hook(lambda *args: None)
    model[2].forward = lambda x: x  # an instance forward
    report = fusion.fuse(model)
    reasons = {s.qualname: s.reason for s in report.skipped if s.fuser == "decode_linear"}
    assert "hooks" in reasons["0"] and "forward" in reasons["2"], reasons
    assert not report.applied
    quantised = nn.Sequential(_Subclass(48, 64))
    assert not fusion.fuse(quantised).applied  # not exactly nn.Linear: not a candidate


def test_tied_weights_and_checkpoints_are_untouched(tmp_path) -> None:
    """An LM head tied to the embeddings stays tied; the state dict is the same dict."""
    from tests.fusion.tiny_models import tiny_model, token_ids

    model = tiny_model("llama", seed=3, tie_word_embeddings=True)
    before = model.state_dict()
    fusion.fuse(model)
    assert type(model.lm_head) is nn.Linear and linear_forward(model.lm_head) is not None
    assert model.lm_head.weight is model.model.embed_tokens.weight
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    ids = token_ids()
    with torch.no_grad():
        model(ids)


def test_tensor_parallel_plans_are_kept() -> None:
    """An installed forward leaves the model's modules and parameters as they were, so its
    tensor-parallel plan (which names them) is not pruned."""
    model = _model()
    model._tp_plan = {"0": "colwise", "2": "rowwise"}
    fusion.fuse(model)
    assert model._tp_plan == {"0": "colwise", "2": "rowwise"}


def test_compiles_fullgraph_through_the_operator() -> None:
    """Compiled, a fused linear is the `fusion::linear_product` node where a kernel may run
    unmeasured (`eligible`), and plain `F.linear` where nothing was measured to win for the
    call (`KernelPolicy.traced_reference`, an empty table)."""
    model = _model()
    fusion.fuse(model)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    def targets() -> list[str]:
        graphs.clear()
        torch._dynamo.reset()
        with torch.no_grad():
            got = torch.compile(model, backend=backend, fullgraph=True)(x)
            torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-6)
        return [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]

    x = torch.randn(1, 48)
    POLICY.set_table(table())
    assert not any("fusion" in t for t in targets())
    POLICY.use("eligible")
    if onednn_backend.row_machine_known_ok():
        found = targets()
        assert sum("fusion.linear_product" in t for t in found) == 2, found


def test_deepcopy_and_pickle_keep_a_forward_reading_the_copy() -> None:
    import io

    POLICY.use("eligible")
    model = _model()
    fusion.fuse(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(1, 48)
    for copied in (copy.deepcopy(model), loaded):
        assert type(copied[0]) is nn.Linear and copied[0].forward.module is copied[0]
        assert copied[0].forward is not model[0].forward
        with torch.no_grad():
            copied[0].weight.mul_(-1.0)  # the copy's own weight, not the original's
            torch.testing.assert_close(copied[0](x), -model[0](x) + 2 * model[0].bias)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v3"])
def test_every_linear_taking_it_passes_parity_and_the_lifecycle(arch: str) -> None:
    """With the thresholds at zero and the policy running every eligible kernel, every
    plain linear of a tiny corpus model gets a LinearForward and every linear of a fused one
    whose width allows takes the native kernel (where it is built): the parity oracle and
    every lifecycle operation (generate, train, save and reload, weight edits, copies,
    compile) still pass."""
    import corpus
    from harness.runner.arch_check import CheckOptions, check_model, make_inputs

    POLICY.use("eligible")  # the suite's autouse fixture restores the default

    onednn_backend.ROW_MIN_ELEMENTS = 0  # both restored by the autouse fixture's monkeypatch
    native_gemm.MIN_ELEMENTS = 0
    calls: list[int] = []
    real = native_gemm.run
    native_gemm.run = lambda *a: calls.append(1) or real(*a)
    try:
        model = corpus.build(arch, seed=0, dtype=torch.float32, device="cpu")
        options = CheckOptions(lifecycle="full")
        result = check_model(arch, model, make_inputs(model, options), options).result
    finally:
        native_gemm.run = real
    assert bool(calls) == native_gemm.known_ok()  # the kernel ran wherever it is on
    assert result.status == "pass", result.message
    assert all(v["verdict"] in {"pass", "n/a"} for v in result.lifecycle.values())
    assert any("decode_linear" in str(entry) for entry in (result.applied or {})), result.applied


def test_plan_reports_without_changing_the_class() -> None:
    model = _model()
    report = fusion.plan(model)
    assert [(r.qualname, r.fuser) for r in report.applied] == [
        ("0", "decode_linear"),
        ("2", "decode_linear"),
    ]
    assert all(type(m) is nn.Linear for m in (model[0], model[2], model[3]))


class _Doubled(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


def test_parametrization_and_pruning_after_fusing_compute_as_unfused() -> None:
    """A parametrization (a class swap to `ParametrizedLinear`: the forward falls back) and
    pruning (a forward pre-hook writing `weight`: read live) added after fusing give the
    unfused model's outputs with the same edit."""
    from torch.nn.utils import parametrize, prune

    POLICY.use("eligible")
    unfused = _model()
    fused = copy.deepcopy(unfused)
    fusion.fuse(fused)
    forward = fused[0].forward
    x = torch.randn(1, 48)
    for model in (unfused, fused):
        parametrize.register_parametrization(model[0], "weight", _Doubled())
        prune.l1_unstructured(model[2], "weight", amount=0.5)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), unfused(x), rtol=1e-5, atol=1e-6)
    assert forward.guard_failures >= 1 and "Parametrized" in forward.last_failure
    assert fused[2].forward.guard_failures == 0  # pruned: still the fast path, live weight


def _spy_chosen(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes `ops.chosen_for` is asked for from now on (a product asking the policy)."""
    chosen: list[tuple[int, ...]] = []
    real_chosen = ops.chosen_for

    def spied(memo, op, shape, *args):
        chosen.append(shape)
        return real_chosen(memo, op, shape, *args)

    monkeypatch.setattr(ops, "chosen_for", spied)
    return chosen


def test_the_quiet_lane_runs_the_class_forward_and_nothing_else(monkeypatch) -> None:
    """With routes open and nothing measured to win (`KernelPolicy.quiet`), a call runs what
    the unfused module runs, `type(module).forward`, without asking the policy or any
    kernel; closed routes, a recording calibration or a measured winner close the lane."""
    model = _model()
    fusion.fuse(model)
    x = torch.randn(1, 48)
    want = F.linear(x, model[0].weight, model[0].bias)

    def untouchable(*args, **kwargs):
        raise AssertionError("the quiet lane asked for a kernel")

    class_calls: list[nn.Module] = []
    real_forward = nn.Linear.forward

    def counted(self, input):
        class_calls.append(self)
        return real_forward(self, input)

    with torch.no_grad(), monkeypatch.context() as patch:
        patch.setattr(ops, "chosen_for", untouchable)
        patch.setattr(ops, "product", untouchable)
        patch.setattr(nn.Linear, "forward", counted)
        with POLICY.routing(True):
            assert torch.equal(model[0](x), want)
        assert class_calls == [model[0]] and POLICY.lane is True
        assert model[0].forward.guard_failures == 0  # the lane is not a fallback
        with POLICY.routing(False):  # closed: the premises see the patch, and count it
            assert torch.equal(model[0](x), want)
        assert model[0].forward.guard_failures == 1

    chosen = _spy_chosen(monkeypatch)
    with torch.no_grad(), POLICY.routing(True):
        with POLICY.recording_asks():  # calibration must see the product asked
            model[0](x)
        assert chosen == [(64, 48)] and ("linear", (64, 48), "float32", 1, 1) in {
            (op, shape, dtype, bucket, 1) for op, shape, dtype, bucket, _ in POLICY.asked
        }
        POLICY.set_table(table(entry("linear", (64, 48), 1, native=WIN)))
        torch.testing.assert_close(model[0](x), want)
        assert POLICY.lane is False and chosen[-1] == (64, 48)


def test_a_winner_for_another_shape_leaves_a_linear_its_own_lane(monkeypatch) -> None:
    """Another model calibrated on this machine closes the process's quiet lane; a linear
    whose own shape has no winner still runs its class forward without asking for a kernel
    (`LinearForward._quiet_call`); its own winner brings the kernel path back."""
    model = _model()
    fusion.fuse(model)
    x = torch.randn(1, 48)
    POLICY.set_table(table(entry("linear", (8, 8), 1, native=WIN)))
    chosen = _spy_chosen(monkeypatch)
    want = F.linear(x, model[0].weight, model[0].bias)
    with torch.no_grad(), POLICY.routing(True):
        assert torch.equal(model[0](x), want)
        assert POLICY.lane is False and chosen == []
        POLICY.set_table(table(entry("linear", (64, 48), 1, native=WIN)))
        torch.testing.assert_close(model[0](x), want)
        assert chosen == [(64, 48)]


def test_a_winner_at_other_rows_leaves_those_calls_on_the_class_forward(monkeypatch) -> None:
    """A linear whose shape won only at 8 rows (a prompt's) runs its class forward for a
    one-row call without asking for a kernel (`KernelPolicy.won_rows`: nothing won for
    that dtype and row bucket at any thread count), and asks for the 8-row call; a win at
    any thread count counts, so a second thread count's winner at one row brings it back."""
    model = _model()
    fusion.fuse(model)
    one, eight = torch.randn(1, 48), torch.randn(8, 48)
    chosen = _spy_chosen(monkeypatch)
    prompt_only = table(entry("linear", (64, 48), 8, native=WIN))
    POLICY.set_table(prompt_only)
    with torch.no_grad(), POLICY.routing(True):
        assert torch.equal(model[0](one), F.linear(one, model[0].weight, model[0].bias))
        assert POLICY.lane is False and chosen == []
        torch.testing.assert_close(model[0](eight), F.linear(eight, model[0].weight, model[0].bias))
        assert chosen == [(64, 48)]
        one_row = entry("linear", (64, 48), 1, native=WIN)
        # measured for another thread count only
        prompt_only.add(dataclasses.replace(one_row, threads=one_row.threads + 1))
        POLICY.set_table(prompt_only)
        model[0](one)
        assert chosen == [(64, 48), (64, 48)]


def test_compiled_under_other_shapes_winners_a_linear_traces_its_class_forward(
    monkeypatch,
) -> None:
    """Compiled code takes a linear's own lane (`KernelPolicy.traced_own_lane`, answered by
    `fuse` and by each `forget`) where a winner for another shape closed the process's, so
    Inductor sees the unfused `F.linear`; where its own shape wins, the next call recompiles
    (Dynamo guarded the answer it read) and runs the `fusion::linear_product` operator."""
    force_native_on(monkeypatch)  # the kernel eligible at these sizes on any flavour
    POLICY.use("measured")  # ... but chosen by the tables below
    model = _model()
    fusion.fuse(model)
    x = torch.randn(1, 48)
    targets: list[str] = []

    def backend(gm, _inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    POLICY.set_table(table(entry("linear", (8, 8), 1, native=WIN)))
    assert POLICY.lane is False and POLICY.own_lane(("linear", (64, 48), "auto"))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad(), POLICY.routing(True):
        torch.testing.assert_close(compiled(x), model(x))
        assert targets and not any("fusion" in t for t in targets), targets
        POLICY.set_table(table(entry("linear", (64, 48), 1, native=WIN)))
        assert not POLICY.own_lane(("linear", (64, 48), "auto"))
        targets.clear()
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
        assert any("fusion.linear_product" in t for t in targets), targets


def test_a_call_in_the_row_lane_asks_nothing_of_its_own(monkeypatch) -> None:
    """Where the process's row-bucket lane holds the call (`KernelPolicy.row_lane`: every
    watched product's winners are at more rows), a linear runs its class forward before
    its own answers (`_quiet_call`) are read; past the lane it reads them."""
    model = _model()
    fusion.fuse(model)
    POLICY.set_table(table(entry("linear", (64, 48), 8, native=WIN)))
    assert POLICY.row_lane == {torch.float32: 8}
    own = []
    real = LinearForward._quiet_call
    monkeypatch.setattr(LinearForward, "_quiet_call", lambda s, a: own.append(1) or real(s, a))
    one, eight = torch.randn(1, 48), torch.randn(8, 48)
    with torch.no_grad(), POLICY.routing(True):
        assert torch.equal(model[0](one), F.linear(one, model[0].weight, model[0].bias))
        assert own == []
        model[0](eight)
        assert own == [1]
