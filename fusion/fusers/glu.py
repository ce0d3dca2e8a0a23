"""GLU: `act(gate(x)) * up(x)` -> `act_and_mul(gate_up_proj(x))`.

The gate and up projections become one `MergedLinear` (gate is shard 0) and the activation
and product one `ActAndMul`, which applies the activation to the first half. The activation
is identified per instance from its module type (and, for Transformers' wrappers, the exact
function they call), so two instances of one MLP class with different `hidden_act` each get
the right kernel, and an activation we cannot reproduce exactly refuses.
"""

from __future__ import annotations

import ast
import functools
import operator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch.nn.functional as F
from torch import fx, nn

from fusion import bound, source
from fusion.callpath import has_hooks
from fusion.errors import RewriteRefused
from fusion.fusers.base import Fuser
from fusion.fusers.stacked import check_stackable, install_merged
from fusion.graph import is_fn, is_linear, submodule
from fusion.modules import ActAndMul, MergedLinear


def activation_kind(act: nn.Module) -> str:
    """`silu`, `gelu` or `gelu_tanh` for an activation module we reproduce exactly; else
    RewriteRefused naming the type."""
    kind = type(act)
    if has_hooks(act):
        raise RewriteRefused(f"activation {kind.__name__} has hooks")
    if kind is nn.SiLU:
        return "silu"
    if kind is nn.GELU:
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    try:
        from transformers import activations as hf
    except ImportError:  # no transformers: only torch's own activation classes are known
        hf = None
    if hf is not None:
        if kind is getattr(hf, "SiLUActivation", None):
            return "silu"
        if kind is getattr(hf, "GELUActivation", None) and getattr(act, "act", None) is F.gelu:
            return "gelu"
        if kind is getattr(hf, "NewGELUActivation", None):
            return "gelu_tanh"
        inner = getattr(act, "act", None)
        if (
            kind in {getattr(hf, "GELUTanh", None), getattr(hf, "PytorchGELUTanh", None)}
            and isinstance(inner, functools.partial)
            and inner.func is F.gelu
            and inner.keywords == {"approximate": "tanh"}
        ):
            return "gelu_tanh"
    raise RewriteRefused(f"activation {kind.__name__} is not one ActAndMul reproduces exactly")


def _glu_nodes(graph: fx.Graph, module: nn.Module) -> tuple[str, str, str] | None:
    """(gate, up, act) names of the first `act(gate(x)) * up(x)` product in `graph`."""
    for node in graph.nodes:
        if not is_fn(node, operator.mul) or len(node.args) != 2:
            continue
        for act_node, up_node in (node.args, node.args[::-1]):
            if not (
                isinstance(act_node, fx.Node)
                and act_node.op == "call_module"
                and not is_linear(act_node, module)
                and is_linear(up_node, module)
                and len(act_node.args) == 1
                and is_linear(act_node.args[0], module)
            ):
                continue
            gate_node = act_node.args[0]
            if gate_node.args != up_node.args or gate_node.kwargs or up_node.kwargs:
                continue
            if submodule(act_node, module) is None or len(gate_node.args) != 1:
                continue
            return str(gate_node.target), str(up_node.target), str(act_node.target)
    return None


def _is_self_call(node: ast.AST, name: str) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == name
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
        and len(node.args) == 1
        and not node.keywords
    )


def rewrite_glu(module: nn.Module, gate: str, up: str, act: str) -> tuple[Any, str, str]:
    """Rewrite the product `self.<act>(self.<gate>(X)) * self.<up>(X)` (either order) into
    `self.act_and_mul(self.gate_up_proj(X))`; returns (forward, original, rewritten).

    Refuses unless the product is one expression of that exact shape with the same plain
    input on both sides: then the only code between the two projection calls is the
    activation on a fresh GEMM output, which cannot change the input.
    """
    funcdef, fn = source.recover_forward(type(module))
    original = source.unparse(funcdef)
    gate_call, gate_refs = source.self_call_and_refs(funcdef, gate)
    up_call, up_refs = source.self_call_and_refs(funcdef, up)
    for name, refs in ((gate, gate_refs), (up, up_refs)):
        for ref in refs:
            source.fold_existence_guard(funcdef, ref, name)
    if ast.dump(gate_call.args[0]) != ast.dump(up_call.args[0]) or not all(
        isinstance(n, (ast.Name, ast.Load)) for n in ast.walk(gate_call.args[0])
    ):
        raise RewriteRefused("gate and up are not called on the same plain name")
    product = next(
        (
            node
            for node in ast.walk(funcdef)
            if isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Mult)
            and any(
                _is_self_call(a, act) and a.args[0] is gate_call and b is up_call
                for a, b in ((node.left, node.right), (node.right, node.left))
            )
        ),
        None,
    )
    if product is None:
        raise RewriteRefused("the GLU product is not one expression act(gate(x)) * up(x)")
    if source.enclosing_loops(funcdef, product):
        raise RewriteRefused("the GLU product is inside a loop or comprehension")
    taken = source.bound_names(funcdef) | {
        n.attr for n in ast.walk(funcdef) if isinstance(n, ast.Attribute)
    }
    if {"gate_up_proj", "act_and_mul"} & taken:
        raise RewriteRefused("gate_up_proj or act_and_mul already used in the forward")
    replacement = ast.parse("self.act_and_mul(self.gate_up_proj(__input__))", mode="eval").body
    placeholder = next(
        n for n in ast.walk(replacement) if isinstance(n, ast.Name) and n.id == "__input__"
    )
    source.replace_expr(replacement, placeholder, gate_call.args[0])
    for node in ast.walk(replacement):
        ast.copy_location(node, product)
    source.replace_expr(funcdef, product, replacement)
    return source.compile_forward(funcdef, fn), original, source.unparse(funcdef)


@dataclass
class GLUFuser(Fuser):
    """A gated MLP's gate/up projections and activation-times-up product."""

    name: ClassVar[str] = "glu"
    gate: str = ""
    up: str = ""
    act: str = ""
    forward_fn: Any = field(default=None, repr=False)

    @classmethod
    def candidate(cls, module: nn.Module) -> bool:
        return sum(isinstance(c, nn.Linear) for c in module.children()) >= 2

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> GLUFuser | None:
        if graph is None:
            return None
        names = _glu_nodes(graph, module)
        if names is None:
            return None
        gate, up, act = names
        fuser = cls(source_class=type(module).__name__, gate=gate, up=up, act=act)
        fuser.forward_fn, fuser.original_source, fuser.rewritten_source = rewrite_glu(
            module, gate, up, act
        )
        return fuser

    def validate(self, module: nn.Module) -> None:
        check_stackable(module, (self.gate, self.up), "gate_up_proj")
        if hasattr(module, "act_and_mul"):
            raise RewriteRefused(f"{type(module).__name__} already has act_and_mul")
        gate, up = getattr(module, self.gate), getattr(module, self.up)
        if gate.out_features != up.out_features:
            raise RewriteRefused(f"gate width {gate.out_features} != up width {up.out_features}")
        activation_kind(getattr(module, self.act))

    def fuse(self, module: nn.Module, backend: str) -> nn.Module:
        self.validate(module)
        kind = activation_kind(getattr(module, self.act))
        linears = check_stackable(module, (self.gate, self.up), "gate_up_proj")
        install_merged(
            module, "gate_up_proj", MergedLinear.from_linears(linears), (self.gate, self.up)
        )
        module.act_and_mul = ActAndMul(kind, backend)
        bound.bind(module, self.forward_fn)
        return module

    def describe(self) -> str:
        return f"{self.gate} + {self.up} -> gate_up_proj, {self.act}(*) * -> act_and_mul"
