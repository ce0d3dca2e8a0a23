"""What `self.<name>` is when Python evaluates it: the one place the analysis resolves it.

`module.name` runs `object.__getattribute__` (nn.Module overrides neither it nor the
descriptor protocol), which looks in this order:

1. a *data* descriptor found on the type (a `property`, a slot): its `__get__` runs;
2. the instance's `__dict__`;
3. anything else found on the type: a function (bound to `module`), a `staticmethod`, a
   `classmethod`, another non-data descriptor, or a plain class attribute;
4. only when all of that finds nothing, `type(module).__getattr__`: `nn.Module`'s reads
   `_parameters`, then `_buffers`, then `_modules`.

So a method `scale` defined on the class wins over a child registered as `self.scale`
(`nn.Module.__setattr__` files it under `_modules`, where step 4 never looks): reading the
child's forward would prove the wrong code. `resolve` follows exactly this order without
running any code (no descriptor `__get__`, no `__getattr__` of a class's own), and answers
`UNKNOWN`, with a reason, where the answer depends on code it does not run or where the name
lives in more than one of those places (`AMBIGUOUS`): a reader might take either, so the
analysis refuses rather than guess. It is a pure function of the module's state.

`self` means the module only while the method never rebinds it (`self = self.other`):
`self_is_bound_to_owner` says when a method's `self.<name>` may be resolved at all.
"""

from __future__ import annotations

import ast
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

_MODULE_GETATTR = nn.Module.__getattr__
_NN_TABLES = ("_parameters", "_buffers", "_modules")
"""`nn.Module.__getattr__`'s tables, in the order it reads them."""


class Kind(enum.Enum):
    """Where Python finds `self.<name>`."""

    ABSENT = "absent"
    """Nowhere: evaluating it raises AttributeError (calling it writes nothing)."""
    PARAMETER = "parameter"
    BUFFER = "buffer"
    CHILD = "child"
    """In `_modules` (the value may be None: a registered empty slot)."""
    INSTANCE = "instance"
    """In the instance's `__dict__` (an instance-level callable, a config value)."""
    METHOD = "method"
    """A plain function on the class: a bound method (`value` is the function)."""
    STATIC = "static"
    """A `staticmethod` on the class (`value` is the underlying function)."""
    CLASS_VALUE = "class value"
    """A class attribute with no `__get__` (a constant, a class-level module)."""
    UNKNOWN = "unknown"
    """Code decides (a property or other descriptor, a `classmethod`, a `__getattr__` or
    `__getattribute__` of the class's own), or the name is ambiguous: see `reason`."""
    OF_OBJECT = "attribute of an object"
    """A later step of a chain through something that is no module (`self.config.eps`):
    that object's own business, not resolved here (`value` is None)."""


@dataclass(frozen=True)
class Resolution:
    """What `self.<name>` evaluates to: its `kind`, its `value` (None for ABSENT and
    UNKNOWN), and for UNKNOWN the `reason` the analysis gives when it refuses."""

    kind: Kind
    value: Any = None
    reason: str = ""

    @property
    def raises_when_called(self) -> bool:
        """Does calling it raise before any code of its own runs (absent, or None)?"""
        known = self.kind not in (Kind.UNKNOWN, Kind.OF_OBJECT)
        return self.kind is Kind.ABSENT or (known and self.value is None)

    @property
    def child(self) -> nn.Module | None:
        """The module it is, when it is one held as a child, instance or class value."""
        if self.kind in (Kind.CHILD, Kind.INSTANCE, Kind.CLASS_VALUE) and isinstance(
            self.value, nn.Module
        ):
            return self.value
        return None

    @property
    def tensor(self) -> torch.Tensor | None:
        """The tensor it is (a parameter, a buffer, a tensor attribute), or None."""
        return self.value if isinstance(self.value, torch.Tensor) else None


def _on_type(cls: type, name: str) -> tuple[bool, Any]:
    """(found, the raw class attribute) from `cls.__mro__`'s `__dict__`s, as
    `object.__getattribute__` finds it, without running any descriptor."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return True, vars(klass)[name]
    return False, None


def _is_data_descriptor(obj: Any) -> bool:
    kind = type(obj)
    return hasattr(kind, "__set__") or hasattr(kind, "__delete__")


def resolve(module: nn.Module, name: str) -> Resolution:
    """`module.<name>` as Python evaluates it (see the module docstring), without running
    any code. UNKNOWN, with a reason, when code would decide (a descriptor, a `__getattr__`
    or `__getattribute__` of the class's own) or when `name` lives in more than one place
    (say, a method on the class and a child in `_modules`): fail closed, never a guess."""
    cls = type(module)
    if cls.__getattribute__ is not object.__getattribute__:
        return Resolution(Kind.UNKNOWN, reason=f"{cls.__name__} has its own __getattribute__")
    on_type, raw = _on_type(cls, name)
    instance = vars(module)
    places = [table for table in _NN_TABLES if name in instance.get(table, {})]
    if on_type:
        places.insert(0, f"the class ({type(raw).__name__})")
    if name in instance:
        places.append("the instance __dict__")
    if len(places) > 1:
        return Resolution(
            Kind.UNKNOWN,
            reason=f"self.{name} is ambiguous: it is in {' and in '.join(places)}",
        )
    if on_type and _is_data_descriptor(raw):
        return Resolution(
            Kind.UNKNOWN, reason=f"self.{name} is a {type(raw).__name__} (code computes it)"
        )
    if name in instance:
        return Resolution(Kind.INSTANCE, instance[name])
    if on_type:
        if isinstance(raw, staticmethod):
            return Resolution(Kind.STATIC, raw.__func__)
        if type(raw).__name__ == "function":
            return Resolution(Kind.METHOD, raw)
        if hasattr(type(raw), "__get__"):
            return Resolution(
                Kind.UNKNOWN, reason=f"self.{name} is a {type(raw).__name__} (code computes it)"
            )
        return Resolution(Kind.CLASS_VALUE, raw)
    if getattr(cls, "__getattr__", _MODULE_GETATTR) is not _MODULE_GETATTR:
        return Resolution(Kind.UNKNOWN, reason=f"{cls.__name__} has its own __getattr__")
    for table, kind in zip(_NN_TABLES, (Kind.PARAMETER, Kind.BUFFER, Kind.CHILD)):
        entries = instance.get(table, {})
        if name in entries:
            return Resolution(kind, entries[name])
    return Resolution(Kind.ABSENT)


def resolve_chain(module: nn.Module, names: Sequence[str]) -> Resolution:
    """`module.a.b.c` for `names` ("a", "b", "c"): each step from a module resolved by
    `resolve` (the first UNKNOWN step ends it); a step from anything else (a config object,
    a tensor) is OF_OBJECT, since its attributes are not a module's to resolve."""
    resolution = Resolution(Kind.INSTANCE, module)
    for index, name in enumerate(names):
        owner = resolution.value
        if resolution.kind is Kind.UNKNOWN:
            return resolution
        if not isinstance(owner, nn.Module):
            return Resolution(
                Kind.OF_OBJECT, reason=f"self.{'.'.join(names[:index])} is not a module"
            )
        resolution = resolve(owner, name)
    return resolution


def self_chain(node: ast.expr) -> tuple[str, ...] | None:
    """The attribute names of a `self.a.b` chain (`("a", "b")`), or None when `node` is not
    an attribute chain rooted at the name `self`."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and names:
        return tuple(reversed(names))
    return None


def self_is_bound_to_owner(funcdef: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """May `self` in `funcdef` be read as the module the method runs on?

    True only when `self` is its first positional parameter and nothing else in it binds the
    name: no assignment, `del`, loop or `with` target, walrus, import, `except ... as`,
    `match` capture, `global`/`nonlocal`, nested `def`/`class`, or a parameter of a nested
    function or lambda (whose `self` is another object). Otherwise `self.<name>` may be any
    object's attribute (`self = self.other`), and the analysis must not resolve it."""
    arguments = funcdef.args
    positional = [*arguments.posonlyargs, *arguments.args]
    if not positional or positional[0].arg != "self":
        return False
    for node in ast.walk(funcdef):
        if isinstance(node, ast.arg) and node.arg == "self" and node is not positional[0]:
            return False
        if isinstance(node, ast.Name) and node.id == "self" and not isinstance(node.ctx, ast.Load):
            return False
        if isinstance(node, (ast.Global, ast.Nonlocal)) and "self" in node.names:
            return False
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
            (alias.asname or alias.name).split(".")[0] == "self" for alias in node.names
        ):
            return False
        if isinstance(node, ast.ExceptHandler) and node.name == "self":
            return False
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and node is not funcdef
            and node.name == "self"
        ):
            return False
        if isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name == "self":
            return False
        if isinstance(node, ast.MatchMapping) and node.rest == "self":
            return False
    return True
