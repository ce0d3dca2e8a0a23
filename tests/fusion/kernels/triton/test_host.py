"""`fusion.kernels.triton.host`: the MoE launch reads no device value on the host (no
`.item()` / `.tolist()`), so a CUDA graph can capture it; its padded block table covers each
expert's rows exactly. Runs in Triton's interpreter on CPU (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before fusion imports triton

from fusion import kernels
from fusion.kernels import reference as torch_ref

# Triton is optional (the `gpu` extra, not `test`): without it the host module has no kernels
# to import, which is an ImportError of ours, not a missing module, so ask for Triton itself.
pytest.importorskip("triton", reason="Triton is not installed (pip install '.[gpu]')")
host = pytest.importorskip("fusion.kernels.triton.host")


def _triton():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if "triton" not in kernels.available_backends(device):
        pytest.skip("the triton backend is not available here (no GPU and no interpreter)")
    return kernels.get("triton", device), device


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("seed", range(6))
def test_expert_blocks_cover_each_expert_exactly(block_m: int, seed: int) -> None:
    """Every row of every expert lies in exactly one block of that expert, blocks hold at
    most block_m rows, and the padding past the real blocks is empty (0, 0, 0)."""
    g = torch.Generator().manual_seed(seed)
    experts = int(torch.randint(1, 9, (1,), generator=g))
    counts = torch.randint(0, 3 * block_m, (experts,), generator=g)
    counts[torch.rand(experts, generator=g) < 0.3] = 0  # some experts without rows
    total = int(counts.sum())
    table = host._expert_blocks(counts, host._max_blocks(total, experts, block_m), block_m)
    owner = torch.full((total,), -1)
    real = 0
    for expert, first, end in table.tolist():
        if first == end:
            assert (expert, first) == (0, 0)
            continue
        real += 1
        assert 0 < end - first <= block_m and (owner[first:end] == -1).all()
        owner[first:end] = expert
    expected = torch.repeat_interleave(torch.arange(experts), counts)
    assert torch.equal(owner, expected)
    assert real == int(((counts + block_m - 1) // block_m).sum())


def test_moe_launch_reads_nothing_back(monkeypatch) -> None:
    """The Triton MoE path never calls `.item()` or `.tolist()` (a host synchronisation on a
    GPU) and still computes the reference's function."""
    _, device = _triton()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 32, generator=g).to(device)
    gate_up = (0.2 * torch.randn(6, 48, 32, generator=g)).to(device)
    down = (0.2 * torch.randn(6, 32, 24, generator=g)).to(device)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(9)]).to(device)
    weights = torch.rand(9, 2, generator=g).to(device)
    want = torch_ref.moe_experts(hidden, gate_up, down, ids, weights, "silu")

    def refuse(*args, **kwargs):
        raise AssertionError("host synchronisation in the MoE launch")

    monkeypatch.setattr(torch.Tensor, "item", refuse)
    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    got = host._launch_moe(hidden, gate_up, down, ids, weights, "silu")
    monkeypatch.undo()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
