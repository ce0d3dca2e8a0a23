"""When a rewritten forward runs its class's original forward instead: the route.

A rewrite that merges projections earns its keep only through the kernels its merged
children may choose for a call (one GEMM on the stacked weight, the native kernel). Where
the kernel policy runs every one of them on its reference for the call at hand (nothing
measured to win on this machine for this dtype, thread count and row bucket, or measured
to lose), the rewrite computes the unfused calls anyway, through more Python frames than
the original forward: on a decode step of SmolLM2 (30 layers) its q/k/v and GLU rewrites
added 2.8 ms to an 8.5 ms step of a narrow twin (2-core Xeon, float32, one thread). Running
the original costs next to nothing. There the original runs, by default, so a fused model
nobody calibrated is not slower than the unfused one.

A residual-norm rewrite (`NormRoute`) routes likewise where every norm it adds into takes
its own route (the torch reference on a CPU): its add + norm helper would compute the two
original statements anyway.

Safe because the original forward is what every guard failure already runs: the fused
state never removes what it needs (merged projections keep their children, each Parameter
a view of the stacked weight, `fusion.runtime.merged.MergedLinear`), so it computes the unfused
function whatever changed since fusing, and a route changes speed, never the result. While
Dynamo traces, on a quiet lane only: the process's (`KernelPolicy.traced_lane`) or, where
winners measured for other shapes close that, the rewrite's own (`traced_own_lane`: nothing
measured to win for any of its products' shapes), answered eagerly and only read by the
trace. There no product of ours could run, so the compiled code is the unfused calls, which
Inductor compiles best. A residual-norm rewrite's route reads no table, so it is traced by
its eager rule. Never for a
pinned backend or in the `eligible` mode (they name kernels), or while the policy records
asks; and not where routes are closed (`KernelPolicy.routing`):
the harness judges the rewrites with routes closed, so the code a calibrated machine runs is
the code its oracles see, and judges the route as an operation of its own.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import get_num_threads, nn

from fusion.analysis.callpath import HOOK_ATTRS
from fusion.kernels import ops
from fusion.kernels.policy import LANE_BACKENDS, POLICY, in_row_lane, quiet_for
from fusion.runtime.guards import ChildGuard, Guard
from fusion.runtime.merged import ActAndMul, MergedLinear
from fusion.runtime.norm_forward import NormForward


@dataclass(frozen=True)
class Route:
    """What decides, per call, whether a rewritten forward may run its class's original:
    the merged projections and act-and-mul modules the rewrite calls, and the name of the
    forward's first parameter (the input whose dtype and rows the projections read)."""

    merged: tuple[MergedLinear, ...]
    acts: tuple[ActAndMul, ...]
    first: str
    _watched: tuple[nn.Module, ...] = field(init=False, repr=False, compare=False)
    _width: int = field(init=False, repr=False, compare=False)
    _backends: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _act_backends: frozenset[str] = field(init=False, repr=False, compare=False)
    _laned: bool = field(init=False, repr=False, compare=False)
    _acts_on_cpu: bool = field(init=False, repr=False, compare=False)
    _memo: list = field(init=False, repr=False, compare=False)
    _lane_memo: list = field(init=False, repr=False, compare=False)
    _lane_keys: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Read once: a route decides speed, never the result (the original computes the
        # unfused function whatever these are now), so a stale one costs a missed route.
        widths = {merged.in_features for merged in self.merged}
        fields = {
            "_watched": (*self.merged, *self.acts),
            "_width": widths.pop() if len(widths) == 1 else -1,
            "_backends": tuple(dict.fromkeys(merged.backend for merged in self.merged)),
            "_act_backends": frozenset(act.backend for act in self.acts),
            # the quiet lane (`KernelPolicy.quiet`) covers every product of a lane backend;
            # an `auto` act-and-mul is on its reference only on a CPU (`ops.eager_reference`)
            "_laned": all(module.backend in LANE_BACKENDS for module in (*self.merged, *self.acts)),
            "_acts_on_cpu": any(act.backend == "auto" for act in self.acts),
            "_memo": [None],  # (key, allowed) of the last call (`takes_original`)
            "_lane_memo": [None],  # (epoch, answer) of `_won_rows`
            # its products' own lanes, watched from now on (`KernelPolicy.watch_lane`:
            # answered by `fusion.fuse` and each `forget`, read by compiled code)
            "_lane_keys": tuple(
                POLICY.watch_lane("stacked", merged.kernel_shape, merged.backend)
                for merged in self.merged
            ),
        }
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def takes_original(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """True when this call may run the original forward: eager (compiled: on the quiet
        lane only, below), routes open (`KernelPolicy.routes_open`), the input a tensor each merged projection reads whole
        (its last dimension their `in_features`), every merged projection's product on its
        reference for it (`KernelPolicy.runs_reference`), every act-and-mul on its torch
        reference (`ops.eager_reference`), and no hook on any of them (the original does not
        call them, and a hook on a fused module expects its calls).

        The policy's part depends only on the input's dtype, device, width and row count
        and the thread count: the last answer is kept with its key and the policy's epoch,
        so it is asked again whenever any of them changes; the hooks are looked at on every
        call. On a decode step this runs after a GEMV has streamed the caches empty, so
        each frame it saves is a cold one.

        Where the quiet lane is open (`KernelPolicy.quiet`: no product of a lane backend
        could choose anything but its reference, whatever the call) only the hooks and,
        for an `auto` act-and-mul, the input's device are asked: the input's shape decides
        nothing there, and in situ each question costs about ten times what it costs warm.
        Where it is closed, a call in the process's row-bucket lane (`KernelPolicy.row_lane`:
        its row bucket below every winner of its dtype) is answered the same way; past
        it, this route's own answers, kept per epoch (`KernelPolicy.
        won_rows`: no winner for its products' shapes, or none for the call's dtype and row
        bucket at any thread count), send the call to the original before the per-call key
        is built."""
        policy = POLICY
        if self._laned and policy.routes and not policy.recording:
            # the process's lanes, read first and alike eager and traced: the quiet lane
            # (`KernelPolicy.traced_lane`: Dynamo guards the three attributes) or the
            # row-bucket lane (`KernelPolicy.row_lane`, implying `traced_route`): no call
            # to ask whether Dynamo traces, and the hooks read inline, since on a decode
            # step each frame here runs from the caches a GEMV has just emptied (the
            # installed forwards' checks measured 2-3% of a SmolLM2 token:
            # docs/benchmarks.md). `BoundForward.__call__` spells this block out inline.
            x = args[0] if args else kwargs.get(self.first)
            if policy.lane is True or (
                isinstance(x, torch.Tensor)
                and x.dim()
                and x.shape[-1] == self._width
                and in_row_lane(policy.row_lane, x, self._width)
            ):
                if self._acts_on_cpu and not (isinstance(x, torch.Tensor) and x.is_cpu):
                    return False
                return not _any_hooked(self._watched)
        if torch.compiler.is_compiling():
            # compiled code routes on a quiet lane, the process's or its own, or where
            # nothing was measured to win for this call's dtype and row bucket, all
            # answered eagerly (`KernelPolicy.traced_lane`, `traced_own_lane`,
            # `traced_route`), never by the per-call rule, whose memo it must not read
            if not self._laned:
                return False
            x = args[0] if args else kwargs.get(self.first)
            if not (
                policy.traced_lane()
                or policy.traced_own_lane(self._lane_keys)
                or self._traced_reference(x)
            ):
                return False
            on_reference = not self._acts_on_cpu or (isinstance(x, torch.Tensor) and x.is_cpu)
            return on_reference and not _any_hooked(self._watched)
        # `routes_open()` spelled out (its tests hold this to it)
        if not policy.routes or policy.recording:
            return False
        x = args[0] if args else kwargs.get(self.first)
        won = None
        # an `auto` act-and-mul is on its reference only on a CPU (inline: a hot path)
        if self._laned and (not self._acts_on_cpu or (isinstance(x, torch.Tensor) and x.is_cpu)):
            if policy.lane or (policy.lane is None and policy.quiet()):
                return not _any_hooked(self._watched)
            won = self._won_rows()
            if won is not None and not won:  # its own lane: no winner for its shapes
                return not _any_hooked(self._watched)
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return False
        width = x.shape[-1]
        if width != self._width or not width:
            return False
        # this call's own lane: nothing measured to win for its dtype and row bucket at any
        # thread count (a calibration whose winners are the prompt's rows leaves the
        # decode's one-row calls here, not on the per-call key below)
        if won is not None and quiet_for(won, x, width):
            return not _any_hooked(self._watched)
        if self._idle():  # nothing any product could choose: no key to build
            for backend in self._act_backends:
                if not ops.eager_reference(backend, x):
                    return False
            return not _any_hooked(self._watched)
        # the policy's part, kept for its epoch (`KernelPolicy.epoch`: a new table or mode
        # starts one) per dtype, row count, thread count and CPU or not, the only things of
        # the call it reads
        key = (policy.epoch, x.dtype, x.numel() // width, get_num_threads(), x.is_cpu)
        memo = self._memo
        if memo[0] is not None and memo[0][0] == key:
            allowed = memo[0][1]
        else:
            allowed = self._policy_allows(x, width)
            memo[0] = (key, allowed)
        return allowed and not _any_hooked(self._watched)

    def _traced_reference(self, x: Any) -> bool:
        """While Dynamo traces: does every merged product compute its reference for an input
        like `x` whatever the thread count (`KernelPolicy.traced_route`: nothing measured to
        win for its shape, `x`'s dtype and row bucket)?"""
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != self._width:
            return False
        rows = x.numel() // self._width if self._width else 0
        return POLICY.traced_route(self._lane_keys, ops.dtype_name(x.dtype), rows)

    def _won_rows(self) -> dict[Any, frozenset[int]] | None:
        """`KernelPolicy.won_rows` of this route's products, kept for the policy's epoch (a
        new table or mode starts one)."""
        epoch = POLICY.epoch
        memo = self._lane_memo
        if memo[0] is not None and memo[0][0] is epoch:
            return memo[0][1]
        won = POLICY.won_rows(self._lane_keys)
        memo[0] = (epoch, won)
        return won

    def _idle(self) -> bool:
        """Would every merged projection compute its reference whatever the call
        (`KernelPolicy.idle`, its answers read without a call where it gave them before)?"""
        answers = POLICY.idle_answers
        for backend in self._backends:
            answer = answers.get(("stacked", backend))
            if not (answer or (answer is None and POLICY.idle("stacked", backend))):
                return False
        return True

    def _policy_allows(self, x: torch.Tensor, width: int) -> bool:
        """The policy's part of `takes_original` for an input like `x` of `width`."""
        rows = x.numel() // width
        dtype = ops.dtype_name(x.dtype)
        for merged in self.merged:  # every in_features is `width`: `takes_original` checked
            if not POLICY.runs_reference(
                "stacked", merged.kernel_shape, dtype, rows, merged.backend
            ):
                return False
        return all(ops.eager_reference(act.backend, x) for act in self.acts)


@dataclass(frozen=True)
class NormRoute:
    """What decides, per call, whether a residual-norm rewrite may run its class's original:
    the rewrite's only change is `a + b` and the norm child called on the sum, as one
    `add_rms_norm` call (`fusion.fusers.residual_norm.runtime`), and where the norm takes its
    own route that helper computes exactly those two statements anyway, through more frames
    (the layer's guards, the helper, the norm's `add_forward`). `sites` are the children the
    rewrite passes to the helper; `module` is the layer (a copy's route is made with the
    copy's forward, `BoundForward.__deepcopy__` / `rebound`)."""

    module: nn.Module
    sites: tuple[str, ...]
    first: str

    def takes_original(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """True when this call may run the original forward (eager or traced: the rule reads
        no table, and a trace's devices are static): routes open, the input
        a tensor, and every site's child, where it is a norm with a fused forward
        (`NormForward`), computing on the torch reference for an input like it
        (`ops.eager_reference` on the layer's input: a norm's route asks the same of its
        own). A child without one is called on the sum by the helper as by the original,
        hooks and all. Read now from the layer's children, so a swapped child is seen."""
        policy = POLICY  # `routes_open()` spelled out, as in `Route.takes_original`
        if not policy.routes or policy.recording:
            return False
        x = args[0] if args else kwargs.get(self.first)
        if not isinstance(x, torch.Tensor):
            return False
        children = self.module._modules
        for name in self.sites:
            child = children.get(name)
            forward = None if child is None else child.__dict__.get("forward")
            # `ops.eager_reference`'s device rule (compiling: the lane's, checked above)
            if type(forward) is NormForward and not (
                forward.backend == "torch" or (forward.backend == "auto" and x.is_cpu)
            ):
                return False
        return True


def norm_route_of(module: nn.Module, sites: tuple[str, ...], forward: Any) -> NormRoute | None:
    """The route of a residual-norm rewrite of `forward` on `module` adding into the norms
    `sites`, or None (no sites, or no named first parameter to read the input from)."""
    first = _first_parameter(forward)
    return NormRoute(module, sites, first) if sites and first is not None else None


def _first_parameter(forward: Any) -> str | None:
    """The name of `forward`'s first parameter after `self`, where a call may pass it by
    position or by name; else None."""
    parameters = list(inspect.signature(inspect.unwrap(forward)).parameters.values())[1:]
    if not parameters or parameters[0].kind not in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.POSITIONAL_ONLY,
    ):
        return None
    return parameters[0].name


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
    first = _first_parameter(forward)
    return None if first is None else Route(tuple(merged), tuple(acts), first)


def _any_hooked(modules: tuple[nn.Module, ...]) -> bool:
    """Does any of `modules` hold a hook (`HOOK_ATTRS`, read from its own attributes)?"""
    for module in modules:
        state = module.__dict__
        for attr in HOOK_ATTRS:
            if state.get(attr):
                return True
    return False
