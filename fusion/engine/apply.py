"""Walk a model, fuse what matches instance by instance, and report everything.

Transactional per module: every fuser runs against a snapshot of the module (and of the
parent slot it may be installed in); if anything raises part-way the snapshot is restored,
so the module keeps exactly its children, attributes and forward, and the reason lands in
the report while fusing continues elsewhere.

A model that is already (partly) fused is walked the same way: a fused module (a class of
this package: MergedLinear, FusedRMSNorm, FusedMoE, ...) or a module whose forward was
rewritten around fused children is reported as skipped, "already fused", and left alone,
except that a merged projection whose Parameters stopped viewing its stacked weight is
merged again where that is unobservable (`MergedLinear.restack`).

`torch.inference_mode`: fusing runs with inference mode off (`run`), so the stacked weights
and views it makes are ordinary tensors whatever mode the caller is in, and the model trains
afterwards as its unfused twin does. A model whose own Parameters or buffers are inference
tensors (built or loaded inside inference mode) is refused whole, untouched
(`inference_refusal`): such tensors keep no version counter, so neither the views of a
stacked weight nor the guards that watch them can be made of them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fusion.analysis.callpath import installed_forward
from fusion.engine import placement
from fusion.errors import RewriteRefused
from fusion.fusers import registry
from fusion.fusers.base import Fuser
from fusion.report import Applied, FusionReport, Skipped
from fusion.runtime import bound
from fusion.runtime.linear_forward import linear_forward
from fusion.runtime.merged import MergedLinear
from fusion.runtime.norm_forward import NormForward


@dataclass
class _Snapshot:
    """What a fuser may change on a module, to restore exactly: the module's own attribute
    dict (one level of its dicts copied), and for every module below it its class (a
    fuser that swapped one) and every Parameter's memory address (a merge makes
    each Parameter a view of a stacked weight). Addresses, not the tensors: holding an
    alias of each Parameter's memory would itself make the memory shared, which a merge
    refuses (`MergedLinear.restack` moves only memory nothing else uses)."""

    attributes: dict[str, Any]
    classes: list[tuple[nn.Module, type]]
    addresses: list[tuple[nn.Parameter, int]]


def _snapshot(module: nn.Module) -> _Snapshot:
    return _Snapshot(
        {
            key: (type(value)(value) if isinstance(value, dict) else value)
            for key, value in module.__dict__.items()
        },
        [(m, type(m)) for m in module.modules()],
        [(p, p.data_ptr()) for p in module.parameters()],
    )


def _restore(module: nn.Module, snapshot: _Snapshot) -> None:
    module.__dict__.clear()
    module.__dict__.update(snapshot.attributes)
    for m, cls in snapshot.classes:
        if type(m) is not cls:
            m.__class__ = cls
    with torch.no_grad():
        for p, address in snapshot.addresses:
            if p.data_ptr() != address:
                # moved into a stacked weight, from memory it alone used: memory of its own
                # again, same values (only the address differs, which nothing else saw)
                p.data = p.data.clone()


def module_at(model: nn.Module, qualname: str) -> nn.Module:
    """The module registered at `qualname` (a name `named_modules` gives), found through each
    parent's `_modules`: never by attribute lookup, where a class attribute of the same name
    (a method `scale` beside a child registered as `scale`) wins over the child and
    `get_submodule` raises "is not an nn.Module". Raises AttributeError when no module is
    registered there."""
    module = model
    for part in qualname.split(".") if qualname else ():
        child = module._modules.get(part)
        if child is None:
            raise AttributeError(f"no module registered at {qualname!r}")
        module = child
    return module


def _parent_slot(model: nn.Module, qualname: str) -> tuple[nn.Module | None, str]:
    if not qualname:
        return None, ""
    parent_name, _, child_name = qualname.rpartition(".")
    return module_at(model, parent_name), child_name


def _applied(qualname: str, fuser: Fuser) -> Applied:
    return Applied(
        qualname=qualname,
        fuser=fuser.name,
        source_class=fuser.source_class,
        description=fuser.describe(),
        original_source=fuser.original_source,
        rewritten_source=fuser.rewritten_source,
    )


def inference_refusal(model: nn.Module) -> str | None:
    """Why `model` cannot be fused because of `torch.inference_mode`, or None: the first of
    its Parameters and buffers that is an inference tensor (made inside inference mode).
    Such a tensor has no version counter (a merge makes a Parameter a view of a stacked
    weight, and ops on those views, and the piece guards, need one) and cannot be saved for
    backward; fusing it would change which calls raise, so the model is left as it is."""
    for kind, named in (("parameter", model.named_parameters), ("buffer", model.named_buffers)):
        for name, tensor in named():
            if tensor.is_inference():
                return (
                    f"{kind} {name} is an inference tensor (the model was built or loaded "
                    "inside torch.inference_mode): it has no version counter, so no merged "
                    "view of it can be guarded; build the model outside inference mode to fuse it"
                )
    return None


def run(
    model: nn.Module,
    *,
    backend: str = "auto",
    dry_run: bool = False,
    fusers: tuple[type[Fuser], ...] | None = None,
) -> FusionReport:
    """Fuse `model` in place (or, with `dry_run`, only decide what would be fused), with
    `torch.inference_mode` off (`_run`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fusion expects an nn.Module, got {type(model).__name__}")
    refusal = inference_refusal(model)
    if refusal is not None:
        report = FusionReport(dry_run=dry_run)
        report.skipped.append(Skipped("", None, type(model).__name__, refusal))
        return report
    # Off, so every tensor fusing makes (stacked weights, their views) is an ordinary one:
    # made inside inference mode they could never be saved for backward once the caller
    # leaves it, where the unfused model trains.
    with torch.inference_mode(False):
        return _run(model, backend=backend, dry_run=dry_run, fusers=fusers)


def _run(
    model: nn.Module,
    *,
    backend: str,
    dry_run: bool,
    fusers: tuple[type[Fuser], ...] | None,
) -> FusionReport:
    """Fuse `model` in place (or, with `dry_run`, only decide what would be fused).

    Each instance takes at most one forward-redefining fuser: the highest-priority candidate
    that validates. A candidate whose `fuse` raises is rolled back and the next one tried.
    A module whose weights another engine places (tensor-parallel DTensors, accelerate
    hooks: `placement.placement_refusal`) is refused whole. After fusing, the model's
    tensor-parallel plans lose the blocks whose names fusion lost (`_layout`,
    `placement.prune_model_plans`), so they name only what the fused model has. Returns the
    report; never raises for a model it cannot fuse.
    """
    run = _Pass(
        model,
        backend,
        dry_run,
        registry.FUSERS if fusers is None else tuple(fusers),
        FusionReport(dry_run=dry_run),
    )
    for qualname, module in list(model.named_modules()):
        if any(f"{qualname}.".startswith(prefix) for prefix in run.replaced):
            continue  # a module that was replaced or dropped, or inside one ("": the root)
        if not dry_run and _detached(model, qualname, module):
            continue  # dropped by a replacement that kept some children (FusedMoE)
        if not _settled(run, qualname, module):
            _fuse_instance(run, qualname, module)
    if not dry_run and run.relaid:
        # The model's tensor-parallel plans must stay true of the fused model (placement).
        placement.prune_model_plans(model, run.relaid)
    return run.report


@dataclass
class _Pass:
    """One `_run` over a model: what it was asked and what it has done so far."""

    model: nn.Module
    backend: str
    dry_run: bool
    fusers: tuple[type[Fuser], ...]
    report: FusionReport
    replaced: list[str] = field(default_factory=list)
    """The "qualname." of every module that left the model."""
    owners: dict[int, list[tuple[str, nn.Module]]] | None = None
    """Every Parameter's owners (`parameter_owners`), built on the first fuse."""
    fused_parts: list[str] = field(default_factory=list)
    """The "qualname." of every fused module found in the model."""
    relaid: list[str] = field(default_factory=list)
    """Qualnames whose modules or parameters fusion changed."""


def _settled(run: _Pass, qualname: str, module: nn.Module) -> bool:
    """Whether `module` is decided before any fuser is asked: already fused (re-merged where
    provable, reported unless it is a fused module's own part), or sharded or dispatched by
    another engine (refused for every fuser that could be interested)."""
    report, cls_name = run.report, type(module).__name__
    already = _already_fused(module)
    if already is not None and isinstance(module, MergedLinear) and not run.dry_run:
        # fusing again re-merges what is provable: Parameters converted or replaced
        # since, each the only user of its memory, become views of a new stacked weight
        module.restack()
    if already is not None:
        inner = any(f"{qualname}.".startswith(prefix) for prefix in run.fused_parts)
        if _is_fused_module(module):
            run.fused_parts.append(f"{qualname}.")
        if not inner:  # a fused module's own parts (its PackedExperts) are not news
            report.skipped.append(Skipped(qualname, None, cls_name, already))
        return True
    # Sharded or dispatched elsewhere: refuse every fuser that could be interested,
    # before tracing, which would run the placing engine's hooks on meta tensors.
    placed = placement.placement_refusal(module)
    if placed is not None:
        report.skipped.extend(
            Skipped(qualname, cls.name, cls_name, placed)
            for cls in run.fusers
            if cls.candidate(module) and cls.applies_to(module)
        )
        return True
    return False


def _fuse_instance(run: _Pass, qualname: str, module: nn.Module) -> None:
    """Ask each candidate fuser of `module` in turn: refusals reported, the validated ones
    fused (at most one forward-redefining), each fuse transactional (or, dry, in a copy)."""
    model, report, dry_run, cls_name = run.model, run.report, run.dry_run, type(module).__name__
    wrapped = placement.adapter_refusal(module)
    if wrapped is not None:
        report.skipped.append(Skipped(qualname, None, cls_name, wrapped))
    found = registry.candidates(module, run.fusers)
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
        if not fuser.applies_to(module):
            continue
        try:
            fuser.validate(module)
        except RewriteRefused as exc:
            report.skipped.append(Skipped(qualname, fuser.name, cls_name, str(exc)))
            continue
        if run.owners is None:
            run.owners = parameter_owners(model)
        layout = None if dry_run else _layout(module)
        if dry_run:
            error = _untie_in_a_copy(module, fuser, run.backend, run.owners)
        else:
            error = _fuse_transactionally(model, qualname, module, fuser, run.backend, run.owners)
        if error is not None:
            report.skipped.append(Skipped(qualname, fuser.name, cls_name, error))
            continue
        redefined = redefined or fuser.redefines_forward
        report.applied.append(_applied(qualname, fuser))
        if layout is not None and (
            fuser.changes_layout or not layout <= _layout(module_at(model, qualname))
        ):
            run.relaid.append(qualname)
        if fuser.replaces_module:
            run.replaced.append(f"{qualname}." if qualname else "")
        prefix = f"{qualname}." if qualname else ""
        run.replaced.extend(f"{prefix}{child}." for child in fuser.dropped_children(module))


def _layout(module: nn.Module) -> frozenset[tuple[str, int]]:
    """What a tensor-parallel plan can name under `module`: every submodule's relative name
    (with 0) and every parameter's (with the Parameter's id).

    A fused module whose layout still holds all of its unfused layout (same names, same
    Parameter objects; added modules such as a `qkv_proj` do not matter) keeps the plan's
    entries true: a plan applied later puts hooks on those children or makes their
    Parameters DTensors, and the fused forward's guards see either and run the original
    forward (`fusion.runtime.guards`, `FusedMoE._experts_hold`). Anything lost prunes the block."""
    names = {(name, 0) for name, _ in module.named_modules()}
    names.update((name, id(p)) for name, p in module.named_parameters())
    return frozenset(names)


def _is_fused_module(module: nn.Module) -> bool:
    """Is `module` an instance of a fused module class (any nn.Module defined in fusion/)?"""
    return type(module).__module__.partition(".")[0] == "fusion"


def _already_fused(module: nn.Module) -> str | None:
    """The skip reason for a module that is a product of fusion, or None for any other.

    A fused module class says so by name; a module whose instance-level forward fusion
    installed (`fusion.analysis.callpath.installed_forward`: a rewritten forward, a kept norm's fused
    forward, a `LinearForward` of `decode_linear`) is one a fuser took, and so is one with an
    instance-level forward and fused children. Short on purpose: fusers would only refuse
    these with long reasons (their traces see fused code, not the structure they match).
    """
    if _is_fused_module(module):
        return f"already fused ({type(module).__name__})"
    if "forward" not in module.__dict__:
        return None
    if type(module.__dict__["forward"]) is NormForward:
        return "already fused (its forward is a fused norm's)"
    if linear_forward(module) is not None:
        return "already fused (its forward was installed by decode_linear)"
    if installed_forward(module) or any(_is_fused_module(c) for c in module.children()):
        return "already fused (its forward was rewritten to call fused modules)"
    return None


def _detached(model: nn.Module, qualname: str, module: nn.Module) -> bool:
    """Is `module` no longer at `qualname` (a replacement kept some old children, e.g. a
    shared expert, but not this one)?"""
    try:
        return module_at(model, qualname) is not module
    except AttributeError:
        return True


def parameter_owners(model: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """{id(parameter): [(full name, module holding it directly), ...]} over every path of
    `model`, duplicates included: a parameter with two distinct holders is tied."""
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for prefix, holder in model.named_modules(remove_duplicate=False):
        for name, param in holder._parameters.items():
            if param is not None:
                full = f"{prefix}.{name}" if prefix else name
                owners.setdefault(id(param), []).append((full, holder))
    return owners


def _tied_elsewhere(
    module: nn.Module, owners: dict[int, list[tuple[str, nn.Module]]]
) -> dict[int, tuple[str, str]]:
    """{id(parameter): (its name in `module`, a name elsewhere)} of `module`'s parameters
    that a module outside it holds too (Zamba's shared transformer tied across layers by
    `tie_weights`). A module object that is itself reachable by two paths is not a tie: it
    is fused once for both."""
    inside = {id(m) for m in module.modules()}
    tied: dict[int, tuple[str, str]] = {}
    for name, param in module.named_parameters():
        outside = [full for full, holder in owners.get(id(param), []) if id(holder) not in inside]
        if outside:
            tied[id(param)] = (name, outside[0])
    return tied


def _fuse_transactionally(
    model: nn.Module,
    qualname: str,
    module: nn.Module,
    fuser: Fuser,
    backend: str,
    owners: dict[int, list[tuple[str, nn.Module]]],
) -> str | None:
    """Apply `fuser` to `module` and install the result; on any exception restore the module
    and its parent slot exactly and return the reason (None on success).

    Also restored, with that reason: a fusion that replaced a parameter tied to another
    module by a new tensor (a merged weight is a copy). The tie would silently break: a
    training step or an in-place edit would reach one side only, and the checkpoint would
    hold both."""
    parent, child_name = _parent_slot(model, qualname)
    tied = _tied_elsewhere(module, owners)
    if tied and fuser.moves_parameters:
        return str(_Untied(list(tied.values())))
    module_state = _snapshot(module)
    parent_state = _snapshot(parent) if parent is not None else None
    try:
        replacement = fuser.fuse(module, backend)
        if replacement is not module:
            if parent is None:
                raise RewriteRefused(
                    f"cannot replace the root module itself: {fuser.name} installs a new module "
                    "in its parent's slot, and the root has none; fuse the model or the "
                    "module's parent instead"
                )
            setattr(parent, child_name, replacement)
            bound.replace_guarded_child(parent, child_name, module, replacement)
        kept = {id(p) for p in replacement.parameters()}
        lost = [pair for key, pair in tied.items() if key not in kept]
        if lost:
            raise _Untied(lost)
    except Exception as exc:
        _restore(module, module_state)
        if parent is not None and parent_state is not None:
            _restore(parent, parent_state)
        if isinstance(exc, _Untied):
            return str(exc)
        kind = "" if isinstance(exc, RewriteRefused) else f"{type(exc).__name__}: "
        return f"fuse failed, module left unchanged: {kind}{exc}"
    return None


def _untie_in_a_copy(
    module: nn.Module,
    fuser: Fuser,
    backend: str,
    owners: dict[int, list[tuple[str, nn.Module]]],
) -> str | None:
    """For a dry run: the reason `fuse` would refuse for breaking a tie, found by fusing a
    deep copy of `module` (only when it holds tied parameters, so a plan costs no copies
    otherwise); None when there is no tie to break, or fusing the copy fails otherwise (the
    plan then reports what validation decided, as before)."""
    tied = _tied_elsewhere(module, owners)
    if not tied:
        return None
    if fuser.moves_parameters:
        return str(_Untied(list(tied.values())))
    memo: dict[int, object] = {}
    copied = copy.deepcopy(module, memo)
    try:
        replacement = fuser.fuse(copied, backend)
    except Exception:
        return None
    kept = {id(p) for p in replacement.parameters()}
    lost = [pair for key, pair in tied.items() if id(memo.get(key)) not in kept]
    return str(_Untied(lost)) if lost else None


class _Untied(Exception):
    def __init__(self, lost: list[tuple[str, str]]) -> None:
        name, other = lost[0]
        more = f" (and {len(lost) - 1} more)" if len(lost) > 1 else ""
        super().__init__(
            "a parameter it would merge or copy is tied to another module's: "
            f"{name} is {other}{more}; only one merge can hold it, and a copy would untie it"
        )
