"""Lifecycle operations that train: a training step on twins, an optimizer made before
fusing, `parameters()`, LoRA after fusing, a global backward hook.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fusion import inspection
from fusion.inspection import unfused_named
from harness.oracles.lifecycle.core import (
    Context,
    _cast,
    _compare,
    _Failed,
    _logits,
    _NotApplicable,
    _twins,
    _unfused,
    not_installed,
)
from harness.oracles.parity import logits_of


def _accepts(model: nn.Module, name: str) -> bool:
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


def _train_step(model: nn.Module, ctx: Context) -> torch.Tensor:
    model.train()
    kwargs = _cast(ctx.inputs, ctx.dtype)
    labels = kwargs.get("input_ids")
    if labels is not None and _accepts(model, "labels"):
        kwargs["labels"] = labels
    torch.manual_seed(0)  # dropout and router jitter draw the same numbers on both sides
    output = model(**kwargs)
    loss = getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        loss = logits_of(output).float().square().mean()
    loss.backward()
    return loss.detach()


def _train(ctx: Context) -> str:
    unfused, fused = _twins(ctx)
    return _train_twins(ctx, unfused, fused, unfused_named)


def _train_twins(
    ctx: Context,
    unfused: nn.Module,
    fused: nn.Module,
    rename: Callable[[nn.Module, dict[str, Any]], dict[str, Any]],
) -> str:
    """One training step of both: the loss and every gradient (the fused model's mapped to
    unfused names by `rename`) must agree, then an SGD step, and the eval logits after it."""
    want_loss = _unfused("a training step", lambda: _train_step(unfused, ctx))
    got_loss = _train_step(fused, ctx)
    rtol = 1e-3 if ctx.dtype in (torch.float32, torch.float64) else 5e-2
    _compare("loss", got_loss, want_loss, rtol * max(float(want_loss.abs()), 1.0))
    want = {n: p.grad for n, p in unfused.named_parameters()}
    got = rename(fused, {n: p.grad for n, p in fused.named_parameters()})
    if set(got) != set(want):
        extra, lost = sorted(set(got) - set(want)), sorted(set(want) - set(got))
        raise _Failed(f"parameters differ after mapping: extra {extra[:3]}, missing {lost[:3]}")
    scale = max((float(g.abs().max()) for g in want.values() if g is not None), default=0.0)
    for name, grad in want.items():
        other = got[name]
        if (grad is None) != (other is None):
            if other is not None:
                raise _Failed(f"{name} has a gradient the unfused model does not")
            raise _Failed(f"{name} has no gradient where the unfused model has one")
        if grad is not None:
            allowed = rtol * float(grad.abs().max()) + 1e-5 * scale
            _compare(f"gradient of {name}", other, grad, allowed)
    for model in (unfused, fused):
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param.sub_(0.1 * param.grad)
        model.eval()
    after = _logits(unfused, ctx)
    # Gradients that agree to rounding give steps that agree to rounding times the step: the
    # allowance grows with how far the step moved the unfused logits. A step that trains the
    # wrong weights (or misses the merged ones) differs by the step itself.
    moved = float((after.double() - ctx.unfused_logits.double()).abs().max())
    _compare("logits after an SGD step", _logits(fused, ctx), after, ctx.allowance + rtol * moved)
    return f"loss, {sum(g is not None for g in want.values())} gradients and a step agree"


def _fused_late(ctx: Context) -> tuple[nn.Module, torch.optim.Optimizer, list[int]]:
    """An unfused copy, an AdamW optimiser built on it, then the copy fused: (the copy, its
    optimiser, its Parameters' identities before fusing). Made once per check."""
    if "late" not in ctx.shared:
        late = copy.deepcopy(ctx.unfused)
        identities = [id(p) for p in late.parameters()]
        # eps=1: AdamW's update stays linear in small gradients, so gradients equal up to
        # rounding (what `train` checks) give updates equal up to rounding; with the default
        # eps a gradient at rounding-noise level is normalised to a full step of either sign.
        optimizer = torch.optim.AdamW(late.parameters(), lr=1e-2, eps=1.0)
        ctx.fuse(late)  # after the optimiser holds its Parameters
        ctx.shared["late"] = (late, optimizer, identities)
    return ctx.shared["late"]


def _optimizer_before_fuse(ctx: Context) -> str:
    unfused = copy.deepcopy(ctx.unfused)
    before = {name: p.detach().clone() for name, p in unfused.named_parameters()}
    late, late_optimizer, _ = _fused_late(ctx)
    optimizers = [torch.optim.AdamW(unfused.parameters(), lr=1e-2, eps=1.0), late_optimizer]
    rtol = 1e-3 if ctx.dtype in (torch.float32, torch.float64) else 5e-2
    for _ in range(3):
        for model, optimizer in zip((unfused, late), optimizers):
            optimizer.zero_grad(set_to_none=True)
            if model is unfused:
                _unfused("a training step", lambda: _train_step(unfused, ctx))
            else:
                _train_step(late, ctx)
            optimizer.step()
    got = dict(late.named_parameters())
    moved_count = 0
    for name, param in unfused.named_parameters():
        other = got.get(name)
        if other is None:
            raise _Failed(f"the fused model has no parameter {name}")
        moved = float((param.detach().double() - before[name].double()).abs().max())
        if moved == 0.0:
            continue
        moved_count += 1
        if torch.equal(other.detach(), before[name]):
            raise _Failed(f"{name} was never updated by the optimiser built before fusing")
        allowed = rtol * moved + 1e-6 * float(before[name].abs().max())
        _compare(f"{name} after 3 AdamW steps", other.detach(), param.detach(), allowed)
    for model in (unfused, late):
        model.eval()
    after = _logits(unfused, ctx)
    moved = float((after.double() - ctx.unfused_logits.double()).abs().max())
    _compare("logits after the steps", _logits(late, ctx), after, ctx.allowance + rtol * moved)
    return f"{moved_count} parameters trained as unfused by an optimiser built before fusing"


def _parameters(ctx: Context) -> str:
    late, _, identities = _fused_late(ctx)
    if [id(p) for p in late.parameters()] != identities:
        raise _Failed("fusing replaced or reordered Parameter objects")
    for what, listing in (
        ("named_parameters()", lambda m: [(n, p.requires_grad) for n, p in m.named_parameters()]),
        ("named_buffers()", lambda m: [n for n, _ in m.named_buffers()]),
        ("state_dict() keys", lambda m: list(m.state_dict())),
    ):
        want, got = listing(ctx.unfused), listing(ctx.fused)
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
            where = min(len(got), len(want)) if first is None else first
            raise _Failed(
                f"{what} differ at position {where}: "
                f"{got[where] if where < len(got) else 'nothing'}, unfused "
                f"{want[where] if where < len(want) else 'nothing'}"
            )
    kept = {name for name, _ in ctx.fused.named_modules()}
    gone = [name for name, _ in ctx.unfused.named_modules() if name not in kept]
    if gone:  # fused-only modules (a `qkv_proj`) may be added; none may go
        raise _Failed(f"{len(gone)} modules are gone from named_modules() ({gone[:3]})")
    for attr in ("_tp_plan", "_ep_plan"):
        # a plan applied later must meet the names it was written for (fusion.engine.placement)
        want_plan = getattr(ctx.unfused, attr, None) or {}
        got_plan = getattr(ctx.fused, attr, None) or {}
        if got_plan != want_plan:
            lost = sorted(set(want_plan) - set(got_plan))
            raise _Failed(f"{attr.strip('_')} differs: {len(lost)} entries lost ({lost[:3]})")
    return (
        f"{len(identities)} Parameters kept; names, order, buffers, keys and parallel plans "
        "identical; every module name kept"
    )


def _lora_targets(model: nn.Module) -> list[str]:
    """Two shard names (or one) of the model's first merged projection (attention comes
    before the MLP): what a user names in `LoraConfig(target_modules=...)` (`q_proj` and
    `k_proj`). Not a GLU's gate without its up projection: PEFT refuses that split."""
    first = next(iter(inspection.merged_projections(model)), None)
    return [] if first is None else list(first.shard_names[:2])


def _lora_after_fuse(ctx: Context) -> str:
    try:
        import peft
    except ImportError as exc:
        raise _NotApplicable(not_installed("peft")) from exc
    targets = _lora_targets(ctx.fused)
    if not targets:
        raise _NotApplicable("no merged projection for a LoRA adapter to target")
    # init_lora_weights=False: B is random too, so the adapters change the outputs at once
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    unfused, fused = _twins(ctx)
    _unfused(f"LoRA on {targets}", lambda: peft.inject_adapter_in_model(config, unfused))
    peft.inject_adapter_in_model(config, fused)
    adapters = _unfused(
        "PEFT's adapter state dict", lambda: peft.get_peft_model_state_dict(unfused)
    )
    # Loading them back into the unfused model first (a no-op there): where PEFT cannot load
    # adapters into this model at all (PEFT 0.21 over Transformers 5.0's weight conversions
    # raises TypeError), that is the unfused model's own limit, not a fusion failure.
    _unfused(
        "PEFT's set_peft_model_state_dict",
        lambda: peft.set_peft_model_state_dict(unfused, adapters),
    )
    missing = peft.set_peft_model_state_dict(fused, adapters).unexpected_keys
    if missing or set(peft.get_peft_model_state_dict(fused)) != set(adapters):
        raise _Failed("the fused model's LoRA adapters have other names than the unfused one's")
    want = _logits(unfused, ctx)
    if torch.equal(want, ctx.unfused_logits):
        raise _NotApplicable(f"LoRA on {targets} does not change the unfused logits here")
    diff = _compare(f"logits with LoRA on {targets}", _logits(fused, ctx), want, ctx.allowance)
    _train_twins(ctx, unfused, fused, lambda model, grads: grads)
    return f"LoRA on {targets} after fusing: logits within {diff:.3g}, a training step agrees"


def _double_norm_gradients(module: nn.Module, grad_input: Any, grad_output: Any) -> Any:
    if "Norm" not in type(module).__name__:
        return None
    return tuple(g * 2.0 if g is not None and g.is_floating_point() else g for g in grad_input)


def _train_global_hook(ctx: Context) -> str:
    handle = nn.modules.module.register_module_full_backward_hook(_double_norm_gradients)
    try:
        with warnings.catch_warnings():
            # "Full backward hook is firing when gradients are computed with respect to
            # module outputs since no inputs require gradients": the embedding's output.
            warnings.simplefilter("ignore", UserWarning)
            return _train(ctx)
    finally:
        handle.remove()
