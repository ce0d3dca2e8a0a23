"""The rewritten forward a fuser installs on one instance: a bound method that survives
`torch.save`, `pickle` and `copy.deepcopy`.

A rewritten forward is a function compiled at fuse time from an edited AST. Bound with
`types.MethodType` it works, but a whole-model pickle loses it silently: the method pickles
as `getattr(module, "forward")`, evaluated before the module's state is restored, so the
reloaded module gets its class's *original* forward, which calls projections that no longer
exist (or, worse, would compute something else). And the compiled function carries its
class's qualname, so pickling it directly also resolves to the original.

A class's forward may be wrapped (`functools.wraps` decorators such as Transformers'
`deprecate_kwarg`, or the gradient-checkpointing wrapper `GradientCheckpointingLayer` puts
around every decoder layer's forward). The rewrite is of the innermost function; the
wrappers still run around it (`rewrap`), so renamed keywords, checkpointing and whatever
else they do behave as before. A wrapper that cannot be rebuilt around the rewrite refuses
the fusion.

`BoundForward` is callable like the bound method (Dynamo traces it fullgraph, and
`inspect.signature` sees the method's signature) and pickles as what rebuilds it: the class,
the original source it was derived from, and the rewritten AST. On load the class's current
forward source must be the one that was rewritten; otherwise loading raises instead of
grafting an old rewrite onto a changed forward.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

from torch import nn

from fusion import source
from fusion.errors import RewriteRefused


class BoundForward:
    """`fn` (a compiled rewrite of `cls.forward`) bound to `module`."""

    def __init__(
        self,
        module: nn.Module,
        cls: type,
        original: str,
        rewritten: ast.FunctionDef,
        fn: Callable[..., Any],
    ) -> None:
        self.module = module
        self.cls = cls
        self.original = original
        self.rewritten = rewritten
        self.fn = fn
        self.call = rewrap(cls.forward, fn)
        # The class's own signature (the rewrite keeps the parameters, minus annotations).
        signature = inspect.signature(inspect.unwrap(cls.forward))
        self.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])
        self.__name__ = getattr(fn, "__name__", "forward")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(self.module, *args, **kwargs)

    @property
    def __self__(self) -> nn.Module:
        return self.module

    @property
    def __func__(self) -> Callable[..., Any]:
        return self.fn

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_rebuild, (self.module, self.cls, self.original, self.rewritten))

    def __deepcopy__(self, memo: dict[int, Any]) -> BoundForward:
        # The compiled function is immutable and shared; only the instance is copied.
        module = copy.deepcopy(self.module, memo)
        return BoundForward(module, self.cls, self.original, self.rewritten, self.fn)

    def __repr__(self) -> str:
        return f"<fused forward of {type(self.module).__name__} (rewritten by fusion)>"


def rewrap(wrapper: Callable[..., Any], replacement: Callable[..., Any]) -> Callable[..., Any]:
    """`wrapper` (a class's forward as the class holds it) with its innermost function
    (`inspect.unwrap`) replaced by `replacement`: each wrapper level rebuilt from its own
    code, globals and closure, the one closure cell holding the next inner function pointing
    at the rebuilt inner level instead. `replacement` itself when nothing wraps it.

    Safe because each rebuilt level runs its own unchanged code on the same cells (a wrapper
    that tests `type(self).forward is <itself>` still sees the original), and only the call
    into the wrapped function changes. Raises RewriteRefused, naming the wrapper, when a
    level is not a plain function or reaches the wrapped function other than through exactly
    one closure cell (a class-based wrapper, a partial, a registry lookup): such a wrapper
    cannot be re-applied, and dropping it would change what calling the module does."""
    inner = getattr(wrapper, "__wrapped__", None)
    if inner is None:
        return replacement
    name = getattr(wrapper, "__qualname__", repr(wrapper))
    if not isinstance(wrapper, types.FunctionType):
        raise RewriteRefused(f"forward is wrapped by {name}, which is not a plain function")
    cells = wrapper.__closure__ or ()
    holding = [index for index, cell in enumerate(cells) if _contents(cell) is inner]
    if len(holding) != 1:
        raise RewriteRefused(
            f"forward is wrapped by {name}, which does not hold the wrapped function in "
            "exactly one closure cell: it cannot be re-applied around the rewrite"
        )
    rebuilt_inner = rewrap(inner, replacement)
    closure = tuple(
        types.CellType(rebuilt_inner) if index in holding else cell
        for index, cell in enumerate(cells)
    )
    rebuilt = types.FunctionType(
        wrapper.__code__, wrapper.__globals__, wrapper.__name__, wrapper.__defaults__, closure
    )
    rebuilt.__kwdefaults__ = wrapper.__kwdefaults__
    functools.update_wrapper(rebuilt, wrapper, updated=())
    rebuilt.__dict__.update(wrapper.__dict__)
    rebuilt.__wrapped__ = rebuilt_inner  # type: ignore[attr-defined]
    return rebuilt


def _contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell (a name not bound yet)
        return None


def _rebuild(
    module: nn.Module, cls: type, original: str, rewritten: ast.FunctionDef
) -> BoundForward:
    """Recompile the rewrite against `cls`'s current forward (unpickling).

    Raises RuntimeError when `cls.forward` no longer has the source the rewrite was derived
    from (another Transformers version): the rewrite's other statements are that old source,
    and mixing them with a changed class is not a function anyone proved equal."""
    funcdef, fn = source.recover_forward(cls)
    if source.unparse(funcdef) != original:
        raise RuntimeError(
            f"cannot restore the fused forward of {cls.__qualname__}: its forward's source "
            "changed since the model was fused and saved (another Transformers version?); "
            "load the model where it was saved, or save its state_dict and fuse again"
        )
    return BoundForward(module, cls, original, rewritten, source.compile_forward(rewritten, fn))


def bind(module: nn.Module, fn: Callable[..., Any]) -> None:
    """Install `fn`, a rewrite compiled by `source.compile_forward`, as `module.forward`
    (this instance only)."""
    rewritten, original_fn = fn.__fusion_rewrite__  # type: ignore[attr-defined]
    cls = type(module)
    if inspect.unwrap(cls.forward) is not original_fn:
        raise ValueError(f"{fn!r} is not a rewrite of {cls.__qualname__}.forward")
    original = getattr(fn, "__fusion_original__", None)
    if original is None:  # parsed once per compiled rewrite, not per instance
        original = source.unparse(source.recover_forward(cls)[0])
        fn.__fusion_original__ = original  # type: ignore[attr-defined]
    module.forward = BoundForward(module, cls, original, rewritten, fn)
