"""Which attributes of an experts module a replayed program read, so they can be guarded.

A gating program is read from a trace: every attribute the gating read while it was traced
(`self.limit`, `self.alpha`, `self.act_fn` and what that module reads in turn) is frozen into
the program as a constant or an op. `recording` observes those reads: for the duration of a
`with` block, every module of the experts' tree answers attribute reads through a recording
subclass of its own class (swapped back on exit, whatever happens), so each `(module, name)`
read is listed, whichever function, helper or child module made it.

`guarded_reads` keeps the reads whose value can change what the program computes and checks
that each value can be guarded cheaply per call (`fusion.experts_modules.AttributeGuard`):
plain values by value, modules of the tree, functions and classes by identity, methods by
their function and instance. A read of anything else (a config object, a dict, a tensor:
contents a per-call comparison cannot see) refuses.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from fusion.errors import RewriteRefused
from fusion.experts_modules import Missing, guard_key, is_plain

_BOOKKEEPING = frozenset(vars(nn.Module())) - {"training"}
"""`nn.Module`'s per-instance bookkeeping (parameter, buffer, child and hook dicts): read by
every call machinery, never a value a program is traced with."""


@contextmanager
def recording(root: nn.Module) -> Iterator[list[tuple[nn.Module, str]]]:
    """Yield a list that collects `(module, name)` for every attribute read on `root` or a
    module of its tree inside the block. Each module's class is swapped for a subclass that
    records, then restored in `finally`: on exit every module has its own class again."""
    reads: list[tuple[nn.Module, str]] = []
    recorders: dict[type, type] = {}
    swapped: list[tuple[nn.Module, type]] = []

    def recorder(cls: type) -> type:
        if cls not in recorders:

            def __getattribute__(self: Any, name: str, _cls: type = cls) -> Any:
                reads.append((self, name))
                return _cls.__getattribute__(self, name)

            namespace = {"__getattribute__": __getattribute__, "__module__": cls.__module__}
            recorders[cls] = type(f"Recording{cls.__name__}", (cls,), namespace)
        return recorders[cls]

    try:
        for module in root.modules():
            cls = type(module)
            object.__setattr__(module, "__class__", recorder(cls))
            swapped.append((module, cls))
        yield reads
    finally:
        for module, cls in swapped:
            object.__setattr__(module, "__class__", cls)


def _class_attribute(cls: type, name: str) -> Any:
    """`name` as `cls` defines or inherits it (unbound), or a `Missing`."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return Missing()


def _relevant(module: nn.Module, name: str) -> bool:
    """Can this read change what was traced? Not for dunders, `nn.Module`'s bookkeeping and
    call machinery (hook dicts, `_call_impl`: the same for every module), nor `training`
    (the gating is proven the same program in both modes, `fusion.fusers.moe.gate`)."""
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


def _guardable(value: Any, tree: dict[int, str]) -> bool:
    """Can a per-call comparison see every change of `value` that changes the program?"""
    if isinstance(value, Missing) or is_plain(value):
        return True
    if isinstance(value, nn.Module):
        return id(value) in tree  # its own reads are recorded too
    if isinstance(value, types.MethodType):
        return id(value.__self__) in tree
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
    root: nn.Module, reads: list[tuple[nn.Module, str]]
) -> tuple[tuple[str, str], ...]:
    """The relevant reads as `(module path in root, attribute name)`, sorted, each checked
    guardable; RewriteRefused naming the first that is not (or a read outside the tree)."""
    tree = {id(module): path for path, module in root.named_modules()}
    found: set[tuple[str, str]] = set()
    for module, name in reads:
        if not _relevant(module, name):
            continue
        path = tree.get(id(module))
        shown = f"{path}.{name}" if path else name
        if path is None:
            raise RewriteRefused(f"gating reads {name} of a module outside the experts")
        try:
            value = getattr(module, name)
        except AttributeError:
            value = Missing()
        if not _guardable(value, tree):
            raise RewriteRefused(
                f"gating reads {shown} ({type(value).__name__}), whose contents a guard cannot see"
            )
        found.add((path, name))
    return tuple(sorted(found))


def portable_keys(root: nn.Module, reads: tuple[tuple[str, str], ...]) -> tuple:
    """The values of `reads` on `root` in a form comparable across instances of one class:
    plain values by value, modules by class, methods by function, other objects by
    identity. Two instances with equal keys trace to the same program."""
    keys = []
    for path, name in reads:
        try:
            owner = root.get_submodule(path)
        except AttributeError:
            keys.append(("no module", path))
            continue
        key = guard_key(getattr(owner, name, Missing()))
        if key[0] == "object" and isinstance(key[1], nn.Module):
            key = ("module", type(key[1]))
        elif key[0] == "method":
            key = ("method", key[1])
        keys.append(key)
    return tuple(keys)
