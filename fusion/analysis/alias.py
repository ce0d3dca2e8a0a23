"""May-alias and may-write analysis over a forward's AST.

Merging projections moves every projection's read of its input to the earliest call. That
is only correct when nothing between the earliest and the latest call changes the input's
value: not by rebinding its name, not by writing through it, and not by writing through any
other name that may share its storage (a view, a container holding it, a bound method).

Both halves over-approximate. `aliasing_names` may report names that do not alias, and
`written_names` may report names that are not written; a false hit costs a fusion, a miss
would silently change a model's outputs. Anything the analysis does not understand (an
unknown callee receiving a tracked name, `exec`, a lambda) counts as a write, and so does a
write with no in-place spelling: torch functions that write what they are given
(`call_effects.namespace_call_writes`: `nn.init.constant`, `torch.utils.swap_tensors`,
`F.embedding(max_norm=)`, `F.batch_norm(training=True)`) and methods named like tensor
methods on something that may be no tensor (`call_effects.may_be_foreign`: a numpy view's
`put`, a module's `float`). `self.<name>` is what Python resolves it to (`fusion.analysis.name_resolution`),
and nothing of `self` is known in a forward that rebinds it.

Split by concern: the vocabulary and shared AST helpers (`fusion.analysis.alias_terms`), what
one call may write (`fusion.analysis.call_effects`), and here the analyses of a region or a
forward built on them (`aliasing_names`, `written_names`, `check_input_stable`,
`check_write_free`).
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterable

from torch import nn

from fusion.analysis.alias_terms import (
    EVERYTHING,
    PURE_BUILTINS,
    PURE_NAMESPACES,
    alias_reads,
    call_reads,
    is_inplace_name,
    is_opaque,
    local_names,
    match_captures,
    root_name,
    self_callee,
    shadowed_names,
    store_names,
    target_names,
    written_through,
)
from fusion.analysis.call_effects import (
    CallVerdict,
    known_pure,
    may_be_foreign,
    writes_through_args,
)
from fusion.analysis.name_resolution import (
    Kind,
    resolve,
    self_is_bound_to_owner,
)
from fusion.analysis.source import method_source
from fusion.errors import RewriteRefused


def _bindings(
    tree: ast.AST,
    module: nn.Module | None,
    shadowed: frozenset[str],
    foreign: Collection[str],
    calls: CallVerdict | None = None,
) -> list[tuple[set[str], ast.AST | None, bool]]:
    """Every (names bound, value expression, mutual) triple in `tree`, whatever the binding
    form.

    Besides plain bindings this includes stores into containers and objects (`lst[0] = x`,
    `self.saved = x`), `match` captures, nested functions and classes, and every call not
    known to be pure: such a call may store any of its arguments into its receiver or into
    another argument (`lst.append(x)`, `d.update(k=x)`), so they all may alias each other
    (`mutual`: the names are not bound to the call's value, they may hold one another).
    """
    pairs: list[tuple[set[str], ast.AST | None, bool]] = []

    def add(stores: set[str], value: ast.AST | None) -> None:
        pairs.append((stores, value, False))

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            add(set().union(*(target_names(t, module) for t in node.targets)), node.value)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            value = node.value
            if isinstance(node, ast.AugAssign):
                # `t += v` keeps `t`'s storage for tensors and may merge `v` into it.
                value = ast.Tuple(
                    elts=[ast.Name(id=root_name(node.target) or "", ctx=ast.Load()), node.value],
                    ctx=ast.Load(),
                )
            add(target_names(node.target, module), value)
        elif isinstance(node, ast.NamedExpr):
            add(store_names(node.target), node.value)
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            add(target_names(node.target, module), node.iter)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            add(target_names(node.optional_vars, module), node.context_expr)
        elif isinstance(node, ast.Match):
            for case in node.cases:
                add(match_captures(case.pattern), node.subject)
        elif (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and node is not tree
        ):
            # A nested function closes over (so aliases) whatever its body reads.
            add({node.name}, node)
        elif isinstance(node, ast.Call) and not known_pure(node, module, shadowed, foreign, calls):
            pairs.append((call_reads(node, module) - {EVERYTHING}, node, True))
    return pairs


def foreign_names(
    tree: ast.AST,
    module: nn.Module | None,
    globals_too: bool = True,
    calls: CallVerdict | None = None,
) -> frozenset[str]:
    """Names of `tree` that may hold something no tensor (`may_be_foreign`): with
    `globals_too`, every global it reads other than the pure namespaces and builtins
    (`np`, a helper module); and, to a fixed point, every name a binding form binds to a
    value that may be foreign (`a = x.numpy()`, `for r in arr`, `z = np.asarray(x)`), and
    every name a call not known pure may make hold a foreign one (`box.append(a)`).
    The function's own parameters are presumed tensors or plain values: at entry a forward
    receives activations, and a callee is read only where its arguments are not foreign.
    `calls` answers for the calls the caller reads itself (`CallVerdict`)."""
    shadowed = shadowed_names(tree)
    local = local_names(tree)  # type: ignore[arg-type]
    foreign: set[str] = set()
    if globals_too:
        known = (PURE_NAMESPACES | PURE_BUILTINS) - shadowed
        foreign = {
            node.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Name) and node.id not in local and node.id not in known
        }
    changed = True
    while changed:
        changed = False
        for stores, value, mutual in _bindings(tree, module, shadowed, frozenset(foreign), calls):
            if mutual and isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
                stores = stores - {value.func.id}  # the callee holds none of its arguments
            if stores <= foreign:
                continue
            if mutual:
                hit = bool(stores & foreign)
            else:
                hit = value is not None and may_be_foreign(value, module, foreign, shadowed, calls)
            if hit:
                foreign |= stores
                changed = True
    return frozenset(foreign)


def aliasing_names(
    funcdef: ast.FunctionDef, seed: Iterable[str], module: nn.Module | None = None
) -> set[str]:
    """`seed` plus every name of `funcdef` that may alias one of them, to a fixed point.

    Aliasing is symmetric, so a binding joins the names it binds and the names its value
    may alias (`alias_reads`) whenever either side is tracked: `h = x.view(-1)`,
    `a, b = x.chunk(2)`, `lst = [x]`, `lst.append(x)`, `for t in (x,)`, `f = x.add_`,
    `match x: case h:` track the new name; `x = v` tracks `v` (from there on, writes
    through `v` write the input). A value built from locals reached by name (`d = locals()`)
    taints whatever it binds, and binding a tracked name to one (`x = eval("v")`) adds
    `EVERYTHING`: any name may then hold the input. Flow-insensitive on purpose: a name
    tainted anywhere is tainted everywhere.
    """
    if not self_is_bound_to_owner(funcdef):
        module = None  # `self` may be another object: none of its attributes are known
    foreign = foreign_names(funcdef, module)
    return _aliasing(funcdef, seed, module, shadowed_names(funcdef), foreign)


def _aliasing(
    funcdef: ast.FunctionDef,
    seed: Iterable[str],
    module: nn.Module | None,
    shadowed: frozenset[str],
    foreign: Collection[str],
) -> set[str]:
    names = set(seed)
    bindings = [
        (stores, alias_reads(value, module))
        for stores, value, _ in _bindings(funcdef, module, shadowed, foreign)
        if value is not None
    ]
    changed = True
    while changed:
        changed = False
        for stores, reads in bindings:
            joined = stores | reads
            if joined <= names:
                continue
            if stores & names or reads & names:
                names |= joined
                changed = True
            elif EVERYTHING in reads and not stores <= names:
                # The value may be any local (`d = locals()`): what it binds may hold `x`.
                names |= stores
                changed = True
    return names


def written_names(
    region: Iterable[ast.stmt], module: nn.Module | None = None, shadowed: Iterable[str] = ()
) -> set[str]:
    """Names that executing `region` may rebind, delete, or write through.

    Rebinding in any form (`x = ...`, `del x`, `for x in`, `x += 1`, `with ... as x`,
    `except ... as x`, `import ... as x`, `def x`, `match ... case x`), writes through a name
    or anything it may alias (`x[i] = v`, `x.a = v`, `torch.flatten(x)[0] = v`), in-place
    spellings (`x.op_()`, `torch.op_(x)`, `x.__iadd__(v)`, `operator.iadd(x, v)`, `out=x`,
    `inplace=True` by keyword or position), a statement whose result is discarded (it can
    only be there for a side effect), and every call not known to be pure: those write every
    name their arguments and receiver may alias. `EVERYTHING` is included when the region
    can reach locals by name (`exec`, `locals()`, a frame's `f_locals`, `global`).
    Which names may hold something no tensor is read from `region` alone (`foreign_names`
    without its globals: the region's free names are taken for the forward's locals).
    """
    region = list(region)
    foreign = foreign_names(ast.Module(body=region, type_ignores=[]), module, globals_too=False)
    rebound, through = _effects(region, module, frozenset(shadowed), foreign)
    return rebound | through


def _effects(
    region: Iterable[ast.stmt],
    module: nn.Module | None,
    shadowed: frozenset[str],
    foreign: Collection[str],
) -> tuple[set[str], set[str]]:
    """`written_names` split in two: names the region may rebind or delete (which changes
    nothing another name sees), and names it may write *through* (which changes the value
    of every alias: in-place calls, item/attribute stores, augmented assignment)."""
    rebound: set[str] = set()
    through: set[str] = set()
    for stmt in region:
        for node in ast.walk(stmt):
            if is_opaque(node, shadowed) or isinstance(node, (ast.Global, ast.Nonlocal)):
                through.add(EVERYTHING)
            if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                rebound.add(node.id)
            elif isinstance(node, ast.AugAssign):
                # `t += v` is in place for tensors: a write through `t`, not only a rebinding.
                through |= store_names(node.target)
            elif isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(
                node.ctx, (ast.Store, ast.Del)
            ):
                through |= written_through(node, module)
            elif isinstance(node, ast.ExceptHandler) and node.name:
                rebound.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                rebound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                rebound.add(node.name)
            elif isinstance(node, ast.pattern):
                rebound |= match_captures(node)
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                through |= call_reads(node.value, module)
            elif isinstance(node, ast.Call):
                if isinstance(node.func, ast.Attribute) and is_inplace_name(node.func.attr):
                    root = root_name(node.func.value)
                    if root:
                        through.add(root)
                if not known_pure(node, module, shadowed, foreign):
                    through |= call_reads(node, module)
    return rebound, through


def input_names(expr: ast.expr) -> set[str]:
    """Every name the input expression `expr` reads."""
    return {node.id for node in ast.walk(expr) if isinstance(node, ast.Name)}


def check_input_stable(
    funcdef: ast.FunctionDef,
    module: nn.Module | None,
    input_expr: ast.expr,
    region: list[ast.stmt],
) -> None:
    """Refuse unless `input_expr` has the same value throughout `region`.

    `region` is every statement from the earliest to the latest projection call (inclusive);
    the merged call will read the input once, before the first of them. The input is stable
    when no name it reads can be rebound in the region, and no name that may alias one can be
    written through (rebinding an alias, `h = x.view(-1); h = y`, changes no storage).

    `self.<name>` is read as Python resolves it (`fusion.analysis.name_resolution`); where that
    depends on code (a property) or the name is ambiguous (a method on the class and a child
    of the same name), and it is read in the region or by the input, the proof refuses. Where
    the forward rebinds `self`, nothing of `self` is known (every call on it may write).

    Assumed, not checked: at entry the forward's arguments do not share storage with each
    other or with state reachable from `self` or globals (a serving engine passes fresh
    activations), and are tensors or plain values (no numpy views). Aliasing created inside
    the forward is tracked in full.
    """
    if not self_is_bound_to_owner(funcdef):
        module = None  # `self = self.other`: `self.<name>` may be any object's attribute
    if module is not None:
        unresolved = _unresolved_self_names([input_expr, *region], module)
        if unresolved:
            raise RewriteRefused(unresolved)
    names = input_names(input_expr)
    shadowed = shadowed_names(funcdef)
    foreign = foreign_names(funcdef, module)
    tracked = _aliasing(funcdef, names, module, shadowed, foreign)
    rebound, through = _effects(region, module, shadowed, foreign)
    if EVERYTHING in through:
        raise RewriteRefused("the region between projections can write any local (exec/locals)")
    if EVERYTHING in tracked and through:
        raise RewriteRefused(
            "the projection input may be any local (exec/locals) and the region writes "
            f"through {', '.join(sorted(through))}"
        )
    # Rebinding an alias leaves the input's storage alone; rebinding a name the input
    # expression reads changes the input itself.
    hit = sorted((tracked & through) | (names & rebound))
    if hit:
        raise RewriteRefused(
            f"projection input may change between the projection calls (written: {', '.join(hit)})"
        )


def _unresolved_self_names(nodes: Iterable[ast.AST], module: nn.Module) -> str | None:
    """The reason for the first `self.<name>` read in `nodes` that `fusion.analysis.name_resolution`
    cannot resolve without running code or guessing (a property, an ambiguous name), or
    None when every one resolves."""
    for tree in nodes:
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                resolved = resolve(module, node.attr)
                if resolved.kind is Kind.UNKNOWN:
                    return resolved.reason
    return None


# -- write-free methods ------------------------------------------------------------------


def check_write_free(module: nn.Module, name: str = "forward", depth: int = 0) -> None:
    """Refuse unless `module`'s `name` method (and the helper methods it calls on `self`)
    provably writes no tensor: no augmented assignment, no store through a subscript or
    attribute, and no call that may write its arguments (`fusion.analysis.alias` decides which calls
    are pure; a method of a helper's result is one of a tensor only where the helper is shown
    to return no foreign value, `may_be_foreign`).

    The traced graph cannot show a write: fx records `h *= s` as `h = h * s`, and a
    discarded in-place call (`F.relu(x, inplace=True)`) has no user in the dataflow. Yet with
    a float32 input `x.to(torch.float32)` is `x` itself, so such a write changes the caller's
    tensor (a residual kept before the norm) and every later read of it, while FusedRMSNorm
    is a pure function of its input. No Transformers RMSNorm writes anything.
    """
    _write_free_returns_foreign(module, name, depth, {})


def _write_free_returns_foreign(
    module: nn.Module, name: str, depth: int, memo: dict[str, bool]
) -> bool:
    """`check_write_free`'s proof of `module.<name>`; returns whether what the method returns
    may be foreign (`may_be_foreign`), so a caller knows whether the result's tensor-named
    methods are tensor methods. `memo` holds the helpers already proven (a recursive one
    counts as returning something foreign until its proof is done)."""
    if name in memo:
        return memo[name]
    memo[name] = True
    cls = type(module)
    if depth > 3:
        raise RewriteRefused(f"{cls.__name__}.{name}: helper calls nest too deeply to check")
    funcdef = method_source(cls, name)
    if not self_is_bound_to_owner(funcdef):
        raise RewriteRefused(
            f"{cls.__name__}.{name} rebinds self (or does not take it first): "
            "what its self.<name> calls run is unknown"
        )
    unresolved = _unresolved_self_names([funcdef], module)
    if unresolved:
        raise RewriteRefused(f"{cls.__name__}.{name}: {unresolved}")
    shadowed = shadowed_names(funcdef)

    def helper(call: ast.Call) -> str | None:
        """The name of the `self.<method>` `call` runs, where the proof reads it."""
        resolved = self_callee(call.func, module)
        if resolved is None or resolved.kind is not Kind.METHOD or writes_through_args(call):
            return None
        return call.func.attr  # type: ignore[attr-defined]

    def calls(call: ast.Call, foreign: Collection[str]) -> bool | None:
        method = helper(call)
        if method is None:
            return None
        arguments = [*call.args, *(keyword.value for keyword in call.keywords)]
        return any(
            may_be_foreign(argument, module, foreign, shadowed, calls) for argument in arguments
        ) or _write_free_returns_foreign(module, method, depth + 1, memo)

    foreign = foreign_names(funcdef, module, calls=calls)
    for node in ast.walk(funcdef):
        if isinstance(node, ast.AugAssign):
            raise RewriteRefused(
                f"{cls.__name__}.{name} has an augmented assignment (may write a tensor in place)"
            )
        if isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(
            node.ctx, (ast.Store, ast.Del)
        ):
            raise RewriteRefused(f"{cls.__name__}.{name} stores through a subscript or attribute")
        if not isinstance(node, ast.Call) or known_pure(node, module, shadowed, foreign, calls):
            continue
        method = helper(node)
        if method is not None:
            _write_free_returns_foreign(module, method, depth + 1, memo)  # Gemma's `_norm`
            continue
        raise RewriteRefused(
            f"{cls.__name__}.{name} calls {ast.unparse(node.func)}, which may write its arguments"
        )
    memo[name] = any(
        may_be_foreign(node.value, module, foreign, shadowed, calls)
        for node in ast.walk(funcdef)
        if isinstance(node, ast.Return) and node.value is not None
    )
    return memo[name]
