"""`MoEFuser`: `match_block` (match + numeric self-check), per-instance signatures, validate,
fuse. A block refused as a whole may still have its experts fused alone
(`fusion.fusers.moe.experts_only`): the match is then an `ExpertsMatch`, the block keeps its
forward and only its experts child is replaced by a `FusedExperts`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from torch import fx, nn

from fusion.analysis.callpath import has_hooks, own_call_path
from fusion.analysis.reads import portable_keys
from fusion.errors import RewriteRefused
from fusion.fusers.base import Fuser, per_signature
from fusion.fusers.moe.block import MoEMatch, looks_routed, match_packed
from fusion.fusers.moe.build import build_fused
from fusion.fusers.moe.experts import (
    PACKED_FLAGS,
    experts_child,
    packed_experts_activation,
)
from fusion.fusers.moe.experts_only import (
    ExpertsMatch,
    build_fused_experts,
    check_interface,
    expert_layout,
    instance_hazard,
    match_experts_only,
)
from fusion.fusers.moe.selfcheck import check_numerically
from fusion.runtime.experts import FusedExperts
from fusion.trace.signature import plain_attributes
from fusion.trace.tracer import trace

Match = MoEMatch | ExpertsMatch


MODULELIST_REFUSAL = (
    "its experts are a Transformers 4 ModuleList, which fusing would repack into new "
    "Parameters: an optimizer, PEFT adapter or Parameter reference made before fusing would "
    "no longer reach the weights the fused block computes with, and the expert loop is "
    "accepted on a numeric sample, not a proof"
)
"""Why a Transformers 4 block (a `ModuleList` of expert MLPs, routing in the block's forward)
is refused as a whole, found by the 4.57 conformance run's lifecycle checks
(`optimizer-before-fuse`, `parameters`, `lora-after-fuse` failed on Qwen3-MoE, OLMoE and
FlexOlmo). Its expert MLPs are still fused one by one (`glu`, which keeps their Parameters).
Making each expert's Parameters views of the packed tensors, as `MergedLinear` does for
merged projections, would lift it."""


def _signature(module: nn.Module, names: tuple[str | None, ...]) -> tuple:
    """Plain attributes of the block and the named children that could change what a trace
    shows (top-k, flags, scaling factors; objects count by identity), the class and plain
    attributes of every module inside those children (a gating reads its activation's, e.g.
    a soft-cap), and the shapes and dtypes of the children's parameters (a gating program
    holds the experts' width)."""
    owners = (module, *(module.get_submodule(n) for n in names if n))
    return tuple(
        (
            plain_attributes(owner, keep_private=PACKED_FLAGS),
            tuple((n, tuple(p.shape), p.dtype) for n, p in owner.named_parameters()),
            tuple(
                (path, type(inner), plain_attributes(inner))
                for path, inner in owner.named_modules()
                if path and owner is not module
            ),
        )
        for owner in owners
    )


def _whole_block(
    graph: fx.Graph | None, module: nn.Module, name: str, style: str
) -> MoEMatch | None:
    if graph is None:
        raise RewriteRefused("the block does not trace")
    if style == "packed":
        found = match_packed(graph, module, name)
    else:
        if not looks_routed(graph, module):
            return None  # a decoder stack's ModuleList: not an MoE block, no verdict
        raise RewriteRefused(MODULELIST_REFUSAL)
    check_numerically(module, found)
    return found


def match_block(graph: fx.Graph | None, module: nn.Module) -> Match | None:
    """The match for `module` (None when it is not an MoE block at all), numerically checked:
    the whole block, else (Transformers 5 experts) the experts alone; a refusal names both
    reasons."""
    located = experts_child(module)
    if located is None:
        return None
    experts_name, style = located
    if style != "packed":
        return _whole_block(graph, module, experts_name, style)
    try:
        return _whole_block(graph, module, experts_name, style)
    except RewriteRefused as whole:
        try:
            return match_experts_only(module, experts_name, str(whole))
        except RewriteRefused as alone:
            raise RewriteRefused(f"{alone}; the block as a whole: {whole}") from alone


def _block_instance_problem(module: nn.Module) -> str | None:
    """Why this instance cannot be fused as a whole block (None when it can): hooks on the
    block would stop firing, and the routing and experts are recomputed from weights,
    bypassing every linear's call path, so a linear that computes anything else around
    `forward` (per class or per instance, which one traced instance cannot show) refuses."""
    hooks = has_hooks(module)
    if hooks:
        return f"block has {hooks}"
    for name, child in module.named_modules():
        if isinstance(child, nn.Linear):
            own = own_call_path(child)
            if own or "forward" in child.__dict__ or type(child).forward is not nn.Linear.forward:
                return f"{name} is a linear with its own {own or 'forward'}"
    return None


@dataclass
class MoEFuser(Fuser):
    """Replace an MoE block with a `FusedMoE`."""

    name: ClassVar[str] = "moe"
    redefines_forward: ClassVar[bool] = True
    # The router, experts and shared expert stay children under their names, hooks on them
    # are honoured (FusedMoE calls a hooked child), so every name a plan holds survives.
    changes_layout: ClassVar[bool] = False

    class_match: Match | None = None
    signature: tuple = ()
    by_signature: dict[tuple, Match | str] = field(default_factory=dict, repr=False)
    alone_by_signature: dict[tuple, Match | str] = field(default_factory=dict, repr=False)
    last_match: Match | None = field(default=None, repr=False)
    """The match of the instance validated last: what `describe` reports (instances of one
    class may take different matches, e.g. one fused whole and one experts alone)."""

    @classmethod
    def candidate(cls, module: nn.Module) -> bool:
        located = experts_child(module)
        # A block whose experts were fused alone is done: its FusedExperts is reported.
        return located is not None and not isinstance(
            module.get_submodule(located[0]), FusedExperts
        )

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> MoEFuser | None:
        found = match_block(graph, module)
        if found is None:
            return None
        fuser = cls(source_class=type(module).__name__, class_match=found)
        fuser.signature = _signature(module, fuser._names(found))
        fuser.by_signature[fuser.signature] = found
        return fuser

    @staticmethod
    def _names(found: Match) -> tuple[str | None, ...]:
        if isinstance(found, ExpertsMatch):
            return (found.experts_name,)
        return (found.router_name, found.experts_name)

    def _match_for(self, module: nn.Module) -> Match:
        assert self.class_match is not None
        try:
            signature = _signature(module, self._names(self.class_match))
        except AttributeError as exc:
            raise RewriteRefused(f"instance lacks a child of its class's match: {exc}") from exc
        return per_signature(
            self.by_signature,
            signature,
            lambda: match_block(trace(module), module),
            "not an MoE block",
        )

    def _alone_for(self, module: nn.Module, experts_name: str, reason: str) -> ExpertsMatch:
        """The experts-only match of an instance the whole-block fusion refuses for `reason`
        (its own hooks, a linear with its own call path), derived once per signature."""
        signature = ("alone", _signature(module, (experts_name,)))
        return per_signature(
            self.alone_by_signature,
            signature,
            lambda: match_experts_only(module, experts_name, reason),
            "not an MoE block",
        )

    def instance_match(self, module: nn.Module) -> Match:
        """The match this instance takes (validated), or RewriteRefused.

        Instance checks come first: `_match_for` caches what it derives per instance
        signature, and must never derive (and cache) from an instance these checks refuse.
        Hooks on the experts (or inside them) refuse both kinds of fusion (a replaced module's
        hooks would stop firing); hooks on the block or a linear with its own call path refuse
        the whole-block fusion only (experts fused alone leave the block's forward, hooks and
        children to run as they are)."""
        located = experts_child(module)
        if located is None:
            raise RewriteRefused("the block has no experts child")
        experts_name = located[0]
        experts = module.get_submodule(experts_name)
        hazard = instance_hazard(experts, experts_name)
        if hazard is not None:
            raise RewriteRefused(hazard)
        problem = _block_instance_problem(module)
        if problem is None:
            found = self._match_for(module)
            if (
                isinstance(found, MoEMatch)
                and portable_keys(module, found.reads) != found.read_keys
            ):
                # Derived on another instance of this signature, whose routing proof read
                # something this one answers otherwise (a router of another class, an
                # instance-level forward): derived again for this instance alone.
                again = match_block(trace(module), module)
                if again is None:
                    raise RewriteRefused("not an MoE block")
                found = again
        elif located[1] != "packed":
            raise RewriteRefused(problem)
        else:
            try:
                found = self._alone_for(module, experts_name, problem)
            except RewriteRefused as exc:
                raise RewriteRefused(f"{problem} (experts alone: {exc})") from exc
        if isinstance(found, ExpertsMatch):
            check_interface(experts)
            expert_layout(experts)
            found.check_instance(experts)
            self.last_match = found
            return found
        activation = packed_experts_activation(experts)
        router = module.get_submodule(found.router_name)
        weight = getattr(router, found.router_weight)
        if weight.shape != (experts.gate_up_proj.shape[0], experts.gate_up_proj.shape[2]):
            raise RewriteRefused(f"router weight {tuple(weight.shape)} does not fit the experts")
        if activation != found.activation:
            raise RewriteRefused(f"activation {activation}, matched {found.activation}")
        self.last_match = found
        return found

    def validate(self, module: nn.Module) -> None:
        self.instance_match(module)

    def fuse(self, module: nn.Module, backend: str) -> nn.Module:
        found = self.instance_match(module)
        if isinstance(found, ExpertsMatch):
            experts = module.get_submodule(found.experts_name)
            setattr(module, found.experts_name, build_fused_experts(experts, found, backend))
            return module
        return build_fused(module, found, backend)

    def describe(self) -> str:
        m = self.last_match or self.class_match
        assert m is not None
        if isinstance(m, ExpertsMatch):
            return m.describe()
        shared = ""
        if m.shared_name:
            shared = f" + {m.shared_name}" + (
                f" (gated by {m.shared_gate_name})" if m.shared_gate_name else ""
            )
        return (
            f"{m.router_name}: {m.spec.describe()}; {m.experts_name}[packed] grouped{shared}"
            " -> FusedMoE"
        )
