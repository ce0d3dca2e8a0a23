"""`decode_linear`: a plain `nn.Linear` computes its decode-sized products with our kernels.

Not a merge, and no change of type: the module keeps its class (exactly `nn.Linear`), its
parameters, hooks, name and place; only its `forward` becomes an instance attribute, a
`fusion.runtime.linear_forward.LinearForward`, which is `F.linear` except for products on a CPU with
a weight of 256K+ elements (`native_gemm.MIN_ELEMENTS`; oneDNN's one-row product: 1M+), at 1 to
256 rows where the native kernel is on (`native_gemm`: it
streams the live weight once, MKL packs it on every call) and otherwise at one row on
AVX-512 where oneDNN's one-row product is, each where the policy measured it faster. So
type-keyed tools (`quantize_dynamic(model, {nn.Linear})`, `isinstance`, a patch of
`nn.Linear.forward`) see the unfused model; the forward checks its premises on every call
and otherwise runs the class's forward. That is the decode
step (and short prompts) of a CPU model: the projections fusion cannot merge (`o_proj`,
`down_proj`) and the LM head, up to a third of a decoder's weights, read at every generated
token.

Why it is safe: the function is `F.linear`'s (the tests bound both kernels' error by MKL's
against float64); nothing is cached (each call reads the weight as it is now); the
parameters are the same objects, so the state dict, optimisers, tied weights and checkpoint
keys are untouched. Refused (fail closed) for anything that is not exactly `nn.Linear`
(quantised or wrapped linears compute something else) or while `nn.Linear.forward` or
`F.linear` is not torch's own (`linear_forward.premise_failure`), a module with hooks or its
own call path, an instance-level forward, or weights that are not plain 2-D parameters. Linears below
the size threshold are not candidates at all (they would never take the path), so small
models' reports do not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import fx, nn

from fusion.analysis.callpath import has_hooks, own_call_path
from fusion.errors import RewriteRefused
from fusion.fusers.base import Fuser
from fusion.kernels import onednn as onednn_backend
from fusion.kernels.native import gemm as native_gemm
from fusion.runtime.linear_forward import install, premise_failure


@dataclass
class DecodeLinearFuser(Fuser):
    """Give a plain linear the decode-sized CPU kernels behind its forward (`LinearForward`)."""

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
        premise = premise_failure(module)
        if premise is not None:
            raise RewriteRefused(premise)
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
        install(module, backend)
        return module

    def describe(self) -> str:
        return "decode-sized products by the measured kernel, behind its forward (same class)"
