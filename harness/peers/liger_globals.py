"""What a monkey patch changed in Transformers' (and torch's) modules and classes, undone and
replayable: Liger's `apply_liger_kernel_to_<type>(model=...)` patches module-level functions
(`modeling_llama.apply_rotary_pos_emb`), classes of the modeling module
(`modeling_llama.LlamaRMSNorm = LigerRMSNorm`), class attributes
(`Llama4ForCausalLM.forward`) and even torch (`torch.nn.functional.cross_entropy`, through
`transformers.loss.loss_utils.nn`) for every model of the process, not only the one given.

`Snapshot.take()` copies the namespaces a patch can reach (every loaded `transformers.*`
module, the classes those modules define, `torch.nn.functional`, `torch.nn.modules.loss`);
`snapshot.changes()` after the patch lists each changed name as a `Change` (new and old
value); `snapshot.restore()` puts every namespace back as it was and drops modules first
imported during the patch (the next import is a fresh, unpatched one). `Changes` installs
and removes a list of changes reentrantly, so the patched globals hold only while the
patched model runs (`harness.peers.liger_apply`), and an unfused model, a float64 reference
or the next architecture of the same worker sees Transformers' own code.

Fail closed: anything the snapshot did not cover (a namespace outside those listed) is not
restored; `restore` raises nothing and is safe to call twice.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

EXTRA_MODULES = ("torch.nn.functional", "torch.nn.modules.loss")
"""Modules outside Transformers a Liger patch reaches (its cross-entropy patches
`transformers.loss.loss_utils.nn.functional.cross_entropy`, i.e. torch's)."""

PREFIX = "transformers."


class _Missing:
    """The value of a name a namespace did not hold."""

    def __repr__(self) -> str:
        return "<missing>"


MISSING: Any = _Missing()


@dataclass(frozen=True)
class Change:
    """One name a patch changed: where (a module or a class), its new and old value."""

    owner: Any
    name: str
    new: Any
    old: Any

    def where(self) -> str:
        """`module.name` or `module.Class.name`, for messages."""
        owner = self.owner
        if isinstance(owner, ModuleType):
            return f"{owner.__name__.rsplit('.', 1)[-1]}.{self.name}"
        return f"{owner.__module__.rsplit('.', 1)[-1]}.{owner.__qualname__}.{self.name}"


def _set(owner: Any, name: str, value: Any) -> None:
    """Set `name` on a module or class, or delete it when `value` is MISSING."""
    if value is MISSING:
        if name in vars(owner):
            delattr(owner, name)
    else:
        setattr(owner, name, value)


def _namespaces() -> dict[str, ModuleType]:
    """The loaded modules a patch can reach, by name."""
    names = [n for n in list(sys.modules) if n.startswith(PREFIX)] + list(EXTRA_MODULES)
    return {n: sys.modules[n] for n in names if isinstance(sys.modules.get(n), ModuleType)}


def _classes(module: ModuleType) -> list[type]:
    """The classes `module` defines (not those it imports)."""
    found = []
    for value in list(vars(module).values()):
        if isinstance(value, type) and getattr(value, "__module__", None) == module.__name__:
            found.append(value)
    return found


@dataclass
class Snapshot:
    """Copies of every reachable namespace; see the module docstring."""

    modules: dict[str, tuple[ModuleType, dict[str, Any]]] = field(default_factory=dict)
    classes: dict[int, tuple[type, dict[str, Any]]] = field(default_factory=dict)

    @classmethod
    def take(cls) -> Snapshot:
        """The namespaces as they are now."""
        snap = cls()
        for name, module in _namespaces().items():
            snap.modules[name] = (module, dict(vars(module)))
            if name.startswith(PREFIX):
                for klass in _classes(module):
                    snap.classes[id(klass)] = (klass, dict(vars(klass)))
        return snap

    def changes(self) -> list[Change]:
        """Every name changed since `take` in a namespace it covered."""
        found: list[Change] = []
        pairs = [*self.modules.values(), *self.classes.values()]
        for owner, before in pairs:
            after = dict(vars(owner))
            for name in before.keys() | after.keys():
                old, new = before.get(name, MISSING), after.get(name, MISSING)
                if old is not new:
                    found.append(Change(owner, name, new, old))
        return sorted(found, key=Change.where)

    def new_modules(self) -> list[str]:
        """`transformers.*` modules first imported since `take`."""
        return sorted(n for n in _namespaces() if n not in self.modules)

    def restore(self) -> list[str]:
        """Put every covered namespace back; drop the modules first imported since `take`
        from `sys.modules`. Returns the names of the dropped modules."""
        for change in self.changes():
            _set(change.owner, change.name, change.old)
        dropped = self.new_modules()
        for name in dropped:
            sys.modules.pop(name, None)
        return dropped


@dataclass
class Changes:
    """A patch's changes, installable around the patched model's calls: `enter` installs
    them (the outermost of nested entries), `exit` puts the old values back. Deep copies
    share it (a copied model's hooks must drive the same installation)."""

    changes: list[Change] = field(default_factory=list)
    depth: int = 0

    def enter(self) -> bool:
        """Install the changes unless installed; True for the outermost entry."""
        self.depth += 1
        if self.depth > 1:
            return False
        for change in self.changes:
            _set(change.owner, change.name, change.new)
        return True

    def exit(self) -> bool:
        """Leave one entry; the outermost puts every old value back. True when it did."""
        if self.depth == 0:
            return False
        self.depth -= 1
        if self.depth > 0:
            return False
        for change in reversed(self.changes):
            _set(change.owner, change.name, change.old)
        return True

    def __deepcopy__(self, memo: dict) -> Changes:
        return self
