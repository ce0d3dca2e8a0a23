"""Routes: a rewritten forward runs its class's original where every kernel it could choose
runs its reference (nothing measured to win, or measured to lose: `fusion.runtime.routes`), and
nowhere else. The tables are written by hand (`test_policy.py`'s helpers); nothing here is
timed. Routes are open here (tests/conftest.py closes them for every other test)."""

from __future__ import annotations

import copy
import dataclasses
import gc
import pickle
import weakref

import pytest
import torch

import fusion
from fusion.kernels import ops
from fusion.kernels.calibration import Entry, Ratio, Table
from fusion.kernels.policy import POLICY, row_bucket
from fusion.runtime import bound, routes
from fusion.runtime.guards import ChildGuard
from fusion.runtime.merged import FusedRMSNorm, MergedLinear
from fusion.runtime.norm_forward import NormForward
from tests.fusion.policy_tables import LOSS, WIN, entry
from tests.fusion.tiny_models import tiny_model, token_ids


@pytest.fixture(autouse=True)
def _routes_open():
    # counted, so every test here can read `original_calls` (what counting costs and
    # what it leaves uncounted: `test_routes_are_counted_only_where_asked`)
    with POLICY.routing(True), POLICY.counting_routes():
        yield


def fused_model(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, torch.nn.Module]:
    unfused = tiny_model("qwen3").to(dtype).eval()
    fused = copy.deepcopy(unfused)
    assert fusion.fuse(fused).applied
    return unfused, fused


def merged_modules(model: torch.nn.Module) -> list[MergedLinear]:
    return [m for m in model.modules() if isinstance(m, MergedLinear)]


def bound_forwards(model: torch.nn.Module) -> list[bound.BoundForward]:
    found = [m.__dict__.get("forward") for m in model.modules()]
    return [
        f for f in found if isinstance(f, bound.BoundForward) and isinstance(f._route, routes.Route)
    ]


def measured(model: torch.nn.Module, rows: int, dtype: str, **ratios: Ratio) -> Table:
    """A table measuring every merged projection's stacked product of `model` at `rows`."""
    table = Table("routes")
    for merged in merged_modules(model):
        table.add(
            Entry(
                op="stacked",
                shape=merged.kernel_shape,
                dtype=dtype,
                rows=row_bucket(rows),
                threads=torch.get_num_threads(),
                median_us={"reference": 100.0, **{k: 100.0 / r.median for k, r in ratios.items()}},
                ratios=dict(ratios),
                rounds=9,
            )
        )
    return table


def linear_winner() -> Entry:
    """An entry where a plain linear's one-row kernel wins: it closes the quiet lane
    (`KernelPolicy.quiet`), and touches no merged product."""
    return entry("linear", (64, 128), 1, **{"onednn-row": WIN})


def forward(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def calls(model: torch.nn.Module) -> tuple[int, int]:
    """(original calls by route, merged projections' own calls) over the model."""
    return (
        sum(f.original_calls for f in bound_forwards(model)),
        sum(m.shard_calls + m.stacked_calls for m in merged_modules(model)),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measured_references_run_the_original_and_compute_the_same(dtype) -> None:
    unfused, fused = fused_model(dtype)
    ids = token_ids(batch=1, seq=5)
    assert bound_forwards(fused), "qwen3's attention and MLP rewrites have routes"
    POLICY.set_table(measured(fused, 5, str(dtype).removeprefix("torch."), stacked=LOSS))
    assert torch.equal(forward(fused, ids), forward(unfused, ids))
    original, merged = calls(fused)
    assert original == len(bound_forwards(fused)) and merged == 0


def test_nothing_measured_runs_the_original_by_default() -> None:
    """An uncalibrated machine: every merged product on its reference, so the rewrites would
    only add frames; the originals run, computing exactly the unfused calls."""
    unfused, fused = fused_model()
    ids = token_ids(batch=1, seq=5)
    assert torch.equal(forward(fused, ids), forward(unfused, ids))
    original, merged = calls(fused)
    assert original == len(bound_forwards(fused)) and merged == 0
    assert {ask[0] for ask in POLICY.asked} >= {"stacked"}  # still asked: calibrate sees it


def test_closed_routes_run_the_rewrite() -> None:
    unfused, fused = fused_model()
    ids = token_ids(batch=1, seq=5)
    with POLICY.routing(False):
        torch.testing.assert_close(forward(fused, ids), forward(unfused, ids))
    original, merged = calls(fused)
    assert original == 0 and merged == len(merged_modules(fused))
    forward(fused, ids)  # open again (this module's fixture): the route
    assert calls(fused)[0] == len(bound_forwards(fused))


def test_a_winner_runs_the_rewrite_only_for_its_bucket_and_dtype() -> None:
    _, fused = fused_model()
    POLICY.set_table(measured(fused, 5, "float32", stacked=WIN))
    forward(fused, token_ids(batch=1, seq=5))
    assert calls(fused)[0] == 0
    forward(fused, token_ids(batch=1, seq=64))  # another row bucket: nothing wins there
    assert calls(fused)[0] == len(bound_forwards(fused))
    fused.to(torch.bfloat16)  # another dtype: nothing wins there
    forward(fused, token_ids(batch=1, seq=5))
    assert calls(fused)[0] == 2 * len(bound_forwards(fused))


def test_a_pinned_backend_never_routes() -> None:
    """`backend="native"` names its kernel unmeasured: the rewrite runs (the kernel where
    eligible, else the reference)."""
    unfused = tiny_model("qwen3").eval()
    fused = copy.deepcopy(unfused)
    assert fusion.fuse(fused, backend="native").applied
    forward(fused, token_ids(batch=1, seq=5))
    assert calls(fused)[0] == 0


@pytest.mark.parametrize(("mode", "routed"), [("reference", True), ("eligible", False)])
def test_the_eligible_mode_never_routes(mode, routed) -> None:
    """`eligible` names every fast kernel its rules allow, unmeasured; `reference` runs
    every product on its reference, so the originals run."""
    _, fused = fused_model()
    POLICY.set_table(measured(fused, 5, "float32", stacked=WIN))
    POLICY.use(mode)
    forward(fused, token_ids(batch=1, seq=5))
    assert (calls(fused)[0] > 0) == routed


def test_recording_asks_runs_every_product() -> None:
    """The calibration records what the products ask by running the model: a route would
    hide the products it measures."""
    _, fused = fused_model()
    POLICY.set_table(measured(fused, 5, "float32", stacked=LOSS))
    with POLICY.recording_asks():
        forward(fused, token_ids(batch=1, seq=5))
    assert calls(fused)[0] == 0
    assert {ask[0] for ask in POLICY.asked} >= {"stacked"}


def test_a_remembered_decision_is_forgotten_with_the_policys_answers() -> None:
    """A route asks the policy once per (dtype, row bucket, threads) and remembers it with
    the policy's own answers: a new table, a mode and a hook added later all count."""
    _, fused = fused_model()
    ids = token_ids(batch=1, seq=5)
    POLICY.set_table(measured(fused, 5, "float32", stacked=LOSS))
    forward(fused, ids)
    taken = calls(fused)[0]
    assert taken == len(bound_forwards(fused))
    forward(fused, ids)  # remembered: taken again
    assert calls(fused)[0] == 2 * taken
    POLICY.set_table(measured(fused, 5, "float32", stacked=WIN))  # now the stacked one wins
    forward(fused, ids)
    assert calls(fused)[0] == 2 * taken
    POLICY.set_table(measured(fused, 5, "float32", stacked=LOSS))
    forward(fused, ids)
    assert calls(fused)[0] == 3 * taken
    POLICY.use("eligible")  # names kernels unmeasured: no route
    forward(fused, ids)
    assert calls(fused)[0] == 3 * taken
    POLICY.use("measured")
    merged_modules(fused)[0].register_forward_pre_hook(lambda module, args: None)
    forward(fused, ids)  # the hooked child's rewrite runs; the other routes stay
    assert calls(fused)[0] == 4 * taken - 1


def test_a_remembered_decision_does_not_keep_a_deleted_model_alive() -> None:
    _, fused = fused_model()
    POLICY.set_table(measured(fused, 5, "float32", stacked=LOSS))
    forward(fused, token_ids(batch=1, seq=5))
    assert calls(fused)[0] > 0
    gone = weakref.ref(merged_modules(fused)[0])
    del fused
    gc.collect()
    assert gone() is None


def test_a_hook_on_a_fused_child_keeps_the_rewrite() -> None:
    _, fused = fused_model()
    POLICY.set_table(measured(fused, 5, "float32", stacked=LOSS))
    seen = []
    merged = merged_modules(fused)[0]
    merged.register_forward_hook(lambda module, args, out: seen.append(module))
    forward(fused, token_ids(batch=1, seq=5))
    assert seen == [merged]
    assert calls(fused)[0] == len(bound_forwards(fused)) - 1


def test_a_replaced_child_still_computes_the_unfused_function() -> None:
    """After fusing, a user swaps a shard for another linear: routed or not, the forward is
    the original's, which calls the new child."""
    unfused, fused = fused_model()
    POLICY.set_table(measured(fused, 5, "float32", stacked=LOSS))
    for model in (unfused, fused):
        attention = model.model.layers[0].self_attn
        replacement = torch.nn.Linear(
            attention.q_proj.in_features, attention.q_proj.out_features, bias=False
        )
        torch.manual_seed(3)
        torch.nn.init.normal_(replacement.weight)
        attention.q_proj = replacement
    ids = token_ids(batch=1, seq=5)
    assert torch.equal(forward(fused, ids), forward(unfused, ids))


def test_compiled_code_routes_by_answers_made_eagerly() -> None:
    """While Dynamo traces, a route is taken on the process's quiet lane
    (`KernelPolicy.traced_lane`), on its own (`traced_own_lane`: winners measured only for
    other shapes), or where none of its products was measured to win for the call's dtype
    and row bucket (`traced_route`), all answered outside the trace: a winner for its own
    products at one row makes a one-row call trace the rewrite, while a five-row call still
    routes (the eager per-call rule agrees). Each table recompiles where it changes an
    answer the trace read (Dynamo guards it), with no `torch._dynamo.reset()`."""
    _, fused = fused_model()
    POLICY.set_table(measured(fused, 5, "float32", stacked=LOSS))
    route = bound_forwards(fused)[0]._route
    width = route.merged[0].in_features
    x, row = torch.randn(1, 5, width), torch.randn(1, 1, width)

    def takes(x):
        return x + 1 if route.takes_original((x,), {}) else x - 1

    torch._dynamo.reset()
    compiled = torch.compile(takes, backend="eager", fullgraph=True)
    assert route.takes_original((x,), {}) and POLICY.lane is True
    assert torch.equal(compiled(x), x + 1)
    others = measured(fused, 5, "float32", stacked=LOSS)
    others.add(linear_winner())  # another shape's winner: the process's lane closes
    POLICY.set_table(others)
    assert route.takes_original((x,), {}) and POLICY.lane is False
    assert all(POLICY.own_lane(key) for key in route._lane_keys)
    assert torch.equal(compiled(x), x + 1)  # its own lane, answered by `forget`
    own = measured(fused, 5, "float32", stacked=LOSS)
    own.add(linear_winner())
    for won in measured(fused, 1, "float32", stacked=WIN).entries.values():
        own.add(won)  # its own products win at one row: no lane of its own
    POLICY.set_table(own)
    assert route._won_rows()  # winners of its own: no lane of its own
    assert route.takes_original((x,), {}) and not route.takes_original((row,), {})
    assert torch.equal(compiled(x), x + 1)  # five rows: nothing won there
    assert torch.equal(compiled(row), row - 1)
    with POLICY.routing(False):
        assert torch.equal(compiled(x), x - 1)
    POLICY.set_table(others)
    assert torch.equal(compiled(row), row + 1)


def _traced_calls(model: torch.nn.Module, ids: torch.Tensor) -> list[str]:
    """The functions `torch.compile` puts in `model`'s graph, in order (attribute reads
    aside: a route reads the input's device), compiling it whole."""
    seen: list[str] = []

    def backend(gm, example_inputs):
        seen.extend(
            str(node.target)
            for node in gm.graph.nodes
            if node.op == "call_function" and node.target is not getattr
        )
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(ids)
    return seen


def test_a_compiled_model_on_the_quiet_lane_traces_the_unfused_calls() -> None:
    """`fuse` answers the lane (`ops.prepare`), so a model compiled before any eager call
    traces, on the lane, exactly the unfused model's calls, which Inductor compiles best;
    with routes closed it traces the rewrites."""
    unfused, fused = fused_model()
    ids = token_ids(batch=1, seq=5)
    assert POLICY.lane is True  # answered by `fusion.fuse`, no eager call yet
    want = _traced_calls(unfused, ids)
    assert _traced_calls(fused, ids) == want
    with POLICY.routing(False):
        assert _traced_calls(fused, ids) != want
    compiled = torch.compile(fused, backend="eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(ids).logits, forward(unfused, ids))


def test_route_of_needs_merged_projections_and_known_children() -> None:
    _, fused = fused_model()
    attention = fused.model.layers[0].self_attn
    forward_fn = type(attention).forward
    merged = ChildGuard.of(attention, "qkv_proj", called=True)
    norm = ChildGuard("q_norm", attention.q_norm, FusedRMSNorm, True)
    assert routes.route_of((merged,), forward_fn) is not None
    assert routes.route_of((), forward_fn) is None  # nothing it could choose
    assert routes.route_of((merged, norm), forward_fn) is None  # a fused child of another kind
    route = routes.route_of((merged,), forward_fn)
    assert route.first == "hidden_states"
    wrong_width = torch.randn(1, 5, route.merged[0].in_features + 1)
    # the per-call rule (the lanes closed: this product wins at 64 rows) reads the width
    POLICY.set_table(measured(fused, 64, "float32", stacked=WIN))
    assert not route.takes_original((wrong_width,), {})
    assert not route.takes_original((), {"hidden_states": None})
    # on the quiet lane the input decides nothing: the original fails where unfused would
    POLICY.set_table(Table("nothing wins"))
    assert route.takes_original((wrong_width,), {})


def test_the_report_says_where_a_route_runs() -> None:
    _, fused = fused_model()
    POLICY.set_table(measured(fused, 1, "float32", stacked=LOSS))
    choices = [c for c in fusion.kernel_choices(fused) if c.op == "stacked"]
    assert choices and all("runs its class's original (route)" in c.decode[1] for c in choices)
    POLICY.set_table(measured(fused, 128, "float32", stacked=WIN))
    choices = [c for c in fusion.kernel_choices(fused) if c.op == "stacked"]
    assert not any("route" in c.prefill[1] for c in choices)  # 128 rows: the stacked one wins
    assert all("route" in c.decode[1] for c in choices)  # one row: nothing measured
    with POLICY.routing(False):
        choices = [c for c in fusion.kernel_choices(fused) if c.op == "stacked"]
    assert not any("route" in c.decode[1] for c in choices)


@pytest.mark.parametrize(
    ("backend", "device"),
    # a pinned CPU backend on meta raises (`backend=` means exactly what it says)
    [
        ("auto", "cpu"),
        ("torch", "cpu"),
        ("native", "cpu"),
        ("onednn", "cpu"),
        ("auto", "meta"),
        ("torch", "meta"),
    ],
)
@pytest.mark.parametrize("open_routes", [True, False])
def test_a_norm_call_takes_the_route_exactly_where_routed_says(
    backend, device, open_routes
) -> None:
    """`NormForward.__call__` spells the route out (one frame on the hot path): a call runs
    the class's original (counted in `original_calls`) exactly where `routed` answers True,
    and computes the unfused norm either way."""
    unfused, fused = fused_model()
    fused.to(device)
    name, norm = next(
        (n, m)
        for n, m in fused.named_modules()
        if isinstance(m.__dict__.get("forward"), NormForward)
    )
    forward = norm.__dict__["forward"]
    forward.backend = backend
    x = torch.randn(2, 3, norm.weight.shape[0], device=device)
    with POLICY.routing(open_routes), torch.no_grad():
        before = forward.original_calls
        got = norm(x)
        assert (forward.original_calls - before == 1) == forward.routed(x)
    if device == "cpu":
        torch.testing.assert_close(got, unfused.get_submodule(name)(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("backend", ["auto", "torch", "native", "onednn", "triton", "vllm"])
def test_the_route_and_norm_rules_are_ops_eager_reference(backend, device) -> None:
    """A route with an act-and-mul of `backend` (nothing measured: every product idle) and
    `NormForward.routed` answer as `ops.eager_reference` for every backend and device
    (routes open), and the norm never routes with them closed."""
    _, fused = fused_model()
    route = bound_forwards(fused)[0]._route
    x = torch.empty(1, route.merged[0].in_features, device=device)
    act = torch.nn.Module()
    act.backend = backend
    spelled = routes.Route(route.merged, (act,), route.first)
    assert spelled.takes_original((x,), {}) == ops.eager_reference(backend, x)
    x = torch.empty(1, 4, device=device)
    norm = next(
        f
        for f in (m.__dict__.get("forward") for m in fused.modules())
        if isinstance(f, NormForward)
    )
    norm.backend = backend
    assert norm.routed(x) == ops.eager_reference(backend, x)
    with POLICY.routing(False):
        assert not norm.routed(x)


def layer_forwards(model: torch.nn.Module) -> list[bound.BoundForward]:
    """The residual-norm rewrites of `model` (each with its `NormRoute`)."""
    found = [m.__dict__.get("forward") for m in model.modules()]
    return [
        f
        for f in found
        if isinstance(f, bound.BoundForward) and isinstance(f._route, routes.NormRoute)
    ]


def test_a_layer_whose_norms_are_on_their_route_runs_its_original(monkeypatch) -> None:
    """A residual-norm rewrite on a CPU nobody calibrated: every norm it adds into would run
    its class's original, so the layer runs its own (no add + norm kernel, no helper), the
    logits bit for bit the unfused ones; routes closed, the rewrite runs and calls the
    kernel; a site's norm whose backend computes otherwise keeps the rewrite."""
    unfused, fused = fused_model()
    layers = layer_forwards(fused)
    assert layers and all(f.norm_sites for f in layers), "qwen3's decoder layers add into norms"
    kernel_calls: list[int] = []
    real = NormForward.add_forward
    monkeypatch.setattr(
        NormForward, "add_forward", lambda self, a, b: kernel_calls.append(1) or real(self, a, b)
    )
    asked: list[bool] = []
    rule = routes.NormRoute.takes_original
    monkeypatch.setattr(
        routes.NormRoute,
        "takes_original",
        lambda self, a, k: asked.append(rule(self, a, k)) or asked[-1],
    )
    ids = token_ids(batch=1, seq=5)
    assert torch.equal(forward(fused, ids), forward(unfused, ids))
    assert [f.original_calls for f in layers] == [1] * len(layers) and not kernel_calls
    assert asked == []  # `BoundForward.__call__` spells the rule out: it was not asked
    width = layers[0].module.get_submodule(layers[0].norm_sites[0]).weight.shape[0]
    x = torch.randn(1, 5, width)
    assert layers[0]._route.takes_original((x,), {})  # ... and says the same
    with POLICY.routing(False):
        torch.testing.assert_close(forward(fused, ids), forward(unfused, ids))
    assert [f.original_calls for f in layers] == [1] * len(layers)
    assert len(kernel_calls) == sum(len(f.norm_sites) for f in layers)
    norm = layers[0].module.get_submodule(layers[0].norm_sites[0])
    norm.__dict__["forward"].backend = "native"  # computes its own kernel, not the reference
    forward(fused, ids)
    assert layers[0].original_calls == 1 and layers[1].original_calls == 2
    assert not layers[0]._route.takes_original((x,), {})  # the rule agrees


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "copy"])
def test_a_copy_keeps_the_layer_route_on_its_own_children(how) -> None:
    """Copies rebuild the residual-norm rewrite with its sites (`norm_sites`), its route
    reading the copy's children, not the original's."""
    _, fused = fused_model()
    if how == "deepcopy":
        other = copy.deepcopy(fused)
    elif how == "pickle":
        other = pickle.loads(pickle.dumps(fused))
    else:
        other = copy.copy(fused.model.layers[0])
    layers = layer_forwards(other)
    assert layers and all(f._route.module is f.module for f in layers)
    assert [f.norm_sites for f in layers] == [f.norm_sites for f in layer_forwards(fused)][
        : len(layers)
    ]


def test_a_linear_winner_closes_the_quiet_lane_but_not_the_routes() -> None:
    """A table where some plain linear wins closes the quiet lane (`KernelPolicy.quiet`);
    the merged products are still all on their references, so each rewritten forward still
    takes its route, by the per-call rule."""
    unfused, fused = fused_model()
    ids = token_ids(batch=1, seq=5)
    table = Table("linear wins")
    table.add(linear_winner())
    POLICY.set_table(table)
    assert torch.equal(forward(fused, ids), forward(unfused, ids))
    assert POLICY.lane is False
    original, merged = calls(fused)
    assert original == len(bound_forwards(fused)) and merged == 0


def test_winners_at_other_rows_leave_those_calls_on_the_original(monkeypatch) -> None:
    """A calibration whose winners for a route's own products are at the prompt's rows (8)
    leaves a one-row call (a decode step) on the original without the per-call policy
    question (`KernelPolicy.won_rows`, `quiet_for`), while an 8-row call asks it and runs
    the rewrite; a hook on a merged child still keeps every call on the rewrite."""
    _, fused = fused_model()
    POLICY.set_table(measured(fused, 8, "float32", stacked=WIN))
    assert POLICY.lane is False
    route = bound_forwards(fused)[0]._route
    width = route.merged[0].in_features
    one, eight = torch.randn(1, 1, width), torch.randn(1, 8, width)
    asked = []
    real = POLICY.runs_reference
    monkeypatch.setattr(POLICY, "runs_reference", lambda *a: asked.append(a[3]) or real(*a))
    assert route.takes_original((one,), {}) and asked == []
    assert not route.takes_original((eight,), {}) and asked == [8]
    assert route.takes_original((one.to(torch.bfloat16),), {})  # no bf16 entry at all
    handle = route.merged[0].register_forward_hook(lambda *a: None)
    assert not route.takes_original((one,), {})
    handle.remove()
    assert route.takes_original((one,), {})


def test_won_rows_are_the_buckets_won_at_any_thread_count() -> None:
    """`KernelPolicy.won_rows` unions, per torch dtype, the row buckets any of the products
    won at any thread count; `quiet_for` is outside them (rows past every bucket are)."""
    from fusion.kernels.policy import MAX_BUCKET, quiet_for

    _, fused = fused_model()
    table = measured(fused, 8, "float32", stacked=WIN)
    for won in measured(fused, 2, "float32", stacked=WIN).entries.values():
        table.add(dataclasses.replace(won, threads=won.threads + 1, dtype="bfloat16"))
    POLICY.set_table(table)
    keys = bound_forwards(fused)[0]._route._lane_keys
    won = POLICY.won_rows(keys)
    assert won == {torch.float32: frozenset({8}), torch.bfloat16: frozenset({2})}
    width = 16
    rows = {r: torch.zeros(r, width) for r in (1, 2, 5, 8, MAX_BUCKET + 1)}
    assert [quiet_for(won, x, width) for x in rows.values()] == [True, True, False, False, True]
    assert not quiet_for(won, rows[2].to(torch.bfloat16), width)
    assert quiet_for(won, rows[8].to(torch.float16), width)
    with POLICY.override("eligible"):
        assert POLICY.won_rows(keys) is None  # may run unmeasured: no rows are known quiet


def test_winners_for_other_shapes_leave_each_route_its_own_lane(monkeypatch) -> None:
    """Another model calibrated on this machine closes the process's quiet lane; a route
    whose own products have no winner still takes its original without asking the policy
    per call (`Route._won_rows` empty: `KernelPolicy.won_rows`), kept for the epoch."""
    unfused, fused = fused_model()
    ids = token_ids(batch=1, seq=5)
    table = Table("another model")
    table.add(linear_winner())
    other = measured(fused, 5, "float32", stacked=WIN)
    for won in other.entries.values():  # the same winners, for shapes this model lacks
        table.add(dataclasses.replace(won, shape=(7, *won.shape[1:])))
    POLICY.set_table(table)
    assert POLICY.lane is False
    asked = []
    monkeypatch.setattr(POLICY, "runs_reference", lambda *a: asked.append(a) or True)
    assert torch.equal(forward(fused, ids), forward(unfused, ids))
    assert asked == [] and calls(fused) == (len(bound_forwards(fused)), 0)
    assert all(POLICY.idle_for("stacked", m.kernel_shape, "auto") for m in merged_modules(fused))
    monkeypatch.undo()
    POLICY.set_table(measured(fused, 5, "float32", stacked=WIN))  # now its own shapes win
    assert not any(
        POLICY.idle_for("stacked", m.kernel_shape, "auto") for m in merged_modules(fused)
    )
    forward(fused, ids)
    assert calls(fused)[0] == len(bound_forwards(fused))  # no route more: the rewrites ran


def _spied(monkeypatch) -> list[int]:
    """Every call `Route.takes_original` answers, appended as 1 (the rule asked: the
    inline lane block of `BoundForward.__call__` did not take the call)."""
    asked: list[int] = []
    rule = routes.Route.takes_original
    monkeypatch.setattr(
        routes.Route, "takes_original", lambda self, a, k: asked.append(1) or rule(self, a, k)
    )
    return asked


def test_the_inline_lane_block_is_the_rules_first_block(monkeypatch) -> None:
    """`BoundForward.__call__` spells out `Route.takes_original`'s lane block: where the
    quiet lane is open or the call's rows are in the row-bucket lane, every rewritten
    forward runs its original without asking the rule, and the rule, asked of the same
    call, says the same; where a hook is on a merged child, routes are closed, or the rows
    are past the lane, the rule is asked (and decides). Logits equal the unfused model's
    on every path."""
    unfused, fused = fused_model()
    n = len(bound_forwards(fused))
    one, eight = token_ids(batch=1, seq=1), token_ids(batch=1, seq=8)
    asked = _spied(monkeypatch)

    def run(ids: torch.Tensor) -> tuple[int, int]:
        before, asked[:] = calls(fused)[0], []
        assert torch.equal(forward(fused, ids), forward(unfused, ids))
        return calls(fused)[0] - before, len(asked)

    assert POLICY.lane is True and run(eight) == (n, 0)  # the quiet lane: inline
    handle = merged_modules(fused)[0].register_forward_hook(lambda *a: None)
    assert run(one) == (n - 1, 1)  # the hooked one asks the rule, which keeps the rewrite
    handle.remove()
    with POLICY.routing(False):
        assert run(one) == (0, n)
    POLICY.set_table(measured(fused, 8, "float32", stacked=WIN))  # the prompt's rows won
    assert POLICY.lane is False and POLICY.row_lane == {torch.float32: 8}
    assert run(one) == (n, 0)  # a decode step: the row-bucket lane, inline
    assert run(token_ids(batch=1, seq=4)) == (n, 0)  # bucket 4, below 8
    assert run(eight) == (0, n)  # the winners' bucket: the rule runs the rewrite
    handle = merged_modules(fused)[-1].register_forward_pre_hook(lambda *a: None)
    assert run(one) == (n - 1, 1)  # on the row-bucket lane too, a hook keeps its rewrite
    handle.remove()
    with POLICY.recording_asks():
        assert run(one) == (0, n)
    fused.to(torch.bfloat16)
    unfused.to(torch.bfloat16)
    assert run(eight) == (n, 0)  # no bfloat16 winner: every row count
    # the rule, asked directly, agrees with each call the inline block took
    route = bound_forwards(fused)[0]._route
    x = torch.randn(1, 1, route.merged[0].in_features, dtype=torch.bfloat16)
    assert route.takes_original((x,), {})


def test_the_inline_hook_check_reads_every_hook_attribute() -> None:
    """The inline lane block names the hook dicts one by one: they must be
    `callpath.HOOK_ATTRS`, all of them."""
    import inspect as inspect_module

    from fusion.analysis.callpath import HOOK_ATTRS

    source = inspect_module.getsource(bound.BoundForward.__call__)
    assert all(f'state.get("{attr}")' in source for attr in HOOK_ATTRS)
    assert set(HOOK_ATTRS) <= set(vars(torch.nn.Linear(1, 1)))


def test_routes_are_counted_only_where_asked() -> None:
    """Outside `counting_routes` a routed call is not counted (the count costs a frame on
    the hottest path); the result is the same either way."""
    unfused, fused = fused_model()
    ids = token_ids(batch=1, seq=5)
    POLICY.counting = False  # this module's fixture counts: undone on leaving it
    want = forward(unfused, ids)
    assert torch.equal(forward(fused, ids), want) and calls(fused)[0] == 0
    with POLICY.counting_routes():
        assert torch.equal(forward(fused, ids), want)
    assert calls(fused)[0] == len(bound_forwards(fused))


def test_a_model_compiled_on_the_row_lane_traces_the_unfused_calls_for_its_rows() -> None:
    """Compiled code reads the row-bucket lane as eager code does: a one-row call of a
    model calibrated for 8-row winners traces the unfused model's calls; an 8-row call
    traces the rewrites (their products may choose a kernel there)."""
    unfused, fused = fused_model()
    POLICY.set_table(measured(fused, 8, "float32", stacked=WIN))
    one, eight = token_ids(batch=1, seq=1), token_ids(batch=1, seq=8)
    assert _traced_calls(fused, one) == _traced_calls(unfused, one)
    assert _traced_calls(fused, eight) != _traced_calls(unfused, eight)
