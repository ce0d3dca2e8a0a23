"""harness.peers.liger_apply: Liger's entry point applied, scoped to the patched model, and
judged. Without liger-kernel: the scoping, restoring and not-applied logic on hand-made
patches (what Liger's apply functions do, in miniature). With it: its table kept in step with
our data, every global restored after a real apply, and the CI selection (one dense, one MoE
model) judged end to end in a subprocess under Triton's interpreter."""

from __future__ import annotations

import configparser
import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import MethodType

import pytest
import torch
import torch.nn.functional as F
from transformers.models.granite import modeling_granite
from transformers.models.llama import modeling_llama

import corpus
from fusion.report import Applied
from harness.peers import liger_apply, triton_interpreter
from harness.peers.liger_apply import Application, NotRegistered
from harness.peers.liger_globals import Change, Changes
from harness.runner import arch_check

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
needs_liger = pytest.mark.skipif(
    not HAS_LIGER,
    reason=f"liger-kernel is not installed (pip install liger-kernel=={liger_apply.LIGER_VERSION})",
)
ROOT = Path(__file__).resolve().parents[3]
CI_SELECTION = ("llama", "qwen3_moe")


@pytest.fixture(autouse=True)
def _no_shims_left():
    """`apply` installs the interpreter shims for the worker's lifetime (under
    TRITON_INTERPRET=1); a test worker runs other Triton tests after these."""
    yield
    triton_interpreter.SHIMS.reset()


def _llama():
    model = corpus.build("llama", seed=0, dtype=torch.float32, device="cpu").eval()
    return model, corpus.make_inputs(model, seed=0)


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


# ------------------------------------------------------------- hand-made patches, no Liger


class LigerRMSNorm:
    """Liger's class name on a torch forward (Llama's own math): family rms_norm, exact, and
    none of Liger's kernels ever launch."""

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def test_a_patch_scoped_to_its_model_and_restored(monkeypatch):
    modeling = sys.modules[type(_llama()[0]).__module__]
    original = modeling.apply_rotary_pos_emb
    calls = []

    def rope(q, k, cos, sin, *args, **kwargs):
        calls.append(1)
        return original(q, k, cos, sin, *args, **kwargs)

    def fake_apply(model):
        modeling.apply_rotary_pos_emb = rope

    monkeypatch.setattr(liger_apply, "registry", lambda: {"llama": fake_apply})
    unfused, inputs = _llama()
    patched, _ = _llama()
    before = _logits(unfused, inputs)
    app = liger_apply.apply(patched)
    assert modeling.apply_rotary_pos_emb is original  # restored at once
    assert [c.where() for c in app.changes.changes] == ["modeling_llama.apply_rotary_pos_emb"]
    assert torch.equal(_logits(unfused, inputs), before) and not calls  # unfused: untouched
    assert torch.equal(_logits(patched, inputs), before) and calls  # patched: Liger's rope
    assert modeling.apply_rotary_pos_emb is original  # and put back after its forward
    assert app.unapplied() == "no Liger Triton kernel launched in the patched model's forward"


def test_not_applied_when_the_patch_changes_nothing(monkeypatch):
    monkeypatch.setattr(liger_apply, "registry", lambda: {"llama": lambda model: None})
    model, inputs = _llama()
    app = liger_apply.apply(model)
    _logits(model, inputs)
    assert app.unapplied() == "apply_liger_kernel_to_llama changed no module and no global"


def test_check_model_fails_a_patch_whose_kernels_never_launch(monkeypatch):
    def fake_apply(model):  # binds a forward by Liger's class name; it launches nothing
        norm = model.model.norm
        norm.__dict__["forward"] = MethodType(LigerRMSNorm.forward, norm)

    monkeypatch.setattr(liger_apply, "registry", lambda: {"llama": fake_apply})
    model, inputs = _llama()
    options = arch_check.CheckOptions(system="liger", lifecycle="off")
    result = arch_check.check_model("llama", model, inputs, options).result
    assert result.status == "fail"
    assert result.message.startswith("not-applied: no Liger Triton kernel launched")
    assert result.failures[0].kind == "not-applied"
    assert result.applied == {"liger:rms_norm": 1}


def test_an_unregistered_type_is_an_apply_error(monkeypatch):
    monkeypatch.setattr(liger_apply, "registry", lambda: {"llama": lambda model: None})
    model = corpus.build("gpt2", seed=0, dtype=torch.float32, device="cpu")
    with pytest.raises(NotRegistered, match="no apply function for model type 'gpt2'"):
        liger_apply.apply(model)


def test_unapplied_names_a_family_whose_kernels_never_launched():
    app = Application("llama")
    app.report.applied.append(Applied("model.norm", "liger:rms_norm", "LlamaRMSNorm", ""))
    app.changes = Changes([Change(object, "apply_rotary_pos_emb", None, None)])
    app.launches = Counter({"liger_kernel.ops.rms_norm._rms_norm_forward_kernel": 3})
    assert app.unapplied() == "Liger applied rope but launched none of its kernels"
    app.launches["liger_kernel.ops.rope._triton_rope"] = 2
    assert app.unapplied() == ""
    assert "5 kernel launch(es)" in app.summary()


def test_unavailable_without_a_gpu_or_the_interpreter(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the interpreter is not required")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "TRITON_INTERPRET=1" in liger_apply.unavailable()


def test_family_of_reads_the_bound_function():
    norm = torch.nn.Identity()
    assert liger_apply.family_of(MethodType(LigerRMSNorm.forward, norm)) == "rms_norm"

    class LigerFalconH1SwiGLUMLP:
        def forward(self):
            pass

    def multimodal_forward(self):
        pass

    multimodal_forward.__module__ = "liger_kernel.transformers.model.gemma3"
    assert liger_apply.family_of(LigerFalconH1SwiGLUMLP.forward) == "swiglu"
    assert liger_apply.family_of(multimodal_forward) == "fused_linear_cross_entropy"
    assert liger_apply.family_of(lambda self: None) == "<lambda>"


# ------------------------------------------------------------- the installed liger-kernel


def _tox_selection() -> list[str]:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(ROOT / "tox.ini")
    command = parser["testenv:liger-system"]["commands"]
    line = next(line for line in command.splitlines() if "--system liger" in line)
    return line.split("--arch", 1)[1].split("}")[0].split()


@needs_liger
def test_our_data_is_in_step_with_the_installed_table():
    table = liger_apply.registry()
    ours = set(liger_apply.IN_CORPUS) | set(liger_apply.NOT_IN_CORPUS)
    assert set(table) == ours, "liger-kernel's MODEL_TYPE_TO_APPLY_LIGER_FN changed"
    assert not set(liger_apply.IN_CORPUS) & set(liger_apply.NOT_IN_CORPUS)
    names = set(corpus.architectures())
    assert set(liger_apply.IN_CORPUS) <= names
    assert not set(liger_apply.NOT_IN_CORPUS) & names
    assert sorted(_tox_selection()) == sorted(liger_apply.IN_CORPUS)


@needs_liger
def test_a_real_apply_restores_every_global_it_patched():
    names = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")
    before = {name: getattr(modeling_llama, name) for name in names}
    forward, ce = modeling_llama.LlamaForCausalLM.forward, F.cross_entropy
    model, inputs = _llama()
    reference = _logits(model, inputs)
    app = liger_apply.apply(_llama()[0])
    assert {c.name for c in app.changes.changes} >= set(names)
    assert {name: getattr(modeling_llama, name) for name in names} == before
    assert modeling_llama.LlamaForCausalLM.forward is forward
    fresh, _ = _llama()  # the next architecture of this worker: Transformers' own classes
    assert type(fresh.model.norm) is before["LlamaRMSNorm"]
    assert torch.equal(_logits(fresh, inputs), reference)
    granite = corpus.build("granite", seed=0, dtype=torch.float32, device="cpu")
    rope = modeling_granite.apply_rotary_pos_emb
    liger_apply.apply(granite)  # Granite's default patches torch's cross-entropy
    assert F.cross_entropy is ce and modeling_granite.apply_rotary_pos_emb is rope


@needs_liger
def test_ci_selection_dense_and_moe_judged_end_to_end(tmp_path):
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    results = tmp_path / "liger.jsonl"
    command = [sys.executable, "-m", "harness", "run", "--system", "liger", "-j", "1"]
    command += ["--arch", *CI_SELECTION, "--results", str(results)]
    command += ["--repro-dir", str(tmp_path / "bundles")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    rows = {row["architecture"]: row for row in rows if "architecture" in row}
    assert set(rows) == set(CI_SELECTION), done.stdout[-2000:] + done.stderr[-2000:]
    for name, row in rows.items():
        assert row["fused_error"] <= row["tolerance"], name
        assert row["modules"] and all(m["status"] == "pass" for m in row["modules"]), name
        assert {
            op: v["verdict"] for op, v in row["lifecycle"].items() if v["verdict"] != "n/a"
        } == {
            "generate": "pass",
            "train": "pass",
            "save-pretrained": "pass",
        }, name
        assert "kernel launch(es) (" in row["message"], name  # Liger's kernels ran
        # The one known finding (Liger 0.8.5 on Transformers 5.24): its lce_forward passes the
        # deprecated `past_key_values`. Anything else fails this test.
        kinds = {f["kind"] for f in row["failures"]}
        assert kinds <= {"fused-warning"}, (name, row["message"])
        assert all("deprecated" in f["message"] for f in row["failures"]), name
