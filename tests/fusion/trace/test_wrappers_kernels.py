"""fusion.trace.wrappers with kernels installed (a dependency of Transformers 5.25): its function
layers and `use_kernelized_func` wrapper, seen through only while nothing is kernelized."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import nn

from fusion.trace import graph as G
from fusion.trace.tracer import traced
from fusion.trace.wrappers import KNOWN_WRAPPERS, _factory_code, known_wrapper, nested_code

kernels = pytest.importorskip(
    "kernels", reason="kernels function layers exist where kernels is installed (Transformers 5.25)"
)


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)


@kernels.use_kernel_forward_from_hub("FusionTestScale")
def scale_rows(x: torch.Tensor) -> torch.Tensor:
    return x * 3.0


@kernels.use_kernelized_func(scale_rows)
class UsesKernelFunction(Pair):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(scale_rows(self.a(x)))


def test_a_kernels_function_layer_is_traced_as_its_function() -> None:
    module = UsesKernelFunction()
    assert isinstance(scale_rows, nn.Module)  # what kernels made of the function
    result = traced(module)
    assert result.stopped is None, result.stopped
    output = G.output_value(result.graph)
    assert G.is_linear(output, module)
    scaled = output.args[0]
    assert G.is_fn(scaled, operator.mul) and scaled.args[1] == 3.0


def test_a_kernelized_function_layer_stops_the_trace() -> None:
    module = UsesKernelFunction()
    (copy,) = module._kernel_funcs.values()  # filed under the layer name, FusionTestScale
    copy.forward = lambda x: x  # what `kernelize` does: a hub kernel as the instance's forward
    result = traced(module)
    assert result.stopped is not None and "kernelized" in result.stopped
    assert G.output_value(result.graph) is None


def test_use_kernelized_func_is_a_known_wrapper() -> None:
    assert known_wrapper(UsesKernelFunction.forward).factory == "use_kernelized_func"
    (known,) = [k for k in KNOWN_WRAPPERS if k.module.startswith("kernels")]
    assert nested_code(_factory_code(known.module, known.factory), known.nested) is not None
