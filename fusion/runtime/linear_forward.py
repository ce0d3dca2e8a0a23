"""The forward `decode_linear` installs on one plain `nn.Linear`: `nn.Linear.forward`'s
function, with the decode-sized CPU kernels behind it, and no visible change of type.

The module keeps its class (exactly `nn.Linear`), its Parameters, hooks, name and place;
only `module.forward` becomes a `LinearForward` (an instance attribute, as
`fusion.runtime.bound.BoundForward` is for rewritten forwards). Type-keyed tools therefore see the
unfused model: `torch.ao.quantization.quantize_dynamic(model, {nn.Linear})` replaces the
module with a new quantised one (this forward goes with the old module), `isinstance` and
`type(m) is nn.Linear` answer as before, and a patch of `nn.Linear.forward` is obeyed.

Why it is safe: per call, first, where the quiet lane is open (`KernelPolicy.quiet`: routes
open, nothing measured to win for any linear, an `auto` or `torch` backend, eager) the call
runs `type(module).forward(module, *args, **kwargs)`, what the unfused module runs, and
nothing else. Otherwise the premises of "this call computes
`F.linear(x, module.weight, module.bias)`" are checked (`premise_failure`): the module is
still exactly an `nn.Linear` (a class swap, a parametrization's subclass, `__class__`
assignment: no longer), `nn.Linear.forward` is still torch's own (a monkeypatch), the
global `F` it reads is still `torch.nn.functional` and `F.linear` is still torch's own, and
the call is the one-tensor call that forward takes. When one fails the call runs
`type(module).forward(module, *args, **kwargs)`, what the unfused module runs, counted in
`guard_failures` (the reason in `last_failure`). When they hold, the product is the kernel
the policy chooses (`ops.product('linear', ...)`), which asks the dispatcher's contract
(`contract.plain_dense`: no autocast, mode, subclass, functorch transform or reduced
precision) and its operand rules itself, and reads the weight and bias as they are now
(ordinary attribute access: pruning's pre-hooks, a replaced Parameter, in-place writes are
all seen); anything else is `F.linear`. Nothing is cached between calls.

`copy.deepcopy` and pickling (`torch.save`) give a copy whose forward reads the copy
(`__deepcopy__`, `__reduce__`); Dynamo traces it (the premises are identity tests Dynamo
guards on; the kernel is the `fusion::linear_product` operator while tracing).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import linear as linear_module

from fusion.kernels import ops
from fusion.kernels.policy import LANE_BACKENDS, POLICY, quiet_for
from fusion.runtime.bound import install_forward

LINEAR_FORWARD = nn.Linear.__dict__["forward"]
"""torch's own `nn.Linear.forward`, taken when fusion is imported: the function whose
result the fast path stands in for. A later patch of `nn.Linear.forward` is seen per call."""

FUNCTIONAL = F
LINEAR = F.linear
"""`torch.nn.functional` and its `linear`: what `LINEAR_FORWARD` reads (the global `F` of
`torch.nn.modules.linear`, then `F.linear`), watched by identity like its own binding."""

_SIGNATURE = inspect.signature(LINEAR_FORWARD)
_SIGNATURE = _SIGNATURE.replace(parameters=list(_SIGNATURE.parameters.values())[1:])


def premise_failure(
    module: nn.Module, args: tuple[Any, ...] = (None,), kwargs: Any = None
) -> str | None:
    """Why a call of `module` with `args` / `kwargs` may not take the fast path now, or None:
    the module is not exactly `nn.Linear`, `nn.Linear.forward`, the `F` it reads or
    `F.linear` is no longer torch's own, or the call is not one positional input. The
    `decode_linear` fuser refuses on the same answer (with the default one-input call)."""
    if type(module) is not nn.Linear:
        return f"the module is a {type(module).__name__}, not exactly nn.Linear"
    if nn.Linear.forward is not LINEAR_FORWARD:
        return "nn.Linear.forward was replaced"
    if linear_module.F is not FUNCTIONAL or FUNCTIONAL.linear is not LINEAR:
        return "torch.nn.functional.linear (read by nn.Linear.forward) was replaced"
    if len(args) != 1 or kwargs:
        return "the call is not one positional input"
    return None


class LinearForward:
    """`nn.Linear.forward` of `module`, computed by the kernel the policy chooses for its
    shape (`backend` as `fusion.fuse(backend=...)`), or by the class's forward where a
    premise fails (module docstring)."""

    fusion_installed = True  # `fusion.analysis.callpath.FUSION_INSTALLED`

    def __init__(self, module: nn.Module, backend: str = "auto") -> None:
        # Only stored: unpickling calls this with a module whose state is not restored yet.
        self.module = module
        self.backend = backend
        self.laned = backend in LANE_BACKENDS
        """Whether this forward takes the quiet lane when it is open (`KernelPolicy.quiet`)."""
        self.guard_failures = 0
        self.last_failure: str | None = None
        self._choice: tuple | None = None  # `ops.chosen_for`'s memo
        self._lane_memo: tuple | None = None  # (epoch, answer) of `won_rows`: `_quiet_call`
        self.__signature__ = _SIGNATURE
        self.__name__ = "forward"
        self.__qualname__ = "Linear.forward"
        self.__doc__ = LINEAR_FORWARD.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        policy = POLICY
        # the quiet lane (`KernelPolicy.quiet`): nothing to choose for any linear, so what
        # the unfused module runs, `nn.Linear.forward` or whatever its class holds now;
        # the process's lane first, read alike eager and traced (`KernelPolicy.traced_lane`),
        # so the common call asks nobody whether Dynamo traces (two frames, cold on a
        # decode step)
        if self.laned and policy.routes and not policy.recording:
            if policy.lane is True:
                return type(module).forward(module, *args, **kwargs)
            # the process's row-bucket lane (`KernelPolicy.row_lane`, `in_row_lane`
            # inline), likewise alike eager and traced
            lane = policy.row_lane
            if lane is not None and len(args) == 1 and not kwargs:
                x = args[0]
                if isinstance(x, torch.Tensor) and x.dim():
                    bound = lane.get(x.dtype)
                    if bound is None or 2 * x.numel() <= bound * x.shape[-1]:
                        return type(module).forward(module, *args, **kwargs)
        if self.laned and (
            (policy.traced_lane() or policy.traced_own_lane(self._lane_keys()))
            if torch.compiler.is_compiling()
            else policy.routes
            and not policy.recording
            and (policy.lane or (policy.lane is None and policy.quiet()) or self._quiet_call(args))
        ):
            return type(module).forward(module, *args, **kwargs)
        # `premise_failure`, inlined: this runs on every call of a large projection
        if (
            type(module) is not nn.Linear
            or nn.Linear.forward is not LINEAR_FORWARD
            or linear_module.F is not FUNCTIONAL
            or FUNCTIONAL.linear is not LINEAR
            or len(args) != 1
            or kwargs
        ):
            if not torch.compiler.is_compiling():
                self.guard_failures += 1
                self.last_failure = premise_failure(module, args, kwargs)
            return type(module).forward(module, *args, **kwargs)
        x = args[0]
        weight, bias = module.weight, module.bias
        # `POLICY.idle("linear", backend)` read without a call where answered before: on a
        # decode step nobody calibrated this is every call, and a frame after a
        # weight-streaming GEMV runs from cold caches
        if not torch.compiler.is_compiling():  # compiled code must not guard on the memo
            backend = self.backend
            idle = None if policy.recording else policy.idle_answers.get(("linear", backend))
            if idle or (idle is None and policy.idle("linear", backend)):
                return LINEAR(x, weight, bias)  # nothing to choose: `nn.Linear`'s cost
            self._choice, kernels = ops.chosen_for(
                self._choice, "linear", tuple(weight.shape), backend, x, weight.shape[-1]
            )
            decoded = ops.first_eligible(kernels, x, weight, bias) if kernels else None
        else:
            decoded = ops.product("linear", tuple(weight.shape), self.backend, x, weight, bias)
        return LINEAR(x, weight, bias) if decoded is None else decoded

    def _quiet_call(self, args: tuple[Any, ...]) -> bool:
        """Where the process's lane is closed: does this call compute the reference whatever
        the thread count, by this linear's own answers (`KernelPolicy.won_rows`: nothing
        measured to win for its weight's shape, or nothing for the input's dtype and row
        bucket)? A stale answer (a weight of another shape put in within an epoch) costs
        speed only: both paths compute the class's function."""
        epoch = POLICY.epoch
        memo = self._lane_memo
        if memo is not None and memo[0] is epoch:
            won = memo[1]
        else:
            won = POLICY.won_rows(self._lane_keys())
            self._lane_memo = (epoch, won)
        if won is None:
            return False
        if not won:
            return True
        x = args[0] if len(args) == 1 else None
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or not x.shape[-1]:
            return False
        return quiet_for(won, x, x.shape[-1])

    def _lane_keys(self) -> tuple[tuple[str, tuple[int, ...], str]]:
        """The policy's key of this linear's own lane (`KernelPolicy.watch_lane`): its
        weight's shape as it is now (static while Dynamo traces)."""
        return (("linear", tuple(self.module.weight.shape), self.backend),)

    @property
    def __self__(self) -> nn.Module:
        return self.module

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (LinearForward, (self.module, self.backend))

    def rebound(self, module: nn.Module) -> LinearForward:
        """This forward for `module`, a shallow copy of `self.module` (`bound.CopyHook`)."""
        return LinearForward(module, self.backend)

    def __deepcopy__(self, memo: dict[int, Any]) -> LinearForward:
        # the module is in `memo` already when its own deep copy reaches this attribute
        return LinearForward(copy.deepcopy(self.module, memo), self.backend)

    def __repr__(self) -> str:
        return f"<decode forward of {type(self.module).__name__} (installed by fusion)>"


def linear_forward(module: nn.Module) -> LinearForward | None:
    """The `LinearForward` installed on `module`, or None."""
    forward = module.__dict__.get("forward")
    return forward if isinstance(forward, LinearForward) else None


def install(module: nn.Module, backend: str) -> None:
    """Install a `LinearForward` as `module.forward` (this instance only; a shallow copy
    gets one of its own: `bound.install_forward`), its own lane watched by the policy
    (answered by `fusion.fuse`, so compiled code finds it: `KernelPolicy.traced_own_lane`)."""
    forward = LinearForward(module, backend)
    if forward.laned:
        POLICY.watch_lane(*forward._lane_keys()[0])
    install_forward(module, forward)
