"""Walk a model, fuse what matches instance by instance, and report everything.

Transactional per module: every fuser runs against a snapshot of the module (and of the
parent slot it may be installed in); if anything raises part-way the snapshot is restored,
so the module keeps exactly its children, attributes and forward, and the reason lands in
the report while fusing continues elsewhere.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fusion import registry
from fusion.errors import RewriteRefused
from fusion.fusers.base import Fuser
from fusion.report import Applied, FusionReport, Skipped


def _snapshot(module: nn.Module) -> dict[str, Any]:
    return {
        key: (type(value)(value) if isinstance(value, dict) else value)
        for key, value in module.__dict__.items()
    }


def _restore(module: nn.Module, snapshot: dict[str, Any]) -> None:
    module.__dict__.clear()
    module.__dict__.update(snapshot)


def _parent_slot(model: nn.Module, qualname: str) -> tuple[nn.Module | None, str]:
    if not qualname:
        return None, ""
    parent_name, _, child_name = qualname.rpartition(".")
    return model.get_submodule(parent_name), child_name


def _applied(qualname: str, fuser: Fuser) -> Applied:
    return Applied(
        qualname=qualname,
        fuser=fuser.name,
        source_class=fuser.source_class,
        description=fuser.describe(),
        original_source=fuser.original_source,
        rewritten_source=fuser.rewritten_source,
    )


def run(
    model: nn.Module,
    *,
    backend: str = "auto",
    dry_run: bool = False,
    fusers: tuple[type[Fuser], ...] | None = None,
) -> FusionReport:
    """Fuse `model` in place (or, with `dry_run`, only decide what would be fused).

    Each instance takes at most one forward-redefining fuser: the highest-priority candidate
    that validates. A candidate whose `fuse` raises is rolled back and the next one tried.
    Returns the report; never raises for a model it cannot fuse.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fusion expects an nn.Module, got {type(model).__name__}")
    report = FusionReport(dry_run=dry_run)
    chosen_fusers = registry.FUSERS if fusers is None else tuple(fusers)
    replaced: list[str] = []  # "qualname." of every module that left the model
    for qualname, module in list(model.named_modules()):
        if any(f"{qualname}.".startswith(prefix) for prefix in replaced):
            continue  # a module that was replaced or dropped, or inside one ("": the root)
        if not dry_run and _detached(model, qualname, module):
            continue  # dropped by a replacement that kept some children (FusedMoE)
        found = registry.candidates(module, chosen_fusers)
        cls_name = type(module).__name__
        redefined = False
        for candidate in found:
            if candidate.redefines_forward and redefined:
                continue  # the forward is already taken: this fuser's verdict is moot
            if candidate.fuser is None:
                report.skipped.append(
                    Skipped(qualname, candidate.fuser_name, cls_name, candidate.reason or "")
                )
                continue
            fuser = candidate.fuser
            try:
                fuser.validate(module)
            except RewriteRefused as exc:
                report.skipped.append(Skipped(qualname, fuser.name, cls_name, str(exc)))
                continue
            if not dry_run:
                error = _fuse_transactionally(model, qualname, module, fuser, backend)
                if error is not None:
                    report.skipped.append(Skipped(qualname, fuser.name, cls_name, error))
                    continue
            redefined = redefined or fuser.redefines_forward
            report.applied.append(_applied(qualname, fuser))
            if fuser.replaces_module:
                replaced.append(f"{qualname}." if qualname else "")
            prefix = f"{qualname}." if qualname else ""
            replaced.extend(f"{prefix}{child}." for child in fuser.dropped_children(module))
    return report


def _detached(model: nn.Module, qualname: str, module: nn.Module) -> bool:
    """Is `module` no longer at `qualname` (a replacement kept some old children, e.g. a
    shared expert, but not this one)?"""
    try:
        return model.get_submodule(qualname) is not module
    except AttributeError:
        return True


def _fuse_transactionally(
    model: nn.Module, qualname: str, module: nn.Module, fuser: Fuser, backend: str
) -> str | None:
    """Apply `fuser` to `module` and install the result; on any exception restore the module
    and its parent slot exactly and return the reason (None on success)."""
    parent, child_name = _parent_slot(model, qualname)
    module_state = _snapshot(module)
    parent_state = _snapshot(parent) if parent is not None else None
    try:
        replacement = fuser.fuse(module, backend)
        if replacement is not module:
            if parent is None:
                raise RewriteRefused("cannot replace the root module itself")
            setattr(parent, child_name, replacement)
    except Exception as exc:
        _restore(module, module_state)
        if parent is not None and parent_state is not None:
            _restore(parent, parent_state)
        kind = "" if isinstance(exc, RewriteRefused) else f"{type(exc).__name__}: "
        return f"fuse failed, module left unchanged: {kind}{exc}"
    return None
