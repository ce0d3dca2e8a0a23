"""GLU: `act(gate(x)) * up(x)` -> `act_and_mul(*gate_up_proj(x, "as-computed"))`.

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

from fusion.analysis import alias_terms, regions, source
from fusion.analysis.callpath import has_hooks, own_call_path
from fusion.analysis.reads import (
    AttributeGuard,
    Read,
    ReadsGuard,
    guarded_reads,
    recording,
    resolved,
)
from fusion.errors import RewriteRefused
from fusion.fusers.base import Fuser
from fusion.fusers.stacked import check_stackable, install_merged
from fusion.runtime import bound
from fusion.runtime.guards import attribute_guard
from fusion.runtime.merged import AS_COMPUTED, ActAndMul, MergedLinear
from fusion.trace.graph import is_fn, is_linear, submodule


def activation_kind(act: nn.Module) -> str:
    """`silu`, `gelu` or `gelu_tanh` for an activation module we reproduce exactly; else
    RewriteRefused naming the type. The known classes are matched exactly; one of any other
    class must trace to one activation call and provably keep global state
    (`fusion.analysis.regions.module_keeps_state`), the only code that runs between `gate` and `up`."""
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
    traced = _traced_kind(act)
    if traced is not None:
        # A trace records tensor operations only: a grad-mode or autocast switch in the same
        # forward ran during the trace and left no node. `ActAndMul` would drop it, and
        # `up`, merged with `gate`, would no longer run after it.
        if not regions.module_keeps_state(act):
            raise RewriteRefused(
                f"activation {kind.__name__} may change global state (grad mode, autocast, "
                "settings) besides its one call: merging would move up out of the state it "
                "ran in"
            )
        return traced
    raise RewriteRefused(f"activation {kind.__name__} is not one ActAndMul reproduces exactly")


def proven_activation(act: nn.Module) -> tuple[str, tuple[Read, ...]]:
    """(`activation_kind(act)`, what identifying it read on `act`'s tree): its settings
    (`approximate`), the function a Transformers wrapper calls (`act`, by identity, or a
    `functools.partial`'s contents), whatever tracing a class of another kind read, and
    `act`'s `forward` (the kind stands for what calling `act` computes, read off its
    class). Guarding these (`ReadsGuard`) is what makes the fused `ActAndMul`
    compute `act` after fusing too; RewriteRefused as `activation_kind`, or for a read no
    per-call guard can see, or an instance-level `forward` on `act`."""
    with recording(act) as recorded:
        kind = activation_kind(act)
    # The call path and an instance-level forward are `ChildGuard`'s: `fuse` guards the
    # activation's slot with one, which checks both per call.
    return kind, resolved(act, guarded_reads(act, recorded, called=(act,), call_path=False))


def functional_kind(node: object) -> str | None:
    """`silu`, `gelu` or `gelu_tanh` when `node` is one call of `F.silu` (not in place) or
    `F.gelu` (exact or tanh-approximated) on a single tensor; else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and len(node.args) == 1):
        return None
    kwargs = dict(node.kwargs)
    if node.target is F.silu and kwargs in ({}, {"inplace": False}):
        return "silu"
    if node.target is F.gelu:
        approximate = kwargs.pop("approximate", "none")
        if not kwargs and approximate in ("none", "tanh"):
            return "gelu" if approximate == "none" else "gelu_tanh"
    return None


def _traced_kind(act: nn.Module) -> str | None:
    """The kind of an activation module of any class whose forward, traced on this
    instance, is exactly one `functional_kind` call on its input (e.g. a GELU-tanh class
    calling `F.gelu(x, approximate="tanh")` itself); None for anything else, including a
    module with children or a call path of its own (the trace would not be all it runs)."""
    if own_call_path(act) or "forward" in act.__dict__ or any(True for _ in act.children()):
        return None
    try:
        graph = fx.symbolic_trace(act).graph
    except Exception:  # untraceable: not provably one call
        return None
    nodes = list(graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    ops = [n for n in nodes if n.op not in ("placeholder", "output")]
    if len(inputs) != 1 or len(ops) != 1 or nodes[-1].args != (ops[0],):
        return None
    if ops[0].args[:1] != (inputs[0],):
        return None
    return functional_kind(ops[0])


def _glu_nodes(graph: fx.Graph, module: nn.Module) -> tuple[str, str, str, str] | None:
    """(gate, up, act, kind) of the first `act(gate(x)) * up(x)` product in `graph`: `act`
    names the activation child and `kind` is ""; for an activation called as a function
    (`F.silu(gate(x)) * up(x)`), `act` is "" and `kind` its `functional_kind`."""
    for node in graph.nodes:
        if not is_fn(node, operator.mul) or len(node.args) != 2:
            continue
        for act_node, up_node in (node.args, node.args[::-1]):
            if not (
                isinstance(act_node, fx.Node)
                and is_linear(up_node, module)
                and len(act_node.args) == 1
                and is_linear(act_node.args[0], module)
            ):
                continue
            kind = functional_kind(act_node) or ""
            if not kind and (act_node.op != "call_module" or is_linear(act_node, module)):
                continue
            gate_node = act_node.args[0]
            if gate_node.args != up_node.args or gate_node.kwargs or up_node.kwargs:
                continue
            if len(gate_node.args) != 1 or not (kind or submodule(act_node, module) is not None):
                continue
            act = "" if kind else str(act_node.target)
            return str(gate_node.target), str(up_node.target), act, kind
    return None


def _is_function_call(
    node: ast.AST, kind: str, gate_call: ast.Call, fn: Any, local: set[str]
) -> bool:
    """Is `node` the call `F.<silu|gelu>(<gate_call>[, approximate=...])` of activation
    `kind`, its callee resolving in the forward's globals to that very function (a name the
    forward binds itself, in `local`, or a module-level `F` that is something else, does
    not)?"""
    if not (isinstance(node, ast.Call) and len(node.args) == 1 and node.args[0] is gate_call):
        return False
    path = alias_terms.func_chain(node.func)
    func = alias_terms.chain_root(node.func)
    if not isinstance(func, ast.Name) or func.id in local:
        return False
    target: object = fn.__globals__.get(func.id)
    for attr in path:
        target = getattr(target, attr, None)
    expected = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": F.gelu}[kind]
    keywords = {k.arg: getattr(k.value, "value", k) for k in node.keywords}
    allowed = {"silu": ({}, {"inplace": False}), "gelu": ({}, {"approximate": "none"})}
    allowed["gelu_tanh"] = ({"approximate": "tanh"},)
    return target is expected and keywords in allowed[kind]


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


def rewrite_glu(
    module: nn.Module, gate: str, up: str, act: str, kind: str = ""
) -> tuple[Any, str, str]:
    """Rewrite the product `self.<act>(self.<gate>(X)) * self.<up>(X)` (either order; with
    `kind`, `F.<activation>(self.<gate>(X)) * self.<up>(X)`) into
    `self.act_and_mul(*self.gate_up_proj(X, "as-computed"))` (one merged output, or the
    two shards' outputs where they were computed apart: `MergedLinear.outputs`); returns
    (forward, original, rewritten).

    Refuses unless the product is one expression of that exact shape with the same plain
    input on both sides: then the only code between the two projection calls is the
    activation on a fresh GEMM output, which cannot change the input (nor global state:
    `activation_kind`, per instance, admits only activations that provably keep it).
    """
    funcdef, fn = source.recover_forward(type(module))
    local = alias_terms.local_names(funcdef)
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
                (
                    _is_function_call(a, kind, gate_call, fn, local)
                    if kind
                    else _is_self_call(a, act) and a.args[0] is gate_call
                )
                and b is up_call
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
    replacement = ast.parse(
        f"self.act_and_mul(*self.gate_up_proj(__input__, {AS_COMPUTED!r}))", mode="eval"
    ).body
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

    moves_parameters: ClassVar[bool] = True
    changes_layout: ClassVar[bool] = False
    """The merged children stay in place with their own Parameters (views of the stacked
    weight), so a tensor-parallel plan keeps naming what exists; applying it puts hooks and
    DTensor Parameters on those children, which the rewritten forward's guards see (it then
    runs the original forward, so the plan's sharding computes as on the unfused model)."""

    name: ClassVar[str] = "glu"
    gate: str = ""
    up: str = ""
    act: str = ""
    kind: str = ""
    """The activation's kind when it is called as a function (`F.silu(...)`), else ""."""
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
        gate, up, act, kind = names
        fuser = cls(source_class=type(module).__name__, gate=gate, up=up, act=act, kind=kind)
        fuser.forward_fn, fuser.original_source, fuser.rewritten_source = rewrite_glu(
            module, gate, up, act, kind
        )
        return fuser

    def validate(self, module: nn.Module) -> None:
        check_stackable(module, (self.gate, self.up), "gate_up_proj")
        if hasattr(module, "act_and_mul"):
            raise RewriteRefused(f"{type(module).__name__} already has act_and_mul")
        gate, up = getattr(module, self.gate), getattr(module, self.up)
        if gate.out_features != up.out_features:
            raise RewriteRefused(f"gate width {gate.out_features} != up width {up.out_features}")
        self.activation(module)

    def activation(self, module: nn.Module) -> tuple[str, tuple[Read, ...]]:
        """The `ActAndMul` kind for this instance, the functional call's or its child's, and
        what identifying the child's read (`proven_activation`; none for a function the
        forward calls by name: `GlobalsGuard` watches the name)."""
        if self.kind:
            return self.kind, ()
        return proven_activation(getattr(module, self.act))

    def fuse(self, module: nn.Module, backend: str) -> nn.Module:
        self.validate(module)
        kind, reads = self.activation(module)
        linears = check_stackable(module, (self.gate, self.up), "gate_up_proj")
        install_merged(module, "gate_up_proj", MergedLinear.from_linears(linears, backend))
        module.act_and_mul = ActAndMul(kind, backend)
        names = [self.gate, self.up]
        if self.act:  # the activation child the proof read (`self.act_fn`)
            names.append(self.act)
        guards = [attribute_guard(module, n, called=True) for n in ("gate_up_proj", "act_and_mul")]
        guards += [attribute_guard(module, n) for n in names]
        if reads:  # the activation's kind as `act_and_mul` holds it: its settings, forward
            guards.append(ReadsGuard("activation", AttributeGuard.record(reads)))
        bound.bind(module, self.forward_fn, tuple(guards))
        return module

    def dropped_children(self, module: nn.Module) -> tuple[str, ...]:
        return (self.gate, self.up)

    def describe(self) -> str:
        act = self.act or self.kind
        return f"{self.gate} + {self.up} -> gate_up_proj, {act}(*) * -> act_and_mul"
