"""fusion: automatic, fail-closed kernel fusion of Hugging Face Transformers modules.

Public API: `fuse`, `plan`, `FusionReport`, `available_backends`.
"""
