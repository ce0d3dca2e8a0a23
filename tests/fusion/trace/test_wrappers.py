"""fusion.trace.wrappers: the decorators and kernels function layers the tracer sees through, each
proven by provenance (its code object), anything else refused with its name."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils.deprecation import deprecate_kwarg

from fusion.errors import RewriteRefused
from fusion.trace import graph as G
from fusion.trace.tracer import traced
from fusion.trace.wrappers import (
    KNOWN_WRAPPERS,
    _factory_code,
    known_wrapper,
    nested_code,
    unwrap_forward,
)


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)


def doubling(fn: Any) -> Any:
    """A user's decorator that changes what the forward computes (its output doubled)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return 2 * fn(*args, **kwargs)

    return wrapper


def renaming_lookalike(fn: Any) -> Any:
    """Named and shaped like `deprecate_kwarg`'s wrapper, but not its code."""

    @functools.wraps(fn)
    def wrapped_func(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs) + 1

    return wrapped_func


class Doubled(Pair):
    @doubling
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class Lookalike(Pair):
    @renaming_lookalike
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class Renamed(Pair):
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(self, x: torch.Tensor, cache: Any = None) -> torch.Tensor:
        return self.b(self.a(x))


class Layer(GradientCheckpointingLayer):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(self, x: torch.Tensor, cache: Any = None) -> torch.Tensor:
        return self.a(x)


def test_transformers_wrappers_are_known_by_their_code() -> None:
    checkpointing = Layer.forward  # GradientCheckpointingLayer's wrapper around deprecate_kwarg's
    assert known_wrapper(checkpointing) is not None
    assert known_wrapper(checkpointing).factory.startswith("GradientCheckpointingLayer")
    assert known_wrapper(checkpointing.__wrapped__).factory == "deprecate_kwarg"
    assert unwrap_forward(checkpointing).__qualname__ == "Layer.forward"
    assert unwrap_forward(Renamed.forward).__qualname__ == "Renamed.forward"


@pytest.mark.parametrize("cls", [Doubled, Lookalike])
def test_an_unproven_wrapper_is_refused_with_its_name(cls: type[nn.Module]) -> None:
    assert known_wrapper(cls.forward) is None
    with pytest.raises(RewriteRefused, match="not a wrapper proven"):
        unwrap_forward(cls.forward)
    result = traced(cls())
    # Before: `inspect.unwrap` traced the inner function, whose graph is not the forward's
    # function (the output doubled, or plus one).
    assert result.graph is None
    assert result.stopped is not None
    assert "the trace stops at the start of" in result.stopped
    assert "tests.fusion.trace.test_wrappers" in result.stopped


def test_a_wrapper_whose_cell_is_not_the_wrapped_function_is_refused() -> None:
    def other(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x

    forward = Renamed.forward
    assert known_wrapper(forward) is not None
    # The same code, but `__wrapped__` is not what its closure calls.
    impostor = functools.update_wrapper(
        type(forward)(forward.__code__, forward.__globals__, "f", None, forward.__closure__),
        other,
    )
    assert known_wrapper(impostor) is None


def test_a_complete_trace_says_nothing_stopped_and_a_partial_one_says_where() -> None:
    assert traced(Renamed()).stopped is None

    class Stops(Pair):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            if h.sum() > 0:  # a branch on a traced value: the plain trace ends here
                h = -h
            return self.b(h)

    result = traced(Stops())
    assert result.graph is not None and G.output_value(result.graph) is None
    assert result.stopped is not None
    assert result.stopped.startswith("the trace stops at `if h.sum() > 0:` in Stops.forward: ")


def test_force_accelerate_hooks_is_known() -> None:
    from transformers.integrations.accelerate import force_accelerate_hooks

    class Hooked(Pair):
        @force_accelerate_hooks("a")
        @deprecate_kwarg("cache_params", "5.40.0", new_name="cache")
        def forward(self, x: torch.Tensor, cache: Any = None) -> torch.Tensor:
            return self.b(self.a(x))

    assert known_wrapper(Hooked.forward).factory == "force_accelerate_hooks"
    result = traced(Hooked())
    assert result.stopped is None and G.output_value(result.graph) is not None


def test_every_known_wrapper_names_a_loaded_factory() -> None:
    # Guards against a rename upstream: each known wrapper's code must still be found, or
    # the tracer would silently refuse every forward carrying it.
    import transformers.modeling_layers
    import transformers.utils.deprecation  # noqa: F401

    for known in KNOWN_WRAPPERS:
        if known.module.startswith("kernels"):
            continue  # tests/fusion/trace/test_wrappers_kernels.py, where kernels is installed
        factory = _factory_code(known.module, known.factory)
        assert factory is not None, known
        assert nested_code(factory, known.nested) is not None, known


def test_a_renamed_copy_of_a_wrapper_code_is_known_and_an_edited_one_is_not() -> None:
    """torch 2.15's `context_decorator` gives each wrapper a copy of its code renamed after
    the context manager: still the proven code (the same bytecode, constants and names).
    A copy whose body differs, or that comes from another file, is not."""

    class Plain(nn.Module):
        @torch.no_grad()
        def forward(self, x):
            return x

    wrapper = Plain.forward
    assert known_wrapper(wrapper) is not None
    code = wrapper.__code__
    wrapper.__code__ = code.replace(co_name="no_grad")
    assert known_wrapper(wrapper) is not None
    assert unwrap_forward(wrapper) is wrapper.__wrapped__
    wrapper.__code__ = code.replace(co_filename="elsewhere.py")
    assert known_wrapper(wrapper) is None
    wrapper.__code__ = code.replace(co_consts=(*code.co_consts, "an extra constant"))
    assert known_wrapper(wrapper) is None
    with pytest.raises(RewriteRefused, match="not a wrapper proven"):
        unwrap_forward(wrapper)
