"""What every fuser is: the `Fuser` base class and the per-instance match cache.

A fuser's life has three steps, each fail-closed:

1. `match(graph, module)` (once per class and child layout, cached by the registry) reads the
   traced graph and returns a fuser describing the pattern, None when the pattern is not
   there at all, or raises `RewriteRefused` when it is there but cannot be fused safely.
   Rewriting fusers also rewrite and compile the forward here, so the source is analysed
   once per class however many layers share it.
2. `validate(module)` (per instance) raises `RewriteRefused` unless this instance has the
   shapes, dtypes, types and hooks the rewrite assumes.
3. `fuse(module, backend)` (per instance) performs it and returns the module to install at
   that qualname (the same object for rewrites). `fusion.engine.apply` makes it transactional.

The projection-stacking machinery shared by the qkv, sibling, MLA and GLU fusers lives in
`fusion.fusers.stacked`; hook and call-path checks in `fusion.analysis.callpath`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import fx, nn

from fusion.errors import RewriteRefused


@dataclass
class Fuser(ABC):
    """A matched pattern in one module class, ready to be applied to its instances."""

    name: ClassVar[str]
    """Short name used in reports and the registry (`qkv`, `glu`, ...)."""

    redefines_forward: ClassVar[bool] = True
    """Whether fusing changes the module's forward (at most one such fuser per module)."""

    changes_layout: ClassVar[bool] = True
    """Whether fusing changes which modules and parameters the model has (a fuser that only
    changes how a module computes leaves the model's tensor-parallel plans valid)."""

    moves_parameters: ClassVar[bool] = False
    """Whether fusing moves the memory of the module's Parameters (a merge makes them views
    of one stacked weight). Refused for a Parameter a module outside also holds (a tie):
    that module's own merge would move it again, and only one stacked weight can hold it."""

    replaces_module: ClassVar[bool] = False
    """Whether `fuse` returns a new module for the slot (its old children leave the model,
    so `fusion.engine.apply` does not visit them)."""

    source_class: str
    """Name of the matched module's class."""

    @classmethod
    def candidate(cls, module: nn.Module) -> bool:
        """Cheap class-level prefilter: could this pattern be in `module` at all? Tracing is
        skipped for modules no fuser is a candidate for."""
        return True

    @classmethod
    def applies_to(cls, module: nn.Module) -> bool:
        """Per-instance prefilter, checked before `validate`: False skips this instance
        silently (no refusal in the report), for a fuser that by design never takes it
        (a size threshold). `candidate` is cached per class; this is not."""
        return True

    @classmethod
    @abstractmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> Fuser | None:
        """The fuser for the pattern in `graph`, None when absent; raises RewriteRefused when
        the pattern is present but unsafe to fuse."""

    @abstractmethod
    def validate(self, module: nn.Module) -> None:
        """Raise RewriteRefused unless this instance can take the fusion."""

    @abstractmethod
    def fuse(self, module: nn.Module, backend: str) -> nn.Module:
        """Apply the fusion to a validated `module`; return what to install in its place."""

    @abstractmethod
    def describe(self) -> str:
        """One line for the report, e.g. `q_proj + k_proj + v_proj -> qkv_proj`."""

    def dropped_children(self, module: nn.Module) -> tuple[str, ...]:
        """Names of `module`'s direct children that `fuse` takes out of the model (e.g. a
        `ModuleList` of experts repacked into new tensors) or takes over (the shards of a
        merged projection: they stay in place, computed by the merged module, and must
        stay plain linears for its guards to hold). `fusion.engine.apply` visits none of
        them afterwards, and `plan` (which installs nothing) skips them too, so a dry run
        reports what `fuse` would do. Called only on a validated `module`."""
        return ()

    original_source: str | None = field(default=None, init=False, repr=False)
    rewritten_source: str | None = field(default=None, init=False, repr=False)


def per_signature(
    cache: dict[Any, Any], signature: Any, derive: Callable[[], Any], absent: str
) -> Any:
    """The match `derive()` gives for instances with this `signature`, derived once.

    For fusers whose class-level match depends on per-instance flags: each distinct signature
    is derived on its first instance and the verdict (match, or refusal reason; `absent` when
    `derive` finds nothing) cached in `cache`. Raises RewriteRefused for a refused signature.
    """
    if signature not in cache:
        try:
            cache[signature] = derive() or absent
        except RewriteRefused as exc:
            cache[signature] = str(exc)
    found = cache[signature]
    if isinstance(found, str):
        raise RewriteRefused(f"this instance differs from its class's match: {found}")
    return found
