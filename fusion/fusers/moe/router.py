"""The MoE router read as a small program (`fusion.runtime.moe.RouteSpec`).

A bias-free linear (with the casts it computes in), then softmax or sigmoid before or after a
single top-k, renormalisation (a division by the sum of the selection, read from the graph,
never from a config flag), a constant scaling and casts, in their order; DeepSeek V3's
correction bias and group limits on the expert choice. Anything else refuses with its reason.
`read_routing` reads a graph (a router's own forward, or a Transformers 4 block's);
`router_program` reads and checks a Transformers 5 router module.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from fusion.errors import RewriteRefused
from fusion.runtime.moe import DtypeRule, GroupLimit, RouteSpec, RouteStep
from fusion.trace.graph import call_arg, first_input, is_op, output_value, peel, strip_reshapes
from fusion.trace.tracer import trace


@dataclass
class Routing:
    spec: RouteSpec
    linear: fx.Node
    weights: fx.Node
    ids: fx.Node
    weight_name: str
    """The router weight: a parameter of the router module (Transformers 5) or the linear
    child's `weight` (Transformers 4)."""


def _dtype_rule(target: Any, x: fx.Node, linear: fx.Node, module: nn.Module) -> DtypeRule:
    """A cast target as a rule: a fixed dtype, or the dtype of the input `x` or of the logits
    (the output of the router linear's node `linear`)."""
    if isinstance(target, torch.dtype):
        return target
    if isinstance(target, fx.Node):
        if target.op == "call_function" and target.target is getattr and target.args[1] == "dtype":
            target = target.args[0]
        base = strip_reshapes(target, module)
        if base is x:
            return "input"
        if base is linear:
            return "logits"
    raise RewriteRefused("router casts to the dtype of an intermediate value")


def _cast_step(node: fx.Node, x: fx.Node, linear: fx.Node, module: nn.Module) -> DtypeRule:
    fixed = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}
    if node.op == "call_method" and node.target in fixed and len(node.args) == 1:
        return fixed[str(node.target)]
    if node.op == "call_method" and node.target in ("to", "type", "type_as"):
        rest = [*node.args[1:], *(v for k, v in node.kwargs.items() if k == "dtype")]
        other = set(node.kwargs) - {"dtype", "non_blocking", "copy"}
        if len(rest) == 1 and not other:
            return _dtype_rule(rest[0], x, linear, module)
    raise RewriteRefused(f"router op {node.target} is not a cast the fused router reproduces")


def _is_cast(node: Any) -> bool:
    return (
        isinstance(node, fx.Node)
        and node.op == "call_method"
        and node.target
        in (
            "float",
            "half",
            "bfloat16",
            "to",
            "type",
            "type_as",
        )
    )


def _is_getitem(node: Any, source: fx.Node, index: int) -> bool:
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return node.args == (source, index)
    return node.target is getattr and node.args == (source, ("values", "indices")[index])


def _scores_step(node: fx.Node, x: fx.Node, linear: fx.Node, module: nn.Module) -> RouteStep | None:
    """The softmax or sigmoid step `node` is (None for any other op); `linear` is the router
    linear's node, whose output (the logits) a softmax may cast to."""
    if is_op(node, "softmax"):
        dim = call_arg(node, 1, "dim")
        if dim not in (-1, 1):
            raise RewriteRefused(f"router softmax over dim {dim}")
        dtype = node.kwargs.get("dtype", node.args[2] if len(node.args) > 2 else None)
        rule = None if dtype is None else _dtype_rule(dtype, x, linear, module)
        return RouteStep("softmax", rule)
    if is_op(node, "sigmoid"):
        return RouteStep("sigmoid")
    return None


def _linear_of(node: Any, module: nn.Module) -> tuple[fx.Node, Any, Any, str] | None:
    """(linear node, its input, its weight expression, weight name) when `node` is a linear:
    `F.linear(x, self.<w>)` (bias refused) or a plain `nn.Linear` child."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_module":
        child = module.get_submodule(str(node.target))
        if isinstance(child, nn.Linear):
            if child.bias is not None:
                raise RewriteRefused("the router linear has a bias")
            if type(child).forward is not nn.Linear.forward:
                raise RewriteRefused("the router linear has its own forward")
            return node, node.args[0], None, f"{node.target}.weight"
        return None
    if is_op(node, "linear"):
        bias = call_arg(node, 2, "bias")
        if bias is not None:
            raise RewriteRefused("the router linear has a bias")
        weight = call_arg(node, 1, "weight")
        base = peel(weight)
        if not (isinstance(base, fx.Node) and base.op == "get_attr"):
            raise RewriteRefused("the router linear's weight is not a parameter")
        return node, node.args[0], weight, str(base.target)
    return None


def _topk_params(topk: fx.Node) -> tuple[int, bool]:
    """(k, sorted) of a top-k over the last dim that picks the largest; refuses otherwise."""
    k = call_arg(topk, 1, "k")
    if not isinstance(k, int) or call_arg(topk, 2, "dim", -1) not in (-1, 1):
        raise RewriteRefused("top-k is not over the experts of each token")
    if not call_arg(topk, 3, "largest", True):
        raise RewriteRefused("top-k selects the smallest scores")
    return k, bool(call_arg(topk, 4, "sorted", True))


def _user(node: fx.Node, predicate: Callable[[fx.Node], bool]) -> fx.Node | None:
    return next((u for u in node.users if predicate(u)), None)


def _groups(masked: fx.Node, choice: fx.Node, topks: list[fx.Node]) -> GroupLimit:
    """The `GroupLimit` (groups, groups kept, per-group top-k, sorted) of DeepSeek's
    group-limited choice:

        group_scores = choice.view(-1, G, E // G).topk(PK, dim=-1)[0].sum(dim=-1)
        kept = topk(group_scores, k=TG, dim=-1)[1]
        mask = zeros_like(group_scores).scatter_(1, kept, 1)
        masked = choice.masked_fill(~mask.unsqueeze(-1).expand(-1, G, E // G)
                                         .reshape(-1, E).bool(), -inf)

    read op by op from the graph; anything else refuses."""
    refuse = RewriteRefused("top-k over a masked choice that is not group-limited routing")
    mask_expr, fill = masked.args[1], masked.args[2] if len(masked.args) > 2 else None
    if masked.args[0] is not choice or fill != float("-inf") or not is_op(mask_expr, "invert"):
        raise refuse
    node = mask_expr.args[0]
    chain = []
    for name in ("bool", "reshape", "expand", "unsqueeze"):
        if not is_op(node, name):
            raise refuse
        chain.append(node)
        node = node.args[0]
    mask = node
    if not is_op(mask, "zeros_like"):
        raise refuse
    unsqueeze, expand = chain[3], chain[2]
    if call_arg(unsqueeze, 1, "dim") != -1 or len(expand.args) != 4:
        raise refuse
    groups, per_group = expand.args[2], expand.args[3]
    scatter = _user(mask, lambda u: is_op(u, "scatter_"))
    if scatter is None or scatter.args[1] != 1 or scatter.args[3] != 1:
        raise refuse
    kept = scatter.args[2]
    group_topk = kept.args[0] if isinstance(kept, fx.Node) else None
    group_scores = mask.args[0]
    if not (_is_getitem(kept, group_topk, 1) and group_topk.args[0] is group_scores):
        raise refuse
    kept_groups, group_sorted = _topk_params(group_topk)
    if not (is_op(group_scores, "sum") and call_arg(group_scores, 1, "dim") == -1):
        raise refuse
    best = group_scores.args[0]
    inner = best.args[0] if isinstance(best, fx.Node) else None
    if not (_is_getitem(best, inner, 0) and is_op(inner, "topk")):
        raise refuse
    per_group_k, _ = _topk_params(inner)
    view = inner.args[0]
    if not (
        (is_op(view, "view") or is_op(view, "reshape"))
        and view.args[0] is choice
        and tuple(view.args[1:]) == (-1, groups, per_group)
    ):
        raise refuse
    if len(topks) != 3 or set(topks[:2]) != {inner, group_topk}:
        raise refuse
    if not all(isinstance(v, int) for v in (groups, per_group, kept_groups, per_group_k)):
        raise refuse
    return GroupLimit(groups, kept_groups, per_group_k, group_sorted)


def _selection(
    topks: list[fx.Node], module: nn.Module
) -> tuple[RouteStep, fx.Node, fx.Node] | None:
    """(select step, scores node, gathered weights node) when experts are chosen on other
    values than the weights come from (a correction bias, group limits: DeepSeek V3 style:
    `ids = topk(choice)[1]`, `weights = scores.gather(1, ids)`); None for a plain top-k."""
    final = topks[-1]
    ids = _user(final, lambda u: _is_getitem(u, final, 1))
    gather = _user(ids, lambda u: is_op(u, "gather")) if ids is not None else None
    if gather is None:
        return None
    scores = gather.args[0]
    if call_arg(gather, 1, "dim") not in (-1, 1) or call_arg(gather, 2, "index") is not ids:
        raise RewriteRefused("routing weights are gathered in an unexpected way")
    choice = final.args[0]
    groups = None
    if is_op(choice, "masked_fill"):
        masked = choice
        choice = masked.args[0]
        groups = _groups(masked, choice, topks)
    elif len(topks) > 1:
        raise RewriteRefused("several top-k ops that are not group-limited routing")
    bias = None
    if choice is not scores:
        if not (is_op(choice, "add") and len(choice.args) == 2 and scores in choice.args):
            raise RewriteRefused("experts are chosen on values other than scores (+ a bias)")
        other = choice.args[1] if choice.args[0] is scores else choice.args[0]
        if not (isinstance(other, fx.Node) and other.op == "get_attr"):
            raise RewriteRefused("experts are chosen on scores plus something not a buffer")
        bias = str(other.target)
        if not torch.is_tensor(module.get_buffer(bias)):
            raise RewriteRefused(f"{bias} is not a buffer")
    k, sorted_ = _topk_params(final)
    step = RouteStep("select", value=k, sorted=sorted_, groups=groups, bias=bias)
    return step, scores, gather


def _back_to_linear(node: Any, module: nn.Module) -> tuple[tuple, list[tuple[str, fx.Node]]]:
    """Walk back from `node` to the router linear through casts and one scoring op."""
    before: list[tuple[str, fx.Node]] = []
    while True:
        found = _linear_of(node, module)
        if found is not None:
            return found, before
        if not isinstance(node, fx.Node):
            raise RewriteRefused("top-k does not read a linear's output")
        if is_op(node, "add") and any(
            isinstance(a, fx.Node) and a.op == "get_attr" for a in node.args
        ):
            raise RewriteRefused(
                "a correction bias is added to the scores that are also the routing weights"
            )
        if _is_cast(node):
            before.append(("cast", node))
        elif is_op(node, "softmax") or is_op(node, "sigmoid"):
            before.append(("score", node))
        else:
            raise RewriteRefused(f"router op {node.target} between the linear and the top-k")
        node = node.args[0]


def read_routing(graph: fx.Graph, module: nn.Module, x: fx.Node) -> Routing:
    """Read the routing program of `graph` (a router's own forward, or a Transformers 4
    block's): the final top-k, the linear feeding it and the ops around both, including a
    correction bias and group limits on the expert choice (DeepSeek V3)."""
    topks = [n for n in graph.nodes if is_op(n, "topk")]
    if not topks:
        raise RewriteRefused("no top-k in the router")
    selection = _selection(topks, module)
    if selection is None and len(topks) > 1:
        raise RewriteRefused(
            f"grouped top-k routing ({len(topks)} top-k ops) in a form not reproduced exactly"
        )
    if selection is None:
        topk = topks[0]
        k, sorted_ = _topk_params(topk)
        start = topk.args[0]
    else:
        select, start, gather = selection
    found, before = _back_to_linear(start, module)
    linear, linear_input, weight_expr, weight_name = found
    if strip_reshapes(peel(linear_input), module) is not x:
        raise RewriteRefused("the router linear does not read the block input")
    input_cast = _cast_step(linear_input, x, linear, module) if _is_cast(linear_input) else None
    weight_cast = _cast_step(weight_expr, x, linear, module) if _is_cast(weight_expr) else None
    steps: list[RouteStep] = []
    for kind, step_node in reversed(before):
        if kind == "cast":
            steps.append(RouteStep("cast", _cast_step(step_node, x, linear, module)))
        else:
            steps.append(_scores_step(step_node, x, linear, module))
    if selection is None:
        steps.append(RouteStep("topk", value=k, sorted=sorted_))
        values = _user(topk, lambda u: _is_getitem(u, topk, 0))
        ids = _user(topk, lambda u: _is_getitem(u, topk, 1))
    else:
        steps.append(select)
        final = topks[-1]
        values, ids = gather, _user(final, lambda u: _is_getitem(u, final, 1))
    if values is None or ids is None:
        raise RewriteRefused("top-k values or indices are not used as the routing")
    end = values
    while True:
        users = [
            u
            for u in end.users
            if not (u.op == "call_function" and u.target is getattr)
            and not (is_op(u, "sum") and u.args and u.args[0] is end)
        ]
        if len(users) != 1:
            break
        (user,) = users
        if user.op == "output" or user.op == "call_module":
            break
        steps.append(_after_topk_step(user, end, x, linear, module))
        end = user
    if sum(s.kind in ("softmax", "sigmoid") for s in steps) != 1:
        raise RewriteRefused("router scores with no (or more than one) softmax/sigmoid")
    return Routing(RouteSpec(input_cast, weight_cast, tuple(steps)), linear, end, ids, weight_name)


def _after_topk_step(
    node: fx.Node, value: fx.Node, x: fx.Node, linear: fx.Node, module: nn.Module
) -> RouteStep:
    """The op `node` applies to the routing weights `value` after the top-k (`linear`: the
    router linear's node)."""
    if _is_cast(node) and node.args[0] is value:
        return RouteStep("cast", _cast_step(node, x, linear, module))
    scored = _scores_step(node, x, linear, module) if node.args[0] is value else None
    if scored is not None:
        return scored
    if (is_op(node, "truediv") or is_op(node, "div")) and node.args[0] is value:
        denominator = node.args[1]
        eps = 0.0
        if is_op(denominator, "add"):
            terms = list(denominator.args)
            numbers = [t for t in terms if isinstance(t, (int, float))]
            nodes = [t for t in terms if isinstance(t, fx.Node)]
            if len(numbers) == 1 and len(nodes) == 1:
                eps, denominator = float(numbers[0]), nodes[0]
        if (
            is_op(denominator, "sum")
            and denominator.args[0] is value
            and call_arg(denominator, 1, "dim") in (-1, 1)
            and call_arg(denominator, 2, "keepdim", False)
        ):
            return RouteStep("renorm", value=eps)
        raise RewriteRefused("routing weights are divided by something other than their sum")
    if is_op(node, "mul") and value in node.args:
        factor = node.args[1] if node.args[0] is value else node.args[0]
        if isinstance(factor, (int, float)) and not isinstance(factor, bool):
            return RouteStep("scale", value=float(factor))
    raise RewriteRefused(f"router op {node.target} after the top-k is not reproduced")


def router_program(router: nn.Module) -> Routing:
    """The routing program of a Transformers 5 router module (returns logits, weights, ids)."""
    params = dict(router.named_parameters(recurse=False))
    if "bias" in params:
        raise RewriteRefused("the router has a bias")
    buffers = [n for n, _ in router.named_buffers(recurse=False)]
    if next(router.children(), None) is not None:
        raise RewriteRefused("the router has children")
    graph = trace(router)
    x = first_input(graph) if graph is not None else None
    if graph is None or x is None:
        raise RewriteRefused("the router does not trace")
    routing = read_routing(graph, router, x)
    if set(params) != {routing.weight_name}:
        raise RewriteRefused(f"the router holds parameters {sorted(params)} besides its weight")
    used = {step.bias for step in routing.spec.steps if step.bias}
    if set(buffers) != used:
        raise RewriteRefused(f"the router holds buffers {buffers} its routing does not read")
    out = output_value(graph)
    if not (
        isinstance(out, (tuple, list))
        and len(out) == 3
        and out[1] is routing.weights
        and out[2] is routing.ids
        and peel(out[0]) is routing.linear
    ):
        raise RewriteRefused("the router does not return (logits, routing weights, expert ids)")
    return routing
