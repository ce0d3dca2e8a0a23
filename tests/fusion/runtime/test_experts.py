"""`fusion.runtime.experts`: the gated experts reference against a per-token loop (biases,
transposed views, empty input), the program's JSON form, and `FusedExperts`'s calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusion.fusers.moe.gate import gate_program
from fusion.runtime.experts import GateProgram, gated_experts, program_from_json, run_gate
from tests.fusion.fusers.test_moe_gate import CASES, Gating

E, H, INTER, T, K = 4, 12, 8, 7, 2


def program(case: str) -> GateProgram:
    fn, attributes, _ = CASES[case]
    return gate_program(Gating(fn, **attributes), 2 * INTER)


def loop(x, gate_up, gate_up_bias, down, down_bias, ids, weights, gate):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = F.linear(x[t], gate_up[e], gate_up_bias[e] if gate_up_bias is not None else None)
            h = F.linear(gate(h[None])[0], down[e], down_bias[e] if down_bias is not None else None)
            out[t] += (h * weights[t, k]).to(x.dtype)
    return out


@pytest.mark.parametrize("case", ["silu", "gpt_oss", "softcap"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
def test_gated_experts_is_the_experts_function(case: str, bias: bool, transposed: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    gate_up, down = torch.randn(E, 2 * INTER, H, generator=g), torch.randn(E, H, INTER, generator=g)
    if transposed:  # stored [E, H, 2I] / [E, I, H], read through views
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
        gate_up_view, down_view = gate_up.transpose(1, 2), down.transpose(1, 2)
    else:
        gate_up_view, down_view = gate_up, down
    gate_up_bias = torch.randn(E, 2 * INTER, generator=g) if bias else None
    down_bias = torch.randn(E, H, generator=g) if bias else None
    ids = torch.randn(T, E, generator=g).topk(K, dim=-1).indices
    weights = torch.rand(T, K, generator=g)
    prog = program(case)
    fn, attributes, _ = CASES[case]
    module = Gating(fn, **attributes)
    args = (x, gate_up_view, gate_up_bias, down_view, down_bias, ids, weights)
    actual = gated_experts(*args, prog)
    expected = loop(*args, module._apply_gate)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_gated_experts_of_no_tokens() -> None:
    out = gated_experts(
        torch.zeros(0, H),
        torch.randn(E, 2 * INTER, H),
        None,
        torch.randn(E, H, INTER),
        None,
        torch.zeros(0, K, dtype=torch.long),
        torch.zeros(0, K),
        program("silu"),
    )
    assert out.shape == (0, H)


@pytest.mark.parametrize("case", sorted(CASES))
def test_program_json_round_trip(case: str) -> None:
    prog = program(case)
    back = program_from_json(prog.to_json())
    assert back.steps == prog.steps
    x = torch.randn(3, 2 * INTER).bfloat16()
    assert torch.equal(run_gate(back, x), run_gate(prog, x))


def routed_case(seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    gate_up, down = torch.randn(E, 2 * INTER, H, generator=g), torch.randn(E, H, INTER, generator=g)
    ids = torch.randn(T, E, generator=g).topk(K, dim=-1).indices
    return x, gate_up, down, ids, torch.rand(T, K, generator=g)


def test_gated_experts_skips_the_dropped_id() -> None:
    """id == E is Transformers' dropped id: the eager loop skips it, so it contributes 0."""
    x, gate_up, down, ids, weights = routed_case()
    ids[::2, 0] = E
    ids[1, :] = E  # a token all of whose choices are dropped
    fn, attributes, _ = CASES["gpt_oss"]
    module = Gating(fn, **attributes)
    actual = gated_experts(x, gate_up, None, down, None, ids, weights, program("gpt_oss"))
    kept = ids != E
    expected = loop(
        x, gate_up, None, down, None, ids.where(kept, 0), weights * kept, module._apply_gate
    )
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(actual[1], torch.zeros(H))


@pytest.mark.parametrize("bad", [E + 1, -1])
def test_gated_experts_raises_on_other_out_of_range_ids(bad: int) -> None:
    """Any other id outside [0, E) raises, as the eager loop does: never another expert."""
    x, gate_up, down, ids, weights = routed_case()
    ids[0, 1] = bad
    with pytest.raises(RuntimeError):
        gated_experts(x, gate_up, None, down, None, ids, weights, program("silu"))
