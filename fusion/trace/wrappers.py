"""Which decorators around a forward, and which function objects called from one, the
tracer may see through: each proven by provenance, never by its name.

The tracer (`fusion.trace.tracer`) records the function of `module.forward`. A class's forward
is often a decorator's closure around the function written in the class (`__wrapped__`);
tracing that inner function instead records the forward's function only when the
decorator calls it with the arguments it was given, save keyword renames. A wrapper is
recognised here by its code object: the nested `def` of a known decorator factory, found in
that factory's own code (`KNOWN_WRAPPERS`), and by the closure cell that holds the wrapped
function being `__wrapped__` itself. Anything else with a `__wrapped__` (a user's
decorator, a cast, a cache) is refused with its name: `unwrap_forward` raises
`RewriteRefused`, and the trace stops there.

Transformers 5.25 makes the `kernels` package a dependency: module-level functions
decorated `@use_kernel_forward_from_hub` (Llama's `apply_rotary_pos_emb`) become instances
of a `Func(nn.Module)` class built by kernels, called from forwards as globals, and the
classes using them are decorated `@use_kernelized_func`, whose `new_forward` routes those
calls to the instance's own copies. `kernel_function` says which plain Python function such
a call computes: the decorated function, as long as neither the shared object nor this
instance's copy was kernelized (a hub kernel installed as its instance-level `forward`).
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from fusion.errors import RewriteRefused


@dataclass(frozen=True)
class KnownWrapper:
    """A decorator whose wrapper the tracer sees through, located by provenance."""

    module: str
    """The module defining the decorator factory (not imported: no class can carry it)."""
    factory: str
    """The factory's qualified name in `module` (attributes joined by dots)."""
    nested: tuple[str, ...]
    """The names of the nested `def`s (and class bodies) from the factory's code down to the
    wrapper's code object."""
    cell: str
    """The wrapper's free variable holding the wrapped function (it must be `__wrapped__`)."""
    why: str
    """What the wrapper does with the call, and so why its inner function's trace is the
    forward's function."""


KNOWN_WRAPPERS = (
    KnownWrapper(
        "transformers.utils.deprecation",
        "deprecate_kwarg",
        ("wrapper", "wrapped_func"),
        "func",
        "renames a deprecated keyword argument to its new name (or drops it, warns, or "
        "raises) and calls the wrapped function with the arguments otherwise unchanged",
    ),
    KnownWrapper(
        "transformers.modeling_layers",
        "GradientCheckpointingLayer.__init_subclass__",
        ("forward_with_checkpointing",),
        "forward",
        "calls the wrapped forward with the same arguments; training under gradient "
        "checkpointing, the same forward through the checkpoint function, with use_cache "
        "and the cache arguments cleared (which the trace treats as None anyway)",
    ),
    KnownWrapper(
        "transformers.integrations.accelerate",
        "force_accelerate_hooks",
        ("decorator", "wrapped"),
        "forward_func",
        "calls the wrapped forward with the same arguments, around it firing the accelerate "
        "hooks of named children, which only a dispatched model has (fusion refuses those "
        "before tracing: fusion.engine.placement)",
    ),
    KnownWrapper(
        "torch.utils._contextlib",
        "context_decorator",
        ("decorate_context",),
        "func",
        "calls the wrapped forward with the same arguments inside one context manager "
        "(`@torch.no_grad()`, `@torch.autocast(...)`) entered around the whole call; the "
        "rewrite runs inside it too (`fusion.runtime.bound.rewrap` re-applies the wrapper), so every "
        "merged call runs in the state its originals ran in (one region: `fusion.analysis.regions`)",
    ),
    KnownWrapper(
        "torch.amp.autocast_mode",
        "autocast_decorator",
        ("decorate_autocast",),
        "func",
        "calls the wrapped forward with the same arguments inside one autocast context "
        "entered around the whole call (`@torch.autocast(...)`); re-applied around the "
        "rewrite like `context_decorator`",
    ),
    KnownWrapper(
        "kernels._internals.layer.layer",
        "use_kernelized_func",
        ("decorator", "new_forward"),
        "orig_forward",
        "calls the wrapped forward with the same arguments while the kernels functions it "
        "calls run as this instance's own copies (`kernel_function` refuses kernelized ones)",
    ),
)
"""Every wrapper `unwrap_forward` sees through (Transformers 4.57 to 5.25, kernels 0.19, torch's
context decorators)."""

KERNELS_LAYER_MODULE = "kernels._internals.layer.layer"
"""Where kernels builds the `Func` module class of a function it makes a layer of."""


def nested_code(code: types.CodeType, names: tuple[str, ...]) -> types.CodeType | None:
    """The code object defined in `code` as `names[0]`, in that as `names[1]`, ... (a
    nested `def` or class body), None if absent or ambiguous."""
    for name in names:
        found = [c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == name]
        if len(found) != 1:
            return None
        code = found[0]
    return code


def same_code(code: types.CodeType, proven: types.CodeType) -> bool:
    """Is `code` the proven code object, or a copy of it differing only in its name?

    torch 2.15's `context_decorator` renames its wrapper's frame (`code.replace(co_name=...)`)
    per decorated function, so identity alone refuses every `@torch.no_grad()` forward there.
    Safe: code objects compare equal only with the same bytecode, constants, names, variable
    names, line and exception tables; the copy is given the proven name back before the
    comparison and must come from the same file, so only the frame's label may differ."""
    if code is proven:
        return True
    if code.co_filename != proven.co_filename:
        return False
    names = {"co_name": proven.co_name}
    if hasattr(proven, "co_qualname"):  # Python >= 3.11
        names["co_qualname"] = proven.co_qualname
    return code.replace(**names) == proven


def _attribute(root: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        root = getattr(root, part, None)
    return root


def _factory_code(module: str, factory: str) -> types.CodeType | None:
    """The code of `module.factory` when that module is imported, else None."""
    loaded = sys.modules.get(module)
    function = inspect.unwrap(_attribute(loaded, factory)) if loaded is not None else None
    return getattr(function, "__code__", None)


def known_wrapper(fn: Any) -> KnownWrapper | None:
    """The `KnownWrapper` whose wrapper code `fn` runs, holding `fn.__wrapped__` in its
    wrapped-function cell; None for any other function."""
    code = getattr(fn, "__code__", None)
    inner = getattr(fn, "__wrapped__", None)
    if code is None or inner is None or not isinstance(fn, types.FunctionType):
        return None
    for known in KNOWN_WRAPPERS:
        factory = _factory_code(known.module, known.factory)
        proven = None if factory is None else nested_code(factory, known.nested)
        if proven is None or not same_code(code, proven):
            continue
        cells = dict(zip(code.co_freevars, fn.__closure__ or ()))
        cell = cells.get(known.cell)
        if cell is not None and _contents(cell) is inner:
            return known
    return None


def _contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _describe(fn: Any) -> str:
    """Where the wrapper's own code was written (`functools.wraps` copies the wrapped
    function's names onto it, so those would name the class's forward instead)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return repr(fn)
    module = getattr(fn, "__globals__", {}).get("__name__", "?")
    return f"{module}.{getattr(code, 'co_qualname', code.co_name)}"


def unwrap_forward(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function written in the class under `fn`'s decorators, each a `KNOWN_WRAPPERS`
    wrapper (so calling `fn` computes the returned function's function on the same
    arguments, save keyword renames); `fn` itself when it has no `__wrapped__`.

    Raises RewriteRefused naming the first wrapper that is not proven: tracing past it
    could record a function the forward does not compute."""
    while getattr(fn, "__wrapped__", None) is not None:
        if known_wrapper(fn) is None:
            raise RewriteRefused(
                f"the forward is wrapped by {_describe(fn)}, not a wrapper proven to only "
                "rename keyword arguments (fusion.trace.wrappers.KNOWN_WRAPPERS)"
            )
        fn = fn.__wrapped__  # type: ignore[attr-defined]
    return fn


def kernels_func_class(module: nn.Module) -> bool:
    """Is `module` an instance of a class kernels built from a function
    (`use_kernel_forward_from_hub` on a `def`): its `forward` is that class body's code?"""
    factory = _factory_code(KERNELS_LAYER_MODULE, "_create_func_module")
    code = None if factory is None else nested_code(factory, ("Func", "forward"))
    forward = getattr(type(module), "forward", None)
    return code is not None and getattr(forward, "__code__", None) is code


def kernel_function(called: nn.Module, owner: nn.Module) -> Callable[..., Any]:
    """The plain function a call of `called` (a kernels function object, not a submodule)
    computes inside `owner.forward`: the function kernels made a layer of.

    Proven by the code of kernels' `Func.forward`: it runs the function, or, while a
    `use_kernelized_func` forward is active, this instance's copy of the object (the
    same class). Either runs the function unless an instance-level `forward` (a hub
    kernel `kernelize` installed) replaces it, on the shared object or on `owner`'s copy;
    then, and for any other module object, raises RewriteRefused with the reason."""
    name = type(called).__qualname__
    if not kernels_func_class(called):
        raise RewriteRefused(f"calls a module that is not its submodule ({name})")
    forward = type(called).forward
    cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or ()))
    function = _contents(cells["func"]) if "func" in cells else None
    if not inspect.isfunction(function):
        raise RewriteRefused(f"calls a kernels layer ({name}) whose function is not found")
    # The key `use_kernelized_func` files the instance's copy under (its own expression).
    key = getattr(called, "__name__", None) or getattr(called, "kernel_layer_name", None)
    label = function.__name__
    copies = owner.__dict__.get("_kernel_funcs", {})
    copy = copies.get(key) if isinstance(copies, dict) else None
    for instance in (called, copy):
        if instance is not None and "forward" in instance.__dict__:
            raise RewriteRefused(
                f"calls {label}, kernelized (a hub kernel replaces its forward): what it "
                "computes is not the traced function"
            )
    if copy is not None and type(copy) is not type(called):
        raise RewriteRefused(f"calls {label}, whose routed copy is another class")
    return function
