"""harness.runner.arch_check: one architecture end to end, every failure kind recorded and localised."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import fusion
from fusion import Skipped
from harness.runner import arch_check
from harness.runner.arch_check import CheckOptions, check_architecture, check_model
from tests.harness.fakes import FAKE_FUSER, faulty_fuse, nan_change, raising_change

MLP0 = "model.layers.0.mlp"

OFF = CheckOptions(lifecycle="off")
"""Options for checks of fake fusers: they rebind forwards with closures, which the
lifecycle checks (tests/harness/oracles/test_lifecycle.py) rightly fail."""


def _check(llama, inputs, fuse):
    return check_model("llama", llama, inputs, OFF, fuse=fuse).result


def test_real_fusion_of_llama_passes():
    result = check_architecture("llama", CheckOptions()).result
    assert result.status == "pass", result.message
    assert result.built and result.ran
    assert result.fused_error <= result.tolerance
    assert all(m.status == "pass" for m in result.modules)
    assert sum(result.applied.values()) == len(result.modules)


def test_a_rewrite_that_changes_nothing_passes(llama, llama_inputs):
    result = _check(llama, llama_inputs, faulty_fuse(MLP0, change=lambda o: o))
    assert result.status == "pass"
    assert result.applied == {FAKE_FUSER: 1}


def test_a_broken_fused_module_is_caught_and_localised(llama, llama_inputs):
    result = _check(llama, llama_inputs, faulty_fuse(MLP0))
    assert result.status == "fail"
    assert result.fused_error > result.tolerance
    kinds = {f.kind: f for f in result.failures}
    assert set(kinds) == {"model-parity", "module-parity"}
    module = kinds["module-parity"]
    assert (module.qualname, module.fuser, module.source_class) == (MLP0, FAKE_FUSER, "LlamaMLP")
    assert module.observed > module.tolerance
    assert MLP0 in result.message and "LlamaMLP" in result.message


def test_only_the_broken_module_fails(llama, llama_inputs):
    def fuse(model):
        report = faulty_fuse("model.layers.1.mlp", change=lambda o: o)(model)
        report.applied += faulty_fuse(MLP0)(model).applied
        return report

    result = _check(llama, llama_inputs, fuse)
    verdicts = {m.qualname: m.status for m in result.modules}
    assert verdicts == {"model.layers.1.mlp": "pass", MLP0: "fail"}


def test_a_real_fused_module_with_a_perturbed_weight_is_caught(llama, llama_inputs):
    broken = []

    def fuse_then_break(model):
        report = fusion.fuse(model)
        if not report.applied:
            pytest.skip("fusion.fuse applies nothing to llama yet")
        broken.append(report.applied[-1])
        weight = next(model.get_submodule(broken[0].qualname).parameters())
        with torch.no_grad():
            weight.view(-1)[0] += 1.0
        return report

    result = _check(llama, llama_inputs, fuse_then_break)
    assert result.status == "fail"
    failed = [m for m in result.modules if m.status == "fail"]
    assert [(m.qualname, m.fuser) for m in failed] == [(broken[0].qualname, broken[0].fuser)]


def test_nan_never_passes(llama, llama_inputs):
    result = _check(llama, llama_inputs, faulty_fuse(MLP0, change=nan_change))
    assert result.status == "fail"
    assert math.isnan(result.fused_error)
    assert any("not finite" in f.message for f in result.failures)


def test_a_fused_forward_that_raises_names_the_module(llama, llama_inputs):
    result = _check(llama, llama_inputs, faulty_fuse(MLP0, change=raising_change))
    assert result.status == "fused-error"
    kinds = [f.kind for f in result.failures]
    assert kinds == ["fused-forward-error", "module-error"]
    assert result.failures[1].qualname == MLP0
    assert "fused kernel exploded" in result.failures[1].message


def test_fuse_raising_is_recorded(llama, llama_inputs):
    def fuse(model):
        raise TypeError("fuser bug")

    result = _check(llama, llama_inputs, fuse)
    assert result.status == "fuse-error"
    assert result.message == "TypeError: fuser bug"
    assert result.failures[0].kind == "fuse-error"
    assert "fuser bug" in result.failures[0].detail


def test_a_model_that_does_not_run_is_a_forward_error(llama, llama_inputs):
    inputs = {**llama_inputs, "input_ids": llama_inputs["input_ids"] + 10**6}  # out of vocab
    result = check_model("llama", llama, inputs, OFF, fuse=faulty_fuse(MLP0)).result
    assert result.status == "forward-error"
    assert result.message.startswith("unfused model does not run: IndexError")
    assert result.applied == {FAKE_FUSER: 1}  # fusion still reported


def test_unknown_architecture_is_a_build_error_naming_it():
    result = check_architecture("no-such-architecture", CheckOptions()).result
    assert result.status == "build-error"
    assert "no-such-architecture" in result.message
    assert not result.built


def test_the_unfused_model_is_left_unfused(llama, llama_inputs):
    check_model("llama", llama, llama_inputs, CheckOptions())
    assert hasattr(llama.model.layers[0].mlp, "gate_proj")


def test_subject_holds_a_json_config_and_the_applied_records(llama, llama_inputs):
    checked = check_model("llama", llama, llama_inputs, OFF, fuse=faulty_fuse(MLP0))
    subject = checked.subject
    assert subject.model_type == "llama"
    assert subject.config["hidden_size"] == llama.config.hidden_size
    assert [a.qualname for a in subject.applied] == [MLP0]


def test_signature_folds_numbers_and_addresses():
    a = arch_check.signature("module-error", "qkv", "X", "shape [2, 6] at 0x7f00aa != 4")
    b = arch_check.signature("module-error", "qkv", "X", "shape [3, 7] at 0x7f00bb != 8")
    assert a == b
    assert a != arch_check.signature("module-error", "glu", "X", "shape [2, 6] at 0x7f00aa != 4")


def test_refusals_are_grouped_with_counts():
    skipped = [
        Skipped("a.0", "qkv", "Attn", "aliasing"),
        Skipped("a.1", "qkv", "Attn", "aliasing"),
        Skipped("m.0", None, "MLP", "no pattern"),
    ]
    groups = arch_check.group_refusals(skipped)
    assert [(g.fuser, g.count, g.example) for g in groups] == [("qkv", 2, "a.0"), (None, 1, "m.0")]


def test_options_reject_unknown_dtype():
    with pytest.raises(ValueError, match="float8"):
        _ = CheckOptions(dtype="float8").torch_dtype


def _warning_change(output):
    warnings.warn("fused path took a detour", UserWarning, stacklevel=1)
    return output


def test_a_warning_only_the_fused_model_raises_fails(llama, llama_inputs):
    """Same logits, but the fused forward warns where the unfused one does not: a user sees
    the difference, so it is a verdict, recorded per line, with the unfused model's own
    warnings kept apart."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # as the sweep's workers run
        result = _check(llama, llama_inputs, faulty_fuse(MLP0, change=_warning_change))
    assert result.status == "fail", result.message
    assert "only the fused model warns: UserWarning: fused path took a detour" in result.message
    assert result.warnings == {"fused-only": ["UserWarning: fused path took a detour"]}
    assert [f.kind for f in result.failures] == ["fused-warning"]


def test_warnings_both_models_raise_are_recorded_not_judged(llama, llama_inputs):
    handle = llama.model.layers[0].mlp.register_forward_hook(
        lambda module, args, output: _warning_change(output)
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = _check(llama, llama_inputs, faulty_fuse(MLP0, change=lambda o: o))
    finally:
        handle.remove()
    assert result.status == "pass", result.message
    assert result.warnings["unfused"] == ["UserWarning: fused path took a detour"]
    assert "fused-only" not in result.warnings
