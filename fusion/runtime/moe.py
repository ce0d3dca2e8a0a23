"""Fused mixture-of-experts modules: routing exactly as matched, experts as grouped GEMMs.

`FusedMoE` replaces a Transformers MoE block. It keeps the block's children under their own
names (the router, the experts, the shared expert and its gate), so the block's checkpoint
keys and Parameters are unchanged.

`PackedExperts` is legacy: the MoE fuser no longer repacks a Transformers 4 `ModuleList` of
expert MLPs (the new Parameters escaped optimizers and adapters made before fusing:
`fusion.fusers.moe.fuser.MODULELIST_REFUSAL`). The class and its `fusion.runtime.checkpoint` key
mapping stay so a model fused and pickled by an earlier version still loads and runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from fusion.analysis.callpath import has_hooks
from fusion.analysis.reads import AttributeGuard
from fusion.kernels import ops
from fusion.runtime.experts import INTERFACE_ATTRIBUTES
from fusion.runtime.params import apply_state, common_state

DtypeRule = torch.dtype | str | None
"""A dtype a routing step casts to: a fixed dtype, `"input"` (the block input's dtype),
`"logits"` (the router logits' dtype), or None (no cast)."""


class GroupLimit(NamedTuple):
    """Group-limited routing (DeepSeek V3): experts may only come from the `kept` of
    `groups` groups whose best `per_group_k` choice values sum highest; `sorted` is the
    group top-k's own flag."""

    groups: int
    kept: int
    per_group_k: int
    sorted: bool


@dataclass(frozen=True)
class RouteStep:
    """One op of the routing program, in the order the matched router runs them.

    `kind`: `cast` (to `dtype`), `softmax` (over the experts; `dtype` is softmax's own
    `dtype=` argument), `sigmoid`, `topk` (`value` = k, `sorted`), `select` (top-k ids of the
    scores plus `bias`, within the `groups` limit; the weights are the scores at those ids),
    `renorm` (divide by the sum of the selection plus `value`), `scale` (multiply by
    `value`).
    """

    kind: str
    dtype: DtypeRule = None
    value: float | int | None = None
    sorted: bool = True
    groups: GroupLimit | None = None
    """`select` only: the group limit, when routing is group-limited."""
    bias: str | None = None
    """`select` only: the router buffer added to the scores for the choice (not to the
    weights), e.g. DeepSeek V3's `e_score_correction_bias`."""


@dataclass(frozen=True)
class RouteSpec:
    """The router: `logits = linear(x.to(input_cast), weight.to(weight_cast))`, then `steps`.

    Exactly one step is `topk` or `select`; the indices are its ids and the routing weights
    are the value after the last step.
    """

    input_cast: DtypeRule
    weight_cast: DtypeRule
    steps: tuple[RouteStep, ...]

    @property
    def top_k(self) -> int:
        return int(next(s.value for s in self.steps if s.kind in ("topk", "select")))

    def describe(self) -> str:
        names = []
        for step in self.steps:
            if step.kind == "topk":
                names.append(f"top-{step.value}")
            elif step.kind == "select":
                bias = f" of scores + {step.bias}" if step.bias else ""
                groups = ""
                if step.groups:
                    groups = f" in the best {step.groups.kept} of {step.groups.groups} groups"
                names.append(f"top-{step.value}{bias}{groups}")
            elif step.kind == "renorm":
                names.append("renormalise")
            elif step.kind == "scale":
                names.append(f"x{step.value:g}")
            elif step.kind == "cast":
                names.append(f"to {_dtype_name(step.dtype)}")
            else:
                suffix = f"[{_dtype_name(step.dtype)}]" if step.dtype is not None else ""
                names.append(step.kind + suffix)
        linear = "linear"
        if self.input_cast is not None or self.weight_cast is not None:
            linear += f"[{_dtype_name(self.input_cast)}, {_dtype_name(self.weight_cast)}]"
        return " -> ".join([linear, *names])


def _dtype_name(rule: DtypeRule) -> str:
    return str(rule).removeprefix("torch.") if rule is not None else "-"


def _resolve(rule: DtypeRule, x: torch.Tensor, logits: torch.Tensor | None) -> torch.dtype | None:
    if rule is None or isinstance(rule, torch.dtype):
        return rule
    if rule == "input":
        return x.dtype
    if rule == "logits" and logits is not None:
        return logits.dtype
    raise ValueError(f"unknown dtype rule {rule!r}")


def route(
    spec: RouteSpec,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    logits: torch.Tensor | None = None,
    buffers: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, routing weights, expert ids) for 2-D `x`, running `spec`'s ops in its order,
    so every rounding the original router does happens here too (bit-identical results).
    `logits` given (by a router linear the caller ran itself) skip the linear."""
    if logits is None:
        assert weight is not None
        in_dtype = _resolve(spec.input_cast, x, None)
        w_dtype = _resolve(spec.weight_cast, x, None)
        logits = F.linear(
            x if in_dtype is None else x.to(in_dtype),
            weight if w_dtype is None else weight.to(w_dtype),
        )
    value = logits
    ids = None
    for step in spec.steps:
        if step.kind == "cast":
            value = value.to(_resolve(step.dtype, x, logits))
        elif step.kind == "softmax":
            value = F.softmax(value, dim=-1, dtype=_resolve(step.dtype, x, logits))
        elif step.kind == "sigmoid":
            value = torch.sigmoid(value)
        elif step.kind == "topk":
            value, ids = torch.topk(value, int(step.value), dim=-1, sorted=step.sorted)
        elif step.kind == "select":
            ids = _select(step, value, buffers or {})
            value = value.gather(1, ids)
        elif step.kind == "renorm":
            denominator = value.sum(dim=-1, keepdim=True)
            if step.value:
                denominator = denominator + step.value
            value = value / denominator
        elif step.kind == "scale":
            value = value * step.value
        else:
            raise ValueError(f"unknown routing step {step.kind!r}")
    assert ids is not None, "a routing program without top-k"
    return logits, value, ids


def _select(
    step: RouteStep, scores: torch.Tensor, buffers: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Expert ids of a `select` step, with the ops (and their order) of DeepSeek V3's router."""
    choice = scores if step.bias is None else scores + buffers[step.bias]
    if step.groups is not None:
        groups, kept, per_group_k, group_sorted = step.groups  # a GroupLimit
        experts = choice.shape[-1]
        grouped = choice.view(-1, groups, experts // groups)
        group_scores = grouped.topk(per_group_k, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=kept, dim=-1, sorted=group_sorted)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups)
        choice = choice.masked_fill(~score_mask.reshape(-1, experts).bool(), float("-inf"))
    return torch.topk(choice, k=int(step.value), dim=-1, sorted=step.sorted)[1]


def experts_implementation(experts: nn.Module) -> str | None:
    """The Transformers experts implementation `experts` dispatches to now (its config's
    `_experts_implementation`), or None for experts without one (repacked Transformers 4)."""
    config = getattr(experts, "config", None)
    return getattr(config, "_experts_implementation", None) if config is not None else None


_BOOKKEEPING = frozenset(vars(nn.Module()))
"""`nn.Module`'s per-instance bookkeeping: not an activation's settings."""


def experts_reads(
    block: nn.Module, name: str, experts: nn.Module
) -> tuple[tuple[object, str], ...]:
    """What the fused experts kernel took from a Transformers experts module at fuse time:
    which module the block holds, its interface flags and count, its class's `forward` and
    `_apply_gate` (read as bound methods: a class patch or an instance override shows), and
    its activation: the object, its class, `forward` and settings (e.g. GELU's
    `approximate`). Empty for repacked Transformers 4 experts (no activation module)."""
    act = getattr(experts, "act_fn", None)
    if not isinstance(act, nn.Module):
        return ()
    reads: list[tuple[object, str]] = [(block, name), (experts, "act_fn")]
    reads += [(experts, attribute) for attribute in INTERFACE_ATTRIBUTES]
    reads += [(experts, "forward"), (experts, "_apply_gate"), (act, "__class__"), (act, "forward")]
    reads += [(act, key) for key in sorted(act.__dict__) if key not in _BOOKKEEPING]
    return tuple(reads)


def _plain(tensor: torch.Tensor) -> bool:
    """Is `tensor` a dense tensor or Parameter (no subclass: a DTensor shard is not)?"""
    return type(tensor) in (nn.Parameter, torch.Tensor)


def _hooked(module: nn.Module) -> bool:
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or nn.modules.module._global_forward_hooks
        or nn.modules.module._global_forward_pre_hooks
    )


class PackedExperts(nn.Module):
    """(Legacy: only models fused by an earlier version hold one; see the module docstring.)
    A Transformers 4 `ModuleList` of gated expert MLPs, repacked as Transformers 5 does:
    `gate_up_proj [E, 2I, H]` (each expert's gate rows, then its up rows) and
    `down_proj [E, H, I]`. `names` remembers the (gate, up, down) child names of each expert
    so `fusion.runtime.checkpoint` maps `experts.<e>.<name>.weight` keys both ways."""

    def __init__(
        self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, names: tuple[str, str, str]
    ):
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up_proj)
        self.down_proj = nn.Parameter(down_proj)
        self.names = names

    @classmethod
    def from_mlps(cls, experts: nn.ModuleList, names: tuple[str, str, str]) -> PackedExperts:
        """Stack the experts' weights (copies: the per-expert tensors are released with the
        `ModuleList` when the block is replaced)."""
        gate, up, down = names
        with torch.no_grad():
            gate_up = torch.stack(
                [
                    torch.cat([getattr(e, gate).weight, getattr(e, up).weight], dim=0)
                    for e in experts
                ]
            )
            down_w = torch.stack([getattr(e, down).weight for e in experts])
        packed = cls(gate_up, down_w, names)
        # The fuser proved the shards of each packed tensor agree (`fusion.runtime.params`).
        apply_state(packed.gate_up_proj, common_state({"gate": getattr(experts[0], gate).weight}))
        apply_state(packed.down_proj, common_state({"down": getattr(experts[0], down).weight}))
        return packed

    @property
    def num_experts(self) -> int:
        return int(self.gate_up_proj.shape[0])

    def extra_repr(self) -> str:
        e, two_i, h = self.gate_up_proj.shape
        return f"experts={e}, hidden={h}, intermediate={two_i // 2}, from={self.names}"


class FusedMoE(nn.Module):
    """A mixture-of-experts block: matched routing, grouped experts, optional shared expert.

    `forward(x)` flattens `x` to `[T, H]`, routes (`route(spec, ...)`, the original router's
    ops in its order), runs the experts through the backend's `moe_experts` (tokens sorted by
    expert, one GEMM per expert slice per projection, act-and-mul once, one `index_add_`),
    adds `shared(x)` (times `sigmoid(shared_gate(x))` when gated), and restores `x`'s shape.

    The router, experts, shared expert and its gate stay children under their original names
    (`router_name`, ...), so state dicts keep their keys. The router module itself is not
    called: its weight (and nothing else) is read.

    `returns_logits`: the block returned `(output, router logits)` (Transformers 4); the
    fused block returns the same pair, the logits being the router child's own output.

    `training_sensitive`: the original forward behaves differently in training mode (e.g.
    Mixtral's router jitter), which the fused computation does not reproduce. In training
    mode such a block runs `eager`, the original block itself, whose children are this
    module's children (the same objects, so `.to()`, `load_state_dict` and training updates
    reach both; `fusion.fusers.moe` passes it only when the block holds no state of its own).
    Without `eager` (Transformers 4 experts, which were repacked into new tensors) training
    mode raises instead of silently computing another function.

    Routing premises (`routing_guard`, `guard_routing`): every attribute the routing proof
    read (`fusion.fusers.moe.block.routing_reads`: the router's `top_k`, `norm_topk_prob`,
    scaling factor and group sizes by value, its class's `forward` and call path and its
    instance dict by method resolution, the children the block calls by identity, the
    presence of its weight and buffers) and the original block's own `forward`. When one
    changed since fusing, the call runs `eager`'s forward (with this module's current
    children put in its slots first), exactly what the unfused block computes now, counted
    in `guard_failures` (`last_failure` names the read).

    Experts implementation: Transformers 5 experts modules dispatch on
    `config._experts_implementation` (`model.set_experts_implementation(...)`). The value at
    fuse time is recorded (`fused_with`); when the model's choice differs from it later, the
    block calls the experts module itself, `experts(x, ids, weights)` (the calling convention
    the match proved), so the user's choice of implementation is honoured; routing stays
    fused and bit-identical. Setting it back returns to the fused kernel. The same happens
    when anything else the kernel took from the experts at fuse time changed
    (`experts_guard`, `experts_reads`: the experts module, its activation module and that
    module's settings, its flags, its class's functions), a hook was put on them (or a
    global one), or their weights changed shape or became a tensor subclass (a parallel
    plan's shard), counted in `guard_failures`.
    """

    def __init__(
        self,
        *,
        router_name: str,
        router: nn.Module,
        router_weight: str,
        router_is_linear: bool = False,
        spec: RouteSpec,
        experts_name: str,
        experts: nn.Module,
        activation: str,
        shared_name: str | None = None,
        shared: nn.Module | None = None,
        shared_gate_name: str | None = None,
        shared_gate: nn.Module | None = None,
        training_sensitive: bool = False,
        returns_logits: bool = False,
        eager: nn.Module | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        # Not a submodule: its children are already ours, and its own state is empty.
        object.__setattr__(self, "eager", eager)
        self.router_name = router_name
        self.router_weight = router_weight
        self.router_is_linear = router_is_linear
        self.spec = spec
        self.experts_name = experts_name
        self.activation = activation
        self.shared_name = shared_name
        self.shared_gate_name = shared_gate_name
        self.training_sensitive = training_sensitive
        self.returns_logits = returns_logits
        self.backend = backend
        self.fused_with = experts_implementation(experts)
        setattr(self, router_name, router)
        setattr(self, experts_name, experts)
        if shared_name is not None:
            setattr(self, shared_name, shared)
        if shared_gate_name is not None:
            setattr(self, shared_gate_name, shared_gate)
        self.experts_guard = AttributeGuard.record(experts_reads(self, experts_name, experts))
        # Hooks are looked for on these (the experts and their activation): replacing either
        # fails `experts_guard` first, so the tuple never goes stale while it is read.
        self.hooked_modules = tuple(experts.modules()) if self.experts_guard.checks else ()
        # A tensor-parallel plan applied after fusing would make these local shards (or
        # DTensors): the kernel reads them per call, and only the experts' own forward knows
        # what a shard means. (None for repacked Transformers 4 experts, which are ours and
        # have no forward to fall back to.)
        self.expert_shapes = (
            (experts.gate_up_proj.shape, experts.down_proj.shape)
            if self.experts_guard.checks
            else None
        )
        self.guard_failures = 0
        self.last_failure: str | None = None

    routing_guard: AttributeGuard = AttributeGuard(())
    """The routing proof's reads (`guard_routing`); none for a block fused by an earlier
    version (its class default)."""

    def guard_routing(self, reads: tuple[tuple[object, str], ...]) -> None:
        """Guard `reads` (`(owner, name)` on objects this module or `eager` holds) at their
        current values: a call after one changed runs the original forward."""
        self.routing_guard = AttributeGuard.record(reads)

    def run_original(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The original block's forward on this module's current children (a child replaced
        here since fusing is the one it calls), in this module's training mode."""
        eager = self.eager
        assert eager is not None
        slots = eager._modules
        for name, child in self._modules.items():
            if name in slots and slots[name] is not child:
                slots[name] = child
        eager.training = self.training
        return eager.forward(hidden_states)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits, routing weights [T, K], expert ids [T, K]) for 2-D `x`.

        A Transformers 4 router is a plain linear child: it is called (so hooks on it fire)
        and the program runs on its logits. A Transformers 5 router module is called only
        when it carries hooks (Transformers records router logits through them): the match
        proved its outputs bit-identical to the program's, so either path is the same
        function, and the hooks see what they would have seen.
        """
        router = getattr(self, self.router_name)
        if self.router_is_linear:
            # The router child is called on the input as the original calls it (cast
            # included); a weight cast cannot be applied to a child, and never matches.
            in_dtype = _resolve(self.spec.input_cast, x, None)
            logits = router(x if in_dtype is None else x.to(in_dtype))
            return route(self.spec, x, None, logits=logits)
        if _hooked(router):
            logits, weights, ids = router(x)
            return logits, weights, ids
        buffers = dict(router.named_buffers(recurse=False))
        return route(self.spec, x, getattr(router, self.router_weight), buffers=buffers)

    def _experts_hold(self, experts: nn.Module) -> bool:
        """May the fused kernel stand for `experts(x, ids, weights)`: the implementation
        and everything the kernel took from the experts as at fuse time, and no hook on
        them (or inside, or global) that the kernel would skip?"""
        if experts_implementation(experts) != self.fused_with or not self.experts_guard.holds():
            return False
        if self.expert_shapes is not None:
            gate_up, down = experts.gate_up_proj, experts.down_proj
            if (gate_up.shape, down.shape) != self.expert_shapes or not (
                _plain(gate_up) and _plain(down)
            ):
                return False
        # (None for repacked Transformers 4 experts: the block never called them.)
        return not any(has_hooks(module) for module in self.hooked_modules)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.training and self.training_sensitive:
            if self.eager is None:
                raise RuntimeError(
                    "FusedMoE replaced a block whose forward changes in training mode and "
                    "whose experts were repacked; it reproduces the block in eval mode only"
                )
            return self.run_original(hidden_states)
        if self.routing_guard.checks:
            changed = self.routing_guard.failure()
            if changed is not None:
                # A read of the routing proof changed (`top_k`, a flag, the router's
                # forward): the original computes what the unfused block does now.
                self.guard_failures += 1
                self.last_failure = f"{changed} changed since fusing"
                return self.run_original(hidden_states)
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits, weights, ids = self.route(x)
        experts = getattr(self, self.experts_name)
        if not self._experts_hold(experts):
            # The implementation chosen after fusing, or experts edited or hooked since:
            # their own call, which dispatches, reads and fires as unfused.
            self.guard_failures += 1
            out = experts(x, ids, weights)
        else:
            out = ops.moe_experts(
                self.backend,
                x,
                experts.gate_up_proj,
                experts.down_proj,
                ids,
                weights,
                self.activation,
            )
        if self.shared_name is not None:
            shared = getattr(self, self.shared_name)(x)
            if self.shared_gate_name is not None:
                shared = torch.sigmoid(getattr(self, self.shared_gate_name)(x)) * shared
            out = out + shared
        if self.returns_logits:  # (output, router logits), as the Transformers 4 block
            return out.reshape(shape), logits
        return out.reshape(shape)

    def extra_repr(self) -> str:
        shared = ""
        if self.shared_name is not None:
            gate = f" gated by {self.shared_gate_name}" if self.shared_gate_name else ""
            shared = f", shared={self.shared_name}{gate}"
        training = ""
        if self.training_sensitive:
            training = ", training=" + ("original block" if self.eager is not None else "raises")
        return (
            f"routing={self.spec.describe()}, activation={self.activation}{shared}, "
            f"backend={self.backend}{training}"
        )
