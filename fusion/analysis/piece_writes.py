"""May a split piece of a merged GEMM be written in place, asked its layout, or returned,
anywhere in the rewritten forward's source?

The second half of the source write analysis (`fusion.analysis.value_roots` says which names may
hold a piece). It answers for the writes fx cannot record (`q *= s` is traced as
`q = q * s`) or that sit on paths the trace did not take (a branch on a config flag, the
KV-cache branch); `fusion.trace.pieces` replays the traced ones. Flow-insensitive and fail-closed
in both questions: every write spelling counts, and every call not known to leave its
arguments alone counts as writing all of them. Calls of plain Python functions, of
`self`'s methods and of `self`'s children are read (recursively, to MAX_CALL_DEPTH: each
callee's `Summary` of what it writes, returns and joins) instead of presumed to write.
Under `no_grad` a write to a piece changes exactly what a write to the projection's output
would, so a false hit costs one copy; a miss would be a fused forward that autograd rejects
where the original ran.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Sequence
from typing import Any

from torch import nn

from fusion.analysis import alias_terms, call_effects
from fusion.analysis.alias_terms import EVERYTHING
from fusion.analysis.value_roots import (
    CONTAINER_METHODS,
    MAX_CALL_DEPTH,
    NON_WRITING_BUILTINS,
    OPAQUE,
    PURE,
    Scope,
    Summary,
    arguments_foreign,
    bind_arguments,
    bound_only_by_assignment,
    call_arguments,
    is_attention_lookup,
    is_builtin,
    is_cache,
    is_self_call,
    is_tensor_method,
    names_read,
    namespace_of,
    no_writes,
    resolve_callee,
    roots,
    self_attr,
)
from fusion.trace.pieces import LAYOUT_QUESTIONS


def _call_effects(call: ast.Call, scope: Scope) -> tuple[set[str], list[set[str]]]:
    """(names `call` may write through, groups of names it may make hold one another)."""
    key = id(call)
    if key not in scope.effects:
        scope.effects[key] = _compute_call_effects(call, scope)
    return scope.effects[key]


def _compute_call_effects(call: ast.Call, scope: Scope) -> tuple[set[str], list[set[str]]]:
    func = call.func
    every = set().union(*(roots(argument, scope) for argument in call_arguments(call)))
    unknown = every | roots(func, scope)  # receiver included: `obj.method(...)`
    namespace = namespace_of(func, scope)
    # `**options` may carry `out=` or `inplace=True`; a `*args` splat matters only where
    # `inplace` is positional, which `writes_through_args` checks.
    splat = any(keyword.arg is None for keyword in call.keywords)
    outs = [keyword.value for keyword in call.keywords if keyword.arg == "out"]
    spelled = ast.Call(
        func=func,
        args=call.args,
        keywords=[k for k in call.keywords if k.arg not in (None, "out")],
    )
    in_place = call_effects.writes_through_args(spelled)
    if not in_place and not outs and trusted_call(call, scope):
        return set(), []
    if in_place or outs or (splat and resolve_callee(call, scope) is None):
        written = set().union(*(roots(out, scope) for out in outs))
        if in_place:
            if isinstance(func, ast.Attribute) and namespace is None:
                written |= roots(func.value, scope)
                if not is_tensor_method(func, scope):
                    written |= every  # an in-place method of something else: any argument
            else:
                written |= roots(call.args[0], scope) if call.args else every
                if namespace is None:
                    written |= every  # a function of ours spelled in place: any argument
        if splat:
            written |= every  # a splat may carry `out=` or the written operand anywhere
        if namespace is None and not is_tensor_method(func, scope):
            return written | unknown, [unknown]
        return written, []
    if namespace == "operator":
        if getattr(func, "attr", "") in alias_terms.MUTATING_OPERATORS:
            return (roots(call.args[0], scope) if call.args else every), [every]
        return set(), []
    if namespace is not None:
        if call_effects.namespace_call_writes(call):
            # `torch.distributed.all_reduce(q)`, `nn.init.constant(q, v)`,
            # `F.embedding(ids, q, max_norm=m)`: spelled out of place, yet they write.
            return every, [every]
        return set(), []
    if is_tensor_method(func, scope) and func.attr in CONTAINER_METHODS:
        # `s.add(q)` on a set, or `a.add(q)` on a tensor (new storage): the receiver may
        # come to hold the argument; neither writes it.
        return set(), [unknown]
    if is_builtin(call, scope, NON_WRITING_BUILTINS) or is_tensor_method(func, scope):
        return set(), []
    resolution = self_attr(func, scope)
    if resolution is not None and resolution.raises_when_called:
        return set(), []  # calling a missing attribute raises before anything is written
    if (
        isinstance(func, ast.Attribute)
        and func.attr in CONTAINER_METHODS
        and not is_self_call(func)
        and is_box(func.value, scope)
    ):
        return set(), [unknown]  # `kwargs.pop(...)`, `box.append(q)`: holds, never writes
    resolved = resolve_callee(call, scope)
    if resolved is None:
        return unknown, [unknown]
    fn, module, bound = resolved
    summary = summarise(fn, module, scope)
    # A summary read presuming tensors does not hold for a numpy view or a module argument.
    readable = not summary.opaque and not arguments_foreign(call, scope)
    binding = bind_arguments(call, fn, bound, scope) if readable else None
    if binding is None:
        return unknown, [unknown]
    written = set().union(*(binding.get(param, set()) for param in summary.writes))
    groups = [
        set().union(*(binding.get(param, set()) for param in group)) for group in summary.joins
    ]
    return written, [group for group in groups if group]


def trusted_call(call: ast.Call, scope: Scope) -> bool:
    """Is `call` an attention interface looked up at run time, or a KV-cache update?

    Both are trusted, not read, as the rest of fusion already trusts them: the tracer
    records attention interfaces as opaque leaves and the layout replay lets strided
    pieces through them, since every Transformers attention kernel reads q/k/v without
    writing them; a Transformers `Cache.update(key_states, value_states, ...)` (and its
    `update_conv_state`/`update_recurrent_state` kin) copies or concatenates the new
    states into storage of its own. So is an activation looked up in Transformers'
    `ACT2FN` registry (`ACT2FN[name](x)`): its activations are out of place. Module-level functions are read
    instead (`resolve_callee`); trusted is only what cannot be read: `ALL_ATTENTION_FUNCTIONS[...]`
    and `.get_interface(...)` lookups, a local bound to nothing but those and readable
    attention functions that write nothing, and `.update` on the cache argument."""
    func = call.func
    if isinstance(func, ast.Attribute) and (
        func.attr == "update" or func.attr.startswith("update_")
    ):
        return is_cache(func.value, scope, set())
    if (
        isinstance(func, ast.Subscript)
        and isinstance(func.value, ast.Name)
        and func.value.id == "ACT2FN"
        and scope.is_global("ACT2FN")
    ):
        return True  # Transformers' activation registry: functional activations
    # The lookup itself reads a registry; its result is an interface.
    return is_attention_lookup(call, scope, set()) or is_attention_lookup(func, scope, set())


def read_function(fn: Any) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The parsed definition of the Python function `fn`, or None where the source cannot
    be read or may not show what runs: no source, not a plain `def`, no code object, or a
    closure (its free variables are not in the source)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    funcdef = tree.body[0] if tree.body else None
    if (
        not isinstance(funcdef, (ast.FunctionDef, ast.AsyncFunctionDef))
        or getattr(fn, "__code__", None) is None
        or fn.__code__.co_freevars
    ):
        return None
    return funcdef


def summarise(fn: Any, module: nn.Module | None, caller: Scope) -> Summary:
    """What calling the Python function `fn` (with `self` = `module`) may do to its
    parameters, read from its source; `OPAQUE` when the source cannot be read, the function
    is a closure, or the call chain is deeper than MAX_CALL_DEPTH."""
    if fn is no_writes:
        return PURE
    key = (fn, id(module))
    if key in caller.memo:
        return caller.memo[key]
    if caller.depth >= MAX_CALL_DEPTH:
        return OPAQUE
    caller.memo[key] = OPAQUE  # a recursive call is not read twice: unknown until done
    funcdef = read_function(fn)
    if funcdef is None:
        return OPAQUE
    scope = Scope(funcdef, module, fn.__globals__, caller.depth + 1, caller.memo, summarise)
    written = _written(scope)
    arguments = funcdef.args
    params = [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
    params += [a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None]
    held = {param: holders_of(scope, param) for param in params}
    returned: set[str] = set()
    generator = False
    for node in ast.walk(funcdef):
        if isinstance(node, ast.Return):
            returned |= roots(node.value, scope)
        elif isinstance(node, (ast.Yield, ast.YieldFrom, ast.Await)):
            generator = True  # a generator or coroutine holds its whole frame
    if generator or EVERYTHING in written:
        summary = OPAQUE
    else:
        summary = Summary(
            foreign_return=any(
                scope.may_be_foreign(node.value)
                for node in ast.walk(funcdef)
                if isinstance(node, ast.Return) and node.value is not None
            ),
            returns=frozenset(param for param in params if held[param] & returned),
            writes=frozenset(param for param in params if held[param] & written),
            joins=tuple(
                frozenset({param} | (held[param] & set(params)))
                for param in params
                if held[param] & (set(params) - {param})
            ),
        )
    caller.memo[key] = summary
    return summary


def binding_pairs(scope: Scope, root: ast.AST | None = None) -> list[tuple[set[str], set[str]]]:
    """(names that may come to hold the value, roots of the value) for every binding form in
    `root` (the whole function by default), stores into containers and objects included
    (`box[0] = q` makes `box` hold `q`), and for every call that may make its arguments or
    receiver hold one another (`lst.append(q)`): those join both ways."""
    pairs: list[tuple[set[str], set[str]]] = []

    def holders(target: ast.AST) -> set[str]:
        names = alias_terms.store_names(target)
        for node in ast.walk(target):
            if isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(
                node.ctx, (ast.Store, ast.Del)
            ):
                names |= roots(node.value, scope)
        return names

    for node in ast.walk(scope.funcdef if root is None else root):
        if isinstance(node, ast.Assign):
            stores = set().union(*(holders(target) for target in node.targets))
            pairs.append((stores, roots(node.value, scope)))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            # `lst += [q]` extends in place; `t += v` keeps `t`.
            pairs.append((holders(node.target), roots(node.value, scope)))
        elif isinstance(node, ast.NamedExpr):
            pairs.append((alias_terms.store_names(node.target), roots(node.value, scope)))
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            pairs.append((holders(node.target), roots(node.iter, scope)))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            pairs.append((holders(node.optional_vars), roots(node.context_expr, scope)))
        elif isinstance(node, ast.Match):
            for case in node.cases:
                pairs.append((alias_terms.match_captures(case.pattern), roots(node.subject, scope)))
        elif (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and node is not scope.funcdef
        ):
            pairs.append(({node.name}, names_read(node)))  # a closure over what it reads
        elif isinstance(node, ast.Call):
            for group in _call_effects(node, scope)[1]:
                pairs.append((group, group))
    return pairs


def holders_of(scope: Scope, seed: str) -> set[str]:
    """`seed` and every name of the function that may hold (a view of) its value, to a
    fixed point. Flow-insensitive: a name that holds it anywhere holds it everywhere."""
    names = {seed}
    pairs = binding_pairs(scope)
    changed = True
    while changed:
        changed = False
        for stores, reads in pairs:
            if reads & names and not stores <= names:
                names |= stores
                changed = True
    return names


def _reaches_locals(node: ast.AST, scope: Scope) -> bool:
    """Can `node` reach any local by name (`exec`, `locals()`, `setattr`, a frame's
    `f_locals`, `global`)? `torch.stack` is not `inspect.stack`."""
    if isinstance(node, (ast.Global, ast.Nonlocal)):
        return True
    if isinstance(node, ast.Attribute) and namespace_of(node, scope) not in (None, "operator"):
        return False
    return alias_terms.is_opaque(node)


def _written(scope: Scope) -> set[str]:
    """Names the function may write through (not merely rebind): augmented assignment,
    stores and deletes through a subscript or attribute, in-place spellings (`x.op_()`,
    `torch.op_(x)`, `x.__iadd__(v)`, `operator.iadd(x, v)`, `out=x`, `inplace=True` by
    keyword or position, a `**options` splat), and calls that may write their arguments
    (`_call_effects`); nested functions and lambdas included. Contains `EVERYTHING` when
    the function can reach locals by name (`exec`, `locals()`, `setattr`, a frame)."""
    written: set[str] = set()
    for node in ast.walk(scope.funcdef):
        if _reaches_locals(node, scope):
            written.add(EVERYTHING)
        if isinstance(node, ast.AugAssign):
            written |= roots(node.target, scope)
        elif isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(
            node.ctx, (ast.Store, ast.Del)
        ):
            if not is_box(node.value, scope):
                written |= roots(node.value, scope)
        elif isinstance(node, ast.Call):
            written |= _call_effects(node, scope)[0]
    return written


def is_box(node: ast.expr, scope: Scope) -> bool:
    """Can a store into `node` (`node[k] = v`, `node.a = v`) only replace what it holds,
    never write a piece's storage? True for a parameter the forward never rebinds (it is an
    object from before the call, so neither a piece nor a view of one: `self`, a dict of
    shared states; not so for a callee's parameters, which may be pieces) and for a name
    bound only to a new container display (`d = {}`)."""
    if not isinstance(node, ast.Name):
        return False
    arguments = scope.funcdef.args
    params = {
        a.arg
        for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)
        if a is not None
    } | {a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None}
    stores = [
        n
        for n in ast.walk(scope.funcdef)
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)) and n.id == node.id
    ]
    if node.id in params:
        return scope.depth == 0 and not stores
    values = scope.local_values.get(node.id, [])
    displays = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
    return (
        bool(values)
        and bound_only_by_assignment(node.id, scope)
        and all(isinstance(value, displays) for value in values)
    )


def _asked_or_returned(scope: Scope) -> set[str]:
    """Names whose layout the forward asks (`x.stride()`, `x.is_contiguous()`,
    `x.untyped_storage()`, ...: `LAYOUT_QUESTIONS`) or that it returns to its caller (who
    may write them, or ask): a piece reaching either must be a copy of its own."""
    names: set[str] = set()
    for node in ast.walk(scope.funcdef):
        if isinstance(node, ast.Return):
            names |= roots(node.value, scope)
        elif isinstance(node, ast.Attribute) and node.attr in LAYOUT_QUESTIONS:
            if namespace_of(node, scope) is not None:
                names |= _EVERYTHING_READ  # `torch.Tensor.stride(q)`: its argument
            else:
                names |= roots(node.value, scope)
    return names


_EVERYTHING_READ = {EVERYTHING}
"""A layout question spelled through a namespace: fail closed, every piece."""


def written_pieces(
    funcdef: ast.FunctionDef,
    temps: Sequence[str],
    module: nn.Module | None = None,
    namespace: dict[str, Any] | None = None,
) -> tuple[bool, ...]:
    """For each split temporary of a rewritten forward: may its piece, or anything holding
    or viewing it, be written in place anywhere in the source, whether or not the trace
    took that path (or be asked its layout, or be returned: then, too, only a copy of its
    own behaves like the projection's output)?

    True when a name that may hold the piece (`holders_of`: through views, casts, ternaries,
    containers, objects, loop variables, closures, calls) is written through by any spelling
    (`_written`), and for every piece when the forward can reach locals by name (`exec`,
    `locals()`). `module` and `namespace` (the forward's globals) let calls of `self`'s
    children and methods and of module-level functions be read instead of presumed to write
    their arguments. Both halves over-approximate: a false hit costs one copy, a miss would
    be a fused forward that autograd rejects where the original ran.
    """
    try:
        scope = Scope(funcdef, module, namespace or {}, 0, {}, summarise)
        written = _written(scope) | _asked_or_returned(scope)
        if EVERYTHING in written:
            return (True,) * len(temps)
        return tuple(bool(holders_of(scope, temp) & written) for temp in temps)
    except (RecursionError, ValueError, TypeError, AttributeError):
        # Code this analysis cannot take apart (a signature inspect cannot read, an AST too
        # deep): fail closed, every piece its own copy.
        return (True,) * len(temps)
