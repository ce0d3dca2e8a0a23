"""Tracing: what a module's forward computes, as a graph of torch ops.

Holds the tracer (`tracer`: symbolic trace of one forward, fail-closed), the graph it produces
(`graph`), tensor metadata (`tensor_meta`), the pieces of a merged projection (`pieces`),
call signatures (`signature`) and the wrappers fusion looks through (`wrappers`).

Layer: imports `fusion.kernels` and the root leaf modules (`fusion.errors`, `fusion.numerics`,
`fusion.report`) only; never `fusion.analysis`, `fusion.runtime`, `fusion.fusers` or
`fusion.engine` (enforced by import-linter, pyproject.toml `[tool.importlinter]`).
"""
