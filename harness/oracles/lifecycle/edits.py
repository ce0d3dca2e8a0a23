"""Lifecycle operations that edit the model after a forward: weights in place (every
spelling), and every plain attribute a forward reads (found from the forwards' source).
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fusion import inspection
from fusion.errors import RewriteRefused
from harness.oracles import localise
from harness.oracles.lifecycle.core import (
    Context,
    _compare,
    _Failed,
    _logits,
    _NotApplicable,
    _twins,
    _unfused,
)


def _scale_data(p: torch.Tensor) -> None:
    p.data.mul_(0.75)


def _scale_no_grad(p: torch.Tensor) -> None:
    with torch.no_grad():
        p.mul_(0.75)


def _scale_copy(p: torch.Tensor) -> None:
    with torch.no_grad():
        p.copy_(p * 0.75)


def _scale_set(p: torch.Tensor) -> None:
    with torch.no_grad():
        p.set_((p * 0.75).contiguous())


def scale_data_assign(p: torch.Tensor) -> None:
    """`p.data = p.data * 0.75`: the weight moves to memory of its own (a merged
    projection's view of its stacked weight is broken)."""
    p.data = p.data * 0.75


_SPELLINGS: dict[str, Callable[[torch.Tensor], None]] = {
    "p.data.mul_": _scale_data,
    "no_grad p.mul_": _scale_no_grad,
    "p.copy_": _scale_copy,
    "p.set_": _scale_set,
    "p.data = ...": scale_data_assign,
}


def _optimizer_scale(model: nn.Module) -> None:
    """An SGD step whose gradient is 0.25 p: p <- 0.75 p, as an optimiser writes it."""
    params = [p for p in model.parameters() if p.is_floating_point()]
    for p in params:
        p.grad = 0.25 * p.detach()
    torch.optim.SGD(params, lr=1.0).step()
    for p in params:
        p.grad = None


def _edit_weights(ctx: Context) -> str:
    unfused, fused = _twins(ctx)
    _logits(fused, ctx)
    _logits(unfused, ctx)
    edits: list[tuple[str, Callable[[nn.Module], None]]] = [
        (name, _each_parameter(spelling)) for name, spelling in _SPELLINGS.items()
    ]
    edits.append(("optimizer step", _optimizer_scale))
    for name, edit in edits:
        _unfused(f"editing weights by {name}", lambda edit=edit: edit(unfused))
        edit(fused)
        _compare(f"logits after {name}", _logits(fused, ctx), _logits(unfused, ctx), ctx.allowance)
    return f"{len(edits)} spellings of an in-place weight edit seen"


def _each_parameter(spelling: Callable[[torch.Tensor], None]) -> Callable[[nn.Module], None]:
    def edit(model: nn.Module) -> None:
        for param in model.parameters():
            if param.is_floating_point():
                spelling(param)

    return edit


PLAIN_TYPES = (bool, int, float, str)
"""The attribute values `edit-attributes` changes: what a config puts on a module."""

EDIT_LIMIT = 40
"""At most this many attribute edits per model (after one per role: `attribute_edits`)."""

_STRING_EDITS = {"none": "tanh", "tanh": "none", "softmax": "sigmoid", "sigmoid": "softmax"}
"""The strings `edit-attributes` knows another valid value of (GELU's `approximate`, a
router's scoring function); any other string is left alone."""

_NOT_CONFIG = frozenset({"training"})
"""Plain attributes that are modes, not configuration (`train()`/`eval()` set them)."""


@dataclass(frozen=True)
class AttributeEdit:
    """`<owner>.<name>`: `old` -> `new`, read by the original forward of `reader` (a module
    fusion changed: `owner` itself or its parent)."""

    owner: str
    name: str
    old: Any
    new: Any
    reader: str

    def describe(self) -> str:
        where = f"{self.owner}.{self.name}" if self.owner else self.name
        return f"{where} {self.old!r} -> {self.new!r}"


def edited_value(value: Any) -> Any:
    """Another valid value of a plain attribute, or None (no known alternative): a bool
    flipped; an int moved by one, staying at least 1 (`top_k` 2 -> 1, `layer_idx` 0 -> 1);
    a float x1.5, or +0.1 when small (an `eps` of 1e-6 moved by half of itself moves no
    logit past rounding); a known string to its alternative (`_STRING_EDITS`)."""
    kind = type(value)
    if kind is bool:
        return not value
    if kind is int:
        return value - 1 if value > 1 else value + 1
    if kind is float:
        return value * 1.5 if abs(value) >= 0.1 else value + 0.1
    if kind is str:
        return _STRING_EDITS.get(value)
    return None


def changed_modules(unfused: nn.Module, fused: nn.Module) -> list[str]:
    """Qualified names (the unfused model's order) of the modules fusion changed: another
    class at that name in the fused model (a replaced module: a fused norm, a fused MoE
    block) or an instance-level `forward` the unfused module does not have (a rewritten
    forward, a fused forward installed on a kept module)."""
    fused_modules = dict(fused.named_modules())
    changed = []
    for qualname, module in unfused.named_modules():
        other = fused_modules.get(qualname)
        if other is None:
            continue
        if type(other) is not type(module) or (
            "forward" in other.__dict__ and "forward" not in module.__dict__
        ):
            changed.append(qualname)
    return changed


@dataclass(frozen=True)
class SelfReads:
    """What a forward (and the methods of its own class it calls) reads of `self`:
    `paths` are `(name,)` for `self.<name>` and `(child, name)` for `self.<child>.<name>`;
    `called` the names called as `self.<name>(...)`."""

    paths: frozenset[tuple[str, ...]]
    called: frozenset[str]


def self_reads(cls: type, method: str = "forward", limit: int = 16) -> SelfReads:
    """The `SelfReads` of `cls.<method>`, following `self.<m>(...)` calls to functions of
    `cls` (up to `limit` methods). A method whose source is unavailable reads nothing here:
    this is what the check edits, so an unreadable forward gets fewer edits, never a wrong
    verdict."""
    paths: set[tuple[str, ...]] = set()
    called: set[str] = set()
    todo, seen = [method], set()
    while todo and len(seen) < limit:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            funcdef = inspection.method_source(cls, name)
        except RewriteRefused:
            continue
        found = _function_reads(funcdef)
        paths |= found.paths
        called |= found.called
        todo += [
            n for n in found.called if n not in seen and inspect.isfunction(getattr(cls, n, None))
        ]
    return SelfReads(frozenset(paths), frozenset(called))


def _function_reads(funcdef: ast.FunctionDef) -> SelfReads:
    positional = funcdef.args.posonlyargs + funcdef.args.args
    if not positional:
        return SelfReads(frozenset(), frozenset())
    me = positional[0].arg
    paths: set[tuple[str, ...]] = set()
    called: set[str] = set()
    for node in ast.walk(funcdef):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            path = _self_path(node, me)
            if path is not None and len(path) <= 2:
                paths.add(path)
        if isinstance(node, ast.Call):
            path = _self_path(node.func, me) if isinstance(node.func, ast.Attribute) else None
            if path is not None and len(path) == 1:
                called.add(path[0])
            if _is_getattr_of(node, me):  # getattr(self, "name", default)
                paths.add((node.args[1].value,))
    return SelfReads(frozenset(paths), frozenset(called))


def _self_path(node: ast.Attribute, me: str) -> tuple[str, ...] | None:
    """`self.a.b` -> ("a", "b"); None when the chain does not start at `me`."""
    names: list[str] = []
    current: ast.AST = node
    while isinstance(current, ast.Attribute):
        names.append(current.attr)
        current = current.value
    if not (isinstance(current, ast.Name) and current.id == me):
        return None
    return tuple(reversed(names))


def _is_getattr_of(node: ast.Call, me: str) -> bool:
    return (
        isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) >= 2
        and isinstance(node.args[0], ast.Name)
        and node.args[0].id == me
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    )


def attribute_edits(unfused: nn.Module, fused: nn.Module) -> list[AttributeEdit]:
    """The edits `edit-attributes` makes: for each module fusion changed
    (`changed_modules`), each plain attribute (`PLAIN_TYPES`, public, not a mode) its
    original class forward reads, then each one read by the forwards of the children it
    calls (and of theirs: `CHILD_DEPTH`) or read of a child directly, each with another
    valid value (`edited_value`). One per role: layers differ only by their index, so
    `model.layers.*.input_layernorm.eps` of one value is edited once (the first layer's),
    attributed to the module itself where fusion changed it; at most `EDIT_LIMIT`. Values
    are read from the unfused model (what the original forward sees)."""
    modules = dict(unfused.named_modules())
    memo: dict[type, SelfReads] = {}
    edits: list[AttributeEdit] = []
    roles: set[tuple[str, str, str]] = set()

    def add(owner: str, name: str, reader: str) -> None:
        module = modules[owner]
        if name.startswith("_") or name in _NOT_CONFIG or name in module._modules:
            return
        value = getattr(module, name, None)
        if type(value) not in PLAIN_TYPES:
            return
        new = edited_value(value)
        role = (_ROLE.sub("*", owner), name, repr(value))
        if new is None or role in roles:
            return
        roles.add(role)
        edits.append(AttributeEdit(owner, name, value, new, reader))

    changed = changed_modules(unfused, fused)
    for reader in changed:
        for path in _own_reads(type(modules[reader]), memo):
            add(reader, path, reader)
    # deepest first: what a changed child (a MoE block under a rewritten layer) reads of
    # its own children is attributed to it, not to the layer
    for reader in sorted(changed, key=lambda q: -q.count(".")):
        for owner, name in _child_reads(reader, modules[reader], CHILD_DEPTH, memo):
            add(owner, name, reader)
    return edits[:EDIT_LIMIT]


CHILD_DEPTH = 3
"""How far below a changed module `attribute_edits` follows called children: a rewritten
decoder layer calls its MoE block, which calls its experts, which call their activation."""


def _own_reads(cls: type, memo: dict[type, SelfReads]) -> list[str]:
    """The names `cls.forward` reads as `self.<name>`, sorted."""
    if cls not in memo:
        memo[cls] = self_reads(cls)
    return sorted(path[0] for path in memo[cls].paths if len(path) == 1)


def _child_reads(
    qualname: str, module: nn.Module, depth: int, memo: dict[type, SelfReads]
) -> list[tuple[str, str]]:
    """(owner, name) of what `module`'s forward reads of its children: `self.<child>.<name>`
    directly, and what the forwards of the children it calls read of themselves (and,
    `depth` levels down, of theirs)."""
    if type(module) not in memo:
        memo[type(module)] = self_reads(type(module))
    reads = memo[type(module)]
    found: list[tuple[str, str]] = []
    for path in sorted(reads.paths):
        if len(path) == 2 and module._modules.get(path[0]) is not None:
            found.append((_child(qualname, path[0]), path[1]))
    for name in sorted(reads.called):
        child = module._modules.get(name)
        if child is None:
            continue
        where = _child(qualname, name)
        found += [(where, attr) for attr in _own_reads(type(child), memo)]
        if depth > 1:
            found += _child_reads(where, child, depth - 1, memo)
    return found


_ROLE = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")
"""A layer index in a qualified name (`layers.0.mlp` -> `layers.*.mlp`)."""


def _child(qualname: str, name: str) -> str:
    return f"{qualname}.{name}" if qualname else name


_ABSENT = object()


def _assign(module: nn.Module, name: str, value: Any) -> Callable[[], None]:
    """Set `module.<name> = value` as a user would; returns what puts it back (the old
    value, or no instance entry where there was none)."""
    before = getattr(module, name, _ABSENT)
    had = name in module.__dict__
    setattr(module, name, value)

    def restore() -> None:
        if before is not _ABSENT:
            setattr(module, name, before)
        if not had:
            module.__dict__.pop(name, None)

    return restore


@dataclass(frozen=True)
class EditOutcome:
    """One edit judged: `verdict` is `agree`, `rejected` (the unfused model raised: not
    judged) or `differs`; `detail` says how; `moved` whether the edit moved the unfused
    logits (an edit that moves nothing, a dropout rate in eval mode, shows nothing)."""

    edit: AttributeEdit
    verdict: str
    detail: str = ""
    moved: bool = False


def judge_edit(
    edit: AttributeEdit,
    unfused: nn.Module,
    fused: nn.Module,
    ctx: Context,
    base: tuple[torch.Tensor, torch.Tensor],
) -> EditOutcome:
    """`edit` made on both models (already run once; `base`: their logits before it), the
    logits compared, then put back in both. Raises _Failed where putting it back does not
    give the fused model's logits again (its later edits would be judged on a stale state)
    or the fused model cannot take the edit."""
    what = edit.describe()
    try:
        fused_owner = fused.get_submodule(edit.owner)
    except AttributeError as exc:
        raise _Failed(f"{what}: the fused model has no module {edit.owner}") from exc
    restore = None
    try:
        restore = _assign(unfused.get_submodule(edit.owner), edit.name, edit.new)
        want = _logits(unfused, ctx)
    except Exception as exc:
        return EditOutcome(edit, "rejected", f"{what}: {localise.one_line(exc)}")
    finally:
        if restore is not None:
            restore()
    if not bool(torch.isfinite(want).all()):  # nothing to compare: NaN never agrees
        return EditOutcome(edit, "rejected", f"{what}: the unfused logits are not finite")
    try:
        restore = _assign(fused_owner, edit.name, edit.new)
        try:
            got = _logits(fused, ctx)
        finally:
            restore()
    except Exception as exc:
        raise _Failed(f"{what}: the fused model raises: {localise.one_line(exc)}") from exc
    moved = not torch.equal(want, base[0])
    if moved:  # an edit that moved nothing cannot have left a moved state behind
        _compare(f"logits with {what} put back", _logits(fused, ctx), base[1], ctx.allowance)
    try:
        _compare(f"logits after {what}", got, want, ctx.allowance)
    except _Failed as exc:
        return EditOutcome(edit, "differs", str(exc), moved)
    return EditOutcome(edit, "agree", "", moved)


def _edit_attributes(ctx: Context) -> str:
    unfused, fused = _twins(ctx)
    edits = attribute_edits(unfused, fused)
    if not edits:
        raise _NotApplicable(
            "no module fusion changed reads a plain attribute (bool/int/float/str)"
        )
    base = (_logits(unfused, ctx), _logits(fused, ctx))  # the first forward
    outcomes = [judge_edit(edit, unfused, fused, ctx, base) for edit in edits]
    differs = [o for o in outcomes if o.verdict == "differs"]
    rejected = [o for o in outcomes if o.verdict == "rejected"]
    if differs:
        others = ", ".join(f"{o.edit.owner}.{o.edit.name}" for o in differs[1:4])
        more = f"; also {others}" + (" ..." if len(differs) > 4 else "") if others else ""
        raise _Failed(
            f"{differs[0].detail} (read by {differs[0].edit.reader}); "
            f"{len(differs)} of {len(edits)} edits disagree{more}"
        )
    agreed = len(outcomes) - len(rejected)
    if not agreed:
        raise _NotApplicable(
            f"unfused model: every attribute edit raises ({len(rejected)}; first "
            f"{rejected[0].detail})"
        )
    moved = sum(o.moved for o in outcomes)
    detail = f"{agreed} attribute edits agree ({moved} moved the logits)"
    return detail + (f"; {len(rejected)} rejected by the unfused model" if rejected else "")
