"""Safety fuzzing of `fusion.fuse` (docs/design.md, oracle 4) on generated Transformers-shaped
modules.

Property, per generated shape: after `fusion.fuse`, a module is either untouched or computes
the same function. `fuse` never raises, the fused forward never raises where the unfused
one did not, outputs agree to a relative error of 1e-5 in float32 on fresh random inputs,
and inputs the forward mutates end in the same state (`tests.fuzz.oracle.check`).

A failure is shrunk by Hypothesis; every failing call rewrites the shape's repro bundle
(`repro-bundles/fuzz/fuzz--<shape>`, or `FUZZ_REPRO_DIR`), so the bundle left behind holds
the final, shrunk example. Example counts: tests/fuzz/profiles.py (`FUZZ_PROFILE`).

Every failure the fuzzer ever found is also kept as a fixed example: the complete generated
source, shrunk, in tests/fuzz/findings/<name>.py.txt, and `test_known_finding` runs each
through the same oracle on every run, whatever the profile. The CI profile's 50 derandomized
examples per shape (`CI_EXAMPLES`, tests/fuzz/profiles.py) need not draw any given hazard
family (issue 18's guarded chained view was missed that way); these files make sure each
family a fix was made for stays reached.
Add one for every new finding: the shrunk source from its repro bundle, with the header
lines `# fuzz finding: <name> (shape <shape>)`, `# hazards: ...`, `# features: ...`.

`test_post_fuse_edit_is_safe` (issue 43) draws one edit a user makes after fusing
(tests/fuzz/edits.py) and applies it to the fused module and to an unfused copy; the pair
is judged the same way. Each edit kind is a tally family of its own (`edit-<kind>`).

A second test checks the generator itself on a fixed, derandomized batch: it must produce
modules the engine actually fuses (at least MIN_SAFE_FUSED of the hazard-free ones, for
every shape), hazardous ones too, and programs that run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

from tests.fuzz.edits import edit_specs
from tests.fuzz.oracle import check, check_edit
from tests.fuzz.profiles import FUZZ_SETTINGS
from tests.fuzz.repro import write_bundle
from tests.fuzz.strategies import SHAPES, GeneratedModule, generated_modules
from tests.fuzz.tally import SESSION_TALLY, Tally

SEEDS = st.integers(0, 2**16 - 1)
FINDINGS = Path(__file__).with_name("findings")
"""Shrunk generated modules of every failure the fuzzer has found (and of the in-place forms
added to the generator with the fix of issue 18), replayed on every run."""
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
@FUZZ_SETTINGS
@given(data=st.data())
def test_post_fuse_edit_is_safe(
    shape: str, data: st.DataObject, generated_dir: Path, repro_dir: Path
) -> None:
    """Issue 43: after fusing (and a first forward), one edit a user makes (tests/fuzz/
    edits.py: an attribute the original forward reads, a method patch, a helper's code, a
    shadowed child, quantize_dynamic, a shallow copy, a new bias, a parametrized or pruned
    weight, inference-mode construction) applied to the fused model and to an unfused copy
    leaves them computing the same function. `FUZZ_EDIT_KINDS` narrows the kinds drawn.
    Hazard-free modules only: they fuse most often (hazards are `test_fuse_is_safe`'s), and
    a refused module is not edited."""
    module = data.draw(generated_modules(shape, safe=True), label="module")
    seed = data.draw(SEEDS, label="seed")
    spec = data.draw(edit_specs(), label="edit")
    outcome = check_edit(module, spec, seed, generated_dir)
    SESSION_TALLY.record_edit(shape, spec.kind, outcome)
    failure = outcome.failure
    if failure is None:
        return
    bundle = write_bundle(repro_dir, f"fuzz-edit--{shape}--{spec.kind}", module, seed, outcome)
    note(module.source)
    raise AssertionError(
        f"{failure.kind}: {failure.message}\n"
        f"  edit: {spec}\n"
        f"  module: {module.describe()}\n"
        f"  applied: {', '.join(outcome.fusers) or 'nothing'}\n"
        f"  repro bundle: {bundle} (module and seed; the edit is in the message)\n{failure.detail}"
    )


def _finding(path: Path) -> GeneratedModule:
    """A findings file as the GeneratedModule it was generated as (header: shape, labels)."""
    text = path.read_text(encoding="utf-8")
    header = dict(
        line[2:].split(": ", 1)
        for line in text.splitlines()[:8]
        if line.startswith("# ") and ": " in line
    )
    shape = header["fuzz finding"].split("(shape ")[1].rstrip(")")
    labels = {
        key: tuple(v for v in header.get(key, "").split(", ") if v and v != "none")
        for key in ("hazards", "features")
    }
    return GeneratedModule(shape, "GeneratedModel", text, labels["hazards"], labels["features"])


@pytest.mark.parametrize(
    "path", sorted(FINDINGS.glob("*.py.txt")), ids=lambda p: p.name[: -len(".py.txt")]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_known_finding(path: Path, seed: int, generated_dir: Path, repro_dir: Path) -> None:
    module = _finding(path)
    outcome = check(module, seed, generated_dir)
    failure = outcome.failure  # not in the session tally: that counts generated examples
    if failure is not None:
        bundle = write_bundle(
            repro_dir, f"finding--{path.name[: -len('.py.txt')]}", module, seed, outcome
        )
        raise AssertionError(
            f"{failure.kind}: {failure.message}\n  finding: {path.name}\n"
            f"  applied: {', '.join(outcome.fusers) or 'nothing'}\n  repro bundle: {bundle}\n{failure.detail}"
        )


def test_findings_are_there() -> None:
    """At least the findings fixed so far (a glob that matched nothing would pass silently)."""
    names = {path.name for path in FINDINGS.glob("*.py.txt")}
    assert "issue18-decoder-guarded-view-augassign.py.txt" in names, names
    assert len(names) >= 10, names


@pytest.mark.parametrize("shape", SHAPES)
def test_generator_exercises_fusion(shape: str, generated_dir: Path) -> None:
    tally = Tally()

    def batch(safe: bool) -> None:
        # Half safe, half hazardous by construction: the first examples of a derandomized
        # run lean to one kind, and which way changes with every draw a generator adds.
        @settings(
            max_examples=COVERAGE_EXAMPLES // 2,
            derandomize=True,
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(module=generated_modules(shape, safe=safe), seed=SEEDS)
        def run(module, seed: int) -> None:
            tally.record(module, check(module, seed, generated_dir))

        run()

    batch(safe=True)
    batch(safe=False)
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
