"""Source analysis: what a forward's Python source does with the values fusion would merge.

Holds the source reader (`source`), may-alias and may-write analysis (`alias`, over the
vocabulary of `alias_terms` and the per-call verdicts of `call_effects`), name resolution
(`name_resolution`), value roots (`value_roots`), writes to and paths of split pieces
(`piece_writes`, `piece_paths`), regions of a forward (`regions`), call paths (`callpath`)
and reads (`reads`). Every question it cannot answer is answered "unsafe".

Layer: imports `fusion.trace`, `fusion.kernels` and the root leaf modules only; never
`fusion.runtime`, `fusion.fusers` or `fusion.engine` (import-linter, pyproject.toml).
"""
