"""The rewritten forward a fuser installs on one instance: a bound method that survives
`torch.save`, `pickle`, `copy.deepcopy` and `copy.copy` (`CopyHook`: a copy's forward reads
the copy).

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

Guards (`fusion.runtime.guards`): the children, methods and global names a fuser's proof relied on,
and the forward it rewrote (the instance's class and its `forward` at bind time), are
checked before every call; when one no longer holds (a child replaced, shadowed or hooked,
a helper monkeypatched, the class forward patched or the class swapped), the call runs the
forward of the module's class *now* (`type(module).forward`, what the unfused module would
run) instead, counted in `guard_failures`. The fused state never removes what the original forward needs (merged
projections keep their children, `fusion.runtime.merged.MergedLinear`), so the original always
computes the unfused function. While Dynamo traces, the child guards are traced with the
forward (Dynamo then guards what they read, and recompiles when it changes); the global
names are left to Dynamo's own guards on the globals it reads.

Routes (`fusion.runtime.routes`): where every kernel the rewrite could choose for a call
runs its reference (nothing measured to win here, or measured to lose), the call runs that
forward too, before any guard is checked (the original needs none), counted in
`original_calls` while routes are counted (`KernelPolicy.counting_routes`: a count costs a
frame on the hottest path).
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from fusion.analysis import source
from fusion.analysis.callpath import FUSION_INSTALLED
from fusion.errors import RewriteRefused
from fusion.kernels.policy import POLICY
from fusion.runtime import routes
from fusion.runtime.guards import (
    ChildGuard,
    GlobalsGuard,
    Guard,
    distinct,
    first_failure,
    holding_check,
)
from fusion.runtime.norm_forward import NormForward


class BoundForward:
    """`fn` (a compiled rewrite of `cls.forward`) bound to `module`."""

    fusion_installed = True  # `fusion.analysis.callpath.FUSION_INSTALLED`

    def __init__(
        self,
        module: nn.Module,
        cls: type,
        original: str,
        rewritten: ast.FunctionDef,
        fn: Callable[..., Any],
        guards: tuple[Guard, ...] = (),
        globals_guard: GlobalsGuard | None = None,
        class_forward: Callable[..., Any] | None = None,
        norm_sites: tuple[str, ...] = (),
    ) -> None:
        self.module = module
        self.cls = cls
        self.class_forward = cls.forward if class_forward is None else class_forward
        self.norm_sites = norm_sites
        """The children a residual-norm rewrite passes to its add + norm helper (its route:
        `routes.NormRoute`); () for every other rewrite."""
        """`cls.forward` as the class held it when the rewrite was bound (wrappers and all):
        the function the proof is about. A call finding another (`type(module).forward`
        patched, the instance's class swapped) runs that one instead."""
        self.original = original
        self.rewritten = rewritten
        self.fn = fn
        self.guards = guards
        self.globals_guard = GlobalsGuard.of(fn) if globals_guard is None else globals_guard
        self.guard_failures = 0
        self.last_failure: str | None = None
        self.original_calls = 0
        """Calls that ran the class's original forward by the route (`fusion.runtime.routes`):
        every kernel the rewrite could choose measured slower here for the call; counted
        only while routes are counted (`KernelPolicy.counting_routes`)."""
        self.call = rewrap(self.class_forward, fn)
        # The class's own signature (the rewrite keeps the parameters, minus annotations).
        signature = inspect.signature(inspect.unwrap(self.class_forward))
        self.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])
        self.__name__ = getattr(fn, "__name__", "forward")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        laned = self._laned
        if laned is not None:
            # `Route.takes_original`'s first block (the process's lanes), spelled out: on a
            # decode step nearly every call of a model nobody calibrated, or calibrated for
            # its prompt's rows, ends here, and each frame runs from the caches a
            # weight-streaming GEMV has just emptied (one frame per fused forward is what
            # remains over the unfused model: docs/benchmarks.md). A test holds this copy
            # to the method.
            policy = POLICY
            if policy.routes and not policy.recording:
                x = args[0] if args else kwargs.get(laned.first)
                tensor = isinstance(x, torch.Tensor)
                width = laned._width
                lane = policy.row_lane
                if (
                    policy.lane is True
                    or (
                        tensor
                        and lane is not None
                        and x.dim()
                        and x.shape[-1] == width
                        and ((bound := lane.get(x.dtype)) is None or 2 * x.numel() <= bound * width)
                    )
                ) and (not laned._acts_on_cpu or (tensor and x.is_cpu)):
                    for watched in laned._watched:
                        state = watched.__dict__  # `callpath.HOOK_ATTRS`, inline
                        if (
                            state.get("_forward_hooks")
                            or state.get("_forward_pre_hooks")
                            or state.get("_backward_hooks")
                            or state.get("_backward_pre_hooks")
                        ):
                            break
                    else:
                        if policy.counting and not torch.compiler.is_dynamo_compiling():
                            self.original_calls += 1
                        return type(module).forward(module, *args, **kwargs)
        sited = self._sited
        if sited is not None:
            # `NormRoute.takes_original`, spelled out likewise (it decides alone: a rewrite
            # with norm sites has no other route); a test holds this copy to the method
            policy = POLICY
            if policy.routes and not policy.recording:
                x = args[0] if args else kwargs.get(sited.first)
                if isinstance(x, torch.Tensor):
                    children = module._modules
                    for name in sited.sites:
                        child = children.get(name)
                        norm = None if child is None else child.__dict__.get("forward")
                        if type(norm) is NormForward and not (
                            norm.backend == "torch" or (norm.backend == "auto" and x.is_cpu)
                        ):
                            break
                    else:
                        if policy.counting and not torch.compiler.is_dynamo_compiling():
                            self.original_calls += 1
                        return type(module).forward(module, *args, **kwargs)
        route = self._route
        if route is not None and sited is None and route.takes_original(args, kwargs):
            # counted only where asked, never while Dynamo traces (it would guard on the
            # count): asking is a frame
            if POLICY.counting and not torch.compiler.is_dynamo_compiling():
                self.original_calls += 1
            # what calling the unfused module runs now: its current class's forward
            return type(module).forward(module, *args, **kwargs)
        reason = self.failure()
        if reason is None:
            return self.call(module, *args, **kwargs)
        if not torch.compiler.is_compiling():
            self.guard_failures += 1
            self.last_failure = reason
        return type(module).forward(module, *args, **kwargs)

    @property
    def guards(self) -> tuple[Guard, ...]:
        """What the proof relied on, each premise once (`distinct`)."""
        return self._guards

    @guards.setter
    def guards(self, guards: Iterable[Guard]) -> None:
        self._guards = distinct(guards)
        self._holds = holding_check(self._guards, self.cls, self.class_forward)
        route = routes.route_of(self._guards, self.class_forward)
        if self.norm_sites:  # a rewrite of both kinds has no route: neither rule covers it
            norm_route = routes.norm_route_of(self.module, self.norm_sites, self.class_forward)
            route = norm_route if route is None else None
        self._route = route
        self._laned = route if isinstance(route, routes.Route) and route._laned else None
        """The route whose lane block `__call__` spells out (a route of lane backends)."""
        self._sited = route if isinstance(route, routes.NormRoute) else None
        """The residual-norm route `__call__` spells out whole."""

    def failure(self) -> str | None:
        """Why the rewrite may not run now (a guard that no longer holds), or None: the
        one-frame check of the common case first (`holding_check`, which also asks that the
        module is still of `cls` and `cls.forward` still `class_forward`), the premises
        one by one (naming the reason) only when it says no. While Dynamo traces, the
        premises one by one (plain Python it traces, so it guards what they read; the
        one-frame check's `dict_keys` views and MRO identity are eager-only), and no global
        names (Dynamo guards the globals it reads itself)."""
        if torch.compiler.is_compiling():
            return self.class_failure() or first_failure(self.module, self._guards)
        if self._holds(self.module):
            return self.globals_guard.failure()
        return (
            self.class_failure()
            or first_failure(self.module, self._guards)
            or self.globals_guard.failure()
        )

    def class_failure(self) -> str | None:
        """Why the module's forward as Python resolves it now (`type(module).forward`) is
        not the one rewritten, or None. A class swap fails even where the new class
        inherits the same forward: the proof read the old class (its methods, attributes,
        lookup), and a swap (`torch.nn.utils.parametrize`, a user's subclass) may change
        any of them; the fallback runs the new class's forward, as the unfused module
        would."""
        kind = type(self.module)
        if kind is not self.cls:
            return f"the module became a {kind.__qualname__}"
        if kind.forward is not self.class_forward:
            return f"{kind.__qualname__}.forward was replaced"
        return None

    @property
    def __self__(self) -> nn.Module:
        return self.module

    @property
    def __func__(self) -> Callable[..., Any]:
        return self.fn

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (
            _rebuild,
            (self.module, self.cls, self.original, self.rewritten, self.guards, self.norm_sites),
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> BoundForward:
        # The compiled function and the global names are shared; the instance and the
        # children its guards watch are copied (memo: the copy's own children).
        module = copy.deepcopy(self.module, memo)
        guards = copy.deepcopy(self.guards, memo)
        return BoundForward(
            module,
            self.cls,
            self.original,
            self.rewritten,
            self.fn,
            guards,
            self.globals_guard,
            self.class_forward,
            self.norm_sites,
        )

    def rebound(self, module: nn.Module) -> BoundForward:
        """This rewrite bound to `module`, a shallow copy of `self.module` (`copy.copy`:
        the same children, so the same guards), with counters of its own."""
        return BoundForward(
            module,
            self.cls,
            self.original,
            self.rewritten,
            self.fn,
            self.guards,
            self.globals_guard,
            self.class_forward,
            self.norm_sites,
        )

    def __repr__(self) -> str:
        return f"<fused forward of {type(self.module).__name__} (rewritten by fusion)>"


class CopyHook:
    """The `__reduce_ex__` `bind` puts on a fused instance, so that a shallow copy's
    forward reads the copy.

    `copy.copy(module)` looks `__copy__` up on the class (none on `nn.Module`), then
    `__reduce_ex__` on the *instance*; by default it rebuilds the copy from the instance
    dict as it is, so the copy's `forward` would be this very `BoundForward`, reading the
    original module's attributes (the copy's `eval()`, an attribute set on the copy, would
    be ignored). This hook answers as `object.__reduce_ex__` does (the class's
    `__getstate__`, every protocol) but through `_fused_instance`, which gives the new
    instance a one-shot `__setstate__` (`_Rebinding`): after the class's own `__setstate__`
    it rebinds every forward fusion installed (`callpath.FUSION_INSTALLED`) that is bound
    to another module, or drops it where it cannot be rebound (the class forward then runs:
    the unfused function), and the hook itself. `copy.deepcopy` and pickling take the same
    route, where the state already maps onto the new instance (memo, pickle's memo) and
    nothing needs rebinding.

    Not covered: an instance dict copied by other means (`nn.Module.
    _replicate_for_data_parallel`'s `__dict__.copy()`) shares the forward and this hook,
    which cannot tell which instance it was looked up on (an instance-dict value is not
    bound)."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, protocol: int = 4) -> tuple[Any, ...]:
        module = self.module
        return (_fused_instance, (type(module),), module.__getstate__())

    def __deepcopy__(self, memo: dict[int, Any]) -> CopyHook:
        return CopyHook(copy.deepcopy(self.module, memo))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (CopyHook, (self.module,))


class _Rebinding:
    """The one-shot `__setstate__` of an instance `_fused_instance` made (see `CopyHook`)."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, state: Any) -> None:
        module = self.module
        module.__dict__.pop("__setstate__", None)
        type(module).__setstate__(module, state)
        rebind_installed(module)


def _fused_instance(cls: type) -> nn.Module:
    """A new, empty instance of `cls` (as `copyreg.__newobj__` makes it) whose state, once
    set, is rebound to it (`_Rebinding`)."""
    module = cls.__new__(cls)
    module.__dict__["__setstate__"] = _Rebinding(module)
    return module


def rebind_installed(module: nn.Module) -> None:
    """Point what fusion installed on `module`'s instance dict at `module` itself: a forward
    (`callpath.FUSION_INSTALLED`) bound to another module is rebound (`rebound`) or, where
    it has no way to be, removed (the class forward runs: the unfused function, fail
    closed); the copy hook likewise."""
    state = module.__dict__
    forward = state.get("forward")
    if (
        forward is not None
        and getattr(type(forward), FUSION_INSTALLED, False) is True
        and getattr(forward, "__self__", None) is not module
    ):
        rebound = getattr(forward, "rebound", None)
        if rebound is None:
            del state["forward"]
        else:
            state["forward"] = rebound(module)
    hook = state.get("__reduce_ex__")
    if isinstance(hook, CopyHook) and hook.module is not module:
        state["__reduce_ex__"] = CopyHook(module)


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
    module: nn.Module,
    cls: type,
    original: str,
    rewritten: ast.FunctionDef,
    guards: tuple[Guard, ...] = (),
    norm_sites: tuple[str, ...] = (),
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
    compiled = source.compile_forward(rewritten, fn)
    return BoundForward(module, cls, original, rewritten, compiled, guards, norm_sites=norm_sites)


def replace_guarded_child(parent: nn.Module, name: str, old: nn.Module, new: nn.Module) -> None:
    """Fusion itself put `new` (a fused module computing `old`'s function, proven by its
    fuser) in `parent.<name>` in place of `old`: a guard of `parent`'s rewritten forward
    that watched `old` there now watches `new`. Any other replacement fails the guard."""
    forward = parent.__dict__.get("forward")
    if not isinstance(forward, BoundForward):
        return
    forward.guards = distinct(
        ChildGuard(name, new, type(new), guard.called)
        if isinstance(guard, ChildGuard) and guard.name == name and guard.child is old
        else guard
        for guard in forward.guards
    )


def bind(
    module: nn.Module,
    fn: Callable[..., Any],
    guards: tuple[Guard, ...] = (),
    *,
    norm_sites: tuple[str, ...] = (),
) -> None:
    """Install `fn`, a rewrite compiled by `source.compile_forward`, as `module.forward`
    (this instance only), guarded by `guards` (what the fuser's proof relied on that the
    user can change) and by the global names `fn` reads. `norm_sites`: the norms a
    residual-norm rewrite adds into (its route, `routes.NormRoute`)."""
    rewritten, original_fn = fn.__fusion_rewrite__  # type: ignore[attr-defined]
    cls = type(module)
    if inspect.unwrap(cls.forward) is not original_fn:
        raise ValueError(f"{fn!r} is not a rewrite of {cls.__qualname__}.forward")
    original = getattr(fn, "__fusion_original__", None)
    if original is None:  # parsed once per compiled rewrite, not per instance
        original = source.unparse(source.recover_forward(cls)[0])
        fn.__fusion_original__ = original  # type: ignore[attr-defined]
    forward = BoundForward(
        module, cls, original, rewritten, fn, tuple(guards), norm_sites=tuple(norm_sites)
    )
    install_forward(module, forward)


def install_forward(module: nn.Module, forward: Any) -> None:
    """Make `forward` (a forward object fusion made for `module`: `FUSION_INSTALLED`, with a
    `rebound(other)` method) `module`'s instance-level forward, with the `CopyHook` that
    gives a shallow copy of `module` a forward of its own."""
    assert getattr(type(forward), FUSION_INSTALLED, False) is True and forward.__self__ is module
    module.forward = forward
    module.__dict__["__reduce_ex__"] = CopyHook(module)  # copies rebind it (`CopyHook`)
