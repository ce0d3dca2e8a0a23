"""Fused nn.Modules that replace the matched Transformers submodules.

Each holds exactly the state of what it replaces (stacked, never re-initialised) and calls
its kernel through `fusion.kernels.ops` (the backend chosen per call; a registered operator
while `torch.compile` traces), so a backend can be swapped without refusing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fusion.kernels import contract, ops, torch_ref
from fusion.params import apply_state, common_state


class MergedLinear(nn.Module):
    """Several linears reading one input, as one stacked weight and one GEMM.

    `forward` returns the concatenated outputs; the rewritten forward splits them with
    `output_sizes`. `shard_names` and `shard_bias` remember the original children so the
    unfused checkpoint maps onto this module and back bit for bit. A shard without a bias
    gets exact zeros in the stacked bias when any other shard has one: adding 0.0 changes
    no value, and one GEMM with bias stays one GEMM.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        shard_names: Sequence[str],
        shard_bias: Sequence[bool],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        ops.resolve_decode_kernels()  # before any trace: compiled code only reads them
        if not (len(output_sizes) == len(shard_names) == len(shard_bias)):
            raise ValueError("output_sizes, shard_names and shard_bias differ in length")
        self.in_features = in_features
        self.output_sizes = [int(size) for size in output_sizes]
        self.shard_names = tuple(shard_names)
        self.shard_bias = tuple(bool(b) for b in shard_bias)
        total = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(total, in_features, dtype=dtype, device=device))
        if any(self.shard_bias):
            self.bias = nn.Parameter(torch.empty(total, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linears(cls, linears: dict[str, nn.Linear]) -> MergedLinear:
        """Stack `linears` (name -> module, in shard order) into one merged module.

        The caller has checked they share in_features, dtype and device."""
        first = next(iter(linears.values()))
        merged = cls(
            first.in_features,
            [linear.out_features for linear in linears.values()],
            list(linears),
            [linear.bias is not None for linear in linears.values()],
            dtype=first.weight.dtype,
            device=first.weight.device,
        )
        with torch.no_grad():
            merged.weight.copy_(torch.cat([lin.weight for lin in linears.values()], dim=0))
            if merged.bias is not None:
                merged.bias.copy_(torch.cat([_bias_or_zeros(lin) for lin in linears.values()]))
        apply_state(merged.weight, common_state({n: lin.weight for n, lin in linears.items()}))
        biases = {n: lin.bias for n, lin in linears.items() if lin.bias is not None}
        if biases:
            apply_state(merged.bias, common_state(biases))
        return merged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias
        if (
            bias is not None
            and not all(self.shard_bias)
            and bias.requires_grad
            and torch.is_grad_enabled()
        ):
            # The zero slices stand in for absent biases: no gradient may reach them, or an
            # optimiser step would give a bias-less projection a bias. Multiplying by the
            # 0/1 mask keeps every value exact (b * 1.0 == b) and zeroes their gradient.
            bias = bias * self._bias_mask(bias)
        decoded = ops.decode_product(x, self.weight, bias)
        if decoded is not None:
            # decode sizes on a CPU: one stacked product by a kernel that streams the live
            # weight once and errs no more than MKL (`ops.decode_product`)
            return decoded
        if self._per_shard(x, bias):
            return self._shard_products(x, bias)
        return F.linear(x, self.weight, bias)

    def _per_shard(self, x: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether `forward` runs one GEMM per shard (`_shard_products`) instead of one
        stacked GEMM: several shards, several float32 rows on a CPU, inference (no gradient
        recorded), where PyTorch itself would run its plain dense kernel
        (`contract.plain_dense`; elsewhere the one stacked `F.linear` runs, the module's
        reference: e.g. a weight subclass overriding `F.linear` but not `split` would lose
        its override on the shards); under `torch.compile` too (Inductor runs a CPU float32
        GEMM as MKL's `mm` as well: one stacked GEMM was 0.90x the shards at 16 rows,
        gate_up 2048 -> 2 x 8192, one thread).

        Why: MKL's float32 GEMM at 2-128 rows runs a stacked weight slower than its pieces
        (on a 2-core Zen 4, one thread: 16 rows, 2048 -> 8192+8192 1.13x faster per shard,
        1024 -> 3072+3072 1.13x, q/k/v 1.02-1.05x; `tests/bench` measures the models).
        Each shard's GEMM reads its rows of the live stacked weight (a view: no copy, so
        every weight write is seen), and each output element is the same dot product as
        the stacked GEMM's (rounding of the reduction may differ, as between any two GEMM
        calls)."""
        return (
            len(self.output_sizes) > 1
            and x.device.type == "cpu"
            and x.dtype == torch.float32
            and self.weight.dtype == torch.float32
            and x.numel() > x.shape[-1]
            and not torch_ref.records_grad(x, self.weight, *(() if bias is None else (bias,)))
            and contract.plain_dense("cpu", x, self.weight, bias) is None
        )

    def _shard_products(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`F.linear(x, weight, bias)` computed shard by shard on row views of the stacked
        weight (and bias), concatenated along the last dimension: a new tensor. Each block
        is what the unfused projection's `F.linear` returns, bit for bit (the same call on
        the same operands; a synthesised zero bias is not added).

        Why a concatenation rather than each GEMM writing its column block of one output:
        MKL writes a strided output block more slowly than the copy costs (interleaved, 16
        rows, Qwen3-0.6B / Llama-3.2-1B MLPs: 0.5-2% slower at 1 and 2 threads)."""
        weights = self.weight.split(self.output_sizes, dim=0)
        biases = (None,) * len(weights) if bias is None else bias.split(self.output_sizes)
        pieces = [
            F.linear(x, w, b if own else None)
            for w, b, own in zip(weights, biases, self.shard_bias)
        ]
        return torch.cat(pieces, dim=-1)

    def _bias_mask(self, bias: torch.Tensor) -> torch.Tensor:
        pieces = [
            torch.full((size,), float(has), dtype=bias.dtype, device=bias.device)
            for size, has in zip(self.output_sizes, self.shard_bias)
        ]
        return torch.cat(pieces)

    def extra_repr(self) -> str:
        shards = ", ".join(
            f"{name}={size}" for name, size in zip(self.shard_names, self.output_sizes)
        )
        return f"in_features={self.in_features}, shards=({shards}), bias={self.bias is not None}"


class RowLinear(nn.Linear):
    """An `nn.Linear` whose decode-sized products on a CPU take `ops.decode_product` (the
    native kernel at 1 to 256 rows (`native_gemm.rows_ok`), else oneDNN's one-row product); every
    other call is `F.linear`. Installed by the `decode_linear` fuser on a plain linear (a
    class change: same parameters, same place); see `fusion.fusers.decode_linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        decoded = ops.decode_product(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias) if decoded is None else decoded


def _bias_or_zeros(linear: nn.Linear) -> torch.Tensor:
    if linear.bias is not None:
        return linear.bias
    return torch.zeros(linear.out_features, dtype=linear.weight.dtype, device=linear.weight.device)


class ActAndMul(nn.Module):
    """`act(x[..., :d]) * x[..., d:]`: the activation on the gate half, times the up half."""

    def __init__(self, activation: str, backend: str = "auto") -> None:
        super().__init__()
        self.activation = activation
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.act_and_mul(self.backend, x, self.activation)

    def extra_repr(self) -> str:
        return f"activation={self.activation}, backend={self.backend}"


DtypePair = tuple[torch.dtype, torch.dtype | None]
"""(input dtype, weight dtype or None for a weightless norm)."""


class FusedRMSNorm(nn.Module):
    """An RMSNorm in the exact variant it was matched in, as one kernel call.

    The variant (`offset`, `upcast`, `weight_after_cast`, `cast_to_weight`) is what
    `fusion.fusers.rmsnorm` proved the replaced module computes; `torch_ref.rms_norm` defines
    each flag. `weight` is the replaced module's own Parameter object (never a copy), under the
    same name, so checkpoints, ties and optimiser state map 1:1; a weightless norm has none and
    normalises whatever width it is given.

    `eps=None` reproduces `F.rms_norm(..., eps=None)`: machine epsilon of the float32-or-wider
    compute dtype, resolved per call.

    `verified` lists the (input dtype, weight dtype) pairs for which the match proved the
    function equal (float32, bfloat16 and float16 always; float64 only when the original's
    casts agree there too). Any other pair raises TypeError instead of silently computing
    another function.
    """

    def __init__(
        self,
        weight: nn.Parameter | None,
        eps: float | None,
        *,
        offset: float = 0.0,
        upcast: bool = True,
        weight_after_cast: bool = True,
        cast_to_weight: bool = False,
        verified: frozenset[DtypePair] = frozenset(),
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.has_weight = weight is not None
        if weight is not None:
            self.weight = weight
        self.eps = eps
        self.offset = float(offset)
        self.upcast = bool(upcast)
        self.weight_after_cast = bool(weight_after_cast)
        self.cast_to_weight = bool(cast_to_weight)
        self.verified = frozenset(verified)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.has_weight else None
        pair = (x.dtype, None if weight is None else weight.dtype)
        if pair not in self.verified:
            raise TypeError(
                f"FusedRMSNorm was proven equal to the module it replaced only for "
                f"(input, weight) dtypes {sorted(map(str, self.verified))}, not {pair}"
            )
        return ops.rms_norm(self.backend, x, weight, self._eps_for(x.dtype), **self._variant())

    def _eps_for(self, dtype: torch.dtype) -> float:
        """The eps the replaced module used: its own, or (None) the float32-or-wider finfo
        eps of the input dtype, as `torch.nn.RMSNorm` does."""
        if self.eps is not None:
            return self.eps
        return torch.finfo(torch.promote_types(dtype, torch.float32)).eps

    def _variant(self) -> dict[str, Any]:
        """The proven variant's keyword arguments for the rms_norm kernels."""
        return {
            "offset": self.offset,
            "upcast": self.upcast,
            "weight_after_cast": self.weight_after_cast,
            "cast_to_weight": self.cast_to_weight,
        }

    def extra_repr(self) -> str:
        width = tuple(self.weight.shape) if self.has_weight else "any width"
        order = "weight after cast" if self.weight_after_cast else "weight before cast"
        if self.weight_after_cast and self.cast_to_weight:
            order += " to the weight's dtype"
        return (
            f"{width}, eps={self.eps}, offset={self.offset}, upcast={self.upcast}, {order}, "
            f"backend={self.backend}"
        )

    def add_forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(s, n)` with `s = a + b` and `n` this norm of `s`: a decoder layer's residual add
        and the norm reading the sum, as one `add_rms_norm` kernel call.

        Returns exactly what `s = a + b; n = self(s)` binds, bit for bit: the kernel forms
        `s` as PyTorch's add does and normalises the rounded `s` with this module's variant,
        eps and backend (`Kernels.add_rms_norm`). It runs only for two tensors of one dtype
        and shape whose (dtype, weight dtype) pair is `verified`; anything else (promotion,
        broadcasting, an unverified pair: `forward` raises TypeError for it) runs the two
        ops apart, through `self(s)`. Bypasses `__call__`: the caller checks this module has
        no hooks and no call path of its own (`fusion.fusers.residual_norm.runtime`).
        """
        weight = self.weight if self.has_weight else None
        if not (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and (a.dtype, None if weight is None else weight.dtype) in self.verified
        ):
            total = a + b
            return total, self(total)
        return ops.add_rms_norm(
            self.backend, a, b, weight, self._eps_for(a.dtype), **self._variant()
        )
