"""What a rewritten forward's proof relied on that a user can change after fusing, checked
on every call (as Dynamo guards a compiled frame).

A fuser proves a rewrite for the module as it was at fuse time: these children, of these
classes with these forwards, found by `self.<name>` as Python looks it up, called through
plain `nn.Module.__call__` with no hooks; these helper functions behind these global names,
running this code. Each of those can change later (a LoRA wrapper or any replacement child,
a child shadowed by an instance or class attribute, a hook registered on a child or
globally, a patched class forward, a monkeypatched helper or one given new `__code__`), and
a forward that kept running on the old proof would compute something else, silently.
`fusion.runtime.bound.BoundForward` checks its guards before each call and runs the class's
original forward when one fails (counted in `guard_failures`); nothing is ever computed on
a premise that no longer holds.

Guards hold references to the children they watch, so `copy.deepcopy` and pickling map
them onto the copy's children with the rest of the module. `GlobalsGuard` watches global
names by identity of the value bound at fuse time, and the functions reached by the code,
defaults and closure cells they hold; it is per process (never copied) and built again when
a pickled forward is rebuilt.
"""

from __future__ import annotations

import builtins
import dataclasses
import dis
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import nn
from torch.nn.modules import module as nn_module

from fusion.analysis.callpath import CALL_PATH, FUSION_INSTALLED, HOOK_ATTRS, global_hooks


@dataclass(frozen=True, eq=False)
class ChildGuard:
    """`module.<name>` is still `child`, of its class at fuse time, and
    `module.<name>` resolves to it as Python looks it up (no instance `__dict__` entry and no
    class attribute anywhere in the MRO shadows `_modules`, no attribute lookup of the
    class's own); unless `called`, reached through plain `nn.Module.__call__` and running
    its class's `forward` of fuse time: no hook on it or global, no call path of its own, no
    instance `forward` but one fusion installed (`callpath.installed_forward`: it computes
    the class forward's function, proven or by falling back), the class's `forward` not
    replaced (the rewrite no longer calls it, or reads it as that forward alone).
    `called`: a module fusion installed that the rewrite calls through `__call__` itself (a
    `MergedLinear`), so hooks on it run as they would; only identity, class and lookup
    matter. `forward`: the child class's `forward` at fuse time (`of` reads it)."""

    name: str
    child: nn.Module
    cls: type
    called: bool = False
    forward: Any = None

    def __post_init__(self) -> None:
        if self.forward is None:
            object.__setattr__(self, "forward", getattr(self.cls, "forward", _MISSING))

    @classmethod
    def of(cls, module: nn.Module, name: str, *, called: bool = False) -> ChildGuard:
        child = module._modules[name]
        assert child is not None
        return cls(name, child, type(child), called)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # the class's forward is read again on load where it is still the class's (a
        # function patched in before fusing need not pickle)
        forward = None if getattr(self.cls, "forward", _MISSING) is self.forward else self.forward
        return (ChildGuard, (self.name, self.child, self.cls, self.called, forward))

    def failure(self, module: nn.Module) -> str | None:
        current = module._modules.get(self.name)
        if current is not self.child:
            return f"{self.name} was replaced"
        owner = type(module)
        if self.name in module.__dict__:
            return f"{self.name} is shadowed by an instance attribute"
        if class_attribute(owner, self.name) is not _MISSING:
            return f"{self.name} is shadowed by a class attribute of {owner.__name__}"
        lookup = own_lookup(owner)
        if lookup is not None:
            return f"{owner.__name__} has its own {lookup}"
        kind = type(current)
        if kind is not self.cls:
            return f"{self.name} became a {kind.__name__}"
        if self.called:
            return None
        if kind.forward is not self.forward:
            return f"{kind.__name__}.forward was replaced"
        # `callpath.has_hooks` / `own_call_path`, inlined: this runs on every call. Global
        # hooks are checked once per forward by `first_failure`.
        state = current.__dict__
        forward = state.get("forward", _MISSING)
        if forward is not _MISSING and getattr(type(forward), FUSION_INSTALLED, False) is not True:
            return f"{self.name} has an instance-level forward"
        for attr in HOOK_ATTRS:
            if state.get(attr):
                return f"{self.name} has {attr.strip('_').replace('_', ' ')}"
        for attr in CALL_PATH:
            if attr in state or getattr(kind, attr) is not _MODULE_CALL_PATH[attr]:
                return f"{self.name} has its own {attr}"
        return None


@dataclass(frozen=True, eq=False)
class MethodGuard:
    """`module.<name>` still resolves to the class's method `function` (no instance
    attribute shadows it, the class attribute was not replaced)."""

    name: str
    function: Any

    def failure(self, module: nn.Module) -> str | None:
        if self.name in module.__dict__:
            return f"{self.name} is shadowed on the instance"
        if getattr(type(module), self.name, None) is not self.function:
            return f"{type(module).__name__}.{self.name} was replaced"
        return None


@dataclass(frozen=True, eq=False)
class InstanceAttributeGuard:
    """`module.<name>` is still the object `value` set on the instance, and the class
    attribute of that name (which, a data descriptor, would be found first) is still
    `shadow` (absent, mostly). `shadow`: read by `of`."""

    name: str
    value: Any
    shadow: Any = None

    @classmethod
    def of(cls, module: nn.Module, name: str) -> InstanceAttributeGuard:
        return cls(name, module.__dict__[name], class_attribute(type(module), name))

    def failure(self, module: nn.Module) -> str | None:
        if module.__dict__.get(self.name, _MISSING) is not self.value:
            return f"{self.name} was rebound on the instance"
        if class_attribute(type(module), self.name) is not self.shadow:
            return f"{type(module).__name__}.{self.name} was set on the class"
        return None


def attribute_guard(module: nn.Module, name: str, *, called: bool = False) -> Guard:
    """The guard that `self.<name>` still means what it meant at fuse time: the same child
    (called plainly, or `called` through `__call__` by the rewrite: `ChildGuard`), the
    same instance attribute, or the same class attribute."""
    if name in module._modules and module._modules[name] is not None:
        return ChildGuard.of(module, name, called=called)
    if name in module.__dict__:
        return InstanceAttributeGuard.of(module, name)
    return MethodGuard(name, getattr(type(module), name, _MISSING))


class _Missing:
    """The one "nothing there" marker; it pickles and copies as itself (guards holding it
    travel with their module)."""

    def __reduce__(self) -> str:
        return "_MISSING"

    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()
_MODULE_CALL_PATH = {attr: getattr(nn.Module, attr) for attr in CALL_PATH}
_MODULE_GETATTR = nn.Module.__getattr__
_LOOKUP = ("__getattr__", "__getattribute__")


def class_attribute(owner: type, name: str) -> Any:
    """What `owner`'s MRO holds under `name` (the first class dict that has it), or
    `_MISSING`: what an instance's attribute lookup finds on the class, before the instance
    dict (a data descriptor) or after it, and always before `__getattr__` (so before a
    module's `_modules`). Unlike `getattr(owner, name)` it never reads the metaclass."""
    for klass in owner.__mro__:
        found = vars(klass).get(name, _MISSING)
        if found is not _MISSING:
            return found
    return _MISSING


def own_lookup(owner: type) -> str | None:
    """The attribute-lookup method (`__getattr__`, `__getattribute__`) that `owner`'s
    instances do not take from `nn.Module` / `object`, or None. Such a method may answer
    `module.<child>` with anything, so no child guard can hold."""
    for klass in owner.__mro__:
        if klass is object:
            continue
        own = vars(klass)
        if "__getattribute__" in own:
            return "__getattribute__"
        if "__getattr__" in own and (
            klass is not nn.Module or own["__getattr__"] is not _MODULE_GETATTR
        ):
            return "__getattr__"
    return None


# `holding_check` spells out `CALL_PATH` and `HOOK_ATTRS` (a test keeps them one set)


class GlobalsGuard:
    """Every global name a rewritten forward (and the plain functions it reaches through
    globals or closures, a few levels deep) reads still binds the object it bound at fuse
    time, and each of those functions still runs the code it ran: the same `__code__`,
    `__defaults__` and `__kwdefaults__` (the dict, and each of its entries), the same
    object in each closure cell.

    The proofs resolve helpers by name (`fusion.analysis.name_resolution`, `fusion.fusers.pure_calls`:
    `apply_rotary_pos_emb` read as pure, `rotate_half` inside it); a monkeypatch swaps what
    the name means, and a swap of the function's code (or defaults, or a closure cell)
    changes what it computes without rebinding the name. Watching every name the code reads
    is a superset of what any proof used: it may fall back when an unrelated global is
    rebound (a missed fusion), never the other way round. A name absent at fuse time must
    stay absent (a new global would shadow a builtin); a closure cell empty at fuse time
    must stay empty.

    `entries`: (namespace, name, value) per global name watched. `functions`: per function
    reached (not the rewrite itself, compiled by fusion and held by its forward alone),
    (function, code, defaults, kwdefaults). `failure` compares all of them by identity in
    one frame of plain loops over tuples precomputed here (measured cheaper on CPython 3.11
    than `map` over `dict.get`/`getattr`: the loops' attribute reads and method calls are
    specialised)."""

    __slots__ = (
        "_cells",
        "_code_free",
        "_empty_cells",
        "_keyword",
        "_positional",
        "_watched",
        "entries",
        "functions",
    )
    DEPTH = 3
    LIMIT = 512

    def __init__(
        self,
        entries: tuple[tuple[dict[str, Any], str, Any], ...],
        functions: tuple[tuple[types.FunctionType, Any, Any, Any], ...] = (),
    ) -> None:
        self.entries = entries
        self.functions = functions
        # keyword defaults are a dict the function holds: watched entry by entry, like globals
        watched = list(entries)
        for _, _, _, kwdefaults in functions:
            if kwdefaults:
                watched.extend((kwdefaults, name, value) for name, value in kwdefaults.items())
        self._watched = tuple(watched)
        # `__kwdefaults__` is read by calls only where the code has keyword-only parameters
        # (and a code swap that adds some fails the code check first)
        self._keyword = tuple(f for f in functions if f[1].co_kwonlyargcount)
        self._positional = tuple(f[:3] for f in functions if not f[1].co_kwonlyargcount)
        cells = [(cell, _contents(cell)) for f, *_ in functions for cell in f.__closure__ or ()]
        self._cells = tuple((cell, value) for cell, value in cells if value is not _MISSING)
        self._empty_cells = tuple(cell for cell, value in cells if value is _MISSING)
        self._code_free = not functions  # no function reached: nothing but names to compare

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> GlobalsGuard:
        entries: dict[tuple[int, str], tuple[dict[str, Any], str, Any]] = {}
        functions: dict[int, tuple[types.FunctionType, Any, Any, Any]] = {}

        def visit(function: Any, depth: int) -> None:
            if not isinstance(function, types.FunctionType) or id(function) in functions:
                return
            functions[id(function)] = (
                function,
                function.__code__,
                function.__defaults__,
                function.__kwdefaults__,
            )
            if depth < cls.DEPTH:
                for cell in function.__closure__ or ():
                    visit(_contents(cell), depth + 1)
            namespace = function.__globals__
            for name in _global_names(function.__code__):
                if len(entries) >= cls.LIMIT:
                    return
                key = (id(namespace), name)
                if key in entries:
                    continue
                value = namespace.get(name, _MISSING)
                entries[key] = (namespace, name, value)
                if value is _MISSING:
                    # builtins are read through the same lookup; watch them too
                    space = vars(builtins)
                    entries[(id(space), name)] = (space, name, space.get(name, _MISSING))
                elif depth < cls.DEPTH:
                    if isinstance(value, nn.Module):
                        called_module(value, depth + 1)
                    else:
                        visit(value, depth + 1)

        def called_module(module: nn.Module, depth: int) -> None:
            # A module object called as a global (Transformers 5.25 makes helpers such as
            # `apply_rotary_pos_emb` kernels `Func` modules): what runs is its forward, so its
            # instance-level and class-level `forward` bindings are watched like names, and
            # the class forward's code, closure (the wrapped helper) and globals like a helper.
            for namespace in (vars(module), vars(type(module))):
                entries[(id(namespace), "forward")] = (
                    namespace,
                    "forward",
                    namespace.get("forward", _MISSING),
                )
            visit(getattr(type(module), "forward", None), depth)

        visit(fn, 0)
        functions.pop(id(fn), None)  # the rewrite: fusion's own code, reached by no name
        return cls(tuple(entries.values()), tuple(functions.values()))

    def failure(self) -> str | None:
        """The first change to what the watched code runs, named, or None."""
        missing = _MISSING
        for namespace, name, value in self._watched:
            if namespace.get(name, missing) is not value:
                return self._reason()
        if self._code_free:
            return None
        for function, code, defaults in self._positional:
            if function.__code__ is not code or function.__defaults__ is not defaults:
                return self._reason()
        for function, code, defaults, kwdefaults in self._keyword:
            if (
                function.__code__ is not code
                or function.__defaults__ is not defaults
                or function.__kwdefaults__ is not kwdefaults
            ):
                return self._reason()
        for cell, value in self._cells:
            try:
                if cell.cell_contents is not value:
                    return self._reason()
            except ValueError:  # emptied (`del` of the enclosing name)
                return self._reason()
        return self._reason() if self._empty_cells else None

    def _reason(self) -> str | None:
        """Why `failure` stopped: the first change found, named (or None: only empty cells,
        still empty)."""
        for namespace, name, value in self.entries:
            if namespace.get(name, _MISSING) is not value:
                if "__builtins__" not in namespace and namespace is not vars(builtins):
                    # not a module's globals: a called module's or its class's bindings
                    return f"the {name} of a module called as a global was replaced"
                return f"global {name} was rebound"
        for function, *states in self.functions:
            for attribute, state in zip(_FUNCTION_STATE, states):
                if getattr(function, attribute) is not state:
                    return f"{function.__qualname__}.{attribute} was replaced"
        for namespace, name, value in self._watched[len(self.entries) :]:
            if namespace.get(name, _MISSING) is not value:
                return f"the keyword default {name} of a helper was changed"
        for cell, value in self._cells:
            if _contents(cell) is not value:
                return "a closure cell of a helper was rebound"
        if any(_contents(cell) is not _MISSING for cell in self._empty_cells):
            return "an empty closure cell of a helper was filled"
        return None

    def __deepcopy__(self, memo: dict[int, Any]) -> GlobalsGuard:
        return self  # process-wide names, not model state

    def __reduce__(self) -> Any:
        raise TypeError("GlobalsGuard is rebuilt with its forward, never pickled")


_FUNCTION_STATE = ("__code__", "__defaults__", "__kwdefaults__")
"""What a function runs besides its globals and closure, as `GlobalsGuard` records it."""


def _contents(cell: types.CellType) -> Any:
    """A closure cell's object, or `_MISSING` for an empty cell (a name not bound yet)."""
    try:
        return cell.cell_contents
    except ValueError:
        return _MISSING


def _global_names(code: types.CodeType) -> list[str]:
    """Names `code` (and code nested in it: comprehensions, lambdas) looks up as globals
    (`LOAD_GLOBAL` / `LOAD_NAME`: attribute names are not lookups of a global)."""
    names = [
        str(instruction.argval)
        for instruction in dis.get_instructions(code)
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME")
    ]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_global_names(const))
    return names


Guard = ChildGuard | MethodGuard | InstanceAttributeGuard
"""A guard on one instance's state (copied and pickled with it)."""


def distinct(guards: Iterable[Guard]) -> tuple[Guard, ...]:
    """`guards` in order, each premise once: a guard equal in kind and fields (the same
    name, the very same watched object, class and flag) to an earlier one is dropped. Safe:
    two such guards answer alike on every call, so checking one is checking both; proofs
    that rely on one child twice (a merged shard also read between the calls) need not pay
    twice per call."""
    seen: set[tuple[Any, ...]] = set()
    kept: list[Guard] = []
    for guard in guards:
        fields = (getattr(guard, f.name) for f in dataclasses.fields(guard))
        key = (type(guard), *(v if isinstance(v, (str, bool)) else id(v) for v in fields))
        if key not in seen:
            seen.add(key)
            kept.append(guard)
    return tuple(kept)


def holding_check(
    guards: tuple[Guard, ...], owner: type, forward: Any = _MISSING
) -> Callable[[nn.Module], bool]:
    """A function of the guarded module (an instance of `owner`) answering True only where
    `first_failure(module, guards)` answers None, the module is still of class `owner` and,
    given `forward`, `owner.forward` is still `forward` (`BoundForward.class_failure`), in
    one Python frame: the child guards' common case spelled out over precomputed tuples
    (`owner`'s MRO the same and `nn.Module`'s attribute lookup, no child name in the instance dict or
    in any class dict of the MRO; each child the same object, of the very class; each plain
    child with no hook, call path of its own or global hook, its class's `forward` the one
    of fuse time, an instance `forward` only where fusion installed it), the method guards
    and the instance-attribute guards (no class attribute of the name at fuse time, none
    now) inlined alike, the other guards asked as they are. False means "ask `first_failure`", which names the reason or finds
    that the premise holds after all (a class swap that shadows nothing).

    The class dicts are watched through `dict_keys` views taken once (live: a class's dict
    is one object for its lifetime), one `isdisjoint` per class of the MRO for all the
    child names and the lookup methods, so shadowing costs a few C calls per forward, not
    one `getattr` miss (an exception on Python 3.11) per child.

    Why: a rewritten forward checks its guards on every call, after weight streams have
    emptied the caches, where each Python frame costs several times its warm price.
    Safe: every test here is one of `ChildGuard.failure`'s or `global_hooks`'s, so True
    implies each of them holds; nothing is cached between calls but the views. Eager only
    (`BoundForward.failure`): Dynamo traces `first_failure` instead (it cannot trace
    `dict_keys.isdisjoint`, and builds a new `__mro__` tuple)."""
    return _holds_function(owner, forward, _holding_tables(guards, owner))


class _HoldingTables(NamedTuple):
    """What `holding_check`'s function tests, precomputed from the guards at fuse time."""

    called: tuple[tuple[str, nn.Module, type], ...]
    """(name, child, class) of each child guard of a child called as a function."""
    plain: tuple[tuple[str, nn.Module, type, Any], ...]
    """(name, child, class, forward) of each child guard of a plainly called child."""
    names: tuple[str, ...]
    """The guarded child names: none may appear in the instance dict or a class dict."""
    attrs: tuple[tuple[str, Any], ...]
    """(name, value) of each instance attribute no class attribute shadowed at fuse time."""
    methods: tuple[tuple[str, Any], ...]
    """(name, function) of each method guard."""
    others: tuple[Guard, ...]
    """The guards asked as they are (`failure`)."""
    mro: tuple[type, ...]
    """`owner.__mro__` at fuse time."""
    class_keys: tuple[tuple[Any, tuple[str, ...]], ...]
    """(live `dict_keys` of a class of the MRO, the names none of which it may hold)."""
    class_only: bool
    """No guard: only the class premise is tested."""


def _holding_tables(guards: tuple[Guard, ...], owner: type) -> _HoldingTables:
    """`holding_check`'s tables: the guards sorted by how they are tested, and the class
    dicts of `owner`'s MRO with the names each must not hold."""
    children = tuple(g for g in guards if isinstance(g, ChildGuard))
    called = tuple((g.name, g.child, g.cls) for g in children if g.called)
    plain = tuple((g.name, g.child, g.cls, g.forward) for g in children if not g.called)
    names = tuple(dict.fromkeys(g.name for g in children))
    # instance attributes no class attribute shadowed at fuse time: none may appear
    attrs = tuple(
        (g.name, g.value)
        for g in guards
        if isinstance(g, InstanceAttributeGuard) and g.shadow is _MISSING
    )
    methods = tuple((g.name, g.function) for g in guards if isinstance(g, MethodGuard))
    inlined = (ChildGuard, MethodGuard)
    others = tuple(
        g
        for g in guards
        if not isinstance(g, inlined)
        and not (isinstance(g, InstanceAttributeGuard) and g.shadow is _MISSING)
    )
    unshadowed = names + tuple(name for name, _ in attrs)
    mro = owner.__mro__
    # object's dict cannot change; nn.Module's holds `__getattr__` (checked by identity)
    class_keys = tuple(
        (vars(klass).keys(), unshadowed + (_LOOKUP[1:] if klass is nn.Module else _LOOKUP))
        for klass in mro
        if klass is not object
    )
    class_only = not (names or attrs or methods or others)  # no guard: the class premise
    return _HoldingTables(called, plain, names, attrs, methods, others, mro, class_keys, class_only)


def _holds_function(
    owner: type, forward: Any, tables: _HoldingTables
) -> Callable[[nn.Module], bool]:
    """`holding_check`'s function over `tables`: one frame, every table and constant a
    closure variable."""
    called, plain, names, attrs, methods, others, mro, class_keys, class_only = tables
    watch_classes = bool(names or attrs)
    any_plain, any_others = bool(plain), bool(others)
    check_forward = forward is not _MISSING
    registry = nn_module  # read per call: the registries are module globals torch may rebind
    module_class = nn.Module
    module_getattr = _MODULE_GETATTR
    module_call = _MODULE_CALL_PATH["__call__"]
    module_wrapped = _MODULE_CALL_PATH["_wrapped_call_impl"]
    module_impl = _MODULE_CALL_PATH["_call_impl"]
    missing = _MISSING

    def holds(module: nn.Module) -> bool:
        if type(module) is not owner or (check_forward and owner.forward is not forward):
            return False
        if class_only:
            return True
        if watch_classes:
            if owner.__mro__ is not mro or module_class.__getattr__ is not module_getattr:
                return False
            for keys, watched in class_keys:
                if not keys.isdisjoint(watched):
                    return False
        state = module.__dict__
        for name in names:
            if name in state:
                return False
        for name, value in attrs:
            if state.get(name, missing) is not value:
                return False
        for name, function in methods:
            if name in state or getattr(owner, name, None) is not function:
                return False
        children = module._modules
        for name, child, cls in called:
            current = children.get(name)
            if current is not child or type(current) is not cls:
                return False
        if any_plain:
            if (
                registry._global_forward_hooks
                or registry._global_forward_pre_hooks
                or registry._global_backward_hooks
                or registry._global_backward_pre_hooks
            ):
                return False
            for name, child, cls, child_forward in plain:
                current = children.get(name)
                if current is not child or type(current) is not cls:
                    return False
                child_state = current.__dict__
                get = child_state.get
                if (
                    get("_forward_hooks")
                    or get("_forward_pre_hooks")
                    or get("_backward_hooks")
                    or get("_backward_pre_hooks")
                    or cls.forward is not child_forward
                    or "__call__" in child_state
                    or "_wrapped_call_impl" in child_state
                    or "_call_impl" in child_state
                    or cls.__call__ is not module_call
                    or cls._wrapped_call_impl is not module_wrapped
                    or cls._call_impl is not module_impl
                ):
                    return False
                if "forward" in child_state:
                    installed = getattr(type(child_state["forward"]), FUSION_INSTALLED, False)
                    if installed is not True:
                        return False
        return not any_others or all(guard.failure(module) is None for guard in others)

    return holds


def first_failure(module: nn.Module, guards: tuple[Guard, ...]) -> str | None:
    """The first failing guard's reason, or None when every guard holds. The global module
    hooks (which would run for every plainly called child) are asked once, when any guard
    watches such a child."""
    if any(isinstance(g, ChildGuard) and not g.called for g in guards):
        hooks = global_hooks()
        if hooks:
            return hooks
    for guard in guards:
        reason = guard.failure(module)
        if reason is not None:
            return reason
    return None
