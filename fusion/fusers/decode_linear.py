"""`decode_linear`: a plain `nn.Linear` computes its one-row products with oneDNN.

Not a merge: the module keeps its parameters, hooks, name and place; only its class becomes
`fusion.modules.RowLinear` (an `nn.Linear` subclass), whose forward is `F.linear` except for
one float32 row on an AVX-512 CPU with a weight of `ROW_MIN_ELEMENTS` or more, where it is
oneDNN's one-row product on the live weight (`onednn_backend.row_linear`: faster to stream
a weight from memory, and no less accurate than MKL). That is the decode step of a CPU model:
the projections fusion cannot merge (`o_proj`, `down_proj`) and the LM head, up to a third of
a decoder's weights, read at every generated token.

Why it is safe: the function is `F.linear`'s (the tests bound the one-row product's error by
MKL's against float64); nothing is cached (each call reads the weight as it is now); the
parameters are the same objects, so the state dict, optimisers, tied weights and checkpoint
keys are untouched. Refused (fail closed) for anything that is not exactly `nn.Linear`
(quantised or wrapped linears compute something else), a module with hooks or its own call
path, an instance-level forward, or weights that are not plain 2-D parameters. Linears below
the size threshold are not candidates at all (they would never take the path), so small
models' reports do not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import fx, nn

from fusion.callpath import has_hooks, own_call_path
from fusion.errors import RewriteRefused
from fusion.fusers.base import Fuser
from fusion.kernels import native_gemm, onednn_backend, ops
from fusion.modules import RowLinear


@dataclass
class DecodeLinearFuser(Fuser):
    """Give a plain linear oneDNN's one-row product at decode (`RowLinear`)."""

    name: ClassVar[str] = "decode_linear"
    redefines_forward: ClassVar[bool] = True
    changes_layout: ClassVar[bool] = False

    @classmethod
    def candidate(cls, module: nn.Module) -> bool:
        return type(module) is nn.Linear

    @classmethod
    def applies_to(cls, module: nn.Module) -> bool:
        weight = getattr(module, "weight", None)
        smallest = min(native_gemm.MIN_ELEMENTS, onednn_backend.ROW_MIN_ELEMENTS)
        return weight is not None and weight.numel() >= smallest

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> DecodeLinearFuser | None:
        return cls(source_class=type(module).__name__)

    def validate(self, module: nn.Module) -> None:
        if type(module) is not nn.Linear:
            raise RewriteRefused(f"{type(module).__name__} is not exactly nn.Linear")
        hooks = has_hooks(module)
        if hooks:
            raise RewriteRefused(f"linear has {hooks}")
        path = own_call_path(module)
        if path is not None:
            raise RewriteRefused(f"linear has its own {path}")
        if "forward" in module.__dict__:
            raise RewriteRefused("linear has an instance-level forward")
        for name, param in module.named_parameters(recurse=False):
            if type(param) is not nn.Parameter:
                raise RewriteRefused(f"{name} is a {type(param).__name__}, not a Parameter")
        if module.weight.dim() != 2:
            raise RewriteRefused("weight is not 2-D")

    def fuse(self, module: nn.Module, backend: str) -> nn.Module:
        ops.resolve_decode_kernels()  # before any trace: compiled code only reads them
        module.__class__ = RowLinear
        return module

    def describe(self) -> str:
        return "one-row products by oneDNN at decode (RowLinear)"
