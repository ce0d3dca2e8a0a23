"""fusion.trace.tracer: the all-leaf, meta-executing fx tracer."""

from __future__ import annotations

import logging
import operator
from typing import Any

import pytest
import torch
from torch import fx, nn
from transformers.utils.deprecation import deprecate_kwarg

from fusion.trace import graph as G
from fusion.trace.tracer import (
    CACHE_ARGUMENTS,
    LEAF_CALL,
    META_VALUE,
    forward_parameters,
    leaf_call,
    reference_weight,
    trace,
)
from tests.fusion.hf_modules import MODULE_NAMES, build_module

# -- real Transformers modules ----------------------------------------------------------------

ATTENTION = {
    "LlamaAttention",
    "Qwen3Attention",
    "Gemma3Attention",
    "DeepseekV3Attention[q_lora]",
    "DeepseekV3Attention[no_q_lora]",
    "GPTBigCodeAttention",
}

# Children each traced graph must call, beyond the linears (checked for every module).
OTHER_CHILDREN = {
    "Qwen3Attention": {"q_norm", "k_norm"},
    "Gemma3Attention": {"q_norm", "k_norm"},
    "Qwen3MoeSparseMoeBlock": {"gate", "experts"},
    "LlamaMLP": {"act_fn"},
    "DeepseekV3Attention[q_lora]": {"q_a_layernorm", "kv_a_layernorm"},
    "DeepseekV3Attention[no_q_lora]": {"kv_a_layernorm"},
}


def linear_names(module: nn.Module) -> set[str]:
    return {name for name, child in module.named_modules() if isinstance(child, nn.Linear)}


def leaf_calls(graph: fx.Graph) -> list[fx.Node]:
    return [node for node in graph.nodes if G.is_leaf_call(node)]


@pytest.fixture(scope="module")
def traced() -> dict[str, tuple[nn.Module, fx.Graph]]:
    result = {}
    for name in MODULE_NAMES:
        module = build_module(name)
        graph = trace(module)
        assert graph is not None, name
        result[name] = (module, graph)
    return result


@pytest.mark.parametrize("name", MODULE_NAMES)
def test_real_module_reaches_output(traced: dict, name: str) -> None:
    _, graph = traced[name]
    assert G.output_value(graph) is not None
    graph.lint()


@pytest.mark.parametrize("name", MODULE_NAMES)
def test_every_linear_is_one_call_module_node(traced: dict, name: str) -> None:
    module, graph = traced[name]
    calls = G.calls_by_target(graph.nodes)
    for linear in linear_names(module):
        assert len(calls.get(linear, [])) == 1, f"{linear} should be one call_module node"
    assert {str(n.target) for n in G.linear_calls(graph, module)} == linear_names(module)


@pytest.mark.parametrize("name", MODULE_NAMES)
def test_children_stay_leaves(traced: dict, name: str) -> None:
    module, graph = traced[name]
    called = {str(n.target) for n in graph.nodes if n.op == "call_module"}
    assert OTHER_CHILDREN.get(name, set()) <= called
    direct = {child_name for child_name, _ in module.named_children()}
    # Every child is called as a whole (`act_fn(...)`), never decomposed into its ops.
    assert called <= direct
    assert not any(
        n.op == "call_function" and n.target in (torch.sigmoid, torch.nn.functional.silu)
        for n in graph.nodes
    )


@pytest.mark.parametrize("name", MODULE_NAMES)
def test_attention_is_one_leaf_with_both_outputs_used(traced: dict, name: str) -> None:
    _, graph = traced[name]
    leaves = leaf_calls(graph)
    if name not in ATTENTION:
        assert leaves == []
        return
    assert len(leaves) == 1
    (leaf,) = leaves
    assert leaf.op == "call_function"
    assert not hasattr(leaf.target, "__wrapped_leaf__"), "target is the real attention function"
    indices = {user.args[1] for user in leaf.users if G.is_fn(user, operator.getitem)}
    assert indices == {0, 1}
    assert all(G.is_fn(user, operator.getitem) for user in leaf.users)
    # (attn_output, attn_weights): the output projection reads the first, the second is
    # returned as the weights.
    output = G.output_value(graph)
    assert isinstance(output, tuple)
    assert G.is_fn(output[1], operator.getitem) and output[1].args == (leaf, 1)


@pytest.mark.parametrize(
    ("name", "query", "key", "value"),
    [
        ("LlamaAttention", "q_proj", "k_proj", "v_proj"),
        ("Qwen3Attention", "q_proj", "k_proj", "v_proj"),
        ("Gemma3Attention", "q_proj", "k_proj", "v_proj"),
        # DeepSeek builds its keys by `copy_` into `new_empty(...)` slices: no dataflow edge
        # reaches the key argument, only the shape of `kv_b_proj`'s output (not values).
        ("DeepseekV3Attention[q_lora]", "q_b_proj", None, "kv_b_proj"),
        ("DeepseekV3Attention[no_q_lora]", "q_proj", None, "kv_b_proj"),
        ("GPTBigCodeAttention", "c_attn", "c_attn", "c_attn"),
    ],
)
def test_attention_inputs_come_from_projections(
    traced: dict, name: str, query: str, key: str | None, value: str
) -> None:
    module, graph = traced[name]
    (leaf,) = leaf_calls(graph)
    found = [G.upstream_linear(arg, module) for arg in leaf.args[:3]]
    assert [None if n is None else str(n.target) for n in found] == [query, key, value]


def test_gptbigcode_cache_is_concrete_none(traced: dict) -> None:
    # `layer_past` is GPTBigCode's cache argument: with it None, no cache update is traced
    # and the attention reads the split of `c_attn` directly.
    _, graph = traced["GPTBigCodeAttention"]
    assert not any(G.is_method(n, "update") for n in graph.nodes)


@pytest.mark.parametrize("name", sorted(ATTENTION - {"GPTBigCodeAttention"}))
def test_transformers_cache_argument_is_concrete_none(traced: dict, name: str) -> None:
    _, graph = traced[name]
    placeholders = {str(n.target) for n in graph.nodes if n.op == "placeholder"}
    assert any(p.startswith("cache") for p in placeholders)
    assert not any(G.is_method(n, "update") for n in graph.nodes)


def test_meta_values_follow_the_stand_in_input(traced: dict) -> None:
    module, graph = traced["LlamaAttention"]
    q_proj = G.find_node(graph, lambda n: n.target == "q_proj")
    assert q_proj is not None
    value = q_proj.meta[META_VALUE]
    assert value.device.type == "meta"
    assert tuple(value.shape) == (1, 8, module.q_proj.out_features)
    assert value.dtype == module.q_proj.weight.dtype
    # Past the opaque attention call nothing is known: its outputs have no meta value.
    o_proj = G.find_node(graph, lambda n: n.target == "o_proj")
    assert o_proj is not None and META_VALUE not in o_proj.meta


# -- the module is left alone ----------------------------------------------------------------


def snapshot(module: nn.Module) -> dict[str, Any]:
    return {
        "state": {
            k: (v.detach().clone(), v.data_ptr(), v.device) for k, v in module.state_dict().items()
        },
        "params": {k: id(v) for k, v in module.named_parameters()},
        "buffers": {k: id(v) for k, v in module.named_buffers()},
        "dicts": {name: dict(child.__dict__) for name, child in module.named_modules()},
        "training": [m.training for m in module.modules()],
    }


def assert_untouched(module: nn.Module, before: dict[str, Any]) -> None:
    after = snapshot(module)
    assert after["params"] == before["params"]
    assert after["buffers"] == before["buffers"]
    assert after["training"] == before["training"]
    assert after["state"].keys() == before["state"].keys()
    for key, (value, ptr, device) in before["state"].items():
        new_value, new_ptr, new_device = after["state"][key]
        assert (new_ptr, new_device) == (ptr, device), key
        # Exactly equal; NaN equal to NaN (`torch.empty` weights may hold NaN bit patterns)
        torch.testing.assert_close(new_value, value, rtol=0, atol=0, equal_nan=True, msg=key)
    for name, state in before["dicts"].items():
        assert after["dicts"][name].keys() == state.keys(), name
        for attr, value in state.items():
            assert after["dicts"][name][attr] is value, f"{name}.{attr}"
    for child in module.modules():
        for attr, value in vars(child).items():
            assert not isinstance(value, fx.Proxy), attr
            assert not (torch.is_tensor(value) and value.device.type == "meta"), attr


@pytest.mark.parametrize("name", MODULE_NAMES)
def test_trace_does_not_modify_real_modules(name: str) -> None:
    module = build_module(name)
    before = snapshot(module)
    trace(module)
    assert_untouched(module, before)


class Recorder(nn.Module):
    """A child that stores state while it runs (run on meta tensors during tracing)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.history: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = x
        self.calls += 1
        self.history.append(x)
        self.register_buffer("seen", x.detach())
        return x * 2


class StoresState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.rec = Recorder()
        self.register_buffer("scale", torch.full((8,), 3.0))
        self.cache: dict[str, Any] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.rec(self.a(x))
        self.last_output = y  # a proxy while tracing
        self.cache["y"] = y
        return y * self.scale


def test_trace_restores_state_a_forward_writes() -> None:
    module = StoresState()
    before = snapshot(module)
    graph = trace(module)
    assert graph is not None and G.output_value(graph) is not None
    assert_untouched(module, before)
    assert module.cache == {} and module.rec.history == [] and module.rec.calls == 0
    assert not hasattr(module, "last_output") and not hasattr(module.rec, "last")
    assert "seen" not in dict(module.rec.named_buffers())
    # The module still runs normally afterwards.
    out = module(torch.ones(2, 8))
    assert out.shape == (2, 8) and module.rec.calls == 1


def test_trace_does_not_fire_hooks() -> None:
    module = StoresState()
    fired: list[str] = []
    module.a.register_forward_hook(lambda *_: fired.append("a"))
    module.rec.register_forward_pre_hook(lambda *_: fired.append("rec"))
    trace(module)
    assert fired == []


def test_trace_restores_state_after_a_failed_trace() -> None:
    class FailsLate(StoresState):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.rec(self.a(x))
            self.partial = y
            if y.sum() > 0:
                return y
            return -y

    module = FailsLate()
    before = snapshot(module)
    graph = trace(module)
    assert graph is not None and G.output_value(graph) is None
    assert_untouched(module, before)


# -- never raises ----------------------------------------------------------------------------


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)


class DataDependent(Pair):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        if y.sum() > 0:
            return self.b(y)
        return y


class Raises(Pair):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.a(x)
        raise RuntimeError("boom")


class ConvertsToPython(Pair):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return self.b(y) * float(y.sum())


class Weightless(nn.Module):
    """No weight to size the stand-in input: `len(x)` cannot be answered."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        return y / len(x)


@pytest.mark.parametrize(
    ("cls", "before"),
    [
        (DataDependent, ["a", "sum"]),
        (Raises, ["a"]),
        (ConvertsToPython, ["a", "sum"]),
        (Weightless, ["mul"]),
    ],
)
def test_untraceable_forward_returns_partial_graph(
    cls: type[nn.Module], before: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="fusion.trace.tracer"):
        graph = trace(cls())
    assert graph is not None
    assert G.output_value(graph) is None
    names = [n.name for n in graph.nodes if n.op != "placeholder"]
    for name in before:
        assert any(n == name or n.startswith(f"{name}_") for n in names), (name, names)
    assert any("partial trace" in r.getMessage() for r in caplog.records)


def test_partial_graph_keeps_projections_before_the_failure() -> None:
    module = DataDependent()
    graph = trace(module)
    assert graph is not None
    assert [str(n.target) for n in G.linear_calls(graph, module)] == ["a"]


def test_trace_of_forward_with_varargs_never_raises() -> None:
    class VarArgs(Pair):
        def forward(self, *args: torch.Tensor) -> torch.Tensor:
            return self.a(args[0])

    trace(VarArgs())  # complete or partial, but no exception


# -- **kwargs, cache arguments ---------------------------------------------------------------


class KwargsForms(Pair):
    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        n = 1
        for _ in kwargs:
            n += 1
        for _ in kwargs.keys():  # noqa: SIM118 (the `.keys()` spelling is the case tested)
            n += 1
        for _, _ in kwargs.items():
            n += 1
        for _ in kwargs.values():
            n += 1
        extra = dict(**kwargs)
        return self.b(helper(self.a(x), **kwargs)) * n + len(extra)


def helper(x: torch.Tensor, **options: Any) -> torch.Tensor:
    assert options == {}, "**kwargs splat as empty"
    return x + 1


def test_kwargs_iterate_as_empty() -> None:
    graph = trace(KwargsForms())
    assert graph is not None
    output = G.output_value(graph)
    assert isinstance(output, fx.Node)
    # `n` stayed 1 and `len(extra)` 0: the trace saw no keyword extras at all.
    assert G.is_fn(output, operator.add) and output.args[1] == 0
    mul = output.args[0]
    assert G.is_fn(mul, operator.mul) and mul.args[1] == 1


class UsesPastKeyValues(Pair):
    def forward(self, x: torch.Tensor, past_key_values: Any = None) -> torch.Tensor:
        if past_key_values is not None:
            x = past_key_values.update(x)
        return self.a(x)


class UsesCache(Pair):
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(self, x: torch.Tensor, cache: Any = None, **kwargs: Any) -> torch.Tensor:
        if cache is not None:
            x = cache.update(x)
        return self.a(x)


class UsesPastKeyValuesDecorated(Pair):
    @deprecate_kwarg("cache", "5.40.0", new_name="past_key_values")
    def forward(self, x: torch.Tensor, past_key_values: Any = None) -> torch.Tensor:
        if past_key_values is not None:
            x = past_key_values.update(x)
        return self.a(x)


class UsesLayerPast(Pair):
    def forward(self, x: torch.Tensor, layer_past: Any = None) -> torch.Tensor:
        if layer_past is not None:
            x = layer_past.update(x)
        return self.a(x)


@pytest.mark.parametrize(
    "cls", [UsesPastKeyValues, UsesCache, UsesPastKeyValuesDecorated, UsesLayerPast]
)
def test_cache_argument_is_concrete_none(cls: type[nn.Module]) -> None:
    module = cls()
    graph = trace(module)
    assert graph is not None
    assert not any(G.is_method(n, "update") for n in graph.nodes)
    output = G.output_value(graph)
    assert G.is_linear(output, module)
    assert output.args[0].op == "placeholder" and output.args[0].target == "x"
    asserted = [
        n for n in graph.nodes if n.op == "call_function" and "assert_is_none" in str(n.target)
    ]
    assert len(asserted) == 1


def test_cache_spellings() -> None:
    assert {"past_key_values", "cache"} <= set(CACHE_ARGUMENTS)


def test_forward_parameters_unwraps_decorators() -> None:
    assert list(forward_parameters(UsesCache())) == ["self", "x", "cache", "kwargs"]


# -- container writes, shapes ----------------------------------------------------------------


class WritesContainer(Pair):
    def forward(self, x: torch.Tensor, store: dict) -> torch.Tensor:
        h = self.a(x)
        store["k"] = h
        h[:, 0] = 0.0
        return self.b(h)


def test_container_write_is_recorded_and_trace_continues() -> None:
    module = WritesContainer()
    graph = trace(module)
    assert graph is not None
    setitems = [n for n in graph.nodes if G.is_fn(n, operator.setitem)]
    assert len(setitems) == 2
    store, key, value = setitems[0].args
    assert store.target == "store" and key == "k" and value.target == "a"
    assert setitems[1].args[0].target == "a"
    output = G.output_value(graph)
    assert G.is_linear(output, module) and output.target == "b"


class Shapes(Pair):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        count = len(x)
        shape = (*x.shape[:-1], 2, -1)
        y = self.a(x).view(*shape)
        z = y.reshape(batch, seq, -1)
        parts = [*z.split(4, dim=-1)]
        return self.b(torch.cat(parts, dim=-1)) * count + hidden


def test_len_splat_and_shape_unpack_trace() -> None:
    module = Shapes()
    graph = trace(module)
    assert graph is not None
    output = G.output_value(graph)
    # len(x) and the unpacked hidden size were answered on the [1, 8, 8] meta stand-in.
    assert G.is_fn(output, operator.add) and output.args[1] is not None
    view = G.find_node(graph, lambda n: G.is_method(n, "view"))
    assert view is not None and len(view.args) == 5  # receiver, two splatted dims, 2, -1
    split = G.find_node(graph, lambda n: G.is_method(n, "split"))
    assert split is not None and len(split.users) == 2  # 8 / 4 pieces, one getitem each
    assert G.returned_linear(graph, module) == "b"


def test_unknown_shape_unpacks_through_bytecode() -> None:
    class Unpacks(Pair):
        def forward(self, x: torch.Tensor, pair: tuple) -> torch.Tensor:
            first, second = pair  # `pair` has no meta value; fx unpacks by bytecode
            return self.a(x) * first + second

    graph = trace(Unpacks())
    assert graph is not None and G.output_value(graph) is not None


# -- leaf_call, helpers ----------------------------------------------------------------------


def test_leaf_call_outside_tracing_calls_through() -> None:
    wrapped = leaf_call(lambda a, b: a + b, outputs=1)
    assert wrapped(2, 3) == 5


def test_leaf_call_of_a_leaf_wraps_the_original() -> None:
    def attention(q: Any, k: Any) -> tuple[Any, Any]:
        return q, k

    twice = leaf_call(leaf_call(attention, outputs=2), outputs=2)
    assert twice.__wrapped_leaf__ is attention

    class UsesLeaf(Pair):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, _weights = twice(self.a(x), x)
            return self.b(out)

    graph = trace(UsesLeaf())
    assert graph is not None
    (leaf,) = leaf_calls(graph)
    assert leaf.target is attention and leaf.meta[LEAF_CALL] is True
    assert G.returned_linear(graph, UsesLeaf()) == "b"


def test_reference_weight() -> None:
    assert reference_weight(Pair()) is not None and reference_weight(Pair()).shape == (8, 8)
    assert reference_weight(nn.LayerNorm(6)).shape == (6,)
    assert reference_weight(nn.ReLU()) is None


# -- deciding branches ------------------------------------------------------------------------


class _ShapeBranch(nn.Module):
    """A branch on the input's sequence length (8 on the stand-in), then a projection."""

    def __init__(self, wanted: int) -> None:
        super().__init__()
        self.wanted = wanted
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        if x.size(1) == self.wanted:
            return self.a(x)
        return self.b(x)


class _UnknownBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x, mask, flag=False):
        if flag:
            x = self.b(x)
        if mask.dtype == torch.bool:  # `mask` has no meta value: unknown
            return self.a(x)
        return self.b(x)


class _EndlessLoop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x, mask):
        while mask.any():  # unknown every time: only the decision budget ends it
            x = self.a(x)
        return x


def _called(graph: fx.Graph | None) -> list[str]:
    assert graph is not None
    return [str(n.target) for n in graph.nodes if n.op == "call_module"]


@pytest.mark.parametrize(("wanted", "child"), [(8, "a"), (3, "b")])
def test_decided_branch_follows_the_meta_value(wanted: int, child: str) -> None:
    module = _ShapeBranch(wanted)
    plain = trace(module)
    assert plain is not None and G.output_value(plain) is None  # fx stops at the branch
    decided = trace(module, decide_branches=True)
    assert decided is not None and G.output_value(decided) is not None
    assert _called(decided) == [child]


def test_decided_branch_takes_a_flags_default_and_else_the_true_side() -> None:
    decided = trace(_UnknownBranch(), decide_branches=True)
    assert _called(decided) == ["a"]  # `flag` defaults to False; the dtype test is unknown


def test_deciding_a_loop_on_an_unknown_value_ends() -> None:
    from fusion.trace.tracer import MAX_BRANCH_DECISIONS

    decided = trace(_EndlessLoop(), decide_branches=True)
    assert decided is not None and G.output_value(decided) is None  # partial, not endless
    assert len(_called(decided)) == MAX_BRANCH_DECISIONS


def test_deciding_trace_leaves_the_module_alone() -> None:
    module = _ShapeBranch(8)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trace(module, decide_branches=True)
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    assert set(module.__dict__) == set(_ShapeBranch(8).__dict__)


class _OptionalMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x, mask=None, scale=None):
        if mask is not None:  # a proxy is never None: the branch is taken unless concrete
            x = x * mask
        return self.a(x.view(*x.shape[:-1], 2, 2).flatten(-2))


def test_none_defaults_make_optional_arguments_concrete() -> None:
    module = _OptionalMask()
    decided = trace(module, decide_branches=True)
    assert decided is not None and G.output_value(decided) is None  # `mask` has no shape
    defaults = trace(module, decide_branches=True, none_defaults=True)
    assert defaults is not None and G.output_value(defaults) is not None
    assert not any(n.target == "mask" and n.users for n in defaults.nodes)


class _StateTogglingHalfway(nn.Module):
    """Changes global state, then stops the trace (a branch on a traced value) before the
    code that would put it back."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        torch.set_grad_enabled(False)
        torch.set_autocast_enabled("cpu", True)
        torch.set_default_dtype(torch.float64)
        torch.manual_seed(1234)
        y = self.proj(x)
        if y.sum() > 0:  # fx stops here
            y = y * 2
        torch.set_default_dtype(torch.float32)
        torch.set_autocast_enabled("cpu", False)
        torch.set_grad_enabled(True)
        return y


def test_a_trace_leaves_the_global_state_as_it_was() -> None:
    """Before: `fusion.plan` of such a forward left CPU autocast on (seen in issue 24's
    region work), grad mode off, float64 as the default dtype and the RNG reseeded."""
    module = _StateTogglingHalfway()
    torch.manual_seed(7)
    expected_draw = torch.rand(3)
    torch.manual_seed(7)
    trace(module)
    assert torch.is_grad_enabled()
    assert not torch.is_autocast_enabled("cpu")
    assert torch.get_default_dtype() == torch.float32
    assert torch.equal(torch.rand(3), expected_draw)
