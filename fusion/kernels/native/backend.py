"""The `native` backend: MoE experts on our CPU kernel (`native_gemm`) wherever it is on,
including machines where `auto` does not take oneDNN (AVX2).

What it computes: exactly `reference.moe_experts` (routed products rounded to the input dtype
before the K-term sum); each expert's two GEMMs run on the native kernel when every expert's
row count is within the kernel's limits (decode, short prompts), computing the same function
with no more error (`native_gemm`'s tests bound it by MKL's). Every other call, and every op
but the experts, is the torch reference unchanged.

Where `auto` picks it: after oneDNN (whose backend already uses the kernel for its experts on
AVX-512 machines) and before the reference, when `native_gemm.status()` is 'available' (the
kernel built and passed its probe, and the CPU is one it was measured on). Fail closed:
anything the kernel does not take (other dtypes, autograd recording, `torch.compile` tracing,
too many rows for one expert) runs the reference, and so does every call where PyTorch itself
would not run its plain dense kernel (`contract.plain_dense`: autocast, a tensor subclass or
mode, a functorch transform, a reduced float32 matmul precision). Nothing derived from a
weight outlives a call: each GEMM reads the live expert weights.
"""

from __future__ import annotations

import torch

from fusion.kernels import contract, reference
from fusion.kernels.native import gemm as native_gemm


class NativeKernels(reference.TorchKernels):
    """Backend object: the experts on the native kernel; every other op is the reference's."""

    name = "native"
    delegated = frozenset({"act_and_mul", "rms_norm", "add_rms_norm"})
    """Ops this backend inherits from the torch reference unchanged."""

    @classmethod
    def create(cls) -> NativeKernels | None:
        """The backend, or None where the native kernel is off (`native_gemm.status()`)."""
        return cls() if native_gemm.status() == "available" else None

    def supports(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def moe_experts(
        self,
        hidden: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        activation: str,
    ) -> torch.Tensor:
        """`reference.moe_experts`, each expert's GEMMs on the native kernel where it takes
        them (see the module docstring), else the reference itself."""
        if self._takes(hidden, gate_up, down, topk_ids, topk_weights):
            routed = reference.sort_by_expert(hidden, topk_ids, gate_up.shape[0])

            def gemm(x: torch.Tensor, weights: torch.Tensor, expert: int) -> torch.Tensor:
                return native_gemm.linear(x, weights[expert], None)

            expert_out = reference.expert_chain(routed, gate_up, down, activation, gemm)
            return reference.combine(routed, expert_out, topk_weights, hidden.shape[0])
        return reference.moe_experts(hidden, gate_up, down, topk_ids, topk_weights, activation)

    @staticmethod
    def _takes(
        hidden: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> bool:
        """Whether every expert GEMM of this call may run on the kernel: PyTorch itself would
        run its plain dense kernel on these operands (`contract.plain_dense`; asked on the
        whole call, the routing weights included, before `experts_ok` asks it of expert 0's
        slices), tokens routed, no gradient recorded (the weights' gradient included), the
        kernel's operand rules on expert 0's slices (`native_gemm.experts_ok`, which also
        refuses while compiling), and the busiest expert's rows within its limits (counted
        before any rows are gathered)."""
        if contract.plain_dense("cpu", hidden, gate_up, down, topk_ids, topk_weights) is not None:
            return False
        if hidden.shape[0] == 0 or topk_ids.shape[-1] == 0 or hidden.dim() != 2:
            return False
        if reference.records_grad(topk_weights) or not native_gemm.experts_ok(
            hidden, gate_up, down
        ):
            return False
        busiest = int(torch.bincount(topk_ids.reshape(-1), minlength=gate_up.shape[0]).max())
        return native_gemm.expert_rows_ok(busiest, gate_up, down)


def create() -> NativeKernels | None:
    return NativeKernels.create()
