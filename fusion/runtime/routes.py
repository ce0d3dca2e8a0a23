"""When a rewritten forward runs its class's original forward instead: the route.

A rewrite that merges projections earns its keep only through the kernels its merged
children may choose for a call (one GEMM on the stacked weight, the native kernel). Where
the calibration measured every one of them to lose to its reference for the call at hand
(this machine, dtype, thread count, row bucket), the rewrite computes the unfused calls
anyway, through more Python frames than the original forward, so it costs more per call
than the unfused model (measured on a tiny model whose weights all sit in cache, where only
the frames differ); running the original costs next to nothing. There the original runs.

Safe because the original forward is what every guard failure already runs: the fused
state never removes what it needs (merged projections keep their children, each Parameter
a view of the stacked weight, `fusion.runtime.merged.MergedLinear`), so it computes the unfused
function whatever changed since fusing, and a route changes speed, never the result. It
changes nothing where nothing was measured (`KernelPolicy.measured_reference` is False
without a calibration entry, in every mode but `measured`, for a pinned backend, while
the policy records asks and while Dynamo traces), so the rewrites run, and are tested,
wherever no calibration says they only cost.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fusion.analysis.callpath import HOOK_ATTRS
from fusion.kernels import ops
from fusion.kernels.policy import POLICY
from fusion.runtime.guards import ChildGuard, Guard
from fusion.runtime.merged import ActAndMul, MergedLinear


@dataclass(frozen=True)
class Route:
    """What decides, per call, whether a rewritten forward may run its class's original:
    the merged projections and act-and-mul modules the rewrite calls, and the name of the
    forward's first parameter (the input whose dtype and rows the projections read)."""

    merged: tuple[MergedLinear, ...]
    acts: tuple[ActAndMul, ...]
    first: str

    def takes_original(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """True when this call may run the original forward: eager, the input a tensor
        each merged projection reads whole (its last dimension their `in_features`),
        every merged projection's stacked product measured to run its reference for it
        (`KernelPolicy.measured_reference`), every act-and-mul on its torch reference
        (`ops.eager_reference`), and no hook on any of them (the original does not call
        them, and a hook on a fused module expects its calls)."""
        # compiled code never routes, and must not read (so guard on) the policy's memo;
        # then the common case: nothing measured to lose, one memoised lookup
        if torch.compiler.is_compiling() or not POLICY.routes_possible("stacked"):
            return False
        x = args[0] if args else kwargs.get(self.first)
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return False
        width = x.shape[-1]
        if not width:
            return False
        rows = x.numel() // width
        dtype = ops.dtype_name(x.dtype)
        for merged in self.merged:
            if merged.in_features != width or _hooked(merged):
                return False
            if not POLICY.measured_reference(
                "stacked", merged.kernel_shape, dtype, rows, merged.backend
            ):
                return False
        return all(ops.eager_reference(act.backend, x) and not _hooked(act) for act in self.acts)


def route_of(guards: Iterable[Guard], forward: Any) -> Route | None:
    """The route of a rewrite of `forward` whose proof relied on `guards`, or None (it
    always runs the rewrite): the fused children the rewrite calls (`ChildGuard.called`)
    must be merged projections, at least one, and act-and-mul modules, nothing else (a
    fused child of another kind may carry a kernel that no table entry describes), and
    `forward` must take its input as a named first parameter."""
    merged: list[MergedLinear] = []
    acts: list[ActAndMul] = []
    for guard in guards:
        if not (isinstance(guard, ChildGuard) and guard.called):
            continue
        if isinstance(guard.child, MergedLinear):
            merged.append(guard.child)
        elif isinstance(guard.child, ActAndMul):
            acts.append(guard.child)
        else:
            return None
    if not merged:
        return None
    parameters = list(inspect.signature(inspect.unwrap(forward)).parameters.values())[1:]
    if not parameters or parameters[0].kind not in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.POSITIONAL_ONLY,
    ):
        return None
    return Route(tuple(merged), tuple(acts), parameters[0].name)


def _hooked(module: nn.Module) -> bool:
    state = module.__dict__
    return any(state.get(attr) for attr in HOOK_ATTRS)
