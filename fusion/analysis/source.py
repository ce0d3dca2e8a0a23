"""Recover a forward's source as an AST, edit it narrowly, and compile it back.

The rewrite changes only the matched calls; every other statement stays the original
Python, compiled with the original file name and line numbers so a traceback from a fused
model points at the Transformers source a reader can open.
"""

from __future__ import annotations

import ast
import copy
import inspect
import textwrap
from collections.abc import Callable, Iterable, Sequence

from fusion.errors import RewriteRefused

Block = list[ast.stmt]


def _future_flags() -> int:
    """Every `from __future__` compiler flag (a code object's `co_flags` carry its own)."""
    import __future__ as future  # the module itself, not a future statement

    flags = 0
    for name in future.all_feature_names:
        flags |= getattr(future, name).compiler_flag
    return flags


_FUTURE_FLAGS = _future_flags()


def recover_forward(cls: type) -> tuple[ast.FunctionDef, Callable]:
    """`cls.forward` parsed as a plain `def`, with the function it was parsed from.

    Decorators are dropped (the function is already unwrapped) and annotations stripped (they
    may not evaluate outside the class body). Refuses closures (their free variables cannot be
    rebound by recompiling), sources that are not a single `def`, and `__private` names
    (name mangling only happens inside a class body, so recompiling would change them).
    """
    fn = inspect.unwrap(cls.forward)
    code = getattr(fn, "__code__", None)
    if code is None:
        raise RewriteRefused(f"{cls.__name__}.forward is not a Python function")
    if code.co_freevars:
        # `super()` makes `__class__` one; a recompiled function could not rebind them.
        raise RewriteRefused(
            f"the forward is a closure (super() or an enclosing scope): "
            f"{cls.__name__}.forward over {code.co_freevars}"
        )
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError) as exc:
        raise RewriteRefused(f"source of {cls.__name__}.forward unavailable: {exc}") from exc
    try:
        body = _parse_indented(source)
    except SyntaxError as exc:
        raise RewriteRefused(f"source of {cls.__name__}.forward does not parse: {exc}") from exc
    if len(body) != 1 or not isinstance(body[0], ast.FunctionDef):
        raise RewriteRefused(f"{cls.__name__}.forward source is not a plain function definition")
    funcdef = body[0]
    funcdef.decorator_list.clear()
    funcdef.returns = None
    arguments = funcdef.args
    for arg in (
        *arguments.posonlyargs,
        *arguments.args,
        *arguments.kwonlyargs,
        *filter(None, (arguments.vararg, arguments.kwarg)),
    ):
        arg.annotation = None
    for node in ast.walk(funcdef):
        if isinstance(node, ast.AnnAssign):
            node.annotation = ast.Constant(None)
        for name in _identifiers(node):
            if name.startswith("__") and not name.endswith("__"):
                raise RewriteRefused(
                    f"{cls.__name__}.forward uses {name}, which would be name-mangled"
                )
    return funcdef, fn


def method_source(cls: type, name: str = "forward") -> ast.FunctionDef:
    """`cls.<name>` parsed as a plain `def` for reading (decorators dropped), not for
    recompiling; refuses when its source is unavailable or not a single `def`."""
    fn = inspect.unwrap(getattr(cls, name))
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError) as exc:
        raise RewriteRefused(f"source of {cls.__name__}.{name} unavailable: {exc}") from exc
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        raise RewriteRefused(f"{cls.__name__}.{name} source is not a plain function definition")
    funcdef = tree.body[0]
    funcdef.decorator_list.clear()
    return funcdef


def _forward_tree(cls: type) -> ast.Module | None:
    """`cls.forward`'s source parsed, or None when it is unavailable."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward))))
    except (OSError, TypeError, SyntaxError):
        return None


def returns_tuple(cls: type) -> bool:
    """Does `cls.forward` return a tuple literal, or a name bound to one, anywhere? (Read from
    the source, for forwards whose trace stops before the return; True when the source is
    unavailable: fail closed.)"""
    tree = _forward_tree(cls)
    if tree is None:
        return True
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


def reads_training(cls: type) -> bool:
    """Does `cls.forward` read `self.training` (behave differently when training)? True when
    the source is unavailable."""
    tree = _forward_tree(cls)
    if tree is None:
        return True
    return any(
        isinstance(n, ast.Attribute) and n.attr == "training" and isinstance(n.value, ast.Name)
        for n in ast.walk(tree)
    )


def _parse_indented(source: str) -> list[ast.stmt]:
    """Parse a method's source as it sits in its file, indentation and all.

    Wrapping it in an `if` block (rather than dedenting) keeps every column offset true to the
    file, so traceback carets land on the original text, and parses lines that dedenting
    cannot fix (a string literal continued at column zero). Line 1 is the source's first
    line.
    """
    if not source[:1].isspace():
        return ast.parse(source).body
    wrapper = ast.parse("if True:\n" + source)
    ast.increment_lineno(wrapper, -1)
    block = wrapper.body[0]
    assert isinstance(block, ast.If)
    return block.body


def _identifiers(node: ast.AST) -> list[str]:
    """Identifiers `node` spells that Python name-mangles inside a class body: names,
    attributes, parameters, nested definitions, import aliases and global declarations."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.alias):
        return [node.asname or node.name.split(".")[0]]
    if isinstance(node, (ast.Global, ast.Nonlocal)):
        return list(node.names)
    return []


def replace_expr(tree: ast.AST, old: ast.AST, new: ast.AST) -> None:
    """Replace the node `old` (matched by identity, not equality) with `new` inside `tree`."""

    class _Replace(ast.NodeTransformer):
        def visit(self, node: ast.AST) -> ast.AST:
            if node is old:
                return new
            return self.generic_visit(node)

    _Replace().visit(tree)


def contains(tree: ast.AST, node: ast.AST) -> bool:
    """Is `node` (by identity) inside `tree`?"""
    return any(child is node for child in ast.walk(tree))


def _child_blocks(stmt: ast.stmt) -> list[Block]:
    blocks = [getattr(stmt, name, None) for name in ("body", "orelse", "finalbody")]
    blocks += [handler.body for handler in getattr(stmt, "handlers", [])]
    blocks += [case.body for case in getattr(stmt, "cases", [])]
    return [block for block in blocks if isinstance(block, list) and block]


def block_chain(block: Block, node: ast.AST) -> list[tuple[Block, int]]:
    """The (statement list, index) pairs from `block` down to the statement holding `node`.

    The last pair is `node`'s innermost block; empty when `node` is not inside `block`.
    """
    for index, stmt in enumerate(block):
        if not contains(stmt, node):
            continue
        for child in _child_blocks(stmt):
            tail = block_chain(child, node)
            if tail:
                return [(block, index), *tail]
        return [(block, index)]
    return []


def dominating_block(funcdef: ast.FunctionDef, nodes: Iterable[ast.AST]) -> tuple[Block, list[int]]:
    """The innermost block whose statements contain every one of `nodes`, and for each node
    the index of the statement in that block that holds it.

    Code placed before the smallest index runs on every path that reaches any of the nodes,
    which is what makes hoisting a merged call there possible at all.
    """
    chains = [block_chain(funcdef.body, node) for node in nodes]
    if not chains or any(not chain for chain in chains):
        raise RewriteRefused("a matched call is not in the forward's body")
    depth = 0
    while all(len(chain) > depth + 1 for chain in chains) and all(
        chain[depth + 1][0] is chains[0][depth + 1][0] and chain[depth][1] == chains[0][depth][1]
        for chain in chains
    ):
        depth += 1
    block = chains[0][depth][0]
    return block, [chain[depth][1] for chain in chains]


def enclosing_loops(funcdef: ast.FunctionDef, node: ast.AST) -> list[str]:
    """Kinds of the constructs around `node` that can evaluate it more than once or lazily:
    loops, comprehensions, generator expressions, lambdas and nested functions."""
    kinds: list[str] = []
    repeating = (
        ast.For,
        ast.AsyncFor,
        ast.While,
        ast.ListComp,
        ast.SetComp,
        ast.DictComp,
        ast.GeneratorExp,
        ast.Lambda,
        ast.FunctionDef,
        ast.AsyncFunctionDef,
    )
    for candidate in ast.walk(funcdef):
        if candidate is funcdef or not isinstance(candidate, repeating):
            continue
        if contains(candidate, node):
            kinds.append(type(candidate).__name__)
    return kinds


def self_refs(funcdef: ast.FunctionDef, name: str) -> list[ast.Attribute]:
    """Every `self.<name>` expression in `funcdef`."""
    return [
        node
        for node in ast.walk(funcdef)
        if isinstance(node, ast.Attribute)
        and node.attr == name
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    ]


def self_call_and_refs(funcdef: ast.FunctionDef, name: str) -> tuple[ast.Call, list[ast.Attribute]]:
    """The single `self.<name>(arg)` call in `funcdef`, and every other `self.<name>` reference.

    Refuses unless there is exactly one such call with one positional argument and no
    keywords, evaluated at most once (not in a loop, comprehension, generator or lambda), so
    one traced call node maps to exactly one call site. Also refuses when the child is named
    by a string (`hasattr(self, "q_proj")`, `self._modules["q_proj"]`): such a reference
    cannot be folded, and would change meaning once the child is replaced.
    """
    first = funcdef.args.posonlyargs + funcdef.args.args
    if not first or first[0].arg != "self":
        called = repr(first[0].arg) if first else "missing"
        raise RewriteRefused(
            f"the forward's first parameter is {called}, not 'self': the rewrite reads the "
            "module's children as self.<name> only"
        )
    if any(isinstance(n, ast.Constant) and n.value == name for n in ast.walk(funcdef)):
        raise RewriteRefused(f"self.{name} is also referenced by name (a string)")
    refs = self_refs(funcdef, name)
    calls = [
        node
        for node in ast.walk(funcdef)
        if isinstance(node, ast.Call) and any(node.func is ref for ref in refs)
    ]
    if len(calls) != 1:
        raise RewriteRefused(f"self.{name} is called {len(calls)} times in the source")
    call = calls[0]
    if len(call.args) != 1 or isinstance(call.args[0], ast.Starred) or call.keywords:
        raise RewriteRefused(f"self.{name} is not called as self.{name}(input)")
    loops = enclosing_loops(funcdef, call)
    if loops:
        raise RewriteRefused(f"self.{name} is called inside a {loops[0]}")
    return call, [ref for ref in refs if ref is not call.func]


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _parents(tree: ast.AST) -> dict[int, ast.AST]:
    return {
        id(child): parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)
    }


def fold_existence_guard(funcdef: ast.FunctionDef, ref: ast.Attribute, name: str) -> None:
    """Replace a test of `self.<name>`'s existence by its constant value, or refuse.

    After fusion `self.<name>` no longer exists, but the fuser only binds instances on which
    it was a (truthy) module, so `self.<name> is not None` is `True`, `is None` is `False`,
    and a bare truth test (`if self.<name>:`, `not self.<name>`, a ternary's test) is `True`.
    `==`/`!=` are never folded: a module subclass may define equality. Any other reference
    lets the projection escape (a weight read, an argument), so the rewrite is refused.
    """
    parents = _parents(funcdef)
    parent = parents.get(id(ref))
    if (
        isinstance(parent, ast.Compare)
        and len(parent.ops) == 1
        and isinstance(parent.ops[0], (ast.Is, ast.IsNot))
        and (
            (parent.left is ref and _is_none(parent.comparators[0]))
            or (parent.comparators[0] is ref and _is_none(parent.left))
        )
    ):
        value = isinstance(parent.ops[0], ast.IsNot)
        replace_expr(funcdef, parent, ast.copy_location(ast.Constant(value), parent))
        return
    in_test = isinstance(parent, (ast.If, ast.IfExp, ast.While, ast.Assert)) and parent.test is ref
    negated = isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.Not)
    if in_test or negated:
        replace_expr(funcdef, ref, ast.copy_location(ast.Constant(True), ref))
        return
    raise RewriteRefused(f"self.{name} is referenced beyond its call (not an existence guard)")


def bound_names(funcdef: ast.FunctionDef) -> set[str]:
    """Every identifier `funcdef` mentions, so generated temporaries never shadow one."""
    names = {node.id for node in ast.walk(funcdef) if isinstance(node, ast.Name)}
    names |= {arg.arg for arg in ast.walk(funcdef) if isinstance(arg, ast.arg)}
    return names


def splice_merged_call(
    funcdef: ast.FunctionDef,
    calls: list[ast.Call],
    block: Block,
    index: int,
    merged_name: str,
    prefix: str = "_fused",
    contiguous: Sequence[bool] = (),
) -> list[str]:
    """Insert `t0, t1, ... = self.<merged>(arg).split(self.<merged>.output_sizes, -1)` before
    `block[index]` and replace each of `calls` (in order) by its temporary.

    The split sizes are read from the merged module at run time, so instances of one class
    with different widths share one compiled forward. `calls` must share one input
    expression (the caller proves it, and that the input is stable up to the last call).
    Refuses when a temporary would shadow an existing name. Returns the temporaries.

    A split piece is a strided view of the merged output, while the original projection
    returned a contiguous tensor; where `contiguous[i]` is set, call `i` is replaced by
    `temp.contiguous()` so code that needs contiguity (a flattening `.view`) keeps working.
    """
    temps = [f"{prefix}_{merged_name}_{i}" for i in range(len(calls))]
    taken = bound_names(funcdef)
    if taken & set(temps) or merged_name in {
        ref.attr for ref in ast.walk(funcdef) if isinstance(ref, ast.Attribute)
    }:
        raise RewriteRefused(
            f"merged name {merged_name} or its temporaries collide with the source"
        )
    split = ast.parse(
        f"{', '.join(temps)}, = self.{merged_name}(__input__).split("
        f"self.{merged_name}.output_sizes, -1)"
    ).body[0]
    placeholder = next(
        n for n in ast.walk(split) if isinstance(n, ast.Name) and n.id == "__input__"
    )
    replace_expr(split, placeholder, calls[0].args[0])
    ast.copy_location(split, block[index])
    for node in ast.walk(split):
        ast.copy_location(node, block[index])
    block.insert(index, split)
    flags = list(contiguous) + [False] * (len(calls) - len(contiguous))
    for call, temp, flag in zip(calls, temps, flags):
        value: ast.expr = ast.Name(id=temp, ctx=ast.Load())
        if flag:
            value = ast.Call(
                func=ast.Attribute(value=value, attr="contiguous", ctx=ast.Load()),
                args=[],
                keywords=[],
            )
        for node in ast.walk(value):
            ast.copy_location(node, call)
        replace_expr(funcdef, call, value)
    return temps


def compile_forward(funcdef: ast.FunctionDef, fn: Callable) -> Callable:
    """Compile `funcdef` in `fn`'s module globals, under `fn`'s file name and line numbers.

    The result is a plain function; binding it to an instance (`fusion.runtime.bound.bind`) changes
    that instance only. Tracebacks through it point at the original source lines. It is
    compiled under `fn`'s own `__future__` flags (not this module's), and keeps `fn`'s
    default values: they were evaluated in the class body, where names such as class
    attributes resolve that the module's globals lack. `funcdef` itself is not modified; a
    copy of it and `fn` ride on the result as `__fusion_rewrite__`, what `fusion.runtime.bound`
    needs to rebuild the function after pickling.
    """
    rewrite = (copy.deepcopy(funcdef), fn)
    funcdef = copy.deepcopy(funcdef)
    transplant = _stub_defaults(funcdef, fn)
    module = ast.Module(body=[funcdef], type_ignores=[])
    ast.fix_missing_locations(module)
    ast.increment_lineno(module, fn.__code__.co_firstlineno - 1)
    flags = fn.__code__.co_flags & _FUTURE_FLAGS
    code = compile(module, fn.__code__.co_filename, "exec", flags=flags, dont_inherit=True)
    namespace: dict[str, object] = {}
    exec(code, fn.__globals__, namespace)
    compiled = namespace[funcdef.name]
    if transplant:
        compiled.__defaults__ = fn.__defaults__  # type: ignore[attr-defined]
        compiled.__kwdefaults__ = fn.__kwdefaults__  # type: ignore[attr-defined]
    compiled.__qualname__ = getattr(fn, "__qualname__", funcdef.name)  # type: ignore[attr-defined]
    compiled.__fusion_rewrite__ = rewrite  # type: ignore[attr-defined]
    return compiled  # type: ignore[return-value]


def _stub_defaults(funcdef: ast.FunctionDef, fn: Callable) -> bool:
    """Replace `funcdef`'s default expressions by `None` when `fn`'s defaults line up with
    them (same count, same keyword-only names), so compiling never re-evaluates them; True
    when the caller should then copy `fn`'s defaults onto the compiled function."""
    arguments = funcdef.args
    defaults = getattr(fn, "__defaults__", None) or ()
    kwdefaults = getattr(fn, "__kwdefaults__", None) or {}
    kw_names = {
        arg.arg for arg, default in zip(arguments.kwonlyargs, arguments.kw_defaults) if default
    }
    if len(defaults) != len(arguments.defaults) or set(kwdefaults) != kw_names:
        return False
    arguments.defaults = [ast.Constant(None) for _ in arguments.defaults]
    arguments.kw_defaults = [
        None if default is None else ast.Constant(None) for default in arguments.kw_defaults
    ]
    return True


def unparse(funcdef: ast.FunctionDef) -> str:
    """Readable source of `funcdef` (for reports, diffs and repro bundles)."""
    return ast.unparse(funcdef) + "\n"


def plain_function_def(fn: Callable) -> ast.FunctionDef | None:
    """The AST of `fn`'s own source when what runs is exactly that source: no wrapper
    (`inspect.unwrap`: a wrapper runs code of its own), no closure (free variables the
    source does not bind), a readable `def`; else None, and the caller proves nothing."""
    if inspect.unwrap(fn) is not fn:
        return None
    code = getattr(fn, "__code__", None)
    if code is None or code.co_freevars:
        return None
    try:
        funcdef = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    return funcdef if isinstance(funcdef, ast.FunctionDef) else None
