"""The numeric self-check every MoE match passes before it is used.

The expert loop (Transformers 4) is taken on its contract rather than traced; the experts
interface (Transformers 5) is proven by the identity of its functions
(`fusion.fusers.moe.provenance`), never by this sample, which is extra evidence for it. Each
match is run once per kind of instance, on the module's own weights: the fused block must
reproduce the router's indices and weights bit for bit and the block's output to rounding
(`fusion.numerics.relative_error`, NaN never passing), or it refuses."""

from __future__ import annotations

import torch
from torch import nn

from fusion import numerics
from fusion.errors import RewriteRefused
from fusion.fusers.moe.block import MoEMatch
from fusion.fusers.moe.build import build_fused


def check_numerically(module: nn.Module, found: MoEMatch) -> None:
    """Run the block and its fused twin (torch reference kernels) on one random input; refuse
    unless routing is bit-identical (Transformers 5 routers) and outputs agree to rounding."""
    experts = module.get_submodule(found.experts_name)
    weight = next(experts.parameters())
    if weight.device.type == "meta":
        return
    dtype = weight.dtype
    router = module.get_submodule(found.router_name)
    hidden = getattr(router, found.router_weight.rpartition(".")[2]).shape[-1]
    generator = torch.Generator().manual_seed(20240601)
    x = torch.randn(2, 8, hidden, generator=generator).to(weight.device, dtype)
    fused = build_fused(module, found, "torch")
    fused.eval()
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            x2 = x.reshape(-1, hidden)
            _, ref_w, ref_ids = router(x2)
            _, new_w, new_ids = fused.route(x2)
            if not (torch.equal(ref_ids, new_ids) and ref_w.dtype == new_w.dtype):
                raise RewriteRefused("the matched routing picks other experts than the router")
            if not torch.equal(ref_w, new_w):
                raise RewriteRefused("the matched routing weights differ from the router's")
            expected = module(x.clone())
            actual = fused(x.clone())
    except RewriteRefused:
        raise
    except Exception as exc:
        raise RewriteRefused(f"numeric check failed to run: {type(exc).__name__}: {exc}") from exc
    finally:
        module.train(was_training)
    if not torch.is_tensor(expected) or expected.shape != actual.shape:
        raise RewriteRefused("the block's output is not one tensor of the fused block's shape")
    if expected.dtype != actual.dtype:
        raise RewriteRefused(f"the block returns {expected.dtype}, the fused block {actual.dtype}")
    error = numerics.relative_error(actual, expected)
    if not numerics.self_check_passes(error, dtype):  # NaN (a non-finite output) is refused too
        raise RewriteRefused(
            f"fused block differs from the original by {error:.2e} (max-normalised)"
        )
