"""`FusedExperts`: a Transformers experts module fused alone, whatever block calls it.

A Transformers 5 experts module computes the experts function

    out[t] = sum_k  w[t, k] * down_e( gate( gate_up_e(x[t]) ) ),   e = ids[t, k]

with `gate_up_e` / `down_e` one expert's slice of the packed `gate_up_proj` / `down_proj`
(plus that expert's bias row when the module has biases; transposed storage when
`is_transposed`) and `gate` the module's own gating (`_apply_gate`). `FusedExperts`
computes the same function with the rows grouped by expert, one GEMM per expert slice per
projection, and the gating as a `GateProgram`: the module's own gating ops, read from its
trace by `fusion.fusers.moe.gate` (which proves the program equal to `_apply_gate`, op for
op, on every float dtype), replayed here in their order, so every rounding is the same.

Where the program is Transformers' default gating `act(gate) * up` (the activation named in
`program.activation`) and there is no bias, the backend's `moe_experts` kernel runs it
(`fusion.kernels.ops`, a `torch.ops.fusion` operator under `torch.compile`); every other
variant (biases, clamped or soft-capped SwiGLU, GPT-OSS's interleaved `alpha`/`limit` gate,
upcast gating) runs `gated_experts`, the reference below, registered as the operator
`fusion::gated_experts` for `torch.compile`.

State: the fused module holds the original module's parameter objects under their original
names, so its state dict is the unfused one, key for key, and an edit to a weight by any
spelling is the weight both see; no copy of a weight exists. The original module is kept
(`original`, not a submodule) for what the fused path does not cover, where it runs itself
(exactly the unfused function): a call not of the form `(hidden [T, H], ids [T, K],
weights [T, K])` with `hidden` in the weights' dtype, weights whose shape changed since
fusing, and another experts implementation than at fuse time
(`model.set_experts_implementation`). Before it runs, its parameters are re-pointed to this
module's (a parameter replaced on the fused module, e.g. by `load_state_dict(assign=True)`,
is never read stale from the original).

Guards (the premises the fuser's proof used, checked every call; a failed one runs the
original and counts in `guard_failures`): the original's class, its class `forward` and
`_apply_gate` (the functions proven), the set of its instance attributes (an instance
`forward` or `_apply_gate` set later), every attribute the gating program was traced with
(`AttributeGuard`: `limit`, `alpha`, `act_fn` and what it reads, by value or identity),
the interface flags the experts function reads (`num_experts`, `has_bias`, ...), the
configured implementation and what Transformers' interface resolves it to, hooks on the
modules inside the original (its activation: the replayed program does not call it) or
global module hooks, and the routed ids: an id outside `[0, E)` other than the dropped id
`E` runs the original (which raises, wraps or skips exactly as it does), and so does `E`
when the configured implementation is the eager loop; under the other implementations `E`
is skipped (`gated_experts`), its defined meaning (the eager loop skips it, the grouped
implementation reads uninitialised rows for it). Under `torch.compile` the ids are not read
(a data-dependent branch would break the graph): the gated kernel still skips `E` and raises
on other ids, the default-gating kernel assumes ids in range. Attribute writes on this module that name one of the original's attributes or
children (`experts.limit = 0.1`, `experts.act_fn = ...`) reach the original, and reads fall
back to it, so the fused model is edited as the unfused one is.
"""

from __future__ import annotations

import functools
import json
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from fusion.analysis.callpath import has_hooks
from fusion.analysis.reads import AttributeGuard
from fusion.kernels import ops, reference

PARAMETER_NAMES = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
"""The parameters of a Transformers experts module, in the names `FusedExperts` keeps."""

INTERFACE_ATTRIBUTES = (
    "num_experts",
    "has_gate",
    "has_bias",
    "is_transposed",
    "is_concatenated",
    "has_post_expert_norm",
    "_is_expert_parallel",
)
"""Attributes of an experts instance that Transformers' experts functions read (the
`use_experts_implementation` flags and the expert count): guarded per call."""

_MODULE_BOOKKEEPING = frozenset(vars(nn.Module()))
"""`nn.Module`'s own per-instance state: never forwarded to the original."""


@dataclass(frozen=True)
class Dispatch:
    """What an experts class's dispatcher (`use_experts_implementation`'s `forward`) runs:
    it calls `interface.get(config._experts_implementation, <the class's eager forward>)`
    with `interface` from its closure, which at fuse time gave `configured`, a function
    proven to compute the experts function, or the eager forward itself (`configured` None:
    the interface answering nothing is what selects it). A pickle or deep copy holds only
    the dispatcher and `configured` (both found again by name) and reads the interface from
    the dispatcher's closure when rebuilt: always the live interface, never a copy."""

    dispatcher: Callable
    interface: Any
    configured: Callable | None

    @classmethod
    def of(cls, dispatcher: Callable, configured: Callable | None) -> Dispatch:
        """The dispatch of `dispatcher` (its closure's `experts_interface`)."""
        code, cells = dispatcher.__code__, dispatcher.__closure__ or ()
        interface = cells[code.co_freevars.index("experts_interface")].cell_contents
        return cls(dispatcher, interface, configured)

    def __reduce__(self) -> tuple:
        return (Dispatch.of, (self.dispatcher, self.configured))

    def holds(self, implementation: str | None) -> bool:
        """Does the dispatcher still run what it ran at fuse time for `implementation`?"""
        return self.interface.get(implementation) is self.configured


class Ref(NamedTuple):
    """An argument of a gating step that is an earlier value: 0 is the program's input
    (the gate_up projection's rows), i > 0 the result of step i - 1."""

    index: int


@dataclass(frozen=True)
class GateStep:
    """One op of a gating program: `op` is an ATen overload name (`aten::silu.default`),
    `getitem`, or `cast` (`kwargs` = (("dtype", rule),), rule `"input"` for the program
    input's dtype or a dtype name). `args` and `kwargs` hold `Ref`s and constants."""

    op: str
    args: tuple
    kwargs: tuple = ()


@dataclass(frozen=True)
class GateProgram:
    """The gating between an experts module's two projections, as ops in their order.

    `activation`: the `reference.ACTIVATIONS` name when the program is the default gating
    `act(gate) * up` over the halves of its input (the backend kernels run it), else None.
    """

    steps: tuple[GateStep, ...]
    activation: str | None = None

    def describe(self) -> str:
        if self.activation is not None:
            return f"{self.activation}(gate) * up"
        names = [s.op.removeprefix("aten::").partition(".")[0] for s in self.steps]
        return "gate program " + " -> ".join(n for n in names if n != "getitem")

    def to_json(self) -> str:
        """The program as a string (what the `fusion::gated_experts` operator takes)."""
        return json.dumps([[s.op, _encode(s.args), _encode(s.kwargs)] for s in self.steps])


def _encode(value: Any) -> Any:
    if isinstance(value, Ref):
        return {"ref": value.index}
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        return Ref(int(value["ref"]))
    if isinstance(value, list):
        return tuple(_decode(v) for v in value)
    return value


@functools.lru_cache(maxsize=64)
def program_from_json(text: str) -> GateProgram:
    """The inverse of `GateProgram.to_json` (cached: the operator parses it every call)."""
    return GateProgram(tuple(GateStep(op, _decode(a), _decode(k)) for op, a, k in json.loads(text)))


def _aten(name: str) -> Any:
    """`aten::silu.default` -> `torch.ops.aten.silu.default`."""
    packet, _, overload = name.removeprefix("aten::").partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def run_gate(program: GateProgram, x: Tensor) -> Tensor:
    """Replay `program` on `x` (`[rows, 2I]` or `[rows, I']`): the same ops, in the same
    order, with the same constants as the module's `_apply_gate`, so the same bits."""
    values: list[Any] = [x]

    def resolve(arg: Any) -> Any:
        if isinstance(arg, Ref):
            return values[arg.index]
        if isinstance(arg, tuple):
            return [resolve(a) for a in arg]
        return arg

    for step in program.steps:
        args = [resolve(a) for a in step.args]
        kwargs = {key: resolve(value) for key, value in step.kwargs}
        if step.op == "getitem":
            values.append(operator.getitem(*args))
        elif step.op == "cast":
            rule = kwargs["dtype"]
            dtype = x.dtype if rule == "input" else getattr(torch, rule)
            values.append(args[0].to(dtype))
        else:
            values.append(_aten(step.op)(*args, **kwargs))
    return values[-1]


def _grouped(
    rows: Tensor, weight: Tensor, bias: Tensor | None, slices: list[tuple[int, int, int]]
) -> Tensor:
    """`rows[a:b] @ weight[e].T (+ bias[e])` per expert slice `(e, a, b)`, concatenated
    (differentiable; the slices cover every row). `weight` is `[E, out, in]`."""
    pieces = []
    for expert, first, end in slices:
        piece = torch.mm(rows[first:end], weight[expert].t())
        if bias is not None:
            piece = piece + bias[expert]
        pieces.append(piece)
    return torch.cat(pieces) if pieces else rows.new_zeros(0, weight.shape[1])


def gated_experts(
    hidden: Tensor,
    gate_up: Tensor,
    gate_up_bias: Tensor | None,
    down: Tensor,
    down_bias: Tensor | None,
    topk_ids: Tensor,
    topk_weights: Tensor,
    program: GateProgram,
) -> Tensor:
    """The experts function with biases and any proven gating program; a new `[T, H]`
    tensor of `hidden`'s dtype. `gate_up [E, 2I, H]`, `down [E, H, I]` (views of transposed
    storage are fine), biases `[E, 2I]` / `[E, H]` or None.

    Each routed product is formed in `promote(dtype, weights dtype)` and rounded to the
    dtype before the sum (`reference.combine`), as Transformers' expert loop does; a
    projection's bias is added to its GEMM's output, as every Transformers implementation
    does. Only the order of the K-term sum may differ from theirs (rounding).

    Ids: a (token, choice) routed to `E` (Transformers' "dropped" id) contributes nothing,
    as the eager loop skips it; a negative id or one above `E` raises a RuntimeError, as the
    eager loop does (`bincount` refuses negative ids; never a silent read of another
    expert)."""
    num_tokens, num_experts = hidden.shape[0], gate_up.shape[0]
    if num_tokens == 0 or topk_ids.shape[-1] == 0:
        return hidden.new_zeros(hidden.shape)
    routed = reference.sort_by_expert(hidden, topk_ids, num_experts)
    if len(routed.counts) > num_experts + 1:
        raise RuntimeError(f"expert ids above the dropped id {num_experts}")
    if len(routed.counts) > num_experts:
        routed = _without_dropped(routed, num_experts)
    slices, start = [], 0
    for expert, count in enumerate(routed.counts):
        if count:
            slices.append((expert, start, start + count))
            start += count
    projected = _grouped(routed.rows, gate_up, gate_up_bias, slices)
    # A program may end in another dtype (an upcast gate): the down projection reads it in
    # the weights' dtype, as Transformers' grouped implementation casts it.
    activated = run_gate(program, projected).to(down.dtype)
    expert_out = _grouped(activated, down, down_bias, slices)
    return reference.combine(routed, expert_out.to(hidden.dtype), topk_weights, num_tokens)


def _without_dropped(routed: reference.ExpertRows, num_experts: int) -> reference.ExpertRows:
    """`routed` without its rows routed to the dropped id `num_experts`: the stable sort put
    them last, so the first `sum(counts[:E])` rows (and their order and tokens) are the
    rest, unchanged; `combine` then adds nothing for the dropped ones."""
    kept = sum(routed.counts[:num_experts])
    return reference.ExpertRows(
        routed.rows[:kept],
        routed.order[:kept],
        routed.token_of_row[:kept],
        routed.counts[:num_experts],
    )


@torch.library.custom_op("fusion::gated_experts", mutates_args=())
def _gated_experts_op(
    hidden: Tensor,
    gate_up: Tensor,
    gate_up_bias: Tensor | None,
    down: Tensor,
    down_bias: Tensor | None,
    topk_ids: Tensor,
    topk_weights: Tensor,
    program: str,
) -> Tensor:
    return gated_experts(
        hidden,
        gate_up,
        gate_up_bias,
        down,
        down_bias,
        topk_ids,
        topk_weights,
        program_from_json(program),
    )


@_gated_experts_op.register_fake
def _gated_experts_fake(hidden, gate_up, gate_up_bias, down, down_bias, ids, weights, program):
    return hidden.new_empty(hidden.shape)


def gated_experts_call(
    hidden: Tensor,
    gate_up: Tensor,
    gate_up_bias: Tensor | None,
    down: Tensor,
    down_bias: Tensor | None,
    topk_ids: Tensor,
    topk_weights: Tensor,
    program: str,
) -> Tensor:
    """`gated_experts` with `program` given as its JSON (`GateProgram.to_json`, computed once
    per module: Dynamo does not trace `json`): through the `fusion::gated_experts` operator
    while Dynamo traces without autograd recording (one opaque node: the per-expert row
    counts are data-dependent), else directly (autograd differentiates the torch code)."""
    tensors = [
        t for t in (hidden, gate_up, gate_up_bias, down, down_bias, topk_weights) if t is not None
    ]
    if torch.compiler.is_compiling() and not reference.records_grad(*tensors):
        return torch.ops.fusion.gated_experts(
            hidden, gate_up, gate_up_bias, down, down_bias, topk_ids, topk_weights, program
        )
    return gated_experts(
        hidden,
        gate_up,
        gate_up_bias,
        down,
        down_bias,
        topk_ids,
        topk_weights,
        program_from_json(program),
    )


def _implementation(module: nn.Module) -> str | None:
    config = getattr(module, "config", None)
    return getattr(config, "_experts_implementation", None) if config is not None else None


class FusedExperts(nn.Module):
    """A Transformers experts module, grouped by expert (see the module docstring).

    `transposed`: the parameters are stored `[E, H, 2I]` / `[E, I, H]` (Transformers'
    `is_transposed`); the kernels read transposed views of them, never copies.
    `shapes`: (gate_up, down) shapes at fuse time; a call with other shapes runs the original.
    `reads`: `(module, name)` of every attribute the gating program was traced with (modules
    of `original`'s tree), guarded with the interface flags by `attributes`.
    `dispatch`: what the class's dispatcher resolved the configured implementation to at
    fuse time (None: only the implementation's name is guarded).
    `guard_failures`: calls that ran the original because a guard failed.
    """

    OWN = frozenset(
        {
            "original",
            "program",
            "program_json",
            "transposed",
            "backend",
            "fused_with",
            "shapes",
            "original_class",
            "proven",
            "instance_names",
            "attributes",
            "dispatch",
            "eager_configured",
            "inner_modules",
            "guard_failures",
        }
    )
    """This module's own attributes: never forwarded to the original."""

    def __init__(
        self,
        original: nn.Module,
        *,
        program: GateProgram,
        transposed: bool,
        backend: str = "auto",
        reads: tuple[tuple[nn.Module, str], ...] = (),
        dispatch: Dispatch | None = None,
    ) -> None:
        super().__init__()
        for name, param in original._parameters.items():  # the original's order
            if name in PARAMETER_NAMES and param is not None:
                self.register_parameter(name, param)
        # Not a submodule: its parameters are ours (the same objects), registered above
        # (first: `register_parameter` asks `hasattr`, which the original would answer).
        object.__setattr__(self, "original", original)
        # Its children (the activation) are ours too, the same objects under the same names,
        # so the model's module tree (what `get_submodule`, hooks by name and parallel
        # plans see) is the unfused one; `__setattr__` keeps the two slots one.
        for name, child in original._modules.items():
            self._modules[name] = child
        self.program = program
        self.program_json = program.to_json()
        self.transposed = transposed
        self.backend = backend
        self.fused_with = _implementation(original)
        self.shapes = (tuple(original.gate_up_proj.shape), tuple(original.down_proj.shape))
        self.original_class = type(original).__name__
        cls = type(original)
        self.proven = (cls, cls.forward, getattr(cls, "_apply_gate", None))
        self.instance_names = frozenset(original.__dict__)
        interface = tuple((original, name) for name in INTERFACE_ATTRIBUTES)
        self.attributes = AttributeGuard.record(interface + tuple(reads))
        self.dispatch = dispatch
        self.eager_configured = dispatch is not None and dispatch.configured is None
        # The modules the gating calls (its activation, ...): the replayed program skips
        # their calls, so a hook on one (or a global hook) added after fusing runs the
        # original, where it fires as it does unfused.
        self.inner_modules = tuple(m for m in original.modules() if m is not original)
        self.guard_failures = 0

    def __getattr__(self, name: str) -> Any:
        """Parameters first; then the original's attributes (`experts.limit` reads what the
        unfused module holds)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("original")
            if original is None or (name.startswith("__") and name.endswith("__")):
                raise
            return getattr(original, name)

    def __setattr__(self, name: str, value: Any) -> None:
        """A write naming one of the original's own attributes or children (not one of this
        module's) goes to the original: the edit the user makes to the experts is the one
        they see, and the guards see it."""
        original = self.__dict__.get("original")
        if (
            original is not None
            and name not in self.OWN
            and name not in self.__dict__
            and name not in self._parameters
            and name not in _MODULE_BOOKKEEPING
            and (name in original.__dict__ or name in original._modules)
        ):
            setattr(original, name, value)
            if name in self._modules:  # a child both hold: the same object in both trees
                self._modules[name] = original._modules.get(name)
            return
        super().__setattr__(name, value)

    def _weights(self) -> tuple[Tensor, Tensor]:
        # `_parameters` directly: every call reads them, `__getattr__` would add a frame.
        gate_up, down = self._parameters["gate_up_proj"], self._parameters["down_proj"]
        if self.transposed:
            return gate_up.transpose(1, 2), down.transpose(1, 2)
        return gate_up, down

    def _covered(self, args: tuple, kwargs: dict) -> bool:
        """Is this call of the form the fused path computes: `(hidden [T, H], ids [T, K]
        integer, weights [T, K] floating)` positionally, hidden in the weights' dtype?"""
        if kwargs or len(args) != 3 or not all(isinstance(a, Tensor) for a in args):
            return False
        hidden, ids, weights = args
        gate_up, _ = self._weights()
        return (
            hidden.dim() == 2
            and ids.dim() == 2
            and weights.shape == ids.shape
            and ids.shape[0] == hidden.shape[0]
            and hidden.shape[1] == gate_up.shape[2]
            and not ids.is_floating_point()
            and ids.dtype != torch.bool
            and weights.is_floating_point()
            and hidden.dtype == gate_up.dtype
        )

    def guards_hold(self) -> bool:
        """Do the premises of the fuser's proof still hold (see the module docstring)?
        Each is an identity or value comparison: a few microseconds per call."""
        original = self.original
        cls, forward, gate = self.proven
        if (
            type(original) is not cls
            or cls.forward is not forward
            or getattr(cls, "_apply_gate", None) is not gate
            or original.__dict__.keys() != self.instance_names
            or self._parameters["gate_up_proj"].shape != self.shapes[0]
            or self._parameters["down_proj"].shape != self.shapes[1]
        ):
            return False
        implementation = _implementation(original)
        if implementation != self.fused_with:
            return False
        dispatch = self.dispatch
        if dispatch is not None and not dispatch.holds(implementation):
            return False
        if any(has_hooks(module) for module in self.inner_modules):
            return False
        return self.attributes.holds()

    def _ids_route(self, ids: Tensor) -> str:
        """Where a call with these ids goes: `"fused"` (every id in `[0, E)`), `"gated"`
        (some are the dropped id `E`, which the gated kernel skips, and none other is out of
        range) or `"original"` (a negative id, one above `E`, or `E` under the eager loop,
        whose own handling is what the original runs). Under `torch.compile` nothing is read
        (see the module docstring): `"fused"`."""
        if torch.compiler.is_compiling() or ids.numel() == 0:
            return "fused"
        low, high = torch.stack(torch.aminmax(ids)).tolist()  # one device sync
        num_experts = self.shapes[0][0]
        if low < 0 or high > num_experts or (high == num_experts and self.eager_configured):
            return "original"
        return "fused" if high < num_experts else "gated"

    def run_original(self, *args: Any, **kwargs: Any) -> Any:
        """The original module on this call, with this module's current parameters."""
        original = self.original
        for name, param in self._parameters.items():
            if original._parameters.get(name) is not param:
                original._parameters[name] = param
        original.train(self.training)
        return original(*args, **kwargs)

    def _guard_failed(self, *args: Any) -> Any:
        self.guard_failures += 1
        return self.run_original(*args)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self._covered(args, kwargs):
            return self.run_original(*args, **kwargs)
        if not self.guards_hold():
            return self._guard_failed(*args)
        hidden, ids, weights = args
        route = self._ids_route(ids)
        if route == "original":
            return self._guard_failed(*args)
        gate_up, down = self._weights()
        gate_up_bias = self._parameters.get("gate_up_proj_bias")
        down_bias = self._parameters.get("down_proj_bias")
        if (
            route == "fused"
            and self.program.activation is not None
            and gate_up_bias is None
            and down_bias is None
        ):
            return ops.moe_experts(
                self.backend, hidden, gate_up, down, ids, weights, self.program.activation
            )
        # The gated kernel replays the same program on the same rows (so the same bits as
        # the activation kernel), and skips the dropped id.
        return gated_experts_call(
            hidden, gate_up, gate_up_bias, down, down_bias, ids, weights, self.program_json
        )

    def extra_repr(self) -> str:
        return (
            f"{self.original_class}: {self.program.describe()}, transposed={self.transposed}, "
            f"bias={'gate_up_proj_bias' in self._parameters}"
        )
