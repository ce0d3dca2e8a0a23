"""Triton kernels for the fused modules (GPU; CPU only under Triton's interpreter).

Every kernel computes the function its torch reference (`fusion.kernels.reference`) defines,
including where the reference rounds: a statistic the reference computes in bf16 is rounded
to bf16 here at the same step, so the two differ only by the order of a reduction and the
last bit of a transcendental. Inputs the kernels do not cover (an unsupported dtype, an empty
tensor) are computed by the torch reference itself, so a call never returns a different
function.

Device support is decided when this module is imported, because that is when `triton.jit`
decides whether a kernel is compiled or interpreted: with `TRITON_INTERPRET=1` in the
environment at that moment the kernels run in Triton's interpreter on CPU tensors (this is
how CI tests them without a GPU) and the backend `supports()` only CPU; otherwise they are
compiled for CUDA and the backend supports only CUDA devices. The interpreted backend is
never chosen by `auto` (it is `interpreted`, not fast); it runs only when named.

Layout: `jit` holds the `@triton.jit` kernels, `host` the input checks, launches and the
`TritonKernels` backend object.
"""

from __future__ import annotations

from fusion.kernels.triton.host import INTERPRETED, TritonKernels, create

__all__ = ["INTERPRETED", "TritonKernels", "create"]
