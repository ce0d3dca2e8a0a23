"""harness.suites.pytest_plugin: a suite run with --fusion fuses each model once (the outer one,
after construction; after from_pretrained, not during it), records it per test, and the
comparison names what fusion broke."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from harness.suites import pytest_plugin

REPO = Path(__file__).resolve().parents[3]

SUITE = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)


def build():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()


def test_builds_one_model():
    model = build()
    ids = torch.arange(6)[None]
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_from_pretrained_loads_every_weight(tmp_path):
    model = build()
    model.save_pretrained(tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.arange(6)[None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_loading_info_names_the_returned_model(tmp_path):
    build().save_pretrained(tmp_path)
    from safetensors.torch import save_file

    # no weight at all on file (as Transformers' reload test does): every parameter missing
    save_file({"x": torch.zeros(1)}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded, info = LlamaForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert set(info["missing_keys"]) == {name for name, _ in loaded.named_parameters()}


def test_inspects_the_forward():
    attn = build().model.layers[0].self_attn
    assert attn.q_proj.out_features == 32  # a fused model keeps its projections
    if "forward" in vars(attn):
        raise LookupError("the attention's forward was rewritten on the instance")
"""


def _run(tmp_path: Path, outcomes: Path, *flags: str) -> subprocess.CompletedProcess:
    suite = tmp_path / "suite"
    suite.mkdir(exist_ok=True)
    (suite / "test_suite.py").write_text(SUITE)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "harness.pytest_fusion",
            "--fusion-outcomes",
            str(outcomes),
            *flags,
            str(suite),
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _outcomes(path: Path) -> dict[str, dict]:
    return {
        json.loads(line)["test"].rpartition("::")[2]: json.loads(line)
        for line in path.read_text().splitlines()
    }


def test_fused_run_records_and_compares(tmp_path, capsys):
    base_file, fused_file = tmp_path / "base.jsonl", tmp_path / "fused.jsonl"
    base = _run(tmp_path, base_file)
    assert base.returncode == 0, base.stdout + base.stderr
    fused = _run(tmp_path, fused_file, "--fusion", "--fusion-backend", "torch")
    assert fused.returncode == 1, fused.stdout + fused.stderr
    got = _outcomes(fused_file)
    built = got["test_builds_one_model"]
    assert built["outcome"] == "passed"
    # once per model, the outer one only (LlamaModel is built inside LlamaForCausalLM)
    assert [(r["model"], r["when"]) for r in built["fusions"]] == [
        ("LlamaForCausalLM", "constructed")
    ]
    assert built["fusions"][0]["applied"]["qkv"] == 1
    loaded = got["test_from_pretrained_loads_every_weight"]
    assert loaded["outcome"] == "passed"  # fused after loading: every weight arrived
    assert ("LlamaForCausalLM", "from_pretrained") in [
        (r["model"], r["when"]) for r in loaded["fusions"]
    ]
    assert got["test_inspects_the_forward"]["outcome"] == "failed"
    assert all(o["fusions"] == [] for o in _outcomes(base_file).values())

    assert pytest_plugin.main([str(base_file), str(fused_file)]) == 1
    out = capsys.readouterr().out
    assert got["test_loading_info_names_the_returned_model"]["outcome"] == "passed"
    assert "4 tests pass unfused; 1 of them fail fused" in out
    assert "1 x LookupError: the attention's forward was rewritten on the instance" in out
    assert (
        "test_inspects_the_forward" in out
        and "test_builds_one_model" not in out.split("\n\n", 1)[1]
    )


def test_compare_groups_by_cause():
    base = {t: {"outcome": "passed"} for t in ("a", "b", "c", "d")}
    fused = {
        "a": {"outcome": "failed", "cause": "KeyError: x"},
        "b": {"outcome": "failed", "cause": "KeyError: x"},
        "c": {"outcome": "passed"},
        "d": {"outcome": "failed", "cause": "TypeError: y"},
        "e": {"outcome": "failed", "cause": "new test"},
    }
    assert pytest_plugin.compare(base, fused) == {"KeyError: x": ["a", "b"], "TypeError: y": ["d"]}


def test_outcomes_under_xdist_are_written_by_the_controller(tmp_path):
    """Before: every xdist process wrote the file, the controller last and empty."""
    fused_file = tmp_path / "fused.jsonl"
    fused = _run(tmp_path, fused_file, "--fusion", "--fusion-backend", "torch", "-n", "2")
    assert fused.returncode == 1, fused.stdout + fused.stderr
    got = _outcomes(fused_file)
    assert got["test_builds_one_model"]["outcome"] == "passed"
    assert got["test_builds_one_model"]["fusions"][0]["applied"]["qkv"] == 1
    failed = got["test_inspects_the_forward"]
    assert failed["outcome"] == "failed" and failed["cause"].startswith("LookupError: ")
