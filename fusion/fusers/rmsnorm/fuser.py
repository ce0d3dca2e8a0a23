"""`RMSNormFuser`: which modules are norms, per-instance matches, validate, fuse."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

from torch import fx, nn

from fusion.callpath import has_hooks
from fusion.errors import RewriteRefused
from fusion.fusers.base import Fuser, per_signature
from fusion.fusers.rmsnorm.interpret import op_name
from fusion.fusers.rmsnorm.match import NormMatch, instance_signature, prove_variant
from fusion.modules import FusedRMSNorm

_NORM_NAME = re.compile(r"RMSNorm$")
"""Classes whose name says RMSNorm: if they do not match, the reason must be reported."""


def _looks_like_norm(graph: fx.Graph | None) -> bool:
    if graph is None:
        return False
    names = {op_name(node) for node in graph.nodes if node.op.startswith("call")}
    return bool(names & {"rsqrt", "sqrt", "rms_norm", "pow", "reciprocal"}) and bool(
        names & {"mean", "rms_norm", "sum", "var"}
    )


@dataclass
class RMSNormFuser(Fuser):
    """Replace a norm module with a `FusedRMSNorm` computing its exact variant."""

    name: ClassVar[str] = "rmsnorm"
    redefines_forward: ClassVar[bool] = True
    replaces_module: ClassVar[bool] = True
    changes_layout: ClassVar[bool] = False  # same slot, same Parameter under the same name

    class_match: NormMatch | None = None
    signature: tuple = ()
    by_signature: dict[tuple, NormMatch | str] = field(default_factory=dict, repr=False)

    @classmethod
    def candidate(cls, module: nn.Module) -> bool:
        if next(module.children(), None) is not None:
            return False
        params = [p for _, p in module.named_parameters(recurse=False)]
        return len(params) <= 1 and all(p.ndim == 1 for p in params)

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> RMSNormFuser | None:
        named = bool(_NORM_NAME.search(type(module).__name__))
        if not named and not _looks_like_norm(graph):
            return None
        try:
            found = prove_variant(module)
        except RewriteRefused:
            if named or _looks_like_norm(graph):
                raise
            return None
        fuser = cls(source_class=type(module).__name__, class_match=found)
        fuser.signature = instance_signature(module, found.eps_attr)
        fuser.by_signature[fuser.signature] = found
        return fuser

    def _match_for(self, module: nn.Module) -> NormMatch:
        """The match for this instance: the class's, or (for an instance whose flags differ)
        its own, derived once per distinct signature."""
        assert self.class_match is not None
        signature = instance_signature(module, self.class_match.eps_attr)
        return per_signature(
            self.by_signature, signature, lambda: prove_variant(module), "not an RMSNorm"
        )

    def validate(self, module: nn.Module) -> None:
        found = self._match_for(module)
        hooks = has_hooks(module)
        if hooks:
            raise RewriteRefused(f"norm has {hooks}")
        if "forward" in module.__dict__:
            raise RewriteRefused("norm has an instance-level forward")
        eps = getattr(module, found.eps_attr, None)
        if eps is None and not found.eps_default_rule:
            raise RewriteRefused(f"eps attribute {found.eps_attr} is None")
        if eps is not None and not isinstance(eps, (int, float)):
            raise RewriteRefused(f"eps attribute {found.eps_attr} is {type(eps).__name__}")

    def fuse(self, module: nn.Module, backend: str) -> nn.Module:
        self.validate(module)
        found = self._match_for(module)
        v = found.variant
        weight = module._parameters[found.weight_name] if found.weight_name else None
        eps = getattr(module, found.eps_attr)
        fused = FusedRMSNorm(
            weight if v.has_weight else None,
            None if eps is None else float(eps),
            variant=v.kernel,
            verified=found.verified,
            backend=backend,
        )
        for name in found.carried_buffers:
            fused.register_buffer(name, module._buffers[name], persistent=False)
        fused.train(module.training)
        return fused

    def describe(self) -> str:
        assert self.class_match is not None
        return f"-> FusedRMSNorm ({self.class_match.variant.describe()}, eps from {self.class_match.eps_attr})"
