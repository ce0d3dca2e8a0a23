"""The experts child of an MoE block: which child holds the experts, and whether it computes
what `moe_experts` computes (Transformers 5 packed experts in the standard layout, or a
Transformers 4 `ModuleList` of gated MLPs `down(act(gate(x)) * up(x))`)."""

from __future__ import annotations

import inspect
import sys

from torch import fx, nn

from fusion.callpath import has_hooks
from fusion.errors import RewriteRefused
from fusion.fusers.glu import activation_kind
from fusion.fusers.moe.provenance import INTERFACE_MODULE, experts_dispatch
from fusion.graph import calls_child_on, first_input, is_op, output_value, strip_reshapes
from fusion.params import common_state
from fusion.trace import trace

PACKED_FLAGS = {
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


def experts_child(module: nn.Module) -> tuple[str, str] | None:
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


def packed_experts_activation(child: nn.Module) -> str:
    """The activation of a Transformers 5 experts module in the layout `moe_experts`
    computes; RewriteRefused naming the difference otherwise."""
    name = type(child).__name__
    if not hasattr(inspect.unwrap(type(child).forward), "__code__") or not hasattr(
        type(child).forward, "__wrapped__"
    ):
        raise RewriteRefused(f"{name} is not a Transformers experts-interface class")
    for flag, expected in PACKED_FLAGS.items():
        value = getattr(child, flag, _FLAGS_IMPLIED_WHEN_ABSENT.get(flag))
        if value != expected:
            raise RewriteRefused(f"experts {flag}={value!r} (need {expected})")
    # What the experts compute is proven by the identity of their functions, never by the
    # block's numeric sample alone (a decorated loop of its own may drop rows).
    experts_dispatch(child)
    moe = sys.modules[INTERFACE_MODULE]  # loaded: the dispatcher was proven to be its own
    if getattr(type(child), "_apply_gate", None) is not moe._default_apply_gate:
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
    count = getattr(child, "num_experts", experts)
    if count != experts:  # what the eager loop and grouped_mm count experts by
        raise RewriteRefused(f"experts num_experts={count!r} but {experts} expert weights")
    act = getattr(child, "act_fn", None)
    if not isinstance(act, nn.Module):
        raise RewriteRefused(f"{name} has no activation module")
    return activation_kind(act)


def _expert_mlp(expert: nn.Module) -> tuple[tuple[str, str, str], str]:
    """((gate, up, down), activation) of a Transformers 4 expert `down(act(gate(x)) * up(x))`."""
    graph = trace(expert)
    x = first_input(graph) if graph is not None else None
    out = strip_reshapes(output_value(graph), expert) if graph is not None else None
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
            and calls_child_on(act_node.args[0], x, expert)
            and calls_child_on(up_node, x, expert)
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


def modulelist_experts(experts: nn.ModuleList) -> tuple[tuple[str, str, str], str]:
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
