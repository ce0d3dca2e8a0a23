"""Fusers: each recognises one pattern in a module and rewrites it, or refuses with a reason.

Holds the fuser interface (`base`), the matches fusers report (`matches`), the registry of
fusers (`registry`) and every fuser (`glu`, `qkv`, `stacked`, `moe`, `rmsnorm`, ...).

Layer: imports `fusion.runtime`, `fusion.analysis`, `fusion.trace.tracer`, `fusion.kernels` and the
root leaf modules only; never `fusion.engine` (import-linter, pyproject.toml).
"""
