"""Transformers 4 blocks that return `(output, router_logits)`: the logits returned are the
router linear's output, read from the forward's source (the trace of a Transformers 4 block
stops inside its expert loop, before the return).

Accepted only in one form, so the second element is provably the logits `FusedMoE` also
computes: the forward's one `return` is its last statement and returns a pair
`(expr, name)`; `name` is bound exactly once, at the top level of the forward, to the only
call of the router child, `name = self.<router>(...)`, and is never rebound, deleted,
subscripted or read through an attribute (a method call could write it in place). The
numeric self-check then requires the returned logits bit for bit."""

from __future__ import annotations

import ast

from fusion.errors import RewriteRefused
from fusion.source import method_source, self_refs


def _is_store_of(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name and not isinstance(node.ctx, ast.Load)


def returns_router_logits(cls: type, router_name: str) -> bool:
    """True when `cls.forward` returns `(output, logits)` in the one accepted form; False
    when it returns no tuple at all; RewriteRefused for any other tuple return."""
    funcdef = method_source(cls)
    returns = [n for n in ast.walk(funcdef) if isinstance(n, ast.Return)]
    if not any(isinstance(r.value, ast.Tuple) for r in returns):
        return False
    refuse = RewriteRefused("the block returns a tuple other than (output, router logits)")
    last = funcdef.body[-1]
    value = last.value if isinstance(last, ast.Return) else None
    if len(returns) != 1 or not (isinstance(value, ast.Tuple) and len(value.elts) == 2):
        raise refuse
    first, second = value.elts
    if isinstance(first, (ast.Tuple, ast.Starred)) or not isinstance(second, ast.Name):
        raise refuse
    name = second.id
    binds = [
        stmt
        for stmt in funcdef.body
        if isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and isinstance(stmt.targets[0], ast.Name)
        and stmt.targets[0].id == name
    ]
    stores = [n for n in ast.walk(funcdef) if _is_store_of(n, name)]
    calls = [
        n
        for n in ast.walk(funcdef)
        if isinstance(n, ast.Call) and any(n.func is ref for ref in self_refs(funcdef, router_name))
    ]
    if len(binds) != 1 or len(stores) != 1 or len(calls) != 1 or binds[0].value is not calls[0]:
        raise refuse
    for node in ast.walk(funcdef):
        if isinstance(node, (ast.Attribute, ast.Subscript)) and (
            isinstance(node.value, ast.Name) and node.value.id == name
        ):
            raise RewriteRefused(f"the block uses {name}.{getattr(node, 'attr', '[...]')}")
        if isinstance(node, (ast.Global, ast.Nonlocal)) and name in node.names:
            raise refuse
    return True
