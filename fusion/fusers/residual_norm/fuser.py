"""`ResidualNormFuser`: prove each add + norm site safe, rewrite the forward, install it."""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import fx, nn

from fusion.analysis import source
from fusion.analysis.alias import check_input_stable
from fusion.analysis.callpath import has_hooks, own_call_path
from fusion.errors import RewriteRefused
from fusion.fusers import matches
from fusion.fusers.base import Fuser
from fusion.fusers.residual_norm.runtime import HELPER, add_rms_norm
from fusion.fusers.residual_norm.sites import Refused, Site, find_sites
from fusion.fusers.rmsnorm import RMSNormFuser
from fusion.runtime import bound
from fusion.runtime.norm_forward import NormForward

TEMP_PREFIX = "_fused_add_norm"
"""Prefix of the temporaries holding each site's normalised value in the rewritten forward."""

NOT_A_NORM = "not a norm"
"""`norm_verdict` for a child the RMSNorm fuser does not recognise as a norm at all."""


def is_fused_norm(child: object) -> bool:
    """Is `child` a norm module the RMSNorm fuser has fused (its instance-level forward a
    `NormForward` of its own)?"""
    if not isinstance(child, nn.Module):
        return False
    forward = child.__dict__.get("forward")
    return type(forward) is NormForward and forward.module is child


def norm_verdict(child: nn.Module | None) -> RMSNormFuser | str | None:
    """How the RMSNorm fuser judges `child`: None when it is already fused (`is_fused_norm`), the
    matched `RMSNormFuser` when it proves an RMSNorm variant, the refusal reason when it
    recognises a norm it refuses, `NOT_A_NORM` otherwise.

    This is the RMSNorm fuser's own verdict, from the registry's per-class cache, so the
    norm is proven by exactly the proof that will replace it (and is traced once per class).
    """
    if is_fused_norm(child):
        return None
    if not isinstance(child, nn.Module) or not RMSNormFuser.candidate(child):
        return NOT_A_NORM
    found = matches.candidates(child, (RMSNormFuser,))
    if not found:
        return NOT_A_NORM
    verdict = found[0]
    if verdict.fuser is None:
        return verdict.reason or "refused by the RMSNorm fuser"
    assert isinstance(verdict.fuser, RMSNormFuser)
    return verdict.fuser


def _is_child(module: nn.Module, name: str) -> bool:
    """Is `self.<name>` a child module found by a plain dictionary lookup (no class
    attribute or property of that name that would run code instead)?"""
    return name in module._modules and inspect.getattr_static(type(module), name, None) is None


def _is_norm(module: nn.Module, name: str) -> bool:
    return _is_child(module, name) and norm_verdict(module._modules[name]) != NOT_A_NORM


def check_norm_instance(module: nn.Module, name: str) -> None:
    """Refuse unless `module.<name>` is, or will be made by the RMSNorm fuser, a plain
    fused norm: the fused call then computes exactly its forward on the sum."""
    child = getattr(module, name, None)
    verdict = norm_verdict(child)
    if isinstance(verdict, str):
        raise RewriteRefused(f"norm is not an RMSNorm: {name}: {verdict}")
    if verdict is not None:
        try:
            verdict.validate(child)  # the RMSNorm fuser's per-instance checks (hooks, eps)
        except RewriteRefused as exc:
            raise RewriteRefused(f"norm would not be fused: {name}: {exc}") from exc
        return
    hooks = has_hooks(child)
    if hooks:
        raise RewriteRefused(f"norm has {hooks}: {name}")
    call = own_call_path(child) or ("forward" if not is_fused_norm(child) else None)
    if call:
        raise RewriteRefused(f"norm has its own {call}: {name}")


def _fused_call(site: Site, self_name: str) -> ast.Call:
    """`self.fused_add_rms_norm(L, R, self.<norm>)`: operands, then the norm child, in the
    order the original evaluated them."""
    value = site.add.value
    assert isinstance(value, ast.BinOp)
    call = ast.Call(
        func=ast.Attribute(
            value=ast.Name(id=self_name, ctx=ast.Load()), attr=HELPER, ctx=ast.Load()
        ),
        args=[
            value.left,
            value.right,
            ast.Attribute(
                value=ast.Name(id=self_name, ctx=ast.Load()), attr=site.norm, ctx=ast.Load()
            ),
        ],
        keywords=[],
    )
    for node in ast.walk(call):
        ast.copy_location(node, value)
    return call


def rewrite(funcdef: ast.FunctionDef, sites: list[Site], module: nn.Module) -> list[str]:
    """Rewrite each site in place: `H = L + R` becomes `H, t = self.<HELPER>(L, R,
    self.<norm>)` and the norm call becomes `t`. Refuses unless alias analysis proves the sum
    unchanged from the add to the norm call (nothing between them may rebind it or write
    through any name that may alias it) and no name the rewrite adds collides with the
    source. Returns the temporaries."""
    self_name = (funcdef.args.posonlyargs + funcdef.args.args)[0].arg
    taken = source.bound_names(funcdef)
    attrs = {node.attr for node in ast.walk(funcdef) if isinstance(node, ast.Attribute)}
    if HELPER in attrs or HELPER in taken:
        raise RewriteRefused(f"the forward already mentions {HELPER}")
    temps = []
    for index, site in enumerate(sites):
        temp = f"{TEMP_PREFIX}_{index}"
        if temp in taken:
            raise RewriteRefused(f"temporary {temp} collides with the source")
        check_input_stable(funcdef, module, ast.Name(id=site.total, ctx=ast.Load()), list(site.gap))
        target = ast.Tuple(
            elts=[ast.Name(id=site.total, ctx=ast.Store()), ast.Name(id=temp, ctx=ast.Store())],
            ctx=ast.Store(),
        )
        for node in ast.walk(target):
            ast.copy_location(node, site.add.targets[0])
        site.add.value = _fused_call(site, self_name)
        site.add.targets = [target]
        source.replace_expr(
            funcdef,
            site.norm_call,
            ast.copy_location(ast.Name(id=temp, ctx=ast.Load()), site.norm_call),
        )
        temps.append(temp)
    return temps


@dataclass
class ResidualNormFuser(Fuser):
    """Fuse each residual add with the RMSNorm reading the sum into one kernel call."""

    name: ClassVar[str] = "residual_norm"
    redefines_forward: ClassVar[bool] = True
    changes_layout: ClassVar[bool] = False
    """Only the layer's forward changes: every child stays and is called as before, but the
    norms it adds into, whose hooks and call paths the runtime checks on every call (a
    tensor-parallel plan's hooks make it call the norm as the original forward did)."""

    norms: tuple[str, ...] = ()
    refused: tuple[Refused, ...] = ()
    forward_fn: Any = field(default=None, repr=False)

    @classmethod
    def candidate(cls, module: nn.Module) -> bool:
        """A module with a forward of its own and a child that is, or may be, an RMSNorm."""
        if getattr(type(module), "forward", None) is nn.Module.forward:
            return False  # containers (ModuleList, ModuleDict) have no forward to rewrite
        return any(
            is_fused_norm(child) or RMSNormFuser.candidate(child) for child in module.children()
        )

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> ResidualNormFuser | None:
        try:
            funcdef, fn = source.recover_forward(type(module))
        except RewriteRefused:
            return None  # no source to read: the pattern cannot be seen, so it is absent
        found = find_sites(funcdef, lambda n: _is_norm(module, n), lambda n: _is_child(module, n))
        refused = [f for f in found if isinstance(f, Refused)]
        sites = []
        for site in (f for f in found if isinstance(f, Site)):
            verdict = norm_verdict(module._modules[site.norm])
            if isinstance(verdict, str):
                refused.append(
                    Refused(site.norm, f"norm is not an RMSNorm: {site.norm}: {verdict}")
                )
            else:
                sites.append(site)
        if not sites:
            if refused:
                raise RewriteRefused(refused[0].reason)
            return None
        original = source.unparse(funcdef)
        rewrite(funcdef, sites, module)
        fuser = cls(
            source_class=type(module).__name__,
            norms=tuple(site.norm for site in sites),
            refused=tuple(refused),
        )
        fuser.forward_fn = source.compile_forward(funcdef, fn)
        fuser.original_source, fuser.rewritten_source = original, source.unparse(funcdef)
        return fuser

    def validate(self, module: nn.Module) -> None:
        if "forward" in module.__dict__:
            raise RewriteRefused("the module has an instance-level forward")
        if hasattr(module, HELPER):
            raise RewriteRefused(f"{type(module).__name__} already has an attribute {HELPER}")
        for name in self.norms:
            check_norm_instance(module, name)

    def fuse(self, module: nn.Module, backend: str) -> nn.Module:
        # The kernel's backend is the norm's own (its NormForward carries the one it was fused
        # with), so the add + norm runs where the norm alone would have.
        self.validate(module)
        setattr(module, HELPER, add_rms_norm)
        bound.bind(module, self.forward_fn, norm_sites=self.norms)
        return module

    def describe(self) -> str:
        fused = ", ".join(f"residual add + {name}" for name in self.norms)
        text = f"{fused} -> add_rms_norm"
        if self.refused:
            text += f" ({len(self.refused)} other site(s) refused: {self.refused[0].reason})"
        return text
