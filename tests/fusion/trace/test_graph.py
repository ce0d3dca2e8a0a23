"""fusion.trace.graph: node predicates and dataflow walks over traced graphs."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from fusion.trace import graph as G
from fusion.trace.tracer import leaf_call, trace


def attention(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stands in for an attention interface: traced as one opaque leaf."""
    weights = q @ k.transpose(-1, -2)
    return weights @ k, weights


ATTENTION = leaf_call(attention, outputs=2)


class MyLinear(nn.Linear):
    pass


class Toy(nn.Module):
    """One forward exercising every predicate: ops in three spellings, casts, children,
    a leaf call, metadata reads."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = MyLinear(8, 8)
        self.o = nn.Linear(8, 8)
        self.act = nn.SiLU()
        self.drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.q(x).view(x.shape).to(torch.float32)
        k = self.k(x.float()).type_as(x)
        s1 = torch.add(q, k)
        s2 = s1 + k
        s3 = s2.add(q)
        g = F.silu(s3) * self.act(s3)
        out, weights = ATTENTION(g, k)
        return self.drop(self.o(out)), weights


@pytest.fixture(scope="module")
def toy() -> tuple[Toy, fx.Graph]:
    module = Toy()
    graph = trace(module)
    assert graph is not None
    return module, graph


def node(graph: fx.Graph, name: str) -> fx.Node:
    found = G.find_node(graph, lambda n: n.name == name)
    assert found is not None, [n.name for n in graph.nodes]
    return found


# -- predicates --------------------------------------------------------------------------------


def test_is_op_accepts_every_spelling(toy: tuple[Toy, fx.Graph]) -> None:
    _, graph = toy
    adds = [n for n in graph.nodes if G.is_op(n, "add")]
    assert {(n.op, n.target) for n in adds} == {
        ("call_function", torch.add),
        ("call_function", operator.add),
        ("call_method", "add"),
    }
    assert G.is_op(node(graph, "silu"), "silu")  # F.silu
    assert not G.is_op(node(graph, "silu"), "add")
    assert not G.is_op(node(graph, "q"), "q")  # a call_module is not an op
    assert not G.is_op("add", "add")


def test_is_op_rejects_methods_tensors_lack() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    custom = graph.call_method("frobnicate", (x,))
    assert G.is_method(custom, "frobnicate")
    assert not G.is_op(custom, "frobnicate")


def test_is_method_and_is_fn(toy: tuple[Toy, fx.Graph]) -> None:
    _, graph = toy
    view = node(graph, "view")
    assert G.is_method(view, "view") and not G.is_method(view, "reshape")
    assert not G.is_fn(view, torch.Tensor.view)
    add = node(graph, "add")
    assert G.is_fn(add, torch.add) and not G.is_fn(add, operator.add)
    assert not G.is_method(add, "add")
    assert not G.is_fn(None, torch.add) and not G.is_method(None, "view")


def test_is_linear_counts_subclasses_and_only_linears(toy: tuple[Toy, fx.Graph]) -> None:
    module, graph = toy
    assert G.is_linear(node(graph, "q"), module)
    assert G.is_linear(node(graph, "k"), module)  # a subclass is still a linear here
    assert not G.is_linear(node(graph, "act"), module)
    assert not G.is_linear(node(graph, "silu"), module)
    assert not G.is_linear(None, module)
    assert G.submodule(node(graph, "q"), module) is module.q
    assert G.submodule(node(graph, "silu"), module) is None


def test_is_linear_of_a_missing_child_is_false() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    ghost = graph.call_module("ghost", (x,))
    assert G.submodule(ghost, Toy()) is None
    assert not G.is_linear(ghost, Toy())


def test_is_leaf_call(toy: tuple[Toy, fx.Graph]) -> None:
    _, graph = toy
    leaves = [n for n in graph.nodes if G.is_leaf_call(n)]
    assert len(leaves) == 1 and leaves[0].target is attention
    assert not G.is_leaf_call(node(graph, "q"))
    assert not G.is_leaf_call(object())


def test_is_metadata(toy: tuple[Toy, fx.Graph]) -> None:
    _, graph = toy
    shape = G.find_node(graph, lambda n: n.target is getattr)
    assert shape is not None and shape.args[1] == "shape"
    assert G.is_metadata(shape)
    assert not G.is_metadata(node(graph, "view"))
    g = fx.Graph()
    x = g.placeholder("x")
    assert G.is_metadata(g.call_method("size", (x, 0)))
    assert not G.is_metadata(g.call_function(getattr, (x, "T")))


# -- peel ---------------------------------------------------------------------------------------


def test_peel_strips_casts(toy: tuple[Toy, fx.Graph]) -> None:
    _, graph = toy
    to = node(graph, "to")
    assert G.peel(to) is node(graph, "view")  # `.to(float32)` stripped, `.view` kept
    type_as = node(graph, "type_as")
    assert G.peel(type_as) is node(graph, "k")
    assert G.peel(node(graph, "view")) is node(graph, "view")
    assert G.peel(3) == 3


def test_peel_strips_chains_of_every_cast() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    value = x
    for method in ("to", "float", "half", "bfloat16", "double", "type"):
        value = graph.call_method(method, (value,))
    value = graph.call_method("type_as", (value, x))
    assert G.peel(value) is x
    assert G.peel(graph.call_method("contiguous", (value,))).target == "contiguous"


# -- walks --------------------------------------------------------------------------------------


def test_upstream_linear_walks_back_through_ops(toy: tuple[Toy, fx.Graph]) -> None:
    module, graph = toy
    assert G.upstream_linear(node(graph, "to"), module) is node(graph, "q")
    assert G.upstream_linear(node(graph, "type_as"), module) is node(graph, "k")
    # Through a non-linear child: dropout after the output projection.
    assert G.upstream_linear(node(graph, "drop"), module) is node(graph, "o")


def test_upstream_linear_never_crosses_a_leaf_call(toy: tuple[Toy, fx.Graph]) -> None:
    module, graph = toy
    weights = G.output_value(graph)[1]
    assert G.is_fn(weights, operator.getitem)
    # The attention weights are computed from q and k, but inside the opaque leaf.
    assert G.upstream_linear(weights, module) is None


def test_upstream_linear_is_nearest_first() -> None:
    class Nearest(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.near = nn.Linear(8, 8)
            self.far = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.near(x) + torch.relu(torch.tanh(self.far(x)).neg())

    module = Nearest()
    graph = trace(module)
    assert graph is not None
    assert G.returned_linear(graph, module) == "near"


def test_walks_ignore_metadata_edges() -> None:
    class Shapes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(8, 8)
            self.o = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            shaped = h.view(self.q(x).shape)  # only q's *shape* reaches `shaped`
            empty = self.q(x).new_zeros(4, 8)  # only q's dtype and device
            return shaped + empty

    module = Shapes()
    graph = trace(module)
    assert graph is not None
    out = G.output_value(graph)
    assert G.upstream_linear(out, module) is None
    # Downstream from the projection, only metadata reads: no linear consumes its values.
    assert G.downstream_linear(node(graph, "q"), module) is None
    assert G.downstream_linear(node(graph, "h"), module) is None


def test_downstream_linear(toy: tuple[Toy, fx.Graph]) -> None:
    module, graph = toy
    x = node(graph, "x")
    # `x.float()` feeds `self.k` (through a cast); `self.q(x)` reads `x` directly.
    assert G.downstream_linear(x, module) in (node(graph, "q"), node(graph, "k"))
    assert G.downstream_linear(x, module) is node(graph, "q")  # breadth first, trace order
    # The only consumer of `g` is the attention leaf: the walk stops there, so `o` (fed by
    # the leaf's output) is not reported.
    mul = G.find_node(graph, lambda n: G.is_fn(n, operator.mul))
    assert mul is not None
    assert G.downstream_linear(mul, module) is None


def test_downstream_linear_through_casts() -> None:
    class Casts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.p(x.to(torch.float32).float() * 2)

    module = Casts()
    graph = trace(module)
    assert graph is not None
    assert G.downstream_linear(node(graph, "x"), module) is node(graph, "p")


# -- output_value, find_node, returned_linear ------------------------------------------------


def test_output_value_and_returned_linear(toy: tuple[Toy, fx.Graph]) -> None:
    module, graph = toy
    value = G.output_value(graph)
    assert isinstance(value, tuple) and len(value) == 2
    assert value[0] is node(graph, "drop")
    # The first returned value comes from `o`, through dropout.
    assert G.returned_linear(graph, module) == "o"


def test_returned_linear_none_when_no_linear_produces_it() -> None:
    class NoLinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.p(x)
            return x * 2

    module = NoLinear()
    graph = trace(module)
    assert graph is not None
    assert G.output_value(graph) is not None
    assert G.returned_linear(graph, module) is None


def test_output_value_none_on_partial_graph() -> None:
    class Partial(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.p(x)
            if y.sum() > 0:
                return y
            return -y

    module = Partial()
    graph = trace(module)
    assert graph is not None
    assert G.output_value(graph) is None
    assert G.returned_linear(graph, module) is None
    assert [n.target for n in G.linear_calls(graph, module)] == ["p"]


def test_find_node_returns_first_in_trace_order(toy: tuple[Toy, fx.Graph]) -> None:
    module, graph = toy
    first = G.find_node(graph, lambda n: G.is_linear(n, module))
    assert first is node(graph, "q")
    assert G.find_node(graph, lambda n: n.op == "get_attr") is None


def test_linear_calls_and_calls_by_target() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = nn.Linear(8, 8)
            self.r = nn.Linear(8, 8)
            self.act = nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.p(self.act(self.r(self.p(x))))

    module = Twice()
    graph = trace(module)
    assert graph is not None
    assert [n.target for n in G.linear_calls(graph, module)] == ["p", "r", "p"]
    groups = G.calls_by_target(graph.nodes)
    assert {k: len(v) for k, v in groups.items()} == {"p": 2, "r": 1, "act": 1}


def test_strip_reshapes_and_calls_child_on() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.same = nn.Identity()
            self.p = nn.Linear(8, 8)
            self.q = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            flat = self.same(x.view(-1, 8)).contiguous()
            return self.p(flat) + self.q(x.float())

    module = Block()
    graph = trace(module)
    assert graph is not None
    x = G.first_input(graph)
    assert x is not None and x.op == "placeholder"
    p, q_cast = node(graph, "p"), node(graph, "q")
    assert G.strip_reshapes(p.args[0], module) is x  # view, Identity and contiguous stripped
    assert G.calls_child_on(p, x, module)
    assert G.strip_reshapes(q_cast.args[0], module) is not x  # a cast is not a reshape
    assert not G.calls_child_on(q_cast, x, module)
    view = next(n for n in graph.nodes if n.op == "call_method" and n.target == "view")
    assert G.call_arg(view, 1, "size") == -1
    assert G.call_arg(view, 5, "missing", "default") == "default"


def test_downstream_linear_through_children_only_when_asked() -> None:
    class DownNormUp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.down = nn.Linear(4, 2)
            self.norm = nn.LayerNorm(2)
            self.up = nn.Linear(2, 4)

        def forward(self, x):
            return self.up(self.norm(self.down(x)))

    module = DownNormUp()
    graph = trace(module)
    down = node(graph, "down")
    assert G.downstream_linear(down, module) is None
    assert G.downstream_linear(down, module, through_children=True) is node(graph, "up")


def test_dataflow_and_alias_analysis_share_one_metadata_table() -> None:
    # Two tables drifted once (graph.py lacked requires_grad/is_leaf/element_size): a read
    # one analysis ignores must be one the other ignores too.
    # The alias analysis reads them in `alias_terms` (alias reads) and `call_effects`.
    from fusion.analysis import alias_terms, call_effects
    from fusion.trace import tensor_meta

    assert G.METADATA_ATTRS is tensor_meta.METADATA_ATTRS is alias_terms.METADATA_ATTRS
    assert call_effects.METADATA_ATTRS is tensor_meta.METADATA_ATTRS
    assert G.METADATA_METHODS is tensor_meta.METADATA_METHODS is alias_terms.METADATA_METHODS
