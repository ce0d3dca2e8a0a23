"""Deterministic, realistically scaled random weights for tiny models.

Construction runs under a private seeded RNG (the caller's global RNG is left as it was) with
PyTorch's "fill uninitialized memory" switched on, so a parameter a model forgot to initialise
comes out as NaN instead of whatever bytes were lying around, and is then drawn from the seeded
generator. After construction only two targeted kinds of parameter are redrawn, because their
Transformers init is a constant that would hide fusion bugs:

* normalisation weights: scale-type (init 1) become ``1 + N(0, 0.1)``, zero-centred ones
  (Gemma-style ``(1 + w)``, init 0) become ``N(0, 0.1)``; norm biases become ``N(0, 0.1)``;
* linear biases initialised to exactly zero become ``N(0, initializer_range)`` (a fused bias that
  is dropped or added twice must change the output).

Everything else keeps the model's own initialisation (so special inits such as SSM ``A_log`` or
``dt_bias`` keep their meaning).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

__all__ = ["NORM_STD", "deterministic_construction", "randomise"]

NORM_STD = 0.1


@contextlib.contextmanager
def deterministic_construction(seed: int) -> Iterator[None]:
    """Seed a forked CPU RNG and make ``torch.empty`` memory NaN-filled while inside.

    Restores the global RNG state and the determinism flags afterwards, so building a model never
    perturbs the caller's randomness.
    """
    prev_det = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    det = getattr(torch.utils, "deterministic", None)  # torch >= 2.1
    prev_fill = getattr(det, "fill_uninitialized_memory", None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            torch.use_deterministic_algorithms(True, warn_only=True)
            if det is not None:
                det.fill_uninitialized_memory = True
            yield
        finally:
            torch.use_deterministic_algorithms(prev_det, warn_only=prev_warn)
            if det is not None:
                det.fill_uninitialized_memory = prev_fill


def _is_norm(module: nn.Module) -> bool:
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)):
        return True
    return "norm" in type(module).__name__.lower()


def randomise(model: nn.Module, seed: int, std: float = 0.02) -> list[str]:
    """Redraw norm weights/biases, zero linear biases and never-initialised parameters in place.

    Returns the qualified names of never-initialised parameters that had to be drawn (empty for a
    well-behaved model). Deterministic: one generator seeded from ``seed``, parameters visited in
    ``named_modules`` order.
    """
    gen = torch.Generator().manual_seed(seed + 0x5EED)
    uninitialised: list[str] = []

    def draw(p: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        with torch.no_grad():
            p.copy_(fn(noise).to(p.dtype))

    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.is_floating_point():
                continue
            seen.add(id(p))
            qual = f"{mod_name}.{p_name}" if mod_name else p_name
            if torch.isnan(p).any():
                uninitialised.append(qual)
                draw(p, lambda n: n * std)
            elif _is_norm(module) and p.dim() == 1 and p_name in ("weight", "bias"):
                if bool((p == 1).all()):
                    draw(p, lambda n: 1 + n * NORM_STD)
                elif bool((p == 0).all()):
                    draw(p, lambda n: n * NORM_STD)
            elif isinstance(module, nn.Linear) and p_name == "bias" and bool((p == 0).all()):
                draw(p, lambda n: n * std)
    return uninitialised
