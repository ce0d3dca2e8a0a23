"""harness.runner.systems: the systems under test, how the harness selects and records them, and
(slow) the inductor system judged end to end on one tiny architecture."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from harness import cli
from harness.base.results import (
    FUSION_FAILURES,
    STATUSES,
    ArchResult,
    Failure,
    ResultsError,
    from_dict,
    to_dict,
    to_json_line,
)
from harness.oracles import lifecycle
from harness.runner import arch_check, repro, sweep, systems

REPO = Path(__file__).resolve().parents[3]


def _result(**fields) -> ArchResult:
    base = dict(architecture="llama", status="pass", dtype="float32", device="cpu", seed=0)
    return ArchResult(seconds=1.0, **{**base, **fields})


# ------------------------------------------------------------------------------- registry


def test_every_name_makes_its_system_and_the_cli_offers_exactly_them():
    assert systems.NAMES == ("fusion", "inductor", "inductor-freezing", "vllm", "liger")
    assert [systems.get(name).name for name in systems.NAMES] == list(systems.NAMES)
    assert cli.SYSTEM_NAMES == systems.NAMES  # the parser spells them out without torch
    assert all(systems.get(name).description for name in systems.NAMES)


def test_an_unknown_system_is_refused_listing_the_known_ones():
    with pytest.raises(systems.UnknownSystem) as raised:
        systems.get("tvm")
    assert "'tvm'" in str(raised.value)
    assert all(name in str(raised.value) for name in systems.NAMES)
    with pytest.raises(systems.UnknownSystem):  # before any model is built
        arch_check.CheckOptions(system="tvm")


def test_fusion_is_the_default_with_its_plan_lifecycle_and_golden_files():
    default = systems.get()
    assert default.name == systems.DEFAULT == "fusion" == arch_check.CheckOptions().system
    assert (default.lifecycle, default.golden) == (True, True)
    assert (default.apply_status, default.forward_status) == ("fuse-error", "fused-error")
    assert default.timeout == sweep.DEFAULT_TIMEOUT
    assert cli.build_parser().parse_args(["run"]).system == "fusion"


def test_inductor_systems_have_no_lifecycle_nor_golden_plan_and_fail_as_compile_errors():
    for name in ("inductor", "inductor-freezing"):
        system = systems.get(name)
        assert (system.lifecycle, system.golden) == (False, False)
        assert system.apply_status == system.forward_status == system.forward_kind
        assert system.forward_kind == "compile-error" and "compile-error" in repro.KINDS
        assert system.timeout > systems.FUSION_TIMEOUT
    assert "compile-error" in STATUSES and "compile-error" in FUSION_FAILURES


def test_a_fuse_function_is_refused_for_a_system_that_would_ignore_it():
    with pytest.raises(ValueError, match="only to system fusion"):
        systems.get("inductor", fuse=lambda model: None)


def test_inductor_apply_compiles_in_place_and_lazily():
    model = nn.Linear(4, 4)
    prepared = systems.get("inductor").apply(model)
    assert prepared.model is model and prepared.report is None
    assert model._compiled_call_impl is not None  # every call of the model runs compiled
    assert list(model.state_dict()) == ["weight", "bias"]  # names stay the model's own
    assert systems.compiled_note() == "compiled: 0 graph(s), 0 graph break(s)"  # nothing yet


def test_lifecycle_of_a_system_without_it_is_n_a_with_the_reason():
    system = systems.get("inductor")
    cycle = arch_check.not_applicable(system, "quick")
    assert list(cycle) == list(lifecycle.OPERATIONS)
    assert {v["verdict"] for v in cycle.values()} == {"n/a"}
    assert {v["detail"] for v in cycle.values()} == {"not applicable to system inductor"}
    assert arch_check.not_applicable(system, "off") == {}
    with pytest.raises(ValueError):
        arch_check.not_applicable(system, "sometimes")


# ------------------------------------------------------------------------- the records


def test_results_round_trip_with_the_system_and_old_records_are_fusion():
    judged = _result(system="inductor", status="compile-error", message="boom")
    line = json.loads(to_json_line(judged))
    assert line["system"] == "inductor"
    assert from_dict(line) == judged
    old = to_dict(_result())
    del old["system"]  # a line written before systems existed
    assert from_dict(old).system == "fusion"
    with pytest.raises(ResultsError, match="system must be a string"):
        from_dict({**old, "system": 3})


def test_results_files_and_resume_keep_systems_apart(tmp_path):
    fusion, inductor = arch_check.CheckOptions(), arch_check.CheckOptions(system="inductor")
    assert sweep.default_results(fusion) == Path("results/sweep-float32-cpu.jsonl")
    assert sweep.default_results(inductor) == Path("results/sweep-inductor-float32-cpu.jsonl")
    args = cli.build_parser().parse_args(["run", "--system", "inductor"])
    assert cli.run.default_results(args) == sweep.default_results(inductor)
    with pytest.raises(ResultsError, match="system 'fusion'"):
        sweep.previous_results(tmp_path / "r.jsonl", inductor, [_result()])
    done = sweep.previous_results(tmp_path / "r.jsonl", inductor, [_result(system="inductor")])
    assert list(done) == ["llama"]


def test_bundle_directories_of_fusion_keep_their_names_and_other_systems_get_their_own():
    failure = Failure(
        kind="model-parity",
        qualname=None,
        fuser=None,
        source_class=None,
        message="logits: off",
        signature="model-parity|-|-|logits: off",
    )
    fusion = repro.bundle_dirname("llama", failure)
    assert fusion == repro.bundle_dirname("llama", failure, "fusion")
    assert fusion.startswith("llama--model-parity--model--")
    inductor = repro.bundle_dirname("llama", failure, "inductor")
    assert inductor.startswith("llama--inductor--model-parity--model--")
    assert inductor.rsplit("--", 1)[1] != fusion.rsplit("--", 1)[1]


# --------------------------------------------------------------------------- judging


def _raises_at_first_call(self: nn.Module, *args, **kwargs) -> None:
    """Stands in for nn.Module.compile: the compiled call raises as a failed compile does."""

    def compiled(*args, **kwargs):
        raise RuntimeError("backend='inductor' raised: lowering exploded")

    self._compiled_call_impl = compiled


def test_a_compile_that_raises_where_eager_runs_is_a_compile_error(
    llama, llama_inputs, monkeypatch
):
    monkeypatch.setattr(nn.Module, "compile", _raises_at_first_call)
    options = dataclasses.replace(arch_check.CheckOptions(), system="inductor")
    checked = arch_check.check_model("llama", llama, llama_inputs, options)
    result = checked.result
    assert (result.status, result.system) == ("compile-error", "inductor")
    assert "lowering exploded" in result.message
    assert [f.kind for f in result.failures] == ["compile-error"]
    assert result.lifecycle == {} and result.applied == {}
    assert result.fusion_failure  # counted against the system under test


def test_the_plugin_refuses_an_unknown_system(tmp_path):
    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "harness.pytest_fusion",
            "--fusion",
            "--fusion-system",
            "tvm",
            "-q",
            "-p",
            "no:cacheprovider",
            str(tmp_path),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert run.returncode == 4, run.stdout + run.stderr  # pytest's usage error
    assert "--fusion-system 'tvm'" in run.stderr and "inductor" in run.stderr


INDUCTOR_FILE = os.path.join(os.path.dirname(torch.__file__), "_inductor", "lowering.py")


def _warns_from(filename: str):
    """Stands in for nn.Module.compile: the compiled call runs eager but first warns as if
    from `filename` (Inductor's own source, or another file)."""

    def compile(self: nn.Module, *args, **kwargs) -> None:
        eager = self._call_impl

        def compiled(*args, **kwargs):
            warnings.warn_explicit(
                "Torchinductor does not support code generation for complex operators.",
                UserWarning,
                filename=filename,
                lineno=1,
            )
            logging.getLogger("torch._dynamo.variables.functions").warning(
                "Dynamo detected a call to a lru_cache-wrapped function"
            )
            return eager(*args, **kwargs)

        self._compiled_call_impl = compiled

    return compile


def test_a_compilers_own_diagnostics_are_named_not_failed(llama, llama_inputs, monkeypatch):
    """A warning raised from Inductor's or Dynamo's modules (a file, a logger) is the
    compiler's diagnostic about itself: recorded as `compiler`, named in the message, and
    the architecture passes on its parity."""
    monkeypatch.setattr(nn.Module, "compile", _warns_from(INDUCTOR_FILE))
    options = dataclasses.replace(arch_check.CheckOptions(), system="inductor", lifecycle="off")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = arch_check.check_model("llama", llama, llama_inputs, options).result
    assert result.status == "pass", result.message
    assert result.warnings["compiler"] == [
        "UserWarning: Torchinductor does not support code generation for complex operators.",
        "logging.WARNING: Dynamo detected a call to a lru_cache-wrapped function",
    ]
    assert "fused-only" not in result.warnings and result.failures == []
    assert "compiler warned: UserWarning: Torchinductor does not support" in result.message
    assert "(+1 more)" in result.message


def test_the_same_warning_from_elsewhere_still_fails(llama, llama_inputs, monkeypatch):
    """Only a proven origin sets a warning apart: the same text raised from another file is a
    warning only the compiled model raises, a failure."""
    monkeypatch.setattr(nn.Module, "compile", _warns_from(__file__))
    options = dataclasses.replace(arch_check.CheckOptions(), system="inductor", lifecycle="off")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = arch_check.check_model("llama", llama, llama_inputs, options).result
    assert result.status == "fail", result.message
    assert result.warnings["fused-only"] == [
        "UserWarning: Torchinductor does not support code generation for complex operators."
    ]
    assert [f.kind for f in result.failures] == ["fused-warning"]


def test_our_engine_has_no_diagnostics_modules():
    """Every warning a fused model raises and the unfused one does not fails fusion."""
    assert systems.get("fusion").diagnostics == ()
    assert systems.get("inductor").diagnostics == systems.COMPILER_MODULES


def _miscompiles_mlps(self: nn.Module, *args, **kwargs) -> None:
    """Stands in for nn.Module.compile: every LlamaMLP in what is compiled (the whole model, or
    the MLP alone) computes its output 5% off, as a miscompiled kernel would."""
    for module in self.modules():
        if type(module).__name__ == "LlamaMLP":
            eager = module._call_impl
            module._compiled_call_impl = lambda *a, eager=eager, **k: eager(*a, **k) * 1.05


def test_a_compiled_models_mismatch_is_localised_to_the_module_compiled_alone(
    llama, llama_inputs, monkeypatch
):
    """The logits fail; each decoder-layer child is then compiled alone and judged on the
    inputs it saw: the MLPs fail, named with their class and the system, the rest pass."""
    monkeypatch.setattr(nn.Module, "compile", _miscompiles_mlps)
    options = dataclasses.replace(arch_check.CheckOptions(), system="inductor", lifecycle="off")
    result = arch_check.check_model("llama", llama, llama_inputs, options).result
    assert result.status == "fail"
    verdicts = {m.qualname: m.status for m in result.modules}
    layers = len(llama.model.layers)
    assert sorted(verdicts) == sorted(
        f"model.layers.{i}.{child}"
        for i in range(layers)
        for child in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    )
    assert {q for q, v in verdicts.items() if v == "fail"} == {
        f"model.layers.{i}.mlp" for i in range(layers)
    }
    assert set(verdicts.values()) == {"pass", "fail"}
    assert result.message.startswith("model.layers.0.mlp (LlamaMLP) [inductor]: ")
    assert [f.kind for f in result.failures] == ["model-parity"] + ["module-parity"] * layers


def test_a_compiled_model_that_passes_is_not_localised(llama, llama_inputs, monkeypatch):
    """Localisation compiles every unit again: only a failed verdict pays for it."""
    monkeypatch.setattr(nn.Module, "compile", lambda self, *a, **k: None)  # eager: agrees
    options = dataclasses.replace(arch_check.CheckOptions(), system="inductor", lifecycle="off")
    result = arch_check.check_model("llama", llama, llama_inputs, options).result
    assert (result.status, result.modules) == ("pass", [])


def test_only_compilers_are_localised_alone():
    assert not systems.get("fusion").localise_alone
    assert (
        systems.get("inductor").localise_alone and systems.get("inductor-freezing").localise_alone
    )


@pytest.mark.slow
def test_inductor_compiles_a_tiny_llama_and_passes_the_parity_oracle():
    """End to end, in process: build, torch.compile (Inductor), the three forwards, judged."""
    options = arch_check.CheckOptions(system="inductor", lifecycle="quick")
    result = arch_check.check_architecture("llama", options).result
    assert (result.status, result.system) == ("pass", "inductor"), result.message
    assert result.message.startswith("compiled: 1 graph(s)")
    assert result.fused_error is not None and result.fused_error <= result.tolerance
    assert {v["verdict"] for v in result.lifecycle.values()} == {"n/a"}


def test_liger_runs_the_lifecycle_operations_of_a_liger_user_and_names_its_diagnostics():
    system = systems.get("liger")
    assert system.lifecycle and system.lifecycle_operations == (
        "generate",
        "train",
        "save-pretrained",
    )
    assert set(system.lifecycle_operations) <= set(lifecycle.OPERATIONS)
    assert system.diagnostics == ("liger_kernel",) and not system.golden
    assert system.unapplied() == ""  # nothing applied yet: nothing to say
    assert systems.get("fusion").unapplied() == ""  # the default: never not-applied
