"""The Triton backend under its older module name: the same API as `fusion.kernels.triton`
(where the kernels and their host code live)."""

from __future__ import annotations

from fusion.kernels.triton import INTERPRETED, TritonKernels, create

__all__ = ["INTERPRETED", "TritonKernels", "create"]
