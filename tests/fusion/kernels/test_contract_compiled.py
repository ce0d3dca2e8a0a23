"""`fusion.kernels.contract` under `torch.compile` (issue 24): compiled fused modules obey
autocast, device contexts, `__torch_function__` modes and the float32 matmul precision read
when they run, as the unfused ones do.

Each fast path is forced on for test-sized operands (`native_helpers`), so the tests run on
any machine; a spy records which path ran."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.fusion.dynamo_graphs import compiled_call_targets
from tests.fusion.kernels.contract_helpers import (
    K,
    PlusOneMode,
    linear_pair,
    merged_pair,
    mkldnn_matmul_bf16,
)
from tests.fusion.kernels.native_helpers import (
    force_native_on,
)

# --------------------------------------------------------------------------------------------
# Under torch.compile


@pytest.fixture
def native_only(monkeypatch) -> None:
    """The native kernel forced on (the operator path under compile needs a loaded kernel)."""
    force_native_on(monkeypatch)


@pytest.mark.parametrize("rows", [1, 16])
def test_compiled_modules_under_cpu_autocast_are_the_unfused_ones(
    native_only, taken: list[str], rows: int
) -> None:
    """Autocast around a compiled fused module: Dynamo guards on autocast, and the trace
    routes the product to `F.linear` (no `fusion::linear_product`, whose float32 output would
    contradict autocast), so the compiled module returns the unfused module's bfloat16."""
    linear, row = linear_pair()
    unfused, merged = merged_pair()
    x = torch.randn(1, rows, K)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for fused, reference in ((row, linear), (merged, unfused)):
            got, targets = compiled_call_targets(fused, x)
            with torch.no_grad():
                want = reference(x)
            assert not any("decode_linear" in t for t in targets), targets
            assert got.dtype == want.dtype == torch.bfloat16
            torch.testing.assert_close(got, want)
    assert taken == []


def test_compiled_modules_under_a_device_context_keep_the_fast_path(
    native_only, taken: list[str]
) -> None:
    """`torch.device(...)` around compiling and running: the factory-only mode is plain, so
    the trace still takes `fusion::linear_product`, which runs the native kernel."""
    _, row = linear_pair()
    x = torch.randn(1, 4, K)
    with torch.device("cpu"):
        got, targets = compiled_call_targets(row, x)
    assert targets == ["fusion.linear_product"]
    torch.testing.assert_close(got, F.linear(x, row.weight, row.bias).detach())
    assert taken == ["native"]


def test_compiled_modules_under_a_function_mode_obey_it(native_only, taken: list[str]) -> None:
    """A `TorchFunctionMode` active while compiling and running: the traced forward calls
    `F.linear`, which the mode sees (Dynamo traces the mode), as the compiled unfused
    linear's does. (With a backend that runs the graph's Python, the mode sees it again at
    run time and adds 2.0: the same for both, which is what is compared.)"""
    linear, row = linear_pair()
    x = torch.randn(1, 4, K)
    with PlusOneMode():
        got, targets = compiled_call_targets(row, x)
        want, _ = compiled_call_targets(linear, x)
    assert not any("decode_linear" in t for t in targets), targets
    assert torch.equal(got, want)
    with torch.no_grad():
        assert not torch.equal(got, F.linear(x, linear.weight, linear.bias))
    assert taken == []


def test_compiled_modules_read_precision_settings_when_they_run(
    native_only, taken: list[str], restore_precision
) -> None:
    """A precision setting changed after compiling (Dynamo does not guard on the oneDNN
    ones): the `fusion::linear_product` operator asks the predicate when it runs, so the
    compiled module then runs `F.linear`, without recompiling."""
    _, row = linear_pair()
    x = torch.randn(1, 4, K)
    torch._dynamo.reset()
    compiled = torch.compile(row, backend="eager", fullgraph=True)
    with torch.no_grad():
        compiled(x)
        assert taken == ["native"]
        mkldnn_matmul_bf16()
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = compiled(x)
        assert torch.equal(got, F.linear(x, row.weight, row.bias))
    assert taken == ["native"]
