"""The native (C) backend: its kernels object (`backend`), the build of its shared library
(`build`) and its row-major GEMM (`gemm`).

Layer: part of `fusion.kernels`; imports the rest of `fusion.kernels` and the root leaf
modules only.
"""
