"""`MoEFuser`: `match_block` (match + numeric self-check), per-instance signatures, validate,
fuse."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from torch import fx, nn

from fusion.callpath import has_hooks, own_call_path
from fusion.errors import RewriteRefused
from fusion.fusers.base import Fuser, per_signature
from fusion.fusers.moe.block import MoEMatch, match_modulelist, match_packed
from fusion.fusers.moe.build import build_fused
from fusion.fusers.moe.experts import (
    PACKED_FLAGS,
    experts_child,
    modulelist_experts,
    packed_experts_activation,
)
from fusion.fusers.moe.selfcheck import check_numerically
from fusion.signature import plain_attributes
from fusion.trace import trace


def _signature(module: nn.Module, names: tuple[str | None, ...]) -> tuple:
    """Plain attributes of the block and the named children that could change what a trace
    shows (top-k, flags, scaling factors); objects count by identity."""
    owners = (module, *(module.get_submodule(n) for n in names if n))
    return tuple(plain_attributes(owner, keep_private=PACKED_FLAGS) for owner in owners)


def match_block(graph: fx.Graph | None, module: nn.Module) -> MoEMatch | None:
    """The match for `module` (None when it is not an MoE block at all), numerically checked."""
    located = experts_child(module)
    if graph is None or located is None:
        return None
    experts_name, style = located
    if style == "packed":
        found = match_packed(graph, module, experts_name)
    else:
        found = match_modulelist(graph, module, experts_name)
        if found is None:
            return None
    check_numerically(module, found)
    return found


@dataclass
class MoEFuser(Fuser):
    """Replace an MoE block with a `FusedMoE`."""

    name: ClassVar[str] = "moe"
    redefines_forward: ClassVar[bool] = True

    class_match: MoEMatch | None = None
    signature: tuple = ()
    by_signature: dict[tuple, MoEMatch | str] = field(default_factory=dict, repr=False)

    @classmethod
    def candidate(cls, module: nn.Module) -> bool:
        return experts_child(module) is not None

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
    def _names(found: MoEMatch) -> tuple[str | None, ...]:
        return (found.router_name, found.experts_name)

    def _match_for(self, module: nn.Module) -> MoEMatch:
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

    def validate(self, module: nn.Module) -> None:
        # Instance checks first: `_match_for` caches what it derives per instance signature,
        # and must never derive (and cache) from an instance these checks refuse.
        hooks = has_hooks(module)
        if hooks:
            raise RewriteRefused(f"block has {hooks}")
        # The routing and the experts are recomputed from weights, bypassing every linear's
        # call path: a linear that computes anything else around `forward` (per class or per
        # instance, which one traced instance cannot show) must refuse the whole block.
        for name, child in module.named_modules():
            if isinstance(child, nn.Linear):
                own = own_call_path(child)
                if (
                    own
                    or "forward" in child.__dict__
                    or type(child).forward is not nn.Linear.forward
                ):
                    raise RewriteRefused(f"{name} is a linear with its own {own or 'forward'}")
        located = experts_child(module)
        if located is not None:
            experts = module.get_submodule(located[0])
            for name, child in [(located[0], experts), *experts.named_modules(prefix=located[0])]:
                hooks = has_hooks(child)
                if hooks:
                    raise RewriteRefused(f"{name} has {hooks}")
        found = self._match_for(module)
        experts = module.get_submodule(found.experts_name)
        if found.style == "packed":
            activation = packed_experts_activation(experts)
            router = module.get_submodule(found.router_name)
            weight = getattr(router, found.router_weight)
            if weight.shape != (experts.gate_up_proj.shape[0], experts.gate_up_proj.shape[2]):
                raise RewriteRefused(
                    f"router weight {tuple(weight.shape)} does not fit the experts"
                )
        else:
            _, activation = modulelist_experts(experts)
        if activation != found.activation:
            raise RewriteRefused(f"activation {activation}, matched {found.activation}")

    def fuse(self, module: nn.Module, backend: str) -> nn.Module:
        from fusion.checkpoint import register_packed_experts_layout

        self.validate(module)
        found = self._match_for(module)
        fused, packed = build_fused(module, found, backend)
        if packed is not None:
            register_packed_experts_layout(fused, found.experts_name)
        return fused

    def dropped_children(self, module: nn.Module) -> tuple[str, ...]:
        """A Transformers 4 `ModuleList` of experts is repacked: its MLPs leave the model."""
        found = self._match_for(module)
        return (found.experts_name,) if found.style == "modulelist" else ()

    def describe(self) -> str:
        assert self.class_match is not None
        m = self.class_match
        shared = ""
        if m.shared_name:
            shared = f" + {m.shared_name}" + (
                f" (gated by {m.shared_gate_name})" if m.shared_gate_name else ""
            )
        experts = (
            f"{m.experts_name}[{'ModuleList -> packed' if m.style == 'modulelist' else 'packed'}]"
        )
        return f"{m.router_name}: {m.spec.describe()}; {experts} grouped{shared} -> FusedMoE"
