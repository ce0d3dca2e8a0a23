"""Runtime: the modules and hooks a fused model runs with.

Holds the merged modules (`merged`, `moe`, `experts`) and their parameters (`params`), the
bound forwards (`bound`), the guards that keep a fused model equal to its unfused weights
(`guards`), the fast-path routes (`routes`), checkpoint round-trips (`checkpoint`) and the
norm and linear forwards (`norm_forward`, `linear_forward`).

Layer: imports `fusion.analysis`, `fusion.trace`, `fusion.kernels` and the root leaf modules
only; never `fusion.fusers` or `fusion.engine` (import-linter, pyproject.toml).
"""
