"""The fused forward of an RMSNorm kept in its slot: the user's norm module stays where it was,
of its own class, and fusion installs `NormForward` as its instance-level `forward`.

Nothing about the norm is frozen at fuse time. Every call reads, from the module as it is
now, what the original forward would read: eps (its attribute, by ordinary lookup) and the
weight (so a `prune` mask or a replaced Parameter is what is normalised with), and checks the
premises the RMSNorm fuser's proof relied on before computing the proven variant:

- the instance is still of the class that was proven, and that class's `forward` (resolved
  through its MRO, as `nn.Module.__call__` would) is still the function that was proven:
  a patched class forward, or a class swap such as `torch.nn.utils.parametrize`'s, runs the
  current original instead;
- every other attribute the original forward read while the proof's dtype points ran
  (recorded as it was read, `fusion.fusers.rmsnorm.fuser`, not listed by hand) still has its
  fuse-time value (`fusion.analysis.reads.AttributeGuard`: plain values by value, methods by
  function, objects by identity), and the global names the forward reads still bind what
  they bound (`fusion.runtime.guards.GlobalsGuard`);
- eps is a number (or None where the proof saw it reach `F.rms_norm`), the weight a 1-D tensor
  as wide as the input, and the (input dtype, weight dtype) pair one the proof verified;
- PyTorch would run the plain dense ops now (`fusion.kernels.contract.plain_dense`: no
  autocast, no `__torch_function__`/`__torch_dispatch__` mode, no tensor subclass), so a mode
  sees exactly the ops the original runs.

Any premise that fails runs `type(module).forward(module, x)`: the unfused function, by
construction, counted in `guard_failures` with the reason in `last_failure`.

The route (as a rewritten forward's, `fusion.runtime.routes`): where the norm would run on
the torch reference kernels (eager, a CPU input under `auto` or `torch`) and the policy's
routes are open (`KernelPolicy.routes_open`), the call runs the class's original forward at
once, before any premise is read, counted in `original_calls`. Measured in situ on a decode
step (SmolLM2-135M, 2-core Xeon, float32, one thread), `torch.rms_norm` with no check at
all saved 0.5 ms of a 72 ms token over 61 norms, and the premise checks cost 3 ms: on a CPU
the norm gains nothing a check can pay for. While Dynamo traces, by the same rule (the
device is static in a trace; no table entry describes a norm, so neither the process's
quiet lane nor a product's own matters here): Inductor then compiles the original's ops
with the rest, as in the unfused model. The original is the unfused function by
construction, so the route changes speed, never the result. Hooks on the norm
need no premise: `nn.Module.__call__` runs them around this forward exactly as around the
class's. `copy.deepcopy` and pickling give the copy a forward of its own; an unpickled forward
whose class's forward source changed since it was saved always runs the original.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn

from fusion.analysis import source
from fusion.analysis.reads import AttributeGuard
from fusion.errors import RewriteRefused
from fusion.kernels.contract import mode_reason, plain_dense
from fusion.kernels.norm_variant import NormVariant
from fusion.kernels.ops import eager_reference
from fusion.kernels.policy import POLICY
from fusion.runtime.guards import GlobalsGuard
from fusion.runtime.merged import DtypePair, norm_kernel, norm_pair_kernel, uses_float32_aten

_MISSING = object()


def forward_source(cls: type) -> str | None:
    """The unparsed source of `cls.forward`'s innermost function, or None where it has none:
    what a pickled `NormForward` compares on load."""
    try:
        return source.unparse(source.recover_forward(cls)[0])
    except RewriteRefused:
        return None


class NormForward:
    """The proven RMSNorm variant of `module`, computed live from `module`'s own state."""

    fusion_installed = True  # `fusion.analysis.callpath.FUSION_INSTALLED`

    def __init__(
        self,
        module: nn.Module,
        *,
        variant: NormVariant,
        verified: frozenset[DtypePair],
        eps_attr: str,
        eps_default_rule: bool,
        weight_name: str | None,
        backend: str,
        reads: AttributeGuard,
        cls: type | None = None,
        proven_forward: Any = None,
        original: str | None = None,
    ) -> None:
        self.module = module
        self.cls = type(module) if cls is None else cls
        self.proven_forward = self.cls.forward if proven_forward is None else proven_forward
        self.original = forward_source(self.cls) if original is None else original
        self.variant = variant
        self.verified = frozenset(verified)
        self.eps_attr = eps_attr
        self.eps_default_rule = eps_default_rule
        self.weight_name = weight_name
        self.backend = backend
        self.reads = reads
        self.globals_guard = GlobalsGuard.of(inspect.unwrap(self.proven_forward))
        self._class_dicts = tuple(vars(klass) for klass in self.cls.__mro__)
        self.float32_aten = uses_float32_aten(variant)
        self.guard_failures = 0
        self.last_failure: str | None = None
        self.original_calls = 0
        """Calls that ran the class's original forward by the route (the module docstring),
        while routes are counted (`KernelPolicy.counting_routes`)."""
        self.disabled: str | None = None
        """Set when an unpickled forward cannot be trusted: every call runs the original."""
        signature = inspect.signature(inspect.unwrap(self.cls.forward))
        self.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])

    # -- premises -------------------------------------------------------------------------

    def _weight(self) -> Any:
        """The weight as `self.<weight_name>` reads it now (None for a weightless norm), or
        `_MISSING` where the lookup fails."""
        name = self.weight_name
        if name is None:
            return None
        module = self.module
        state = module.__dict__
        if name in state:  # e.g. `prune`: the masked weight is a plain attribute
            return state[name]
        weight = module._parameters.get(name, _MISSING)
        if weight is _MISSING:
            return getattr(module, name, _MISSING)
        return weight

    def _eps(self) -> Any:
        state = self.module.__dict__
        name = self.eps_attr
        return state[name] if name in state else getattr(self.module, name, _MISSING)

    def failure(self, x: Any, weight: Any, eps: Any, compiling: bool = False) -> str | None:
        """Why the proven variant may not compute this call (the first failed premise), or
        None. Reads nothing it does not compare; caches nothing between calls. `compiling`:
        Dynamo is tracing (the caller asked once)."""
        if self.disabled is not None:
            return self.disabled
        module = self.module
        cls = type(module)
        if cls is not self.cls:
            return f"the norm became a {cls.__name__}"
        if cls.forward is not self.proven_forward:
            return f"{cls.__name__}.forward was replaced"
        name = self.weight_name
        if name is not None:
            # a class attribute of the weight's name (a property added later) is found
            # before the instance's parameter; the class dicts are live views
            for namespace in self._class_dicts:
                if name in namespace:
                    return f"{cls.__name__}.{name} is a class attribute"
        changed = self.reads.failure() if self.reads.checks else None
        if changed is not None:
            return f"{changed}, which the norm's forward read, changed"
        # While Dynamo traces, the globals are left to its own guards (as `BoundForward`).
        reason = None if compiling else self.globals_guard.failure()
        if reason is not None:
            return reason
        if not isinstance(x, torch.Tensor):
            return "the input is not a tensor"
        if eps is None:
            if not self.eps_default_rule:
                return f"{self.eps_attr} is None"
        elif type(eps) not in (float, int):
            return f"{self.eps_attr} is a {type(eps).__name__}"
        if weight is not None:
            if weight is _MISSING or not isinstance(weight, torch.Tensor):
                return f"{name} is not a tensor"
            shape, width = weight.shape, x.shape
            if len(shape) != 1 or not width or shape[0] != width[-1]:
                return f"{name} is not a per-channel weight of the input's width"
        pair = (x.dtype, None if weight is None else weight.dtype)
        if pair not in self.verified:
            return f"dtypes {pair} were not proven"
        return plain_dense("cpu" if x.is_cpu else x.device.type, x, weight, matmul=False)

    # -- calls ----------------------------------------------------------------------------

    def routed(self, x: Any) -> bool:
        """Does a call on `x` take the route (the module docstring): routes open, `x` a
        tensor the torch reference kernels would compute eagerly on this norm's backend?"""
        if not (POLICY.routes_open() and isinstance(x, torch.Tensor)):
            return False
        if torch.compiler.is_compiling():  # the same device rule (static while tracing)
            backend = self.backend
            return backend == "torch" or (backend == "auto" and x.is_cpu)
        return eager_reference(self.backend, x)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) != 1 or kwargs:
            return self._original(*args, **kwargs)
        x = args[0]
        # `routed(x)` and `_original`, inlined (a test holds this copy to `routed`'s rule):
        # on a CPU decode step nearly every call takes the route, each frame runs from the
        # caches a weight-streaming GEMV has just emptied: three frames of a norm's four
        # measured 1.4% of a SmolLM2 bf16 token (one in-process A/B, one thread)
        backend = self.backend
        if (
            POLICY.routes
            and not POLICY.recording
            and isinstance(x, torch.Tensor)
            and (backend == "torch" or (backend == "auto" and x.is_cpu))
        ):
            module = self.module
            # counted only where asked (`KernelPolicy.counting`), and never while Dynamo
            # traces (it would guard on the count): the question is a frame
            if POLICY.counting and not torch.compiler.is_dynamo_compiling():
                self.original_calls += 1
            return type(module).forward(module, x)
        compiling = torch.compiler.is_compiling()
        if not compiling:
            # first, before any tensor is asked anything: a mode would record the question
            reason = mode_reason()
            if reason is not None:
                self._fell_back(reason)
                return self._original(*args)
        x = args[0]
        weight, eps = self._weight(), self._eps()
        reason = self.failure(x, weight, eps, compiling)
        if reason is not None:
            self._fell_back(reason)
            return self._original(x)
        return norm_kernel(x, weight, eps, self.variant, self.float32_aten, self.backend)

    def add_forward(self, a: Any, b: Any) -> tuple[Any, Any]:
        """`(s, n)`: what `s = a + b; n = module(s)` binds, with the add and this norm as one
        `add_rms_norm` kernel call where every premise holds for `s` (two tensors of one
        dtype and shape, so `s` has their dtype and shape); else exactly those two
        statements. The caller checks that calling the module runs nothing but this forward
        (no hooks, no call path of its own: `fusion.fusers.residual_norm.runtime`). On the
        route (`routed`), those two statements, the norm's call taking the route."""
        if self.routed(a):
            total = a + b
            return total, self.module(total)
        if (
            (torch.compiler.is_compiling() or mode_reason() is None)
            and isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
        ):
            weight, eps = self._weight(), self._eps()
            compiling = torch.compiler.is_compiling()
            if (
                self.failure(a, weight, eps, compiling) is None
                and plain_dense(a.device.type, b) is None
            ):
                return norm_pair_kernel(a, b, weight, eps, self.variant, self.backend)
        total = a + b
        return total, self.module(total)

    def _original(self, *args: Any, **kwargs: Any) -> Any:
        """What the unfused module runs now: its current class's forward."""
        return type(self.module).forward(self.module, *args, **kwargs)

    def _fell_back(self, reason: str) -> None:
        if not torch.compiler.is_compiling():
            self.guard_failures += 1
            self.last_failure = reason

    # -- copies ---------------------------------------------------------------------------

    @property
    def __self__(self) -> nn.Module:
        return self.module

    def _fields(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "verified": self.verified,
            "eps_attr": self.eps_attr,
            "eps_default_rule": self.eps_default_rule,
            "weight_name": self.weight_name,
            "backend": self.backend,
        }

    def __deepcopy__(self, memo: dict[int, Any]) -> NormForward:
        module = copy.deepcopy(self.module, memo)
        return NormForward(
            module,
            reads=copy.deepcopy(self.reads, memo),
            cls=self.cls,
            proven_forward=self.proven_forward,
            original=self.original,
            **self._fields(),
        )

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_rebuild, (self.module, self.cls, self.original, self.reads, self._fields()))

    def rebound(self, module: nn.Module) -> NormForward:
        """This forward for `module`, a shallow copy of `self.module` (`bound.CopyHook`):
        the reads it guards are re-pointed from the original at the copy (a read of the
        module itself, or a method bound to it), so the copy is judged on its own state."""
        old = self.module

        def moved(value: Any) -> Any:
            return module if value is old else value

        reads = AttributeGuard(
            tuple((moved(o), n, k, a, moved(b)) for o, n, k, a, b in self.reads.checks)
        )
        forward = NormForward(
            module,
            reads=reads,
            cls=self.cls,
            proven_forward=self.proven_forward,
            original=self.original,
            **self._fields(),
        )
        forward.disabled = self.disabled
        return forward

    def __repr__(self) -> str:
        return (
            f"<fused forward of {type(self.module).__name__} "
            f"({self.variant.describe(self.weight_name is not None)}, eps from "
            f"{self.eps_attr}, backend={self.backend})>"
        )


def _rebuild(
    module: nn.Module, cls: type, original: str | None, reads: AttributeGuard, fields: dict
) -> NormForward:
    """A `NormForward` for an unpickled module. Where the class's forward source is not the
    one proven (another Transformers version) the forward is disabled: every call runs the
    original, never an old proof grafted onto a changed class."""
    forward = NormForward(module, reads=reads, cls=cls, original=original, **fields)
    if original is None or forward_source(cls) != original:
        forward.disabled = f"{cls.__qualname__}.forward changed since the model was saved"
    return forward
