"""MoE: a mixture-of-experts block -> `FusedMoE` (matched routing, grouped experts).

Matched by dataflow in the block's traced forward, never by name:

- Transformers 5 (packed experts): the block returns `experts(x, ids, weights) [+ shared]`
  where `_, weights, ids = router(x)` and `x` is the block's input up to reshapes. The
  experts child must be a Transformers experts class (`use_experts_implementation`) in the
  standard layout: `gate_up_proj [E, 2I, H]` (gate rows, then up), `down_proj [E, H, I]`,
  no bias, not transposed, the default `act(gate) * up` gating with an activation
  `ActAndMul` reproduces. Its semantics are then fixed by Transformers' experts interface,
  whichever implementation (eager loop, `grouped_mm`) the config selects.
- Transformers 4 (`ModuleList` of gated MLPs): the routing is in the block's own forward and
  the expert loop is data-dependent, so the trace stops inside it; each expert must be
  `down(act(gate(x)) * up(x))` and the block may hold nothing else with state.

The router is read from its graph as a small program (`fusion.moe_modules.RouteSpec`): a
bias-free linear (with the casts it computes in), then softmax or sigmoid before or after a
single top-k, renormalisation (a division by the sum of the selection, read from the graph,
never from a config flag), a constant scaling and casts, in their order. Anything else in
the router refuses with its reason: a biased linear, grouped top-k (several top-k ops), an
`e_score_correction_bias` added for the choice.

A shared expert is found by dataflow as the other addend of the output: `shared(x)`, or
`sigmoid(gate(x)) * shared(x)` with `gate` a linear to one logit (Qwen2-MoE).

Refused: a block returning a tuple (directly or through a name), any stateful child the
fused block would not run, hooks on the block or its experts (they would stop firing).

Because the expert loop (Transformers 4) and the experts interface (Transformers 5) are
taken on their contract rather than traced, every match is also checked numerically once per
kind of instance, on the module's own weights: the fused block must reproduce the router's
indices and weights bit for bit and the block's output to rounding, or it refuses.
"""

from __future__ import annotations

import ast
import inspect
import operator
import textwrap
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import fx, nn

from fusion.errors import RewriteRefused
from fusion.fusers.base import Fuser, _own_call_path, has_hooks, per_signature
from fusion.fusers.glu import activation_kind
from fusion.graph import is_op, output_value, peel
from fusion.moe_modules import DtypeRule, FusedMoE, PackedExperts, RouteSpec, RouteStep
from fusion.params import common_state
from fusion.trace import trace

_SHAPE_OPS = ("reshape", "view", "flatten", "contiguous")
"""Ops that only reshape a value: `x.view(-1, h)` is still the block's input."""

_MODULE_INTERNALS = frozenset(
    {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training"}
)

_PACKED_FLAGS = {
    "has_gate": True,
    "has_bias": False,
    "is_transposed": False,
    "is_concatenated": True,
    "has_post_expert_norm": False,
    "_is_expert_parallel": False,
}
"""Transformers' experts-interface flags of the layout `moe_experts` computes."""

_FLAGS_IMPLIED_WHEN_ABSENT = {
    "has_gate": True,
    "is_concatenated": True,
    "has_post_expert_norm": False,
    "_is_expert_parallel": False,
}
"""Flags an older experts interface (Transformers 5.0 sets only has_bias and is_transposed)
does not define because it has no other variant: its only layout is gated, concatenated
[gate; up], without a post-expert norm, not expert-parallel. Read from the instance (the
flag is absent), never from a version number; the numeric check still runs."""

_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9, torch.bfloat16: 3e-2, torch.float16: 1e-2}
"""Max-normalised error the numeric check allows between the block and its fused twin: the
expert sums are reordered (rounding), while a changed function errs by far more."""


# --------------------------------------------------------------------------------------------
# Graph helpers.


def _unwrap(node: Any, module: nn.Module) -> Any:
    """`node` with reshapes and `nn.Identity` children stripped (no casts: a cast changes the
    values an expert sees)."""
    while isinstance(node, fx.Node):
        shape_only = any(is_op(node, name) for name in _SHAPE_OPS)
        identity = node.op == "call_module" and isinstance(
            module.get_submodule(str(node.target)), nn.Identity
        )
        if not (shape_only or identity):
            break
        node = node.args[0]
    return node


def _input(graph: fx.Graph) -> fx.Node | None:
    return next((n for n in graph.nodes if n.op == "placeholder"), None)


def _reads_input(node: Any, x: fx.Node, module: nn.Module) -> bool:
    """Is `node` a child module called on just the block's input (up to reshapes)?"""
    return (
        isinstance(node, fx.Node)
        and node.op == "call_module"
        and len(node.args) == 1
        and not node.kwargs
        and _unwrap(node.args[0], module) is x
    )


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _returns_tuple(cls: type) -> bool:
    """Does `cls.forward` return a tuple literal, or a name bound to one, anywhere? (Read from
    the source, for forwards whose trace stops before the return.)"""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward))))
    except (OSError, TypeError, SyntaxError):
        return True  # unknown: fail closed
    funcdef = tree.body[0]
    tuple_names = {
        target.id
        for node in ast.walk(funcdef)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple)
        for target in node.targets
        if isinstance(target, ast.Name)
    }

    def is_tuple(value: ast.AST | None) -> bool:
        if isinstance(value, ast.Tuple):
            return True
        if isinstance(value, ast.Name):
            return value.id in tuple_names
        if isinstance(value, ast.IfExp):
            return is_tuple(value.body) or is_tuple(value.orelse)
        return False

    return any(isinstance(n, ast.Return) and is_tuple(n.value) for n in ast.walk(funcdef))


def _reads_training(cls: type) -> bool:
    """Does `cls.forward` read `self.training` (behave differently when training)?"""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward))))
    except (OSError, TypeError, SyntaxError):
        return True
    return any(
        isinstance(n, ast.Attribute) and n.attr == "training" and isinstance(n.value, ast.Name)
        for n in ast.walk(tree)
    )


# --------------------------------------------------------------------------------------------
# The routing program.


@dataclass
class _Routing:
    spec: RouteSpec
    linear: fx.Node
    weights: fx.Node
    ids: fx.Node
    weight_name: str
    """The router weight: a parameter of the router module (Transformers 5) or the linear
    child's `weight` (Transformers 4)."""


def _dtype_rule(target: Any, x: fx.Node, logits: fx.Node, module: nn.Module) -> DtypeRule:
    """A cast target as a rule: a fixed dtype, or the dtype of the input or of the logits."""
    if isinstance(target, torch.dtype):
        return target
    if isinstance(target, fx.Node):
        if target.op == "call_function" and target.target is getattr and target.args[1] == "dtype":
            target = target.args[0]
        base = _unwrap(target, module)
        if base is x:
            return "input"
        if base is logits:
            return "logits"
    raise RewriteRefused("router casts to the dtype of an intermediate value")


def _cast_step(node: fx.Node, x: fx.Node, logits: fx.Node, module: nn.Module) -> DtypeRule:
    fixed = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}
    if node.op == "call_method" and node.target in fixed and len(node.args) == 1:
        return fixed[str(node.target)]
    if node.op == "call_method" and node.target in ("to", "type", "type_as"):
        rest = [*node.args[1:], *(v for k, v in node.kwargs.items() if k == "dtype")]
        other = set(node.kwargs) - {"dtype", "non_blocking", "copy"}
        if len(rest) == 1 and not other:
            return _dtype_rule(rest[0], x, logits, module)
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


def _scores_step(node: fx.Node, x, logits, module) -> RouteStep | None:
    if is_op(node, "softmax"):
        dim = _arg(node, 1, "dim")
        if dim not in (-1, 1):
            raise RewriteRefused(f"router softmax over dim {dim}")
        dtype = node.kwargs.get("dtype", node.args[2] if len(node.args) > 2 else None)
        rule = None if dtype is None else _dtype_rule(dtype, x, logits, module)
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
        bias = _arg(node, 2, "bias")
        if bias is not None:
            raise RewriteRefused("the router linear has a bias")
        weight = _arg(node, 1, "weight")
        base = peel(weight)
        if not (isinstance(base, fx.Node) and base.op == "get_attr"):
            raise RewriteRefused("the router linear's weight is not a parameter")
        return node, node.args[0], weight, str(base.target)
    return None


def _topk_params(topk: fx.Node) -> tuple[int, bool]:
    """(k, sorted) of a top-k over the last dim that picks the largest; refuses otherwise."""
    k = _arg(topk, 1, "k")
    if not isinstance(k, int) or _arg(topk, 2, "dim", -1) not in (-1, 1):
        raise RewriteRefused("top-k is not over the experts of each token")
    if not _arg(topk, 3, "largest", True):
        raise RewriteRefused("top-k selects the smallest scores")
    return k, bool(_arg(topk, 4, "sorted", True))


def _user(node: fx.Node, predicate) -> fx.Node | None:
    return next((u for u in node.users if predicate(u)), None)


def _groups(masked: fx.Node, choice: fx.Node, topks: list[fx.Node]) -> tuple[int, int, int, bool]:
    """(groups, groups kept, per-group top-k, sorted) of DeepSeek's group-limited choice:

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
    if _arg(unsqueeze, 1, "dim") != -1 or len(expand.args) != 4:
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
    if not (is_op(group_scores, "sum") and _arg(group_scores, 1, "dim") == -1):
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
    return groups, kept_groups, per_group_k, group_sorted


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
    if _arg(gather, 1, "dim") not in (-1, 1) or gather.args[2] is not ids:
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


def _routing(graph: fx.Graph, module: nn.Module, x: fx.Node) -> _Routing:
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
    if _unwrap(peel(linear_input), module) is not x:
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
    return _Routing(RouteSpec(input_cast, weight_cast, tuple(steps)), linear, end, ids, weight_name)


def _after_topk_step(node: fx.Node, value: fx.Node, x, logits, module) -> RouteStep:
    """The op `node` applies to the routing weights `value` after the top-k."""
    if _is_cast(node) and node.args[0] is value:
        return RouteStep("cast", _cast_step(node, x, logits, module))
    scored = _scores_step(node, x, logits, module) if node.args[0] is value else None
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
            and _arg(denominator, 1, "dim") in (-1, 1)
            and _arg(denominator, 2, "keepdim", False)
        ):
            return RouteStep("renorm", value=eps)
        raise RewriteRefused("routing weights are divided by something other than their sum")
    if is_op(node, "mul") and value in node.args:
        factor = node.args[1] if node.args[0] is value else node.args[0]
        if isinstance(factor, (int, float)) and not isinstance(factor, bool):
            return RouteStep("scale", value=float(factor))
    raise RewriteRefused(f"router op {node.target} after the top-k is not reproduced")


# --------------------------------------------------------------------------------------------
# Block structure.


@dataclass(frozen=True)
class MoEMatch:
    """What one kind of MoE block computes, in names of its children."""

    style: str
    """`packed` (Transformers 5 experts) or `modulelist` (Transformers 4)."""
    router_name: str
    router_weight: str
    """Name of the router weight within the router child."""
    spec: RouteSpec
    experts_name: str
    activation: str
    expert_names: tuple[str, str, str] | None = None
    """(gate, up, down) child names of each Transformers 4 expert MLP."""
    shared_name: str | None = None
    shared_gate_name: str | None = None
    training_sensitive: bool = False


def _packed_experts(child: nn.Module) -> str:
    """The activation of a Transformers 5 experts module in the layout `moe_experts`
    computes; RewriteRefused naming the difference otherwise."""
    name = type(child).__name__
    if not hasattr(inspect.unwrap(type(child).forward), "__code__") or not hasattr(
        type(child).forward, "__wrapped__"
    ):
        raise RewriteRefused(f"{name} is not a Transformers experts-interface class")
    for flag, expected in _PACKED_FLAGS.items():
        value = getattr(child, flag, _FLAGS_IMPLIED_WHEN_ABSENT.get(flag))
        if value != expected:
            raise RewriteRefused(f"experts {flag}={value!r} (need {expected})")
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError as exc:  # pragma: no cover - Transformers 5 always has it
        raise RewriteRefused("Transformers' experts interface is unavailable") from exc
    if getattr(type(child), "_apply_gate", None) is not _default_apply_gate:
        raise RewriteRefused(f"{name} has its own gating (_apply_gate)")
    params = dict(child.named_parameters(recurse=False))
    if set(params) != {"gate_up_proj", "down_proj"} or list(child.buffers()):
        raise RewriteRefused(f"{name} holds {sorted(params)}, not gate_up_proj and down_proj")
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    if gate_up.ndim != 3 or down.ndim != 3:
        raise RewriteRefused("expert weights are not 3-D")
    experts, two_i, hidden = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (experts, hidden, two_i // 2):
        raise RewriteRefused(f"expert shapes {tuple(gate_up.shape)} / {tuple(down.shape)}")
    if gate_up.dtype != down.dtype or gate_up.device != down.device:
        raise RewriteRefused("expert weights differ in dtype or device")
    act = getattr(child, "act_fn", None)
    if not isinstance(act, nn.Module):
        raise RewriteRefused(f"{name} has no activation module")
    return activation_kind(act)


def _expert_mlp(expert: nn.Module) -> tuple[tuple[str, str, str], str]:
    """((gate, up, down), activation) of a Transformers 4 expert `down(act(gate(x)) * up(x))`."""
    graph = trace(expert)
    x = _input(graph) if graph is not None else None
    out = _unwrap(output_value(graph), expert) if graph is not None else None
    name = type(expert).__name__
    if x is None or not (isinstance(out, fx.Node) and out.op == "call_module"):
        raise RewriteRefused(f"expert {name} does not return a projection")
    down = expert.get_submodule(str(out.target))
    product = out.args[0] if len(out.args) == 1 else None
    if not isinstance(down, nn.Linear) or not (is_op(product, "mul") and len(product.args) == 2):
        raise RewriteRefused(f"expert {name} is not down(act(gate(x)) * up(x))")
    for act_node, up_node in (product.args, product.args[::-1]):
        if not (
            isinstance(act_node, fx.Node)
            and act_node.op == "call_module"
            and len(act_node.args) == 1
            and _reads_input(act_node.args[0], x, expert)
            and _reads_input(up_node, x, expert)
        ):
            continue
        gate_node = act_node.args[0]
        names = (str(gate_node.target), str(up_node.target), str(out.target))
        linears = [expert.get_submodule(n) for n in names]
        for n, lin in zip(names, linears):
            if type(lin) is not nn.Linear or lin.bias is not None or has_hooks(lin):
                raise RewriteRefused(f"expert projection {n} is not a plain bias-free nn.Linear")
        activation = activation_kind(expert.get_submodule(str(act_node.target)))
        return names, activation
    raise RewriteRefused(f"expert {name} is not down(act(gate(x)) * up(x))")


def _modulelist_experts(experts: nn.ModuleList) -> tuple[tuple[str, str, str], str]:
    if len(experts) < 2 or len({type(e) for e in experts}) != 1:
        raise RewriteRefused("experts ModuleList of mixed or too few modules")
    names, activation = _expert_mlp(experts[0])
    first = [getattr(experts[0], n).weight for n in names]
    for expert in experts:
        if has_hooks(expert):
            raise RewriteRefused("an expert has hooks")
        weights = [getattr(expert, n).weight for n in names]
        if any(w.shape != f.shape or w.dtype != f.dtype for w, f in zip(weights, first)):
            raise RewriteRefused("experts differ in shape or dtype")
        if activation_kind(_act_child(expert, names)) != activation:
            raise RewriteRefused("experts differ in activation")
    if first[0].shape != first[1].shape or first[2].shape[::-1] != first[0].shape:
        raise RewriteRefused("expert gate/up/down shapes do not chain")
    # Packing stacks every expert's gate+up into one parameter and every down into another:
    # the shards of each must agree on requires_grad, type and attributes.
    gate, up, down = names
    common_state(
        {f"{e}.{n}.weight": getattr(x, n).weight for e, x in enumerate(experts) for n in (gate, up)}
    )
    common_state({f"{e}.{down}.weight": getattr(x, down).weight for e, x in enumerate(experts)})
    return names, activation


def _act_child(expert: nn.Module, names: tuple[str, str, str]) -> nn.Module:
    children = [c for n, c in expert.named_children() if n not in names]
    if len(children) != 1:
        raise RewriteRefused("expert MLP holds other children than its projections and activation")
    return children[0]


def _other_state(module: nn.Module, accounted: set[str]) -> None:
    for name, child in module.named_children():
        if name in accounted:
            continue
        if next(child.parameters(), None) is not None or next(child.buffers(), None) is not None:
            raise RewriteRefused(f"child {name} holds state the fused block would not run")
    own = [n for n, _ in module.named_parameters(recurse=False)] + [
        n for n, _ in module.named_buffers(recurse=False)
    ]
    if own:
        raise RewriteRefused(f"the block holds state of its own ({own})")


def _shared(node: Any, x: fx.Node, module: nn.Module) -> tuple[str, str | None]:
    """(shared expert, its gate or None) for `shared(x)` or `sigmoid(gate(x)) * shared(x)`."""
    node = _unwrap(node, module)
    if _reads_input(node, x, module):
        return str(node.target), None
    if is_op(node, "mul") and len(node.args) == 2:
        for gated, shared in (node.args, node.args[::-1]):
            gated, shared = _unwrap(gated, module), _unwrap(shared, module)
            if not (is_op(gated, "sigmoid") and _reads_input(shared, x, module)):
                continue
            gate = _unwrap(gated.args[0], module)
            if _reads_input(gate, x, module):
                linear = module.get_submodule(str(gate.target))
                if (
                    type(linear) is nn.Linear
                    and linear.out_features == 1
                    and linear.bias is None
                    and str(gate.target) != str(shared.target)
                ):
                    return str(shared.target), str(gate.target)
    raise RewriteRefused("the output adds a term that is not a (gated) shared expert of the input")


def _match_packed(graph: fx.Graph, module: nn.Module, experts_name: str) -> MoEMatch:
    x = _input(graph)
    out = output_value(graph)
    if isinstance(out, (tuple, list)):
        raise RewriteRefused("the block returns a tuple")
    if out is None:
        reason = (
            "returns a tuple" if _returns_tuple(type(module)) else "does not trace to its return"
        )
        raise RewriteRefused(f"the block {reason}")
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target == experts_name]
    if x is None or len(calls) != 1:
        raise RewriteRefused(f"{experts_name} is not called exactly once")
    experts_node = calls[0]
    experts = module.get_submodule(experts_name)
    activation = _packed_experts(experts)
    try:
        bound = inspect.signature(type(experts).forward).bind(
            None, *experts_node.args, **experts_node.kwargs
        )
    except TypeError as exc:
        raise RewriteRefused(f"experts call does not bind: {exc}") from exc
    arguments = list(bound.arguments.values())[1:]
    if len(arguments) != 3:
        raise RewriteRefused("experts are called with other than (hidden, ids, weights)")
    hidden, ids, weights = arguments
    if _unwrap(hidden, module) is not x:
        raise RewriteRefused("experts do not read the block input")
    router = ids.args[0] if isinstance(ids, fx.Node) and ids.args else None
    if not (
        isinstance(router, fx.Node)
        and ids.target is operator.getitem
        and ids.args == (router, 2)
        and isinstance(weights, fx.Node)
        and weights.target is operator.getitem
        and weights.args == (router, 1)
        and _reads_input(router, x, module)
    ):
        raise RewriteRefused("experts do not take (ids, weights) = router(x)[2], router(x)[1]")
    router_name = str(router.target)
    router_module = module.get_submodule(router_name)
    if isinstance(router_module, nn.Linear):
        raise RewriteRefused("the router is a bare linear returning logits, not routing")
    routing = _router_program(router_module)
    root = _unwrap(out, module)
    shared_name = shared_gate_name = None
    if root is not experts_node:
        if not (is_op(root, "add") and len(root.args) == 2):
            raise RewriteRefused(
                "the block does not return the experts' output (plus a shared expert)"
            )
        a, b = (_unwrap(arg, module) for arg in root.args)
        if b is experts_node:
            a, b = b, a
        if a is not experts_node:
            raise RewriteRefused(
                "the block does not return the experts' output (plus a shared expert)"
            )
        shared_name, shared_gate_name = _shared(b, x, module)
    accounted = {experts_name, router_name, shared_name, shared_gate_name} - {None}
    _other_state(module, accounted)
    return MoEMatch(
        style="packed",
        router_name=router_name,
        router_weight=routing.weight_name,
        spec=routing.spec,
        experts_name=experts_name,
        activation=activation,
        shared_name=shared_name,
        shared_gate_name=shared_gate_name,
        training_sensitive=_reads_training(type(module)) or _reads_training(type(router_module)),
    )


def _router_program(router: nn.Module) -> _Routing:
    """The routing program of a Transformers 5 router module (returns logits, weights, ids)."""
    params = dict(router.named_parameters(recurse=False))
    if "bias" in params:
        raise RewriteRefused("the router has a bias")
    buffers = [n for n, _ in router.named_buffers(recurse=False)]
    if next(router.children(), None) is not None:
        raise RewriteRefused("the router has children")
    graph = trace(router)
    x = _input(graph) if graph is not None else None
    if graph is None or x is None:
        raise RewriteRefused("the router does not trace")
    routing = _routing(graph, router, x)
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


def _looks_routed(graph: fx.Graph, module: nn.Module) -> bool:
    """Does the (possibly partial) graph select experts: a top-k over a linear child's
    output? A decoder stack also holds a `ModuleList` of linear-bearing modules, but no
    top-k; it is not an MoE block at all, so it gets no verdict."""
    for node in graph.nodes:
        if is_op(node, "topk"):
            stack, seen = [node], set()
            while stack:
                current = stack.pop()
                if current in seen or not isinstance(current, fx.Node):
                    continue
                seen.add(current)
                if current.op == "call_module" and isinstance(
                    module.get_submodule(str(current.target)), nn.Linear
                ):
                    return True
                stack.extend(current.all_input_nodes)
    return False


def _match_modulelist(graph: fx.Graph, module: nn.Module, experts_name: str) -> MoEMatch | None:
    x = _input(graph)
    if x is None or not _looks_routed(graph, module):
        return None
    if output_value(graph) is not None and isinstance(output_value(graph), (tuple, list)):
        raise RewriteRefused("the block returns a tuple")
    if _returns_tuple(type(module)):
        raise RewriteRefused("the block returns a tuple")
    names, activation = _modulelist_experts(module.get_submodule(experts_name))
    routing = _routing(graph, module, x)
    if routing.linear.op != "call_module":
        raise RewriteRefused("the Transformers 4 router is not a linear child")
    router_name = str(routing.linear.target)
    shared_name, shared_gate_name = _modulelist_shared(graph, module, x)
    _other_state(module, {experts_name, router_name, shared_name, shared_gate_name} - {None})
    return MoEMatch(
        style="modulelist",
        router_name=router_name,
        router_weight="weight",
        spec=routing.spec,
        experts_name=experts_name,
        activation=activation,
        expert_names=names,
        shared_name=shared_name,
        shared_gate_name=shared_gate_name,
        training_sensitive=_reads_training(type(module)),
    )


def _modulelist_shared(
    graph: fx.Graph, module: nn.Module, x: fx.Node
) -> tuple[str | None, str | None]:
    """(shared expert, its gate) of a Transformers 4 block returning `routed + shared(x)`
    (or `+ sigmoid(gate(x)) * shared(x)`), where `routed` is the buffer the expert loop
    `index_add_`s into; (None, None) when the output is not such a sum. Anything else the
    block computes with a stateful child is then refused by `_other_state`, and the routed
    part itself is proven by the numeric check (a loop has no dataflow to read)."""
    root = _unwrap(output_value(graph), module)
    if not (is_op(root, "add") and len(root.args) == 2):
        return None, None
    buffers = {
        _unwrap(node.args[0], module)
        for node in graph.nodes
        if node.op == "call_method" and node.target == "index_add_" and node.args
    }
    a, b = (_unwrap(arg, module) for arg in root.args)
    if b in buffers:
        a, b = b, a
    if a not in buffers:
        return None, None
    return _shared(b, x, module)


def _experts_child(module: nn.Module) -> tuple[str, str] | None:
    """(name, style) of the one child holding the experts, or None."""
    found = []
    for name, child in module.named_children():
        params = dict(child.named_parameters(recurse=False))
        if params.get("gate_up_proj") is not None and params["gate_up_proj"].ndim == 3:
            found.append((name, "packed"))
        elif (
            isinstance(child, nn.ModuleList)
            and len(child) >= 2
            and any(isinstance(c, nn.Linear) for c in child[0].children())
        ):
            found.append((name, "modulelist"))
    return found[0] if len(found) == 1 else None


# --------------------------------------------------------------------------------------------
# Building and checking the fused block.


def _build(
    module: nn.Module, found: MoEMatch, backend: str
) -> tuple[FusedMoE, PackedExperts | None]:
    """The fused block for `module` (sharing its parameters, except that Transformers 4
    experts are packed into new tensors)."""
    packed = None
    experts = module.get_submodule(found.experts_name)
    if found.style == "modulelist":
        assert found.expert_names is not None
        packed = PackedExperts.from_mlps(experts, found.expert_names)
        experts = packed
    router = module.get_submodule(found.router_name)
    fused = FusedMoE(
        router_name=found.router_name,
        router=router,
        router_weight=found.router_weight.rpartition(".")[2],
        router_is_linear=found.style == "modulelist",
        spec=found.spec,
        experts_name=found.experts_name,
        experts=experts,
        activation=found.activation,
        shared_name=found.shared_name,
        shared=module.get_submodule(found.shared_name) if found.shared_name else None,
        shared_gate_name=found.shared_gate_name,
        shared_gate=module.get_submodule(found.shared_gate_name)
        if found.shared_gate_name
        else None,
        training_sensitive=found.training_sensitive,
        # The original can run in training mode only when the fused block shares everything
        # it holds: its children (packed experts are not repacked), and no state of its own,
        # which `_other_state` already refused for every match.
        eager=module if found.training_sensitive and found.style == "packed" else None,
        backend=backend,
    )
    fused.train(module.training)
    return fused, packed


def _error(reference: torch.Tensor, other: torch.Tensor) -> float:
    a, b = reference.double(), other.double()
    finite = torch.isfinite(a)
    if not torch.equal(finite, torch.isfinite(b)):
        return float("inf")
    if not finite.any():
        return 0.0
    scale = a[finite].abs().max().clamp_min(1e-30)
    return float((a[finite] - b[finite]).abs().max() / scale)


def _check_numerically(module: nn.Module, found: MoEMatch) -> None:
    """Run the block and its fused twin (torch reference kernels) on one random input; refuse
    unless routing is bit-identical (Transformers 5 routers) and outputs agree to rounding."""
    experts = module.get_submodule(found.experts_name)
    weight = next(experts.parameters())
    if weight.device.type == "meta":
        if found.style == "modulelist":
            raise RewriteRefused("cannot check a Transformers 4 expert loop on the meta device")
        return
    dtype = weight.dtype
    router = module.get_submodule(found.router_name)
    hidden = getattr(router, found.router_weight.rpartition(".")[2]).shape[-1]
    generator = torch.Generator().manual_seed(20240601)
    x = torch.randn(2, 8, hidden, generator=generator).to(weight.device, dtype)
    fused, _ = _build(module, found, "torch")
    fused.eval()
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            if found.style == "packed":
                x2 = x.reshape(-1, hidden)
                _, ref_w, ref_ids = router(x2)
                _, new_w, new_ids = fused.route(x2)
                if not (torch.equal(ref_ids, new_ids) and ref_w.dtype == new_w.dtype):
                    raise RewriteRefused("the matched routing picks other experts than the router")
                if not torch.equal(ref_w, new_w):
                    raise RewriteRefused("the matched routing weights differ from the router's")
            expected = module(x.clone())
            actual = fused(x.clone())
    except RewriteRefused:
        raise
    except Exception as exc:
        raise RewriteRefused(f"numeric check failed to run: {type(exc).__name__}: {exc}") from exc
    finally:
        module.train(was_training)
    if not torch.is_tensor(expected) or expected.shape != actual.shape:
        raise RewriteRefused("the block's output is not one tensor of the fused block's shape")
    if expected.dtype != actual.dtype:
        raise RewriteRefused(f"the block returns {expected.dtype}, the fused block {actual.dtype}")
    error = _error(expected, actual)
    if error > _TOLERANCE.get(dtype, 3e-2):
        raise RewriteRefused(
            f"fused block differs from the original by {error:.2e} (max-normalised)"
        )


def _signature(module: nn.Module, names: tuple[str | None, ...]) -> tuple:
    """Plain attributes of the block and the named children that could change what a trace
    shows (top-k, flags, scaling factors); objects count by identity."""
    parts = []
    for owner in (module, *(module.get_submodule(n) for n in names if n)):
        items = []
        for key, value in sorted(owner.__dict__.items()):
            if key in _MODULE_INTERNALS or (key.startswith("_") and key not in _PACKED_FLAGS):
                continue
            plain = isinstance(value, (bool, int, float, str, type(None), torch.dtype)) or (
                isinstance(value, tuple) and all(isinstance(v, (int, float, str)) for v in value)
            )
            items.append((key, value) if plain else (key, type(value).__name__, id(value)))
        parts.append(tuple(items))
    return tuple(parts)


def derive(graph: fx.Graph | None, module: nn.Module) -> MoEMatch | None:
    """The match for `module` (None when it is not an MoE block at all), numerically checked."""
    located = _experts_child(module)
    if graph is None or located is None:
        return None
    experts_name, style = located
    if style == "packed":
        found = _match_packed(graph, module, experts_name)
    else:
        found = _match_modulelist(graph, module, experts_name)
        if found is None:
            return None
    _check_numerically(module, found)
    return found


@dataclass
class MoEFuser(Fuser):
    """Replace an MoE block with a `FusedMoE`."""

    name: ClassVar[str] = "moe"
    redefines_forward: ClassVar[bool] = True

    match_: MoEMatch | None = None
    signature: tuple = ()
    by_signature: dict[tuple, MoEMatch | str] = field(default_factory=dict, repr=False)

    @classmethod
    def candidate(cls, module: nn.Module) -> bool:
        return _experts_child(module) is not None

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> MoEFuser | None:
        found = derive(graph, module)
        if found is None:
            return None
        fuser = cls(source_class=type(module).__name__, match_=found)
        fuser.signature = _signature(module, fuser._names(found))
        fuser.by_signature[fuser.signature] = found
        return fuser

    @staticmethod
    def _names(found: MoEMatch) -> tuple[str | None, ...]:
        return (found.router_name, found.experts_name)

    def _match_for(self, module: nn.Module) -> MoEMatch:
        assert self.match_ is not None
        try:
            signature = _signature(module, self._names(self.match_))
        except AttributeError as exc:
            raise RewriteRefused(f"instance lacks a child of its class's match: {exc}") from exc
        return per_signature(
            self.by_signature, signature, lambda: derive(trace(module), module), "not an MoE block"
        )

    def validate(self, module: nn.Module) -> None:
        # Instance checks first: `_match_for` caches what it derives per instance signature,
        # and must never derive (and cache) from an instance these checks refuse.
        hooks = has_hooks(module)
        if hooks:
            raise RewriteRefused(f"block has {hooks}")
        # The routing and the experts are recomputed from weights, bypassing every linear's
        # call path: a linear that computes anything else around `forward` (per class or per
        # instance, which one traced instance cannot show) must refuse the whole block.
        for name, child in module.named_modules():
            if isinstance(child, nn.Linear):
                own = _own_call_path(child)
                if (
                    own
                    or "forward" in child.__dict__
                    or type(child).forward is not nn.Linear.forward
                ):
                    raise RewriteRefused(f"{name} is a linear with its own {own or 'forward'}")
        located = _experts_child(module)
        if located is not None:
            experts = module.get_submodule(located[0])
            for name, child in [(located[0], experts), *experts.named_modules(prefix=located[0])]:
                hooks = has_hooks(child)
                if hooks:
                    raise RewriteRefused(f"{name} has {hooks}")
        found = self._match_for(module)
        experts = module.get_submodule(found.experts_name)
        if found.style == "packed":
            activation = _packed_experts(experts)
            router = module.get_submodule(found.router_name)
            weight = getattr(router, found.router_weight)
            if weight.shape != (experts.gate_up_proj.shape[0], experts.gate_up_proj.shape[2]):
                raise RewriteRefused(
                    f"router weight {tuple(weight.shape)} does not fit the experts"
                )
        else:
            _, activation = _modulelist_experts(experts)
        if activation != found.activation:
            raise RewriteRefused(f"activation {activation}, matched {found.activation}")

    def fuse(self, module: nn.Module, backend: str) -> nn.Module:
        from fusion.checkpoint import register_packed_experts_layout

        self.validate(module)
        found = self._match_for(module)
        fused, packed = _build(module, found, backend)
        if packed is not None:
            register_packed_experts_layout(fused, found.experts_name)
        return fused

    def dropped_children(self, module: nn.Module) -> tuple[str, ...]:
        """A Transformers 4 `ModuleList` of experts is repacked: its MLPs leave the model."""
        found = self._match_for(module)
        return (found.experts_name,) if found.style == "modulelist" else ()

    def describe(self) -> str:
        assert self.match_ is not None
        m = self.match_
        shared = ""
        if m.shared_name:
            shared = f" + {m.shared_name}" + (
                f" (gated by {m.shared_gate_name})" if m.shared_gate_name else ""
            )
        experts = (
            f"{m.experts_name}[{'ModuleList -> packed' if m.style == 'modulelist' else 'packed'}]"
        )
        return f"{m.router_name}: {m.spec.describe()}; {experts} grouped{shared} -> FusedMoE"
