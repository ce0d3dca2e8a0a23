"""Time the fusion core's per-class work on LlamaAttention: trace + alias analysis.

What is timed is what a fuser does once per module class: trace the forward (fx + meta
execution), recover its source, locate the q/k/v calls, and prove the projection input
stable over the q..v region (`check_input_stable`). Reported, never asserted (target:
median under 20 ms on a 2-core CPU):

    python -m pytest tests/bench/test_bench_trace.py -p no:xdist --benchmark-only
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import fx, nn

from fusion.analysis import source
from fusion.analysis.alias import check_input_stable
from fusion.trace.graph import is_leaf_call, linear_calls
from fusion.trace.tracer import trace
from tests.fusion.hf_modules import build_module

PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def trace_and_analyse(module: nn.Module) -> fx.Graph:
    graph = trace(module)
    assert graph is not None
    funcdef, _ = source.recover_forward(type(module))
    calls = [source.self_call_and_refs(funcdef, name)[0] for name in PROJECTIONS]
    block, indices = source.dominating_block(funcdef, calls)
    check_input_stable(funcdef, module, calls[0].args[0], block[min(indices) : max(indices) + 1])
    return graph


@pytest.fixture(scope="module")
def llama_attention() -> nn.Module:
    torch.manual_seed(0)
    return build_module("LlamaAttention")


def test_trace_and_alias_analysis_llama_attention(
    benchmark: Any, llama_attention: nn.Module
) -> None:
    benchmark.group = "fusion core"
    benchmark.extra_info["target_median_ms"] = 20
    graph = benchmark.pedantic(
        trace_and_analyse, args=(llama_attention,), rounds=50, iterations=1, warmup_rounds=3
    )
    # The timed work is the real thing: a complete graph with every projection and one
    # attention leaf, and a region the analysis accepts.
    assert {str(n.target) for n in linear_calls(graph, llama_attention)} == {
        *PROJECTIONS,
        "o_proj",
    }
    assert sum(is_leaf_call(n) for n in graph.nodes) == 1
