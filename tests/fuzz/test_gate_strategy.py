"""Fuzzing the gating-program reader (`fusion.fusers.moe.gate`) with generated `_apply_gate`
functions (tests/fuzz/gate_strategy.py) on a real Transformers experts module.

Property: `proven_gate` refuses, or its program replays the gating bit for bit (NaNs in
the same places) on random inputs of every float dtype, and the `FusedExperts` built on it
(guarding the attributes the gating reads) agrees with the experts' own forward to float32
rounding at one row and at many, in train and eval mode, and after `limit` changes. A fixed batch also checks the
generator: it yields programs that are accepted and hazards that are refused.

Example counts: the fuzzer's profiles (tests/fuzz/profiles.py, `FUZZ_PROFILE`): CI runs
`CI_EXAMPLES` derandomized gate programs, `tox -e fuzz` 10 000."""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, note, settings
from torch import nn

import corpus
from fusion import numerics
from fusion.errors import RewriteRefused
from fusion.fusers.moe.experts import experts_child
from fusion.fusers.moe.gate import proven_gate
from fusion.runtime.experts import FusedExperts, run_gate
from tests.fuzz.gate_strategy import GeneratedGate, generated_gates
from tests.fuzz.profiles import FUZZ_SETTINGS

_EXPERTS: list[nn.Module] = []


def base_experts() -> nn.Module:
    """A tiny real experts module (built once; each example gets a copy of its own)."""
    if not _EXPERTS:
        logging.getLogger("transformers").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", message=".*experts_implementation.*")
        model = corpus.build("afmoe", seed=0, dtype=torch.float32, device="cpu")
        block = next(m for m in model.modules() if experts_child(m) is not None)
        _EXPERTS.append(block.experts)
    return copy.deepcopy(_EXPERTS[0])


def with_gate(generated: GeneratedGate) -> nn.Module:
    namespace: dict = {"torch": torch, "F": F}
    exec(compile(generated.source, "<generated gate>", "exec"), namespace)
    experts = base_experts()
    experts.__class__ = type("GeneratedExperts", (type(experts),), dict(namespace))
    experts.limit = 7.0  # read by the "attribute read" hazard, as GPT-OSS's gate reads it
    return experts


def check(generated: GeneratedGate) -> str:
    """'refused' or 'fused', raising AssertionError when the property fails."""
    experts = with_gate(generated)
    width = experts.gate_up_proj.shape[1]
    try:
        proven = proven_gate(experts, width)
    except RewriteRefused:
        return "refused"
    program = proven.program
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = (6 * torch.randn(11, width, generator=generator)).to(dtype)
        expected = type(experts)._apply_gate(experts, x)
        actual = run_gate(program, x)
        assert actual.dtype == expected.dtype, (dtype, actual.dtype, expected.dtype)
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)
    reads = tuple((experts.get_submodule(path), name) for path, name in proven.reads)
    fused = FusedExperts(experts, program=program, transposed=False, backend="torch", reads=reads)
    hidden = experts.gate_up_proj.shape[2]
    # What one trace cannot show (issue 24, defect 6): one row and many, train and eval,
    # an attribute the gating reads changed after fusing. Each must match the experts' own
    # forward, by a program that holds there or by the guard's fallback.
    for rows, training, limit in (
        (9, False, 7.0),
        (1, False, 7.0),
        (9, True, 7.0),
        (9, False, 0.5),
    ):
        experts.train(training)
        fused.train(training)
        experts.limit = limit
        x = torch.randn(rows, hidden, generator=generator)
        ids = torch.randn(rows, experts.num_experts, generator=generator).topk(2, dim=-1).indices
        weights = torch.rand(rows, 2, generator=generator)
        with torch.no_grad():
            expected = type(experts).forward(experts, x, ids, weights)
            actual = fused(x, ids, weights)
        # The expert sums are reordered (rounding, relative to the output's scale); the
        # gating itself was required bit for bit above.
        error = numerics.relative_error(actual, expected)
        assert error <= 1e-5 or (
            expected.isnan().any() and torch.equal(expected.isnan(), actual.isnan())
        ), (rows, training, limit, error)
    return "fused"


@pytest.mark.slow
@settings(FUZZ_SETTINGS)
@given(generated=generated_gates())
def test_gate_programs_are_refused_or_exact(generated: GeneratedGate) -> None:
    note(generated.source)
    check(generated)


def test_generator_yields_accepted_programs_and_refused_hazards() -> None:
    accepted, refused_hazards, hazards = 0, 0, 0
    batch = []

    @settings(max_examples=30, derandomize=True, database=None, deadline=None)
    @given(generated=generated_gates())
    def collect(generated: GeneratedGate) -> None:
        batch.append(generated)

    collect()
    for generated in batch:
        outcome = check(generated)
        accepted += outcome == "fused" and not generated.hazards
        if generated.hazards:
            hazards += 1
            refused_hazards += outcome == "refused"
    assert accepted >= 5, accepted
    assert hazards >= 3 and refused_hazards >= 3, (hazards, refused_hazards)
