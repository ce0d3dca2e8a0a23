"""Building the fused block (`FusedMoE`) for a matched MoE block."""

from __future__ import annotations

from torch import nn

from fusion.analysis.reads import Read
from fusion.fusers.moe.block import MoEMatch
from fusion.runtime.moe import FusedMoE


def routing_owners(module: nn.Module, fused: FusedMoE, found: MoEMatch) -> tuple[Read, ...]:
    """`found.reads` on the objects the fused model holds: a read of a child on the block
    watches the fused block's child of that name (the one it routes with); any other read
    on the block watches the original block (kept as `eager`: what the fallback runs, its
    class's forward and what that forward reads); reads inside the router watch the router,
    which both blocks share."""
    owners = []
    for path, name in found.reads:
        if path:
            owners.append((fused.get_submodule(path), name))
        elif name in module._modules:
            owners.append((fused, name))
        else:
            owners.append((module, name))
    return tuple(owners)


def build_fused(module: nn.Module, found: MoEMatch, backend: str) -> FusedMoE:
    """The fused block for `module`, sharing its children and Parameters (router, packed
    experts, shared expert and its gate)."""
    experts = module.get_submodule(found.experts_name)
    router = module.get_submodule(found.router_name)
    fused = FusedMoE(
        router_name=found.router_name,
        router=router,
        router_weight=found.router_weight.rpartition(".")[2],
        router_is_linear=False,
        spec=found.spec,
        experts_name=found.experts_name,
        experts=experts,
        activation=found.activation,
        shared_name=found.shared_name,
        shared=module.get_submodule(found.shared_name) if found.shared_name else None,
        shared_gate_name=found.shared_gate_name,
        shared_gate=module.get_submodule(found.shared_gate_name)
        if found.shared_gate_name
        else None,
        training_sensitive=found.training_sensitive,
        returns_logits=False,
        # The original runs in training mode (when sensitive) and whenever a routing read
        # changed: the fused block shares everything it holds (its children), and no state
        # of its own, which block matching (`_other_state`) already refused for every match.
        eager=module,
        backend=backend,
    )
    # The block's own `forward` is what the fused block stands for (a patch of its class
    # shows here), besides what the routing proof read.
    fused.guard_routing((*routing_owners(module, fused, found), (module, "forward")))
    fused.train(module.training)
    # The block's children in the block's own order, so `named_parameters()`, `modules()`
    # and the state dict list them as the unfused model does.
    order = {name: i for i, name in enumerate(module._modules)}
    fused._modules = dict(
        sorted(fused._modules.items(), key=lambda kv: order.get(kv[0], len(order)))
    )
    return fused
