"""What an analysis read on the modules it proved a fusion for, recorded as it read it, and the
guard that every such read still answers what it answered at fuse time.

A fuser's proof reads attributes: a router's trace reads `self.top_k` and
`self.norm_topk_prob` and freezes the values into the routing program; an activation is
identified by its class and `approximate`; a gating program is traced with `self.limit`.
Listing those premises by hand forgets some; `recording` observes them instead. For the
duration of a `with` block every attribute read on a module of the given trees, by whatever
function, helper, tracer or child made it, is listed as `(module, name)`.

`guarded_reads` keeps the reads whose value can change what the proof concluded and checks
that each can be guarded cheaply per call (`AttributeGuard`): plain values by value, modules
of the tree, functions, classes and `functools.partial`s of those by identity (a partial by
its contents), methods by their function and instance, and (where the fused code reads them
again by name at each call: `live_tensors`) parameters and buffers by presence. A read of
anything else (a config object, a dict, a tensor frozen into a program) refuses. Modules
whose call the fused code stands in for (`called`) have their method resolution guarded too:
`forward` and the `nn.Module` call path, as Python resolves them (instance dict, then the
class and its MRO), so a class patch or an instance-level `forward` shows.

`AttributeGuard` compares the reads per call; `ReadsGuard` is the same check in the shape a
rewritten forward's guard list takes (`failure(module) -> reason or None`,
`fusion.runtime.bound.bind`).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fusion.analysis.callpath import CALL_PATH
from fusion.errors import RewriteRefused

Read = tuple[Any, str]
"""`(owner, attribute name)`: one attribute read on one object."""


class Missing:
    """The value of an attribute that does not exist (a guard key; equal to any other)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Missing)

    def __hash__(self) -> int:
        return 0


def is_plain(value: Any) -> bool:
    """Is `value` an immutable plain value (compared by value in a guard)?"""
    if isinstance(value, (tuple, frozenset)):
        return all(is_plain(v) for v in value)
    return value is None or isinstance(
        value, (bool, int, float, complex, str, bytes, torch.dtype, torch.device)
    )


def guard_key(value: Any) -> tuple:
    """What a guard compares of an attribute's value: `("value", type, value)` for plain
    values, `("method", function, instance)` for bound methods (a new object per read),
    `("partial", function, (args, keywords))` for a `functools.partial` (its contents, which
    a write can change in place), `("missing",)`, else `("object", value)` (compared by
    identity: `AttributeGuard`)."""
    if isinstance(value, Missing):
        return ("missing",)
    if isinstance(value, types.MethodType):
        return ("method", value.__func__, value.__self__)
    if type(value) is functools.partial:
        return ("partial", value.func, (value.args, dict(value.keywords)))
    if is_plain(value):
        return ("value", type(value), value)
    return ("object", value)


_ABSENT = Missing()
"""What `getattr` answers for an attribute that does not exist (compared by identity)."""


@dataclass(frozen=True)
class AttributeGuard:
    """Attributes read by what the fused path stands for, with their values at fuse time.

    `checks`: one `(owner, name, kind, a, b)` per read (owners are the fused model's own
    modules: a deep copy or a pickle of the fused module carries them along), `kind` and
    `(a, b)` from `guard_key`: `value` (type, value), `object` (the object, None), `method`
    (function, instance), `partial` (function, (args, keywords)) or `missing` (None, None);
    `child` (the module, None) for a child module the read resolved to, read from
    `_modules` (what `nn.Module.__getattr__` reads, without its frame); `parameter` /
    `buffer` (None, None) for a tensor the fused code reads again by name at each call: only
    that the name still resolves to a parameter (buffer) is a premise."""

    checks: tuple[tuple[Any, str, str, Any, Any], ...]

    @property
    def reads(self) -> tuple[Read, ...]:
        return tuple((owner, name) for owner, name, *_ in self.checks)

    @classmethod
    def record(cls, reads: tuple[Read, ...] | list[Read]) -> AttributeGuard:
        """A guard on `reads` holding for their current values (each read once)."""
        checks = []
        seen: set[tuple[int, str]] = set()
        for owner, name in reads:
            if (id(owner), name) in seen:
                continue
            seen.add((id(owner), name))
            checks.append(_check(owner, name))
        return cls(tuple(checks))

    def holds(self) -> bool:
        """True when every read attribute has its fuse-time value: plain values by type and
        value, anything else by identity (never `==` on an arbitrary object, which a tensor
        answers elementwise). Cost: one attribute read and one comparison per read."""
        return self.failure() is None

    def failure(self) -> str | None:
        """The first read whose value changed, as `owner class.name`, or None."""
        for owner, name, kind, a, b in self.checks:
            if kind == "child":
                if owner._modules.get(name) is not a or name in owner.__dict__:
                    return _shown(owner, name)
                continue
            if kind in ("parameter", "buffer"):
                table = owner._parameters if kind == "parameter" else owner._buffers
                if table.get(name) is None or name in owner.__dict__:
                    return _shown(owner, name)
                continue
            if kind == "method" and b is owner:
                # The owner's own method: still the class's function, not shadowed on the
                # instance. Read through the class because Dynamo answers `__func__` of a
                # bound method it traces with another object (the guard failed in every
                # compiled call, and counting it recompiled the graph).
                if name in owner.__dict__ or getattr(type(owner), name, None) is not a:
                    return _shown(owner, name)
                continue
            value = getattr(owner, name, _ABSENT)
            if kind == "value":
                if type(value) is not a or value != b:
                    return _shown(owner, name)
            elif kind == "object":
                if value is not a:
                    return _shown(owner, name)
            elif kind == "method":
                if getattr(value, "__func__", None) is not a:
                    return _shown(owner, name)
                if getattr(value, "__self__", None) is not b:
                    return _shown(owner, name)
            elif kind == "partial":
                if (
                    type(value) is not functools.partial
                    or value.func is not a
                    or value.args != b[0]
                    or value.keywords != b[1]
                ):
                    return _shown(owner, name)
            elif value is not _ABSENT:
                return _shown(owner, name)
        return None


def _check(owner: Any, name: str) -> tuple[Any, str, str, Any, Any]:
    """The `AttributeGuard` check of `owner.<name>` for its current value."""
    if isinstance(owner, nn.Module):
        state = owner.__dict__
        if name not in state:
            for kind, table in (
                ("child", "_modules"),
                ("parameter", "_parameters"),
                ("buffer", "_buffers"),
            ):
                entries = state.get(table, {})
                if entries.get(name) is not None:
                    return (owner, name, kind, entries[name] if kind == "child" else None, None)
    value = getattr(owner, name, _ABSENT)
    kind, *rest = guard_key(value)
    if kind == "method" and name in getattr(owner, "__dict__", {}):
        # A bound method stored on the instance (`self.act = self._gelu_python`): one fixed
        # object, not a fresh binding of the class's function per read.
        kind, rest = "object", [value]
    a, b = [*rest, None, None][:2]
    return (owner, name, kind, a, b)


def _shown(owner: Any, name: str) -> str:
    return f"{type(owner).__name__}.{name}"


@dataclass(frozen=True, eq=False)
class ReadsGuard:
    """A rewritten forward's guard (`fusion.runtime.bound.bind`) that the reads `what` names (e.g.
    "activation") still have their fuse-time values (`attributes`). The owners are modules
    of the guarded instance's tree: a deep copy or a pickle maps them with it."""

    what: str
    attributes: AttributeGuard

    def failure(self, module: nn.Module) -> str | None:
        changed = self.attributes.failure()
        return None if changed is None else f"{self.what}: {changed} changed since fusing"


@contextmanager
def recording(*roots: nn.Module) -> Iterator[list[Read]]:
    """Yield a list that collects `(module, name)` for every attribute read on a module of
    the `roots`' trees inside the block.

    Each class of those modules gets a recording `__getattribute__` for the duration (set on
    the class itself, so `type(module)`, source lookups and `isinstance` are unchanged),
    which records reads on the trees' modules only and answers through the class's own
    lookup; on exit every class is restored (`finally`: whatever happens). Reads made on
    other instances of those classes meanwhile answer as before and are not listed."""
    modules = {id(m): m for root in roots for m in root.modules()}
    reads: list[Read] = []
    classes = list(dict.fromkeys(type(m) for m in modules.values()))
    # Every class's lookup as it is before any is patched: a class whose base is patched
    # too still records each read once.
    lookups = {cls: cls.__getattribute__ for cls in classes}
    own = {
        cls: cls.__dict__["__getattribute__"] for cls in classes if "__getattribute__" in vars(cls)
    }

    def recorder(lookup: Any) -> Any:
        def __getattribute__(self: Any, name: str) -> Any:
            if id(self) in modules:
                reads.append((self, name))
            return lookup(self, name)

        return __getattribute__

    patched: list[type] = []
    try:
        for cls in classes:
            cls.__getattribute__ = recorder(lookups[cls])  # type: ignore[method-assign]
            patched.append(cls)
        yield reads
    finally:
        for cls in reversed(patched):
            if cls in own:
                cls.__getattribute__ = own[cls]  # type: ignore[method-assign]
            else:
                delattr(cls, "__getattribute__")


def _class_attribute(cls: type, name: str) -> Any:
    """`name` as `cls` defines or inherits it (unbound), or a `Missing`."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return Missing()


_BOOKKEEPING = frozenset(vars(nn.Module())) - {"training"}
"""`nn.Module`'s per-instance bookkeeping (parameter, buffer, child and hook dicts): read by
every call machinery, never a value a program is traced with."""


def relevant(module: nn.Module, name: str) -> bool:
    """Can this read change what was proven? Not for dunders, `nn.Module`'s bookkeeping and
    call machinery (hook dicts, `_call_impl`: the same for every module, and guarded for the
    `called` modules), nor `training` (each proof is of one program in both modes, or its
    fused module runs the original in training mode: `fusion.fusers.moe.gate`, the MoE
    block's `training_sensitive`)."""
    if name.startswith("__") and name.endswith("__"):
        return False
    if name == "training" or name in _BOOKKEEPING:
        return False
    if name in module.__dict__ or name in module._modules:
        return True
    if name in module._parameters or name in module._buffers:
        return True
    inherited = _class_attribute(type(module), name)
    if isinstance(inherited, Missing):
        return True  # a read that failed (`getattr(self, name, default)`): guarded absent
    return inherited is not _class_attribute(nn.Module, name)


def _guardable(value: Any, tree: dict[int, str], live_tensors: bool) -> bool:
    """Can a per-call comparison see every change of `value` that changes the proof?"""
    if isinstance(value, Missing) or is_plain(value):
        return True
    if isinstance(value, nn.Module):
        return id(value) in tree  # its own reads are recorded too
    if isinstance(value, torch.Tensor):
        # Read again by name per call by the fused code: its presence is the premise.
        return live_tensors and type(value) in (torch.Tensor, nn.Parameter, nn.Buffer)
    if isinstance(value, types.MethodType):
        return id(value.__self__) in tree
    if type(value) is functools.partial:
        contents = (*value.args, *value.keywords.values())
        return _guardable(value.func, tree, live_tensors) and all(map(is_plain, contents))
    return isinstance(
        value,
        (
            types.FunctionType,
            types.BuiltinFunctionType,
            type,
            torch._ops.OpOverload,
            torch._ops.OpOverloadPacket,
        ),
    )


def guarded_reads(
    root: nn.Module,
    reads: list[Read],
    *,
    within: tuple[nn.Module, ...] | None = None,
    called: tuple[nn.Module, ...] = (),
    call_path: bool = True,
    live_tensors: bool = False,
) -> tuple[tuple[str, str], ...]:
    """The relevant reads as `(module path in root, attribute name)`, sorted, each checked
    guardable; RewriteRefused naming the first that is not (or a read outside the tree).

    `within`: the modules whose reads this guard covers (default: the whole tree); reads on
    other modules of the tree are another guard's (a child the fused code calls itself).
    `called`: modules whose call the fused code stands in for: their `forward` and call path
    are guarded by method resolution, and an instance-level `forward` on one refuses (the
    proof read its class's); `call_path=False` leaves the call path (and hooks) to a guard
    that already checks it per call (`fusion.runtime.guards.ChildGuard` on the slot holding the
    module). `live_tensors`: the fused code reads the parameters and
    buffers it was proven with by name at each call, so their presence is guarded, not a
    value (else a tensor read refuses: its contents are frozen into the proof)."""
    tree = {id(module): path for path, module in root.named_modules()}
    covered = None if within is None else {id(m) for m in within}
    found: set[tuple[str, str]] = set()
    for module, name in reads:
        if not relevant(module, name):
            continue
        path = tree.get(id(module))
        shown = f"{path}.{name}" if path else name
        if path is None:
            raise RewriteRefused(f"the proof reads {name} of a module outside the fused one")
        if covered is not None and id(module) not in covered:
            continue
        try:
            value = getattr(module, name)
        except AttributeError:
            value = Missing()
        if not _guardable(value, tree, live_tensors):
            raise RewriteRefused(
                f"the proof reads {shown} ({type(value).__name__}), whose contents a guard "
                "cannot see"
            )
        found.add((path, name))
    for module in called:
        path = tree.get(id(module))
        if path is None:
            raise RewriteRefused("the proof stands in for a module outside the fused one")
        forward = module.__dict__.get("forward")
        if forward is not None:
            shown = path or type(module).__name__
            raise RewriteRefused(
                f"{shown} has an instance-level forward; the proof read its class's"
            )
        found.update((path, name) for name in ("forward", *(CALL_PATH if call_path else ())))
    return tuple(sorted(found))


def resolved(root: nn.Module, reads: tuple[tuple[str, str], ...]) -> tuple[Read, ...]:
    """`reads` (paths in `root`) as `(module, name)` on `root`'s own modules."""
    return tuple((root.get_submodule(path), name) for path, name in reads)


def portable_keys(root: nn.Module, reads: tuple[tuple[str, str], ...]) -> tuple:
    """The values of `reads` on `root` in a form comparable across instances of one class:
    plain values by value, modules by class, methods by function, other objects by
    identity. Two instances with equal keys prove the same program."""
    keys = []
    for path, name in reads:
        try:
            owner = root.get_submodule(path)
        except AttributeError:
            keys.append(("no module", path))
            continue
        if name in owner.__dict__ and name in ("forward", *CALL_PATH):
            keys.append(("instance", name))  # an instance's own method: never portable
            continue
        key = guard_key(getattr(owner, name, Missing()))
        if key[0] == "object" and isinstance(key[1], nn.Module):
            key = ("module", type(key[1]))
        elif key[0] == "object" and isinstance(key[1], torch.Tensor):
            key = ("tensor", type(key[1]))
        elif key[0] == "method":
            key = ("method", key[1])
        elif key[0] == "partial":
            key = ("partial", key[1], key[2][0], tuple(sorted(key[2][1].items())))
        keys.append(key)
    return tuple(keys)
