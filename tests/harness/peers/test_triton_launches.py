"""harness.peers.triton_launches: launches of kernels under a prefix counted while the block
runs (interpreted here), others and warm-ups not; the launchers put back after."""

from __future__ import annotations

import pytest
import torch

from harness.peers import triton_launches

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
tl = pytest.importorskip("triton.language")
interpreter = pytest.importorskip("triton.runtime.interpreter")


def _fill(out_ptr, n: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, n), tl.full((n,), 7, tl.int32))


def test_launches_under_the_prefix_are_counted_and_the_launcher_put_back(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel = triton.jit(_fill)
    out = torch.zeros(4, dtype=torch.int32)
    run = interpreter.InterpretedFunction.__dict__["run"]
    with triton_launches.counting(__name__) as mine, triton_launches.counting("other.") as other:
        kernel[(1,)](out, 4)
        kernel[(2,)](out, 4)
    assert mine == {f"{__name__}._fill": 2}
    assert not other
    assert torch.equal(out, torch.full((4,), 7, dtype=torch.int32))
    assert interpreter.InterpretedFunction.__dict__["run"] is run
    kernel[(1,)](out, 4)  # outside the block: not counted
    assert sum(mine.values()) == 2


def test_kernel_name_of_something_that_is_not_a_kernel():
    assert triton_launches.kernel_name(object()) == ""
