"""Models whose weights another engine places: tensor parallelism and accelerate dispatch.

Two ways a user runs a model that outgrows one device, both on Transformers' engine, not
ours, and what fusion does about each:

- **Tensor parallel** (`from_pretrained(..., tp_plan="auto")`): weights are DTensors, each
  rank holding its slice, and the plan's hooks sit on the modules. A merged q/k/v weight
  would need per-rank slices of q, of k and of v (a plain column split of the merged weight
  hands rank 0 all of q), and fused kernels would bypass the plan's hooks. So every module
  holding a DTensor parameter or buffer is refused, with that reason (`placement_refusal`).
- **adapters** (PEFT's LoRA and its kin): a projection wrapped by an adapter layer (a child
  holding the linear as `base_layer`) computes the linear plus the adapter's low-rank path,
  so it is not a plain linear and is never merged; `adapter_refusal` says so in the report,
  naming the children, instead of leaving the module without a reason.
- **accelerate dispatch** (`device_map=...`, offloading): `_hf_hook`s on modules move
  inputs and load offloaded weights just before each forward. A fused forward would skip
  the hooks of the children it merged, so modules carrying such a hook anywhere in their
  subtree are refused too.

And a model fused in one process keeps a **tensor-parallel plan** (`model.tp_plan`) that
must stay true of it: `prune_plans` drops the plan entries of every block whose module or
Parameter names fusion lost (`fusion.engine.apply` compares each fused module's names before and
after; a fusion keeping them all keeps the plan, its guards honouring what a plan applied
later does to those children), the whole block (`o_proj` stays rowwise only if
`q_proj`/`k_proj`/`v_proj` stay colwise), so the plan names only modules that exist and
its sharding computes the fused model's function (a replicated block computes what a sharded one does). When the plan holds a style
whose output crosses blocks (`sequence_parallel`, ...) no block can be dropped alone, and
the whole plan is dropped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

BLOCK_LOCAL_STYLES = frozenset(
    {
        "colwise",
        "rowwise",
        "colwise_gather_output",
        "colwise_rep",
        "rowwise_rep",
        "rowwise_split_input",
        "packed_colwise",
        "packed_rowwise",
        "embedding_rowwise",
        "replicated_with_grad_allreduce",
        "replicate",
        "mla_kv_a_proj",
        "moe_tp_experts",
        "moe_identity_expert",
        "grouped_gemm",
        "ep_dispatch_experts",
    }
)
"""Transformers' TP/EP styles whose sharding starts and ends inside one block (colwise pairs
with rowwise under one parent; an embedding or gathered head returns replicated output), so
dropping every entry of a block leaves the rest of the plan valid."""

PLAN_ATTRS = ("_tp_plan", "_ep_plan")
"""Per-instance plans Transformers' `post_init` sets (relative to each PreTrainedModel)."""


def _is_dtensor(tensor: torch.Tensor) -> bool:
    """Is `tensor` a torch.distributed DTensor (checked without importing distributed)?"""
    return any(cls.__name__ == "DTensor" for cls in type(tensor).__mro__)


def placement_refusal(module: nn.Module) -> str | None:
    """Why `module` must not be fused because another engine places its weights, or None.

    Returns a reason when a parameter or buffer anywhere under `module` is a DTensor
    (tensor-parallel sharding) or a module under it carries an accelerate `_hf_hook`
    (device_map dispatch, offloading). Fail-closed: either would be bypassed or mis-split by
    a fused module, so the whole subtree stays as it is."""
    for name, tensor in (*module.named_parameters(), *module.named_buffers()):
        if _is_dtensor(tensor):
            return (
                f"{name or 'a tensor'} is a DTensor (sharded by a tensor-parallel plan): a "
                "merged weight cannot hold each rank's slices of the projections it stacks "
                "and fused kernels would bypass the plan's hooks, so fusing is refused"
            )
    for name, child in module.named_modules():
        if getattr(child, "_hf_hook", None) is not None:
            where = name or "the module itself"
            return (
                f"{where} carries an accelerate hook (device_map dispatch or offloading): a "
                "fused forward would bypass the hooks that place its weights and inputs"
            )
    return None


def wildcard(name: str) -> str:
    """`name` with its layer numbers as `*` (`layers.3.mlp` -> `layers.*.mlp`), the form
    Transformers' plan keys take."""
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name)


def _touches(key: str, fused: str) -> bool:
    """Does plan key `key` name `fused`, something inside it, or a module containing it?"""
    if not fused:
        return True
    return key == fused or key.startswith(f"{fused}.") or fused.startswith(f"{key}.")


def prune_plan(plan: dict[str, str], fused: Iterable[str]) -> dict[str, str]:
    """`plan` without the blocks that the fused modules `fused` (wildcard names relative to
    the plan's owner) changed; returns a new dict.

    An entry is dropped when it names a fused module, something inside one or a module
    containing one, and so is every other entry of its block (its parent, `layers.*.self_attn`
    for `layers.*.self_attn.q_proj`), so no rowwise layer is left expecting a colwise input.
    An entry at the top level (no parent) or a style outside BLOCK_LOCAL_STYLES empties the
    plan whenever anything must go: dropping part of it could not be proven valid."""
    fused = list(fused)
    hit = [key for key in plan if any(_touches(key, f) for f in fused)]
    if not hit:
        return dict(plan)
    blocks = {key.rpartition(".")[0] for key in hit}
    if "" in blocks or any(style not in BLOCK_LOCAL_STYLES for style in plan.values()):
        return {}
    return {
        key: style
        for key, style in plan.items()
        if not any(key == b or key.startswith(f"{b}.") for b in blocks)
    }


def prune_model_plans(model: nn.Module, fused_qualnames: Iterable[str]) -> None:
    """Prune the instance plans (`_tp_plan`, `_ep_plan`) of every module of `model` that has
    them after fusing the modules `fused_qualnames` (names in `model`).

    Each plan is relative to its owner, so fused names are taken relative to it; an owner's
    plan is replaced by a new dict (class-level and config plans, shared with unfused
    models, are never mutated)."""
    fused = [wildcard(q) for q in fused_qualnames]
    for prefix, owner in model.named_modules():
        for attr in PLAN_ATTRS:
            plan = owner.__dict__.get(attr)
            if not isinstance(plan, dict) or not plan:
                continue
            start = f"{wildcard(prefix)}." if prefix else ""
            inside = [f[len(start) :] for f in fused if f.startswith(start) or not start]
            setattr(owner, attr, prune_plan(plan, inside))


def adapter_refusal(module: nn.Module) -> str | None:
    """Why `module`'s adapter-wrapped projections are not merged, or None when no direct
    child is one: a child that is not itself an `nn.Linear` but holds an `nn.Linear` as its
    `base_layer` (how PEFT's LoRA, DoRA, IA3 and similar layers wrap a projection). Such a
    child computes more than its linear, so no stacking fuser may treat it as one (they
    only take exact `nn.Linear`s): this only adds the reason to the report."""
    wrapped = [
        f"{name} ({type(child).__module__}.{type(child).__qualname__})"
        for name, child in module.named_children()
        if type(child) is not nn.Linear
        and isinstance(getattr(child, "base_layer", None), nn.Linear)
    ]
    if not wrapped:
        return None
    return (
        f"adapter-wrapped projections are not merged: {', '.join(wrapped)}; apply adapters "
        "after fusing (the original projections stay in place for them) or merge them into "
        "the weights first (merge_and_unload)"
    )
