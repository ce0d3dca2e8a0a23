"""`RMSNormFuser`: which modules are norms, per-instance matches, validate, fuse.

Fusing keeps the norm module in its slot, of its own class, and installs
`fusion.runtime.norm_forward.NormForward` as its forward; what the proof relied on besides eps and the
weight (which the fused forward reads live) is recorded here as the original forward reads
it (`forward_reads`), never listed by hand."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import fx, nn

from fusion.analysis.callpath import has_hooks
from fusion.analysis.reads import AttributeGuard, guarded_reads, recording
from fusion.errors import RewriteRefused
from fusion.fusers.base import Fuser, per_signature
from fusion.fusers.rmsnorm.interpret import op_name
from fusion.fusers.rmsnorm.match import NormMatch, instance_signature, prove_variant
from fusion.fusers.rmsnorm.variants import GRID
from fusion.runtime.bound import install_forward
from fusion.runtime.norm_forward import NormForward

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
    """Give a norm module a fused forward computing its exact variant (`NormForward`)."""

    name: ClassVar[str] = "rmsnorm"
    redefines_forward: ClassVar[bool] = True
    changes_layout: ClassVar[bool] = False  # the same module, its Parameter untouched

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
        weight_name = found.weight_name if found.variant.has_weight else None
        reads = AttributeGuard.record(forward_reads(module, found))
        forward = NormForward(
            module,
            variant=found.variant.kernel,
            verified=found.verified,
            eps_attr=found.eps_attr,
            eps_default_rule=found.eps_default_rule,
            weight_name=weight_name,
            backend=backend,
            reads=reads,
        )
        install_forward(module, forward)  # a shallow copy gets one of its own
        return module

    def describe(self) -> str:
        assert self.class_match is not None
        match = self.class_match
        return f"-> fused RMSNorm ({match.variant.describe()}, eps from {match.eps_attr})"


def forward_reads(module: nn.Module, found: NormMatch) -> tuple[tuple[nn.Module, str], ...]:
    """`(module, name)` for every attribute of `module` its class's forward reads while it
    runs at each input dtype of the proof's grid (on a two-row input of the weight's width,
    on the weight's device), except eps and the weight, which the fused forward reads live:
    the premises `NormForward` guards (`AttributeGuard`).

    Recorded as read (`fusion.analysis.reads.recording`), so a flag read by a helper method
    is found as well as one read by `forward` itself; `training` is kept when read. A read
    whose value a per-call comparison cannot see (a dict, a config object) refuses
    (`guarded_reads`), as does a forward that runs at no grid dtype."""
    cls = type(module)
    weight = module._parameters.get(found.weight_name) if found.weight_name else None
    device = weight.device if weight is not None else torch.device("cpu")
    raw: list[tuple[nn.Module, str]] = []
    ran = 0
    for dtype in GRID:
        for width in _widths(module, weight):
            x = torch.ones(2, width, dtype=dtype, device=device)
            with recording(module) as reads, torch.no_grad():
                try:
                    cls.forward(module, x)
                    ran += 1
                except Exception:  # a width or dtype this norm cannot run: calls fall back
                    continue
                finally:
                    raw.extend(reads)
            break
    if not ran:
        raise RewriteRefused("the norm's forward runs at no dtype of the proof's grid")
    live = {found.eps_attr, found.weight_name}
    raw = [(owner, name) for owner, name in raw if name not in live]
    names = {name for path, name in guarded_reads(module, raw) if not path}
    if any(owner is module and name == "training" for owner, name in raw):
        names.add("training")
    return tuple((module, name) for name in sorted(names))


def _widths(module: nn.Module, weight: torch.Tensor | None) -> list[int]:
    """Input widths to run a norm at: its weight's, or (weightless) each positive integer
    the instance carries (`normalized_shape`'s last entry, a `dim`), then 8."""
    if weight is not None:
        return [int(weight.shape[0])]
    found = []
    for value in module.__dict__.values():
        if isinstance(value, tuple) and value and isinstance(value[-1], int):
            value = value[-1]
        if type(value) is int and 0 < value <= 1 << 16 and value not in found:
            found.append(value)
    return [*found, 8]
