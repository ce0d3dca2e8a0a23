"""Safety fuzzing of `fusion.fuse` (DESIGN.md, oracle 4) on generated Transformers-shaped
modules.

Property, per generated shape: after `fusion.fuse`, a module is either untouched or computes
the same function. `fuse` never raises, the fused forward never raises where the unfused
one did not, outputs agree to a relative error of 1e-5 in float32 on fresh random inputs,
and inputs the forward mutates end in the same state (`tests.fuzz.oracle.check`).

A failure is shrunk by Hypothesis; every failing call rewrites the shape's repro bundle
(`repro-bundles/fuzz/fuzz--<shape>`, or `FUZZ_REPRO_DIR`), so the bundle left behind holds
the final, shrunk example. Example counts: tests/fuzz/profiles.py (`FUZZ_PROFILE`).

A second test checks the generator itself on a fixed, derandomized batch: it must produce
modules the engine actually fuses (at least MIN_SAFE_FUSED of the hazard-free ones, for
every shape), hazardous ones too, and programs that run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

from tests.fuzz.oracle import SESSION_TALLY, Tally, check
from tests.fuzz.profiles import FUZZ_SETTINGS
from tests.fuzz.repro import write_bundle
from tests.fuzz.strategies import SHAPES, generated_modules

SEEDS = st.integers(0, 2**16 - 1)
COVERAGE_EXAMPLES = 40
"""Size of the fixed batch the coverage test draws per shape."""
MIN_SAFE_FUSED = 0.30
"""Below this share of hazard-free modules fused, the generator is too narrow to test much."""
MAX_CRASHED = 0.10
"""Above this share of programs whose own (unfused) forward raises, the generator is broken."""


@pytest.mark.parametrize("shape", SHAPES)
@FUZZ_SETTINGS
@given(data=st.data())
def test_fuse_is_safe(
    shape: str, data: st.DataObject, generated_dir: Path, repro_dir: Path
) -> None:
    module = data.draw(generated_modules(shape), label="module")
    seed = data.draw(SEEDS, label="seed")
    outcome = check(module, seed, generated_dir)
    SESSION_TALLY.record(module, outcome)
    failure = outcome.failure
    if failure is None:
        return
    bundle = write_bundle(repro_dir, f"fuzz--{shape}", module, seed, outcome)
    note(module.source)
    raise AssertionError(
        f"{failure.kind}: {failure.message}\n"
        f"  module: {module.describe()}\n"
        f"  applied: {', '.join(outcome.fusers) or 'nothing'}\n"
        f"  repro bundle: {bundle} (python {bundle / 'repro.py'})\n{failure.detail}"
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_generator_exercises_fusion(shape: str, generated_dir: Path) -> None:
    tally = Tally()

    @settings(
        max_examples=COVERAGE_EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(module=generated_modules(shape), seed=SEEDS)
    def batch(module, seed: int) -> None:
        tally.record(module, check(module, seed, generated_dir))

    batch()
    table = "\n".join(tally.lines())
    print(f"\n{table}")
    row = tally.counts[shape]
    assert row["examples"] == COVERAGE_EXAMPLES, table
    assert row["safe"] >= COVERAGE_EXAMPLES // 4, f"too few hazard-free modules\n{table}"
    assert row["examples"] - row["safe"] >= COVERAGE_EXAMPLES // 4, f"too few hazards\n{table}"
    assert row["crashed"] <= MAX_CRASHED * row["examples"], (
        f"generator writes broken programs\n{table}"
    )
    assert tally.safe_fused_ratio(shape) >= MIN_SAFE_FUSED, f"generator too narrow\n{table}"
