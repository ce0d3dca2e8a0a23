"""Regions are barriers: a merged projection call must run in the state every call it
replaces ran in.

A projection reads more than its arguments: grad mode and inference mode (whether its output
carries gradient), autocast (its dtype), and global settings (matmul precision, backend
flags, the default dtype, random state, dispatch modes a context manager enters). Merging
calls evaluates them all at one point, so merging is exact only when that state is the same
at the merge point as at each original call. Two things break it:

1. a `with` block around some of the merged calls but not all (`k = self.k_proj(h)` inside
   `with torch.no_grad():`, `q` and `v` outside): the merge would move calls out of (or
   into) its region. Calls all inside one `with` block merge inside it, as before.
2. code that runs between the merge point and a call and may change global state without
   restoring it: a statement call (`torch.set_grad_enabled(False)`,
   `torch._C._set_grad_enabled`, `torch.set_autocast_enabled`, `torch.manual_seed`), a store
   into a global (`torch.backends.cuda.matmul.allow_tf32 = False`), a context manager not
   known to restore what it changes, or a helper, method or child that does any of these
   (read from its source, to `MAX_DEPTH`).

Both are decided fail-closed: code passes only when proven to keep global state (known torch
operators, tensor methods, pure builtins, known context managers that restore what they
set, and callees whose source shows nothing else); anything unknown or unreadable is
presumed to change it. Writes to tensors are not this module's concern (`fusion.analysis.alias`,
`fusion.fusers.pure_calls`): a callee those read as pure because it writes no tensor may
still toggle grad mode, which is exactly what is checked here.
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import math
import re
import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fusion.analysis import alias_terms, source
from fusion.analysis.callpath import has_hooks, own_call_path
from fusion.analysis.name_resolution import Kind, resolve, self_is_bound_to_owner
from fusion.errors import RewriteRefused

MAX_DEPTH = 3
"""Deepest chain of callees read (a norm calling its `_norm` method calling a helper)."""

BALANCED_MANAGERS: tuple[object, ...] = (
    torch.no_grad,
    torch.enable_grad,
    torch.inference_mode,
    torch.set_grad_enabled,
    torch.autocast,
    torch.cpu.amp.autocast,
    torch.cuda.amp.autocast,
    torch.random.fork_rng,
)
"""Context managers whose exit restores exactly the state their entry changed (grad mode,
inference mode, autocast, the random state). A `with` of one of these that encloses no
merged call leaves the state as it found it."""

STATELESS_CHILD_TYPES: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Dropout,
    nn.Identity,
    nn.LayerNorm,
    nn.RMSNorm,
    nn.Embedding,
    nn.SiLU,
    nn.GELU,
    nn.ReLU,
    nn.Tanh,
    nn.Sigmoid,
)
"""Children (exact classes, without hooks or a call path of their own) whose forward is
torch's own tensor computation and touches no global state."""

OP_MODULES: tuple[object, ...] = (torch._C._nn, torch._C._special, torch._C._linalg, torch._C._fft)
"""Modules of torch's builtin operators (`F.gelu`, `F.linear` are `torch._C._nn`'s)."""

OP_PYTHON_MODULES = frozenset({"torch.nn.functional", "torch.functional"})
"""Modules of torch's Python-level operators (`F.silu`, `torch.split`, `torch.einsum`)."""

STATELESS_TYPES: tuple[object, ...] = (torch.finfo, torch.iinfo, torch.Size, torch.device)
"""Torch classes whose construction reads or sets nothing global."""

STATELESS_CLASS_MODULES = ("torch.distributions",)
"""Modules whose classes are constructed and whose methods are called in forwards (Gemma 3n's
`Normal(0, 1).icdf(p)`) and touch no global state: tensor math, argument validation, and
random sampling that consumes (never sets) the generator's state."""

STATE_VERB = re.compile(r"(^|_)(set|seed|enable|disable|use|fork|reset|clear|manual)(_|$)")
"""Names that set global state (`set_grad_enabled`, `manual_seed`,
`use_deterministic_algorithms`): refused even where the allow-lists above would admit them."""

_SIMPLE = (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr, ast.Return)
"""Statements that are one expression evaluation (and a binding)."""

TENSOR_EFFECT_METHODS = frozenset(
    {"backward", "register_hook", "register_post_accumulate_grad_hook", "apply_", "map_", "map2_"}
)
"""Tensor methods that run or install arbitrary Python (autograd hooks, per-element
callables)."""


class RegionRefused(RewriteRefused):
    """A merge refused at a region barrier. `mergeable` names the calls (`self.<name>`) that
    run before the first barrier: a fuser may try merging just those (it proves them again
    from scratch; the names are a suggestion, never a proof)."""

    def __init__(self, reason: str, mergeable: tuple[str, ...]) -> None:
        super().__init__(reason)
        self.mergeable = mergeable


@dataclass(frozen=True)
class Barrier:
    """Why merging moves a call out of its region or state (`reason`, naming the statement),
    and the calls that run before the barrier (`before`, in source order)."""

    reason: str
    before: tuple[ast.Call, ...]


def check_same_region(
    funcdef: ast.FunctionDef,
    calls: Sequence[ast.Call],
    module: nn.Module | None,
    globals_: dict[str, Any],
) -> tuple[str, ...]:
    """Refuse (`RegionRefused`) unless merging `calls` (the `self.<shard>(x)` calls of
    `funcdef`, hoisted to the first statement of their dominating block that holds one,
    `source.dominating_block`) runs each of them in the state it ran in: no `with` encloses
    some of them and not all, and nothing that runs from the merge point to the last of them
    may change global state (`region_barrier`, reading callees on `module` and in
    `globals_`).

    Returns the `self.<name>`s (other than the calls) called in that stretch: the proof read
    them on `module`, so a fuser proves them again on every instance it fuses
    (`self_call_keeps_state`)."""
    barrier = region_barrier(funcdef, calls, StateProof.of(funcdef, module, globals_))
    if barrier is not None:
        raise RegionRefused(barrier.reason, tuple(_name(call) for call in barrier.before))
    shards = {_name(call) for call in calls}
    block, indices = source.dominating_block(funcdef, calls)
    roots, after_all = _run_before(block, min(indices), calls)
    names = {
        _name(node)
        for root in roots
        for node in ast.walk(root)
        if isinstance(node, ast.Call)
        and _self_attr(node.func) is not None
        and id(node) not in after_all
    }
    return tuple(sorted(names - shards))


def region_barrier(
    funcdef: ast.FunctionDef, calls: Sequence[ast.Call], proof: StateProof
) -> Barrier | None:
    """The first barrier that merging `calls` at the head of their dominating block would
    move a call across, or None when there provably is none.

    None only when (1) every `with` statement inside the dominating block encloses either
    all of `calls` or none (enclosing all, the dominating block is already inside it), and
    (2) every node that may run between the merge point and the last call is shown by
    `proof` to keep global state: each call (`StateProof.call_keeps_state`), each `with`
    (a `BALANCED_MANAGERS` entry), each store (`StateProof.store_keeps_state`) and each
    `self.<attr>` read (no property runs); no `global`, `import` or `yield`. Code after
    the last call in its own compound statement (a later `else` branch's tail) is not read:
    it runs after every original call. Which calls count as before a barrier is read from
    source positions (a node takes effect where it ends: after its arguments); that only
    shapes the message and `Barrier.before`, never the verdict."""
    block, indices = source.dominating_block(funcdef, calls)
    ordered = sorted(calls, key=_start)
    for position, call in enumerate(ordered):
        for level, index in source.block_chain(block, call)[:-1]:
            stmt = level[index]
            if isinstance(stmt, (ast.With, ast.AsyncWith)):
                outside = next(c for c in ordered if not source.contains(stmt, c))
                reason = (
                    f"{_name(call)} is called inside `{_header(stmt)}` and {_name(outside)} "
                    "outside: merging would move it out of its region"
                )
                return Barrier(reason, tuple(ordered[:position]))
    roots, after_all = _run_before(block, min(indices), calls)
    managers: set[int] = set(after_all)  # calls read as not running in between
    hazards = [
        (node, why)
        for root in roots
        for node in ast.walk(root)
        for why in [_node_hazard(node, calls, managers, proof)]
        if why
    ]
    if not hazards:
        return None
    node, why = min(hazards, key=lambda hazard: _effect(hazard[0]))
    before = tuple(c for c in ordered if _start(c) < _effect(node)[:2])
    after = [c for c in ordered if c not in before] or ordered[-1:]
    where = f"between {_name(before[-1])} and " if before else "before "
    reason = (
        f"`{_snippet(node)}` {why} {where}{_name(after[0])}: merging would move "
        f"{_name(after[0])} out of the state it ran in"
    )
    return Barrier(reason, before)


def _node_hazard(
    node: ast.AST, calls: Sequence[ast.Call], managers: set[int], proof: StateProof
) -> str:
    """Why `node` may change global state ("" when it provably does not). `managers` holds
    the ids of calls not to read: `with` items already proven balanced (`ast.walk` visits a
    `with` before its items, so they are added first) and calls that run after every
    merged call."""
    if isinstance(node, (ast.With, ast.AsyncWith)):
        for item in node.items:
            if isinstance(node, ast.AsyncWith) or not proof.manager_is_balanced(item.context_expr):
                return "is a context manager not known to restore global state"
            managers.add(id(item.context_expr))
        return ""
    if isinstance(node, (ast.Global, ast.Nonlocal, ast.Import, ast.ImportFrom)):
        return "may rebind or run module-level state"
    if isinstance(node, (ast.Yield, ast.YieldFrom, ast.Await)):
        return "hands control to the caller, which may change global state,"
    if isinstance(node, ast.Call):
        if id(node) in managers or _is_one_of(node, calls) or proof.call_keeps_state(node):
            return ""
        return "is a call not proven to keep global state (grad mode, autocast, settings)"
    if isinstance(node, (ast.Attribute, ast.Subscript)) and not isinstance(node.ctx, ast.Load):
        return "" if proof.store_keeps_state(node) else "stores into state outside the forward"
    if isinstance(node, ast.Attribute) and not proof.load_keeps_state(node):
        return "reads a property (code that may change global state)"
    return ""


def _run_before(
    block: source.Block, start: int, calls: Sequence[ast.Call]
) -> tuple[list[ast.AST], set[int]]:
    """Roots of the code that may run from before `block[start]` (the merge point) to the
    last of `calls`: the statements in between whole, and of the statement holding the last
    call, what may run before it (`_prefix`); with the ids of the calls in those roots that
    take effect only after every one of `calls` (`_prefix`)."""
    holding = [i for i, stmt in enumerate(block) if any(source.contains(stmt, c) for c in calls)]
    last = max(holding)
    inside = [c for c in calls if source.contains(block[last], c)]
    roots, after = _prefix(block[last], inside)
    return [*block[start:last], *roots], after


def _prefix(stmt: ast.stmt, calls: Sequence[ast.Call]) -> tuple[list[ast.AST], set[int]]:
    """What of `stmt` may run before the last of `calls` (all inside `stmt`), and the ids of
    calls in it that take effect only after all of them. For an `if`: its test and the
    prefix of each branch that holds a call (a branch without one never runs before a call
    in the other). For a simple statement: all of it, but a call whose callee or arguments
    hold every one of `calls` (`self.k_sconv(self.k_proj(x))`) takes effect after they all
    ran (a call runs once its callee and arguments are evaluated; `calls` are never inside a
    lambda, `source.self_call_and_refs`), so it is no barrier between them (its other
    arguments are still read). Any other statement whole (over-reading only refuses
    more)."""
    if isinstance(stmt, ast.If):
        roots: list[ast.AST] = [stmt.test]
        after: set[int] = set()
        for branch in (stmt.body, stmt.orelse):
            inside = [c for c in calls if any(source.contains(s, c) for s in branch)]
            if inside:
                branch_roots, branch_after = _run_before(branch, 0, inside)
                roots += branch_roots
                after |= branch_after
        return roots, after
    if isinstance(stmt, _SIMPLE):
        return [stmt], {
            id(node)
            for node in ast.walk(stmt)
            if isinstance(node, ast.Call)
            and not _is_one_of(node, calls)
            and all(source.contains(node, call) for call in calls)
        }
    return [stmt], set()


@dataclass
class StateProof:
    """What the names of one function resolve to, for proving its code keeps global state:
    its owner (`self`, or None), globals, locals, local names that may alias a global
    object (`aliases`: a store through one is a store into the global), and locals bound
    once to a new `STATELESS_CLASS_MODULES` object (`instances`, name to class); `depth`
    counts the callees read so far."""

    owner: nn.Module | None
    globals: dict[str, Any]
    local: set[str]
    depth: int
    aliases: frozenset[str] = frozenset()
    instances: dict[str, type] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        funcdef: ast.FunctionDef,
        owner: nn.Module | None,
        globals_: dict[str, Any],
        depth: int = 0,
    ) -> StateProof:
        """The proof context of `funcdef` (a method of `owner`'s class when `owner` is
        given, so `self` is the owner rather than a local). A method that rebinds `self`
        (or whose first parameter is not `self`) gets no owner: `self.<name>` is then any
        object's attribute, a local the proof cannot resolve."""
        if owner is not None and not self_is_bound_to_owner(funcdef):
            owner = None
        local = alias_terms.local_names(funcdef) - ({"self"} if owner is not None else set())
        proof = cls(owner, globals_, local, depth)
        proof.aliases = global_aliases(funcdef, proof)
        proof.instances = stateless_instances(funcdef, proof)
        return proof

    def resolve(self, func: ast.expr) -> tuple[bool, object]:
        """(True, object) for a name or attribute chain rooted at a global or builtin name
        (not a local), each step looked up statically (no property or lazy import runs);
        (False, None) otherwise or when a step is missing."""
        chain = alias_terms.func_chain(func)
        root = alias_terms.chain_root(func)
        if not isinstance(root, ast.Name) or root.id in self.local:
            return False, None
        missing = object()
        value = self.globals.get(root.id, getattr(builtins, root.id, missing))
        for attr in chain:
            if value is missing:
                break
            value = inspect.getattr_static(value, attr, missing)
        return (value is not missing), (None if value is missing else value)

    def call_keeps_state(self, call: ast.Call) -> bool:
        """Does evaluating the call itself (not its arguments, which are read separately)
        provably keep global state? A pure builtin, a torch operator (`op_keeps_state`), a
        tensor method on a computed value, a `self.<child or method>` proven so, or a
        module-level function whose source is proven so; nothing else."""
        func = call.func
        attr = _self_attr(func)
        if attr is not None and self.owner is not None:
            return self_call_keeps_state(self.owner, attr, self.depth + 1)
        if isinstance(func, ast.Name):
            found, target = self.resolve(func)
            if not found:
                return False
            if func.id in alias_terms.PURE_BUILTINS and target is getattr(builtins, func.id, None):
                return not any(keyword.arg == "key" for keyword in call.keywords)
            return callable_keeps_state(target, self.depth + 1)
        if not isinstance(func, ast.Attribute):
            return False
        root = alias_terms.chain_root(func)
        if (
            isinstance(root, ast.Name)
            and root.id in self.instances
            and len(alias_terms.func_chain(func)) == 1
        ):
            # `normal.icdf(p)` on a `torch.distributions` object the function made.
            method = inspect.getattr_static(self.instances[root.id], func.attr, None)
            return _stateless_class_code(method) and not STATE_VERB.search(func.attr)
        if isinstance(root, ast.Name) and root.id == "self" and self.owner is not None:
            # `self.weight.float()`: a method of what the module holds, a tensor's only.
            return isinstance(self.held(func.value), torch.Tensor) and _tensor_method(func.attr)
        if isinstance(root, ast.Name) and (root.id not in self.local or root.id in self.aliases):
            if root.id in self.aliases:
                return False  # a method of a global object held in a local
            found, target = self.resolve(func)
            found_root, namespace = self.resolve(root)
            return found and found_root and _is_torch_or_math(namespace) and op_keeps_state(target)
        # A method of a value the function computed: a tensor's, unless it runs Python.
        return _tensor_method(func.attr)

    def held(self, expr: ast.expr) -> object:
        """The object a `self.a.b` chain reads on the owner, without running a property
        (None when the chain is anything else, or passes one)."""
        root = alias_terms.chain_root(expr)
        if not (isinstance(root, ast.Name) and root.id == "self" and self.owner is not None):
            return None
        value: object = self.owner
        for name in alias_terms.func_chain(expr):
            if _is_descriptor(type(value), name):
                return None
            value = getattr(value, name, None)
        return value

    def manager_is_balanced(self, expr: ast.expr) -> bool:
        """Is `expr` the construction of a `BALANCED_MANAGERS` context manager, resolved
        through this function's globals?"""
        if not isinstance(expr, ast.Call):
            return False
        found, target = self.resolve(expr.func)
        return found and any(target is manager for manager in BALANCED_MANAGERS)

    def store_keeps_state(self, target: ast.Attribute | ast.Subscript) -> bool:
        """Does storing into (or deleting) `target` leave global state alone? Yes through a
        local that cannot alias a global object, and through `self.<attr>` unless the class
        defines `<attr>` as a property or other data descriptor (a setter is code); no
        through a global, a local alias of one, or anything deeper or computed."""
        value = target.value
        if isinstance(value, ast.Name):
            if value.id == "self" and self.owner is not None:
                if isinstance(target, ast.Subscript):
                    return True  # `self[k] = v` on a module: its own container
                return not _is_descriptor(type(self.owner), target.attr)
            return value.id in self.local and value.id not in self.aliases
        if _self_attr(value) is not None and self.owner is not None:
            held = self.held(value)
            if isinstance(held, (torch.Tensor, dict, list)):
                return True  # an item or attribute of a tensor or container the module holds
            if isinstance(held, nn.Module) and isinstance(target, ast.Attribute):
                return not _is_descriptor(type(held), target.attr)
            return False
        root = _store_root(value)
        return isinstance(root, ast.Name) and root.id in self.local and root.id not in self.aliases

    def load_keeps_state(self, node: ast.Attribute) -> bool:
        """Does reading `self.<attr>` run no code: not a property or data descriptor of the
        class?"""
        attr = _self_attr(node)
        if attr is None or self.owner is None:
            return True
        return not _is_descriptor(type(self.owner), attr)


def stateless_instances(funcdef: ast.FunctionDef, proof: StateProof) -> dict[str, type]:
    """Locals of `funcdef` bound exactly once, by `name = Class(...)`, to a class of
    `STATELESS_CLASS_MODULES` (resolved through `proof`): their methods are that module's
    code (`StateProof.call_keeps_state`)."""
    stores: dict[str, int] = {}
    for node in ast.walk(funcdef):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            stores[node.id] = stores.get(node.id, 0) + 1
        elif isinstance(node, ast.arg):  # a parameter is a binding too
            stores[node.arg] = stores.get(node.arg, 0) + 1
    found: dict[str, type] = {}
    for node in ast.walk(funcdef):
        if not (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and stores.get(node.targets[0].id) == 1
            and isinstance(node.value, ast.Call)
        ):
            continue
        resolved, target = proof.resolve(node.value.func)
        if resolved and isinstance(target, type) and _stateless_class_code(target):
            found[node.targets[0].id] = target
    return found


def global_aliases(funcdef: ast.FunctionDef, proof: StateProof) -> frozenset[str]:
    """Locals of `funcdef` that may be bound to a global object (or part of one) rather than
    a computed value: `m = torch.backends.cuda.matmul`, `for b in GLOBALS:`,
    `c = self.config if f else GLOBAL`. Grown to a fixed point through local-to-local
    bindings. A call result is computed, not a global (calls are checked on their own)."""
    pairs: list[tuple[ast.AST, ast.AST]] = []
    for node in ast.walk(funcdef):
        if isinstance(node, ast.Assign):
            pairs += [(target, node.value) for target in node.targets]
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            pairs.append((node.target, node.value))
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            pairs.append((node.target, node.iter))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            pairs.append((node.optional_vars, node.context_expr))
    found: set[str] = set()
    while True:
        grown = {
            name
            for target, value in pairs
            if _may_hold_global(value, proof.local, found)
            for name in alias_terms.store_names(target)
        }
        if grown <= found:
            return frozenset(found)
        found |= grown


def _may_hold_global(value: ast.AST, local: set[str], aliases: set[str]) -> bool:
    """Can `value` evaluate to a global object: a name (or attribute or item chain, or a
    container or choice of such) rooted at a global or at a local in `aliases`?"""
    if isinstance(value, ast.Name):
        return value.id not in local or value.id in aliases
    if isinstance(value, (ast.Attribute, ast.Subscript, ast.Starred)):
        return _may_hold_global(value.value, local, aliases)
    if isinstance(value, (ast.Tuple, ast.List, ast.Set)):
        return any(_may_hold_global(e, local, aliases) for e in value.elts)
    if isinstance(value, ast.IfExp):
        return any(_may_hold_global(e, local, aliases) for e in (value.body, value.orelse))
    if isinstance(value, ast.BoolOp):
        return any(_may_hold_global(e, local, aliases) for e in value.values)
    if isinstance(value, ast.NamedExpr):
        return _may_hold_global(value.value, local, aliases)
    return False


def op_keeps_state(target: object) -> bool:
    """Is `target` a torch or math operator or query that sets no global state: a builtin of
    `torch._C._VariableFunctions` or `OP_MODULES`, a Python function of `OP_PYTHON_MODULES`,
    a `math` function, a `STATELESS_TYPES` class or a class of `STATELESS_CLASS_MODULES`, or
    an `is_*` or `get_*` query of torch; never a name that reads as a setter
    (`STATE_VERB`)."""
    name = getattr(target, "__name__", "")
    if not isinstance(name, str) or STATE_VERB.search(name):
        return False
    if any(target is kind for kind in STATELESS_TYPES):
        return True
    if isinstance(target, type):
        return _stateless_class_code(target)
    if isinstance(target, types.BuiltinFunctionType):
        owner = getattr(target, "__self__", None)
        if owner is math or any(owner is module for module in OP_MODULES):
            return True
        if getattr(torch._C._VariableFunctions, name, None) is target:
            return True
    module = getattr(target, "__module__", None) or ""
    if inspect.isfunction(target) and module in OP_PYTHON_MODULES:
        return True
    is_torch = module == "torch" or module.startswith("torch.")
    return is_torch and name.startswith(("is_", "get_")) and callable(target)


def callable_keeps_state(target: object, depth: int) -> bool:
    """Does calling `target` (a global or an instance-held callable) provably keep global
    state: a torch operator (`op_keeps_state`), a `functools.partial` of one with plain
    arguments, or a plain Python function whose source is proven so?"""
    if op_keeps_state(target):
        return True
    if isinstance(target, functools.partial):
        plain = (str, int, float, bool, type(None), torch.dtype)
        arguments = [*target.args, *target.keywords.values()]
        return all(isinstance(a, plain) for a in arguments) and op_keeps_state(target.func)
    return inspect.isfunction(target) and function_keeps_state(target, None, depth)


def function_keeps_state(fn: Any, owner: nn.Module | None, depth: int = 0) -> bool:
    """Does running the Python function `fn` (with `self` = `owner`, if given) provably
    leave global state as it found it? It must be no wrapper (`inspect.unwrap`: a wrapper
    runs code its source does not show) and no closure, its source readable, and every node
    of it must pass `_node_hazard` (so every call it makes is proven in turn, to
    `MAX_DEPTH`)."""
    funcdef = None if depth > MAX_DEPTH else source.plain_function_def(fn)
    if funcdef is None:
        return False
    proof = StateProof.of(funcdef, owner, fn.__globals__, depth)
    managers: set[int] = set()
    body = [*funcdef.body, *funcdef.args.defaults, *filter(None, funcdef.args.kw_defaults)]
    return not any(
        _node_hazard(node, (), managers, proof) for root in body for node in ast.walk(root)
    )


def module_keeps_state(child: object, depth: int = 0) -> bool:
    """Does calling `child` (an `nn.Module`) provably keep global state: no hooks, the
    plain `nn.Module` call path, no instance-level forward, and a forward that is torch's
    own (`STATELESS_CHILD_TYPES`) or whose source is proven so on this instance?"""
    if not isinstance(child, nn.Module) or depth > MAX_DEPTH:
        return False
    if has_hooks(child) or own_call_path(child) or "forward" in child.__dict__:
        return False
    if type(child) in STATELESS_CHILD_TYPES:
        return True
    return function_keeps_state(type(child).forward, child, depth)


def self_call_keeps_state(owner: nn.Module, name: str, depth: int = 0) -> bool:
    """Does `owner.<name>(...)` provably keep global state: a child proven so, a method of
    the class (a plain function or staticmethod) proven so on `owner`, an instance-held
    callable proven so (`callable_keeps_state`), or nothing at all (calling a missing or
    None attribute raises before anything runs)?

    `self.<name>` is resolved as Python looks it up (`name_resolution.resolve`: a method of
    the class wins over a child registered under the same name); a name that resolves to
    code (a property, a `__getattr__` of the class's own) or is ambiguous proves nothing."""
    resolved = resolve(owner, name)
    if resolved.raises_when_called:
        return True
    value = resolved.value
    if resolved.kind is Kind.CHILD:
        return module_keeps_state(value, depth)
    if resolved.kind is Kind.INSTANCE:
        return callable_keeps_state(value, depth)
    if resolved.kind is Kind.STATIC:
        return inspect.isfunction(value) and function_keeps_state(value, None, depth)
    if resolved.kind is Kind.METHOD:
        return inspect.isfunction(value) and function_keeps_state(value, owner, depth)
    if resolved.kind is Kind.CLASS_VALUE and isinstance(value, nn.Module):
        return module_keeps_state(value, depth)
    return False


def _is_descriptor(cls: type, attr: str) -> bool:
    """Does `cls` define `attr` as something whose access runs code: a property or other
    data descriptor (functions, static and class methods are plain method lookups)?"""
    value = inspect.getattr_static(cls, attr, None)
    if value is None or isinstance(value, (types.FunctionType, staticmethod, classmethod)):
        return False
    return hasattr(type(value), "__set__") or isinstance(
        value, (property, functools.cached_property)
    )


def _stateless_class_code(target: object) -> bool:
    """Is `target` a class or plain function defined in `STATELESS_CLASS_MODULES`?"""
    if not isinstance(target, (type, types.FunctionType)):
        return False
    module = getattr(target, "__module__", None) or ""
    return any(module == m or module.startswith(m + ".") for m in STATELESS_CLASS_MODULES)


def _tensor_method(name: str) -> bool:
    """Is `name` a tensor method that runs no Python of anyone else's (a tensor method
    changes no global state)?"""
    return hasattr(torch.Tensor, name) and name not in TENSOR_EFFECT_METHODS


def _store_root(expr: ast.expr) -> ast.expr:
    """What an attribute/item chain being stored into starts from (`a` in `a.b[0].c`)."""
    while isinstance(expr, (ast.Attribute, ast.Subscript)):
        expr = expr.value
    return expr


def _is_torch_or_math(namespace: object) -> bool:
    """Is `namespace` the `math` module or a torch module (`torch`, `torch.nn.functional`)?"""
    if not isinstance(namespace, types.ModuleType):
        return False
    name = namespace.__name__
    return name in ("math", "torch") or name.startswith("torch.")


def _self_attr(func: ast.AST) -> str | None:
    """`name` when `func` is `self.<name>`, else None."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return func.attr if func.value.id == "self" else None
    return None


def _is_one_of(node: ast.AST, calls: Iterable[ast.AST]) -> bool:
    return any(node is call for call in calls)


def _start(node: ast.AST) -> tuple[int, int]:
    return getattr(node, "lineno", 0), getattr(node, "col_offset", 0)


def _end(node: ast.AST) -> tuple[int, int]:
    return getattr(node, "end_lineno", 0) or 0, getattr(node, "end_col_offset", 0) or 0


def _effect(node: ast.AST) -> tuple[int, int, int]:
    """Where `node` takes effect, for ordering barriers: where it ends (after its
    arguments), a `with` where its items end (it enters there, and outranks the manager
    call it would otherwise tie with)."""
    if isinstance(node, (ast.With, ast.AsyncWith)):
        return (*_end(node.items[-1].context_expr), 0)
    return (*_end(node), 1)


def _name(call: ast.Call) -> str:
    """`<name>` for a `self.<name>(...)` call, else the callee's source."""
    return _self_attr(call.func) or ast.unparse(call.func)


def _header(stmt: ast.With | ast.AsyncWith) -> str:
    items = ", ".join(ast.unparse(item) for item in stmt.items)
    return f"{'async with' if isinstance(stmt, ast.AsyncWith) else 'with'} {items}"


def _snippet(node: ast.AST, limit: int = 80) -> str:
    """`node`'s source on one line, shortened to `limit` characters (a `with` to its header)."""
    text = _header(node) if isinstance(node, (ast.With, ast.AsyncWith)) else ast.unparse(node)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
