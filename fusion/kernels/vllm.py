"""vLLM's custom CUDA ops behind the `Kernels` interface (optional; only where `import vllm` works).

vLLM is never a dependency: `create()` returns None when vLLM does not import, has no compiled
ops (`torch.ops._C`) or no CUDA device, and the registry then lists no `vllm` backend.

vLLM's ops cover a subset of the variants the fused modules need, so this backend uses them
only where they compute exactly the reference's function:

- `rms_norm`: vLLM's kernel is Llama's variant (statistics in float32, normalised value cast
  back to the input dtype, *then* multiplied by a weight of the input's dtype). It is used for
  a `NormVariant` with `upcast`, `weight_after_cast` and no `offset`, with a weight of `x`'s
  dtype and a half/bfloat16/float32 input (T5's `cast_to_weight` is then the same function);
  every other variant (Gemma's offset and cast order, weightless, mixed dtypes) goes to the
  next backend.
- `act_and_mul`: vLLM's `silu_and_mul`, `gelu_and_mul` and `gelu_tanh_and_mul` compute the
  activation in float32, round it to the input dtype and multiply: the reference's function.
- `moe_experts`: always the next backend. vLLM's `fused_experts` sums the K routed products
  in float32 before one rounding (the reference rounds each product first) and its Python
  signature changes between vLLM releases; wiring it is future work.

"The next backend" is Triton when it runs on the tensor's device, else the torch reference,
so a call always computes the documented function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fusion import kernels
from fusion.kernels import reference
from fusion.kernels.norm_variant import DEFAULT_VARIANT, NormVariant

_VLLM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Input dtypes vLLM's norm and activation kernels are compiled for."""

_ACT_OPS = {"silu": "silu_and_mul", "gelu": "gelu_and_mul", "gelu_tanh": "gelu_tanh_and_mul"}
"""Activation name -> name of vLLM's `torch.ops._C` op computing `act(x[:d]) * x[d:]`."""


def _load_ops() -> dict[str, Callable[..., None]] | None:
    """vLLM's compiled ops by name, or None when vLLM (or its CUDA extension) is unavailable."""
    try:
        import vllm._custom_ops  # noqa: F401  (loads the compiled `_C` extension)
    except Exception:  # any failure to import an optional dependency means "not available"
        return None
    namespace = getattr(torch.ops, "_C", None)
    if namespace is None:
        return None
    ops: dict[str, Callable[..., None]] = {}
    for name in ("rms_norm", *_ACT_OPS.values()):
        try:
            ops[name] = getattr(namespace, name)
        except (AttributeError, RuntimeError):
            continue
    return ops or None


class VllmKernels:
    """The vLLM backend (CUDA only); variants vLLM lacks are delegated (see module doc)."""

    name = "vllm"
    interpreted = False
    delegated: frozenset[str] = frozenset()
    """No op is handed to the reference whole (only variants vLLM lacks, per call)."""
    auto_pick = True

    def __init__(self, ops: dict[str, Callable[..., None]]) -> None:
        self._ops = ops

    @classmethod
    def create(cls) -> VllmKernels | None:
        """The backend, or None when vLLM's ops or a CUDA device are missing."""
        if not torch.cuda.is_available():
            return None
        ops = _load_ops()
        return cls(ops) if ops is not None else None

    def supports(self, device: torch.device) -> bool:
        """True for CUDA devices only."""
        return torch.device(device).type == "cuda"

    def _fallback(self, device: torch.device):
        try:
            return kernels.get("triton", device)
        except ValueError:
            return kernels.get("torch", device)

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        *,
        variant: NormVariant = DEFAULT_VARIANT,
    ) -> torch.Tensor:
        """`reference.rms_norm`; vLLM's kernel for the Llama variant, else the next backend.

        Returns a new tensor of `x`'s shape (vLLM writes into a fresh `empty_like`); never
        writes to `x` or `weight`.
        """
        op = self._ops.get("rms_norm")
        if (
            op is None
            or weight is None
            or not variant.fast
            or variant.offset
            or not variant.upcast
            or not variant.weight_after_cast
            or x.dtype not in _VLLM_DTYPES
            or weight.dtype != x.dtype
            or x.device.type != "cuda"
            or x.numel() == 0
            or weight.dim() != 1
            or weight.shape[0] != x.shape[-1]
        ):
            return self._fallback(x.device).rms_norm(x, weight, eps, variant=variant)
        x_in = x.contiguous()
        out = torch.empty_like(x_in)
        op(out, x_in, weight.contiguous(), float(eps))
        return out

    def add_rms_norm(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        *,
        variant: NormVariant = DEFAULT_VARIANT,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`reference.add_rms_norm` through the next backend. vLLM's `fused_add_rms_norm`
        is not used: it writes both inputs in place, and it takes the variance of the float32
        sum before rounding it to the input dtype, while the unfused layer normalises the
        rounded sum (a different function in bfloat16/float16)."""
        return self._fallback(a.device).add_rms_norm(a, b, weight, eps, variant=variant)

    def moe_experts(
        self,
        hidden: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        activation: str,
    ) -> torch.Tensor:
        """`reference.moe_experts` through the next backend (vLLM's fused_moe is not wired)."""
        return self._fallback(hidden.device).moe_experts(
            hidden, gate_up, down, topk_ids, topk_weights, activation
        )

    def act_and_mul(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """`reference.act_and_mul` with vLLM's op for the activation, else the next backend.

        Returns a new tensor of shape `x.shape[:-1] + (x.shape[-1] // 2,)`; never writes to `x`.
        """
        op = self._ops.get(_ACT_OPS.get(activation, ""))
        if (
            op is None
            or x.dtype not in _VLLM_DTYPES
            or x.device.type != "cuda"
            or x.dim() == 0
            or x.shape[-1] % 2
            or x.numel() == 0
        ):
            if op is None and activation not in reference.ACTIVATIONS:
                return reference.act_and_mul(x, activation)  # raises the reference's KeyError
            return self._fallback(x.device).act_and_mul(x, activation)
        x_in = x.contiguous()
        out = torch.empty((*x_in.shape[:-1], x_in.shape[-1] // 2), dtype=x.dtype, device=x.device)
        op(out, x_in)
        return out


def create() -> VllmKernels | None:
    """Registry factory: the vLLM backend, or None where vLLM cannot run."""
    return VllmKernels.create()


__all__ = ["VllmKernels", "create"]
