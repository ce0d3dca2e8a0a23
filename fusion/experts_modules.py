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
"""

from __future__ import annotations

import functools
import json
import operator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from fusion.kernels import ops, torch_ref

PARAMETER_NAMES = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
"""The parameters of a Transformers experts module, in the names `FusedExperts` keeps."""


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

    `activation`: the `torch_ref.ACTIVATIONS` name when the program is the default gating
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
    dtype before the sum (`torch_ref.combine`), as Transformers' expert loop does; a
    projection's bias is added to its GEMM's output, as every Transformers implementation
    does. Only the order of the K-term sum may differ from theirs (rounding)."""
    num_tokens = hidden.shape[0]
    if num_tokens == 0 or topk_ids.shape[-1] == 0:
        return hidden.new_zeros(hidden.shape)
    routed = torch_ref.sort_by_expert(hidden, topk_ids, gate_up.shape[0])
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
    return torch_ref.combine(routed, expert_out.to(hidden.dtype), topk_weights, num_tokens)


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
    if torch.compiler.is_compiling() and not torch_ref.records_grad(*tensors):
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
    """

    def __init__(
        self,
        original: nn.Module,
        *,
        program: GateProgram,
        transposed: bool,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        # Not a submodule: its parameters are ours (the same objects), registered below.
        object.__setattr__(self, "original", original)
        for name in PARAMETER_NAMES:
            param = original._parameters.get(name)
            if param is not None:
                self.register_parameter(name, param)
        self.config = getattr(original, "config", None)
        self.program = program
        self.program_json = program.to_json()
        self.transposed = transposed
        self.backend = backend
        self.fused_with = _implementation(original)
        self.shapes = (tuple(original.gate_up_proj.shape), tuple(original.down_proj.shape))
        self.original_class = type(original).__name__

    def _weights(self) -> tuple[Tensor, Tensor]:
        gate_up, down = self.gate_up_proj, self.down_proj
        if self.transposed:
            return gate_up.transpose(1, 2), down.transpose(1, 2)
        return gate_up, down

    def _covered(self, args: tuple, kwargs: dict) -> bool:
        """Is this call one the fused path computes: `(hidden [T, H], ids [T, K] integer,
        weights [T, K] floating)` positionally, hidden in the weights' dtype, shapes and
        implementation as at fuse time?"""
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
            and (tuple(self.gate_up_proj.shape), tuple(self.down_proj.shape)) == self.shapes
            and _implementation(self) == self.fused_with
        )

    def run_original(self, *args: Any, **kwargs: Any) -> Any:
        """The original module on this call, with this module's current parameters."""
        original = self.original
        for name, param in self._parameters.items():
            if original._parameters.get(name) is not param:
                original._parameters[name] = param
        original.train(self.training)
        return original(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self._covered(args, kwargs):
            return self.run_original(*args, **kwargs)
        hidden, ids, weights = args
        gate_up, down = self._weights()
        gate_up_bias = self._parameters.get("gate_up_proj_bias")
        down_bias = self._parameters.get("down_proj_bias")
        if self.program.activation is not None and gate_up_bias is None and down_bias is None:
            return ops.moe_experts(
                self.backend, hidden, gate_up, down, ids, weights, self.program.activation
            )
        return gated_experts_call(
            hidden, gate_up, gate_up_bias, down, down_bias, ids, weights, self.program_json
        )

    def extra_repr(self) -> str:
        return (
            f"{self.original_class}: {self.program.describe()}, transposed={self.transposed}, "
            f"bias={'gate_up_proj_bias' in self._parameters}"
        )
