"""Building the fused block (`FusedMoE`) for a matched MoE block."""

from __future__ import annotations

from torch import nn

from fusion.fusers.moe.block import MoEMatch
from fusion.moe_modules import FusedMoE


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
        # The original can run in training mode: the fused block shares everything it holds
        # (its children), and no state of its own, which block matching (`_other_state`)
        # already refused for every match.
        eager=module if found.training_sensitive else None,
        backend=backend,
    )
    fused.train(module.training)
    # The block's children in the block's own order, so `named_parameters()`, `modules()`
    # and the state dict list them as the unfused model does.
    order = {name: i for i, name in enumerate(module._modules)}
    fused._modules = dict(
        sorted(fused._modules.items(), key=lambda kv: order.get(kv[0], len(order)))
    )
    return fused
