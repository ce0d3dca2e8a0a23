"""Engine: drives the fusers over a model.

Holds the driver (`apply`: match, rewrite, validate per instance, install or refuse), device
placement of fused modules (`placement`) and kernel tuning (`tuning`: calibrate, the
per-machine choices).

Layer: the top of fusion below `fusion/__init__.py`; may import every layer below
(`fusion.fusers`, `fusion.runtime`, `fusion.analysis`, `fusion.trace`, `fusion.kernels`, the
root leaf modules). Nothing in fusion but the root package imports it (import-linter,
pyproject.toml).
"""
