"""The per-class cache of fuser matches: which fusers matched a module class, or why not.

Kept apart from the registry (which lists the fusers) so that a fuser can ask another
fuser's verdict on a child (`residual_norm` asks the RMSNorm fuser's) without importing the
registry that imports it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import fx, nn

from fusion.analysis.callpath import has_hooks, own_call_path
from fusion.errors import RewriteRefused
from fusion.fusers.base import Fuser
from fusion.trace.tracer import traced

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    """One fuser's verdict on one module class: a ready fuser, or the reason it refused."""

    fuser_name: str
    fuser: Fuser | None
    reason: str | None
    redefines_forward: bool = True


CacheKey = tuple


@dataclass
class MatchCache:
    """Explicit cache: (`cache_key(module)`, fusers) -> the candidates for that class and
    child layout. `clear()` forgets every match (tests and fuzzers that generate many
    classes)."""

    entries: dict[tuple, tuple[Candidate, ...]] = field(default_factory=dict)

    def clear(self) -> None:
        self.entries.clear()


CACHE = MatchCache()
"""The process's one match cache."""


def cache_key(module: nn.Module) -> CacheKey:
    """The class, and for each child its name, exact type, `inplace` flag, `max_norm`
    (`nn.Embedding` renormalises its own weight in place when set), whether it carries
    hooks, a call path of its own, or an instance-level `forward`, and the names of the
    Parameters and buffers it registers itself.

    Matching reads the forward (per class) and asks of each child whether calling it can
    write its input or state (its type, `inplace=True`, `max_norm`, hooks, what runs instead
    of the class forward) and what state it holds (the MoE fusers refuse experts holding
    more than their weights), so all of that is in the key: two instances share a cached
    verdict only if the analysis would say the same of both (a Parameter registered on one
    instance's experts once made every later instance of the class refused with its
    reason). Widths, biases, dtypes and devices vary per instance and are checked by
    `validate`.
    """
    return (
        type(module),
        tuple(
            (
                name,
                type(child),
                getattr(child, "inplace", None),
                getattr(child, "max_norm", None),
                has_hooks(child) is not None,
                own_call_path(child),
                "forward" in child.__dict__,
                tuple(child._parameters),
                tuple(child._buffers),
            )
            for name, child in module.named_children()
        ),
    )


def unreached_projections(module: nn.Module, graph: fx.Graph | None) -> tuple[str, ...]:
    """The names of `module`'s direct `nn.Linear` children that `graph` never calls, in
    registration order: every one when there is no graph; none for a container (a
    `ModuleList` of experts has no forward of its own to reach them)."""
    if type(module).forward is nn.Module.forward:
        return ()
    called = (
        {str(node.target) for node in graph.nodes if node.op == "call_module"} if graph else set()
    )
    return tuple(
        name
        for name, child in module.named_children()
        if isinstance(child, nn.Linear) and name not in called
    )


def candidates(module: nn.Module, fusers: tuple[type[Fuser], ...]) -> tuple[Candidate, ...]:
    """Every fuser that matched `module`'s class (or refused it with a reason), in priority
    order; traced at most once per cache key.

    A candidate fuser (its class prefilter says the pattern could be there) that finds no
    pattern in a trace that stopped before calling some of the module's projections (its
    `nn.Linear` children) is refused with where and why the trace stopped
    (`fusion.trace.tracer.Traced.stopped`) and the projections it never reached
    (`unreached_projections`): the projection fusers match the dataflow between them, so on
    such a graph "no pattern" is not a verdict, and a trace that starts stopping early (a
    new upstream release) must show in the report as a reason, never as a silently smaller
    plan. A trace that stopped after reaching every projection is no such finding (the
    norm and MoE fusers prove what they take by analyses of their own)."""
    key = (cache_key(module), fusers)
    if key in CACHE.entries:
        return CACHE.entries[key]
    interested = [cls for cls in fusers if cls.candidate(module)]
    result: list[Candidate] = []
    if interested:
        result_of_trace = traced(module)
        graph = result_of_trace.graph
        unreached = unreached_projections(module, graph) if result_of_trace.stopped else ()
        for cls in interested:
            try:
                fuser = cls.match(graph, module)
            except RewriteRefused as exc:
                result.append(Candidate(cls.name, None, str(exc), cls.redefines_forward))
                continue
            except Exception as exc:  # a matcher bug must not take the whole pass down
                logger.debug(
                    "%s.match raised on %s", cls.__name__, type(module).__name__, exc_info=True
                )
                result.append(
                    Candidate(
                        cls.name,
                        None,
                        f"matcher error: {type(exc).__name__}: {exc}",
                        cls.redefines_forward,
                    )
                )
                continue
            if fuser is not None:
                result.append(Candidate(cls.name, fuser, None, cls.redefines_forward))
            elif unreached and result_of_trace.stopped is not None:
                reason = f"{result_of_trace.stopped} (never reached: {', '.join(unreached)})"
                result.append(Candidate(cls.name, None, reason, cls.redefines_forward))
    CACHE.entries[key] = tuple(result)
    return CACHE.entries[key]
