"""Where a forward adds a residual and then normalises the sum: the sites the fuser rewrites.

A site is three parts of one statement list, read from the forward's AST:

1. `H = L + R`: one plain name bound to a sum (any operand expressions);
2. zero or more plain copies `X = H` (Transformers' `residual = hidden_states`);
3. the next statement, whose first evaluated call is `self.<norm>(H)` with `H` its only
   argument, where `<norm>` is a child the caller calls a norm.

Only such a site moves the norm's evaluation up to the add without changing anything the
forward observes: between the add and the norm nothing runs but name copies, which write
no tensor and cannot reach `self`. Any other add whose sum reaches a norm call in the same
block before `H` is rebound is returned as `Refused` with the reason, so a refusal says
which statement stood in the way.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from fusion.analysis import source


@dataclass(frozen=True)
class Site:
    """One fusable add + norm: the add statement, the norm call, and the names involved."""

    add: ast.Assign
    norm_call: ast.Call
    norm: str
    total: str
    gap: tuple[ast.stmt, ...]


@dataclass(frozen=True)
class Refused:
    """An add whose sum reaches a norm call that cannot be fused, and why."""

    norm: str
    reason: str


def _blocks(funcdef: ast.FunctionDef) -> Iterator[list[ast.stmt]]:
    """Every statement list in `funcdef` (its body and each nested body), nested functions
    and classes excluded (their code runs at another time)."""
    stack: list[ast.AST] = [funcdef]
    while stack:
        node = stack.pop()
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block
                stack.extend(stmt for stmt in block if not _is_definition(stmt))
        for handler in getattr(node, "handlers", []):
            yield handler.body
            stack.extend(handler.body)
        for case in getattr(node, "cases", []):
            yield case.body
            stack.extend(case.body)


def _is_definition(stmt: ast.stmt) -> bool:
    return isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))


def _sum_target(stmt: ast.stmt) -> str | None:
    """`H` when `stmt` is `H = L + R` (one plain name target), else None."""
    if (
        isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and isinstance(stmt.targets[0], ast.Name)
        and isinstance(stmt.value, ast.BinOp)
        and isinstance(stmt.value.op, ast.Add)
    ):
        return stmt.targets[0].id
    return None


def _self_calls_on(stmt: ast.stmt, self_name: str, total: str) -> Iterator[tuple[str, ast.Call]]:
    """(child name, call) for every `self.<child>(..., H, ...)` call in `stmt` reading `H`
    as its first argument."""
    for node in ast.walk(stmt):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == self_name
            and node.args
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id == total
        ):
            yield node.func.attr, node


def _rebinds(stmt: ast.stmt, name: str) -> bool:
    return any(
        isinstance(node, ast.Name)
        and node.id == name
        and isinstance(node.ctx, (ast.Store, ast.Del))
        for node in ast.walk(stmt)
    )


def _is_copy(stmt: ast.stmt, total: str, self_name: str) -> bool:
    """Is `stmt` a plain copy `X = H` (X another plain name, not `self`)?"""
    return (
        isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and isinstance(stmt.targets[0], ast.Name)
        and stmt.targets[0].id not in (total, self_name)
        and isinstance(stmt.value, ast.Name)
        and stmt.value.id == total
    )


def _statement_value(stmt: ast.stmt) -> ast.expr | None:
    """The expression a simple statement evaluates first (an assignment's value, a return's
    or an expression statement's), or None for any other statement."""
    if isinstance(stmt, (ast.Assign, ast.Return, ast.Expr)):
        return stmt.value
    if isinstance(stmt, ast.AnnAssign):
        return stmt.value
    return None


def evaluated_first(
    expr: ast.expr, call: ast.Call, self_name: str, is_child: Callable[[str], bool]
) -> bool:
    """Is `call` the first thing `expr` evaluates that can have an effect?

    Python evaluates a call's callee (a method's receiver first), then its arguments left to
    right. So `call` is first when it is `expr`, the receiver of a method chain on it
    (`self.norm(h).to(dtype)`), or the first argument of a call whose callee is a plain
    child lookup `self.<child>` (`self.mlp(self.norm(h))`), or the right operand of a binary
    operator whose left one is a plain name or literal (`h + self.mlp(self.norm(h))`),
    recursively: a child lookup reads module dictionaries, a name load reads a binding, and
    neither runs anything else (the operator itself runs after both operands)."""
    node: ast.AST = expr
    while node is not call:
        if isinstance(node, ast.Call):
            if source.contains(node.func, call):
                node = node.func
            elif (
                node.args
                and source.contains(node.args[0], call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == self_name
                and is_child(node.func.attr)
            ):
                node = node.args[0]
            else:
                return False
        elif isinstance(node, ast.Attribute):
            node = node.value
        elif isinstance(node, ast.BinOp) and source.contains(node.left, call):
            node = node.left
        elif isinstance(node, ast.BinOp) and isinstance(node.left, (ast.Name, ast.Constant)):
            node = node.right  # `h + self.mlp(self.norm(h))`: a name or literal reads nothing
        else:
            return False
    return True


def _judge(
    block: list[ast.stmt],
    index: int,
    end: int,
    call: ast.Call,
    norm: str,
    self_name: str,
    is_child: Callable[[str], bool],
) -> Site | Refused:
    """The site (add at `block[index]`, norm call in `block[end]`), or why it is refused."""
    add = block[index]
    assert isinstance(add, ast.Assign)
    total = _sum_target(add) or ""
    gap = tuple(block[index + 1 : end])
    for stmt in gap:
        if not _is_copy(stmt, total, self_name):
            return Refused(
                norm,
                "a statement between the residual add and the norm is not a plain copy "
                f"of the sum: {ast.unparse(stmt)[:80]}",
            )
    if len(call.args) != 1 or call.keywords:
        return Refused(norm, f"the norm is not called as self.{norm}({total})")
    value = _statement_value(block[end])
    if value is None or not source.contains(value, call):
        kind = type(block[end]).__name__.lower()
        return Refused(norm, f"the norm call is inside a compound statement ({kind})")
    if not evaluated_first(value, call, self_name, is_child):
        return Refused(norm, "the norm call is not the first thing its statement evaluates")
    return Site(add, call, norm, total, gap)


def find_sites(
    funcdef: ast.FunctionDef, is_norm: Callable[[str], bool], is_child: Callable[[str], bool]
) -> list[Site | Refused]:
    """Every add of `funcdef` whose sum reaches a norm call, as a `Site` or `Refused`.

    `is_norm(name)` says whether `self.<name>` is a norm child (an RMSNorm or not: the
    caller refuses the non-RMS ones with the RMSNorm fuser's reason); `is_child(name)`
    whether it is any child module. From each `H = L + R` the block is scanned forward to
    the first statement calling a norm on `H`, stopping where `H` is rebound (the norm
    then reads another value: not a site).
    """
    args = funcdef.args.posonlyargs + funcdef.args.args
    if not args:
        return []
    self_name = args[0].arg
    found: list[Site | Refused] = []
    for block in _blocks(funcdef):
        for index, stmt in enumerate(block):
            total = _sum_target(stmt)
            if total is None or total == self_name:
                continue
            for end in range(index + 1, len(block)):
                calls = [(n, c) for n, c in _self_calls_on(block[end], self_name, total)]
                norms = [(n, c) for n, c in calls if is_norm(n)]
                if norms:
                    norm, call = norms[0]
                    found.append(_judge(block, index, end, call, norm, self_name, is_child))
                    break
                if _rebinds(block[end], total):
                    break
    return found
