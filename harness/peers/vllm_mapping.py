"""vLLM's fuser unit tests answered by our engine: a pytest plugin that stands in for vLLM.

Loaded by `harness.peers.vllm_tests` into a pytest run over vLLM's own test modules (from its
source distribution, never copied here). It installs an import hook that answers every
`vllm...` import, so those modules import with no vLLM installed:

- `vllm.model_executor.models.transformers.fuser` (`get_fuser`, `get_fusers`) and `.fusers`
  (`RMSNormFuser`, `GLUFuser`, `QKVFuser`, `MergedColumnParallelFuser`, `PackedQKVFuser`,
  `MoEBlockFuser`, `MLAFuser`): each vLLM fuser class is mapped to the fuser family of ours
  that makes the same decision (`FAMILIES`). `get_fuser(module, Cls)` / `Cls.match(...)`
  return an instance of the stand-in class exactly when `fusion.plan(module)` applies that
  family to the module itself, else None. So a vLLM test of *what is fused* runs against
  our engine's decision, and a disagreement fails that test.
- The few facts our engine states in vLLM's terms: `zero_centered` (our variant's offset is
  1), and `fuse(module, name, config)`, which returns the module fused by our engine (a
  stand-in exposing vLLM's `variance_epsilon` for our `eps`), so a test comparing the fused
  and unfused forwards compares ours.
- Everything else raises `NotMapped` with the reason: vLLM's layer classes, tensor parallel
  plans (`o_name`, `down_name`: our engine never names an output projection, it shards
  nothing), its tracer and AST helpers (`fx_utils`), its weight loaders, configs. The
  plugin records such a test as "not mapped", with that reason, never as a pass or a fail.

Outcomes (`pytest_runtest_logreport`) go to the JSON file named by `VLLM_MAPPING_JSON`:
per test, `pass`, `fail` (our engine decided otherwise, or its fused module computed
otherwise), `not-mapped` (the first NotMapped reason), `skip`, each with its file.
"""

from __future__ import annotations

import copy
import functools
import importlib.abc
import importlib.machinery
import json
import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import fusion
from fusion import inspection

RESULTS_ENV = "VLLM_MAPPING_JSON"

FAMILIES: dict[str, tuple[str, ...]] = {
    "RMSNormFuser": ("rmsnorm",),
    "GLUFuser": ("glu",),
    "QKVFuser": ("qkv", "sibling"),
    "MergedColumnParallelFuser": ("sibling", "qkv", "glu"),
    "PackedQKVFuser": ("packed_qkv",),
    "MoEBlockFuser": ("moe",),
    "MLAFuser": ("mla",),
}
"""vLLM fuser class -> the families of ours that make its decision. vLLM's merged-column
fuser merges any sibling linears, which ours split into q/k/v, GLU and sibling; our `qkv`
takes q/k/v only where it proves the head layout, `sibling` merges the same three
otherwise (one GEMM either way, vLLM's QKV decision); we have no packed-QKV fuser (a
re-layout of one packed projection), so that family never applies."""

FIELDS: dict[str, str] = {
    "o_name": "vLLM's output-projection name for its tensor-parallel plan: our engine shards "
    "nothing and names no output projection",
    "down_name": "vLLM's down-projection name for its tensor-parallel plan: our engine shards "
    "nothing and names no down projection",
    "eps_attr": "the attribute vLLM reads eps from when it builds its layer: our engine keeps "
    "the instance's own forward reading and never copies eps out",
    "linear_names": "vLLM's record of the merged linears' names",
    "merged_name": "vLLM's name for the merged projection (ours keep the originals' names)",
}
"""Fields of vLLM's fuser records with no counterpart in ours, and why."""


class NotMapped(Exception):
    """The test uses a vLLM concept our engine has no counterpart for (the reason)."""


# ------------------------------------------------------------------------------ decisions


_REFUSALS: list[str] = []
"""Why our engine did not apply a family the running test asked about (reset per test)."""


def _applied_families(module: nn.Module, families: tuple[str, ...]) -> set[str]:
    """The fuser families `fusion.plan` applies to `module` itself (qualname ""); when none
    of `families` is among them, our refusal reasons for them go to `_REFUSALS`."""
    report = fusion.plan(module)
    applied = {a.fuser for a in report.applied if a.qualname == ""}
    if not applied & set(families):
        reasons = [
            f"{s.fuser}: {s.reason}"
            for s in report.skipped
            if s.qualname == "" and (s.fuser in families or s.fuser is None)
        ]
        name = type(module).__name__
        instead = f"applied instead: {', '.join(sorted(applied))}; " if applied else ""
        why = "; ".join(reasons) or "no refusal recorded"
        _REFUSALS.append(f"{name}: {instead}{why}")
    return applied


def _fused_copy(module: nn.Module, families: tuple[str, ...]) -> nn.Module:
    """A deep copy of `module` fused by our engine with those families' fusers only. The copy
    is fused as the child of a holder: a fuser that replaces a module (a norm becomes a
    FusedRMSNorm) installs the replacement in its parent, and a root has none."""
    holder = nn.Module()
    holder.add_module("module", copy.deepcopy(module))
    fusion.fuse(holder, fusers=[f for f in inspection.fuser_names() if f in families])
    return holder._modules["module"]


def _norm_forward(fused: nn.Module) -> Any:
    """The fused RMSNorm our engine gave `fused`, or None: a replacement module carrying the
    variant itself (FusedRMSNorm), or a kept module whose instance forward fusion installed
    (`fusion.inspection.FusedForward` with a `norm_variant`, which reads eps and the weight
    from the module live). Either has `variant` (and a kept one `eps_attr`)."""
    if getattr(fused, "variant", None) is not None:
        return fused
    forward = inspection.fused_forward(fused)
    if forward is not None and forward.norm_variant is not None:
        return SimpleNamespace(variant=forward.norm_variant, eps_attr=forward.norm_eps_attr)
    return None


class _Built(nn.Module):
    """What `fuse` returns: our fused module, with vLLM's `variance_epsilon` read from our
    `eps`; any other vLLM layer attribute is NotMapped."""

    def __init__(self, fused: nn.Module) -> None:
        super().__init__()
        self.fused = fused

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fused(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("fused", "_modules", "_parameters", "_buffers"):
            return super().__getattr__(name)
        fused = super().__getattr__("fused")
        if name == "variance_epsilon" and hasattr(fused, "eps"):
            return fused.eps
        norm = _norm_forward(fused)
        if name == "variance_epsilon" and getattr(norm, "eps_attr", None):
            return getattr(fused, norm.eps_attr)  # a kept module: eps where its forward reads it
        if name == "weight" and hasattr(fused, "weight"):
            return fused.weight
        raise NotMapped(f"vLLM layer attribute {name!r}: our fused module is not a vLLM layer")


class _Decision:
    """A stand-in vLLM fuser: made only when our engine applies the family to the module."""

    families: tuple[str, ...] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotMapped(f"constructs vLLM's {type(self).__name__} record directly")

    @classmethod
    def _decide(cls, module: nn.Module) -> _Decision | None:
        if not isinstance(module, nn.Module):
            raise NotMapped(f"{cls.__name__}.match on a {type(module).__name__}")
        if not _applied_families(module, cls.families) & set(cls.families):
            return None
        decision = object.__new__(cls)
        decision.__dict__["_module"] = module
        return decision

    @classmethod
    def match(cls, first: Any, second: Any = None, **options: Any) -> _Decision | None:
        """vLLM's `match(trace(module), module)` or `match(block, "experts")`."""
        if options:
            raise NotMapped(f"{cls.__name__}.match options {sorted(options)}: vLLM's own")
        module = second if isinstance(second, nn.Module) else first
        if isinstance(module, _Traced):
            module = module.module
        return cls._decide(module)

    def fuse(self, module: nn.Module, name: str, config: Any = None) -> nn.Module:
        return _Built(_fused_copy(module, self.families))

    def __getattr__(self, name: str) -> Any:
        if name == "zero_centered":
            fused = _fused_copy(self.__dict__["_module"], self.families)
            norm = _norm_forward(fused)
            if norm is None:
                raise NotMapped("zero_centered of a module our engine fused into no norm")
            return norm.variant.offset == 1.0
        reason = FIELDS.get(name, "a field of vLLM's fuser record")
        raise NotMapped(f"{type(self).__name__}.{name}: {reason}")


class _DecisionType(type):
    """Stand-in fuser classes: a class attribute vLLM's has and ours lack (`merged_name`)
    is a placeholder that raises NotMapped where it is used."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__name__}.{name}", FIELDS.get(name, "a vLLM class field"))


def _fuser_class(name: str) -> type[_Decision]:
    return _DecisionType(name, (_Decision,), {"families": FAMILIES[name], "__module__": _FUSERS})


class _Traced:
    """What the stand-in `fx_utils.trace` returns: the module, for a `match` to read."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module


def _trace(module: nn.Module, *args: Any, **kwargs: Any) -> _Traced:
    return _Traced(module)


def _not_mapped(what: str):
    def call(*args: Any, **kwargs: Any) -> Any:
        raise NotMapped(what)

    return call


@functools.cache
def _cached_fusers(module: nn.Module) -> tuple[_Decision, ...]:
    found = (cls._decide(module) for cls in _CLASSES.values())
    return tuple(d for d in found if d is not None)


def _get_fusers(module: nn.Module) -> list[_Decision]:
    """vLLM's `get_fusers(module)`: every stand-in fuser our engine applies there."""
    return list(_cached_fusers(module))


_get_fusers.cache_clear = _cached_fusers.cache_clear  # type: ignore[attr-defined]


def _get_fuser(module: nn.Module, cls: type[_Decision]) -> _Decision | None:
    return cls._decide(module)


# --------------------------------------------------------------------------- import hook

_ROOT = "vllm"
_TRANSFORMERS = "vllm.model_executor.models.transformers"
_FUSER = f"{_TRANSFORMERS}.fuser"
_FUSERS = f"{_TRANSFORMERS}.fusers"
_FX = f"{_TRANSFORMERS}.fx_utils"
_CLASSES = {name: _fuser_class(name) for name in FAMILIES}


class _Unmapped(type):
    """The metaclass of a vLLM name with no counterpart: importing it works (collection of
    the other tests goes on), any use raises NotMapped: calling it, `isinstance` against
    it, reading an attribute, comparing it."""

    def _refuse(cls, *args: Any, **kwargs: Any) -> Any:
        raise NotMapped(f"{cls.__qualname__}: {cls.why}")

    __call__ = _refuse
    __instancecheck__ = _refuse
    __subclasscheck__ = _refuse
    __eq__ = _refuse
    __hash__ = type.__hash__

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}", cls.why)


def _placeholder(qualname: str, why: str) -> type:
    return _Unmapped(qualname, (), {"why": why, "__qualname__": qualname})


class _NotMappedModule(types.ModuleType):
    """A vLLM module with no counterpart: each name imported from it is a placeholder that
    raises NotMapped where the test uses it."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{self.__name__}.{name}", "a vLLM name with no counterpart")


def _module(name: str) -> types.ModuleType:
    if name == _FUSER:
        module = types.ModuleType(name)
        module.get_fuser = _get_fuser
        module.get_fusers = _get_fusers
        module.Fusers = _not_mapped("vLLM's Fusers over a whole model with a vLLM config")
    elif name == _FUSERS:
        module = _NotMappedModule(name)
        module.__dict__.update(_CLASSES)
        module.__path__ = []
    elif name == _FX:
        module = _NotMappedModule(name)
        module.trace = _trace
    else:
        module = _NotMappedModule(name)
        module.__path__ = []
    return module


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers every `vllm` import with the stand-ins above."""

    def find_spec(self, fullname: str, path: Any, target: Any = None):
        if fullname == _ROOT or fullname.startswith(_ROOT + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _module(spec.name)

    def exec_module(self, module) -> None:
        return None


def install() -> None:
    """Put the stand-in `vllm` first on the import path (idempotent)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


# ------------------------------------------------------------------------------- plugin

_OUTCOMES: list[dict[str, str]] = []


def pytest_configure(config: pytest.Config) -> None:
    install()


@pytest.fixture
def default_vllm_config() -> SimpleNamespace:
    """vLLM's config fixture: our engine reads none of it."""
    return SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))


def _not_mapped_reason(report: pytest.TestReport) -> str | None:
    text = str(report.longrepr or "")
    for line in text.splitlines():
        if "NotMapped: " in line:
            return line.split("NotMapped: ", 1)[1].strip()
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    _REFUSALS.clear()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "call" and report.passed:
        return  # a setup or teardown that passed: the call's report follows
    reason = _not_mapped_reason(report) if report.failed else None
    if report.passed:
        outcome = "pass"
    elif report.skipped:
        outcome = "skip"
    elif reason is not None:
        outcome = "not-mapped"
    else:
        outcome = "fail"
    detail = reason or ("" if report.passed else _first_error(report))
    _OUTCOMES.append(
        {
            "test": report.nodeid,
            "file": report.nodeid.split("::", 1)[0].rsplit("/", 1)[-1],
            "outcome": outcome,
            "detail": detail,
            "ours": " | ".join(dict.fromkeys(_REFUSALS)),
        }
    )
    _REFUSALS.clear()


def _first_error(report: pytest.TestReport) -> str:
    lines = [ln for ln in str(report.longrepr or "").splitlines() if ln.startswith("E ")]
    return lines[0][1:].strip()[:300] if lines else ""


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        reason = _not_mapped_reason(report)  # type: ignore[arg-type]
        _OUTCOMES.append(
            {
                "test": report.nodeid,
                "file": report.nodeid.rsplit("/", 1)[-1],
                "outcome": "not-mapped" if reason else "fail",
                "detail": reason or "collection failed",
                "ours": "",
            }
        )


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get(RESULTS_ENV)
    if path:
        Path(path).write_text(json.dumps(_OUTCOMES, indent=1) + "\n")
