"""What a Transformers experts class computes, proven by the identity of its functions.

An experts module's call runs its class's `forward`. For the experts function to be known,
that `forward` must be Transformers' experts dispatcher (the closure `use_experts_implementation`
installs: the same code object), wrapping an eager forward that is Transformers' own (the
function object a Transformers model class was decorated over, found again by its module and
qualified name), and the dispatcher's interface must resolve the configured implementation
to a function whose computation is known: Transformers' `grouped_mm` or `batched_mm`
experts function, or that eager forward. Each is an identity check on function objects,
never a numeric sample: a class that carries the decorator over its own loop (one that drops
rows past a capacity, say) is refused whatever a sample shows.

The eager forward is the experts function only together with the gating it was written
with: under the eager implementation, a subclass that overrides `_apply_gate` is refused
(Transformers' eager loops inline `act_fn(gate) * up` where the gating is the default).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

from torch import nn

from fusion.errors import RewriteRefused
from fusion.runtime.experts import Dispatch
from fusion.trace.wrappers import nested_code

INTERFACE_MODULE = "transformers.integrations.moe"
KNOWN_FUNCTIONS = ("grouped_mm_experts_forward", "batched_mm_experts_forward")
"""Transformers' experts functions (in `INTERFACE_MODULE`) that compute the experts function
with the class's `_apply_gate` and flags, whatever the class."""


def _closure(function: types.FunctionType) -> dict[str, Any]:
    cells = function.__closure__ or ()
    return {name: cell.cell_contents for name, cell in zip(function.__code__.co_freevars, cells)}


def dispatcher_target(forward: Any, moe: types.ModuleType) -> tuple[Any, Callable] | None:
    """(interface, eager forward) when `forward` is Transformers' experts dispatcher (the
    code of `use_experts_implementation`'s inner `forward`), else None."""
    code = nested_code(moe.use_experts_implementation.__code__, ("wrapper", "forward"))
    if code is None or getattr(forward, "__code__", None) is not code:
        return None
    closure = _closure(forward)
    interface, eager = closure.get("experts_interface"), closure.get("original_forward")
    if not isinstance(interface, moe.ExpertsInterface) or not callable(eager):
        return None
    return interface, eager


def transformers_owner(eager: Any, moe: types.ModuleType) -> type | None:
    """The Transformers class whose decorated `forward` wraps exactly `eager` (found by
    `eager`'s module and qualified name, then compared by identity), else None."""
    module_name = getattr(eager, "__module__", None) or ""
    owner_path, _, attribute = (getattr(eager, "__qualname__", None) or "").rpartition(".")
    module = sys.modules.get(module_name)
    if not module_name.startswith("transformers.") or module is None:
        return None
    if attribute != "forward" or not owner_path or "<locals>" in owner_path:
        return None
    owner: Any = module
    for part in owner_path.split("."):
        owner = getattr(owner, part, None)
    if not isinstance(owner, type):
        return None
    target = dispatcher_target(owner.__dict__.get("forward"), moe)
    return owner if target is not None and target[1] is eager else None


def experts_dispatch(experts: nn.Module) -> Dispatch:
    """The proven `Dispatch` of `experts` (see the module docstring); RewriteRefused with
    the reason otherwise."""
    name = type(experts).__name__
    moe = sys.modules.get(INTERFACE_MODULE)
    if moe is None:  # no class can carry the decorator before its module is imported
        raise RewriteRefused(f"{name} is not a Transformers experts-interface module")
    target = dispatcher_target(type(experts).forward, moe)
    if target is None:
        raise RewriteRefused(
            f"{name}.forward is not Transformers' experts dispatcher (use_experts_implementation)"
        )
    interface, eager = target
    owner = transformers_owner(eager, moe)
    if owner is None:
        where = f"{getattr(eager, '__module__', '?')}.{getattr(eager, '__qualname__', '?')}"
        raise RewriteRefused(
            f"{name}'s own forward ({where}) is not a Transformers experts forward: what it "
            "computes is not proven (a loop of its own may drop, reorder or scale rows)"
        )
    if not isinstance(experts, owner):
        raise RewriteRefused(f"{name} dispatches to {owner.__name__}'s forward, not its own")
    config = getattr(experts, "config", None)
    implementation = getattr(config, "_experts_implementation", None)
    configured = interface.get(implementation, eager)
    known = [getattr(moe, function, None) for function in KNOWN_FUNCTIONS]
    if configured is not eager and not any(configured is function for function in known):
        raise RewriteRefused(
            f"experts implementation {implementation!r} runs "
            f"{getattr(configured, '__qualname__', configured)!r}, not a function whose "
            "computation is proven (eager, grouped_mm, batched_mm)"
        )
    if configured is eager and getattr(type(experts), "_apply_gate", None) is not getattr(
        owner, "_apply_gate", None
    ):
        raise RewriteRefused(
            f"{name} overrides the gating of {owner.__name__}, whose eager forward is "
            "configured (it may not call _apply_gate)"
        )
    return Dispatch(type(experts).forward, interface, None if configured is eager else configured)
