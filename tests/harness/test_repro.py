"""harness.repro: write a bundle, replay it (reproduces / fixed), reject malformed bundles."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import repro
from harness.check import CheckOptions, check_model
from tests.harness.fakes import FAKE_FUSER, faulty_fuse, raising_change

REPO = Path(__file__).resolve().parents[2]
MLP0 = "model.layers.0.mlp"


def _bundles(llama, inputs, root: Path, fuse) -> list[Path]:
    checked = check_model("llama", llama, inputs, CheckOptions(), fuse=fuse)
    result = repro.write_bundles(checked.result, checked.subject, root)
    return [Path(f.bundle) for f in result.failures]


@pytest.fixture
def module_bundle(llama, llama_inputs, tmp_path) -> Path:
    paths = _bundles(llama, llama_inputs, tmp_path, faulty_fuse(MLP0))
    (module,) = [p for p in paths if "module-parity" in p.name]
    return module


def test_bundle_contents(module_bundle):
    files = sorted(os.listdir(module_bundle))
    assert files == ["bundle.json", "forward.diff", "original.py", "repro.py", "rewritten.py"]
    fields = json.loads((module_bundle / "bundle.json").read_text())
    assert set(fields) == set(repro.FIELDS)
    assert fields["architecture"] == "llama"
    assert (fields["kind"], fields["qualname"], fields["fuser"]) == (
        "module-parity",
        MLP0,
        FAKE_FUSER,
    )
    assert fields["source_class"] == "LlamaMLP"
    assert fields["observed"] > fields["tolerance"] > 0
    assert fields["config"]["model_type"] == "llama"
    assert set(fields["versions"]) >= {"torch", "transformers", "python"}
    assert (
        "+        return  # output scaled by 1.01" in (module_bundle / "forward.diff").read_text()
    )
    for name in files:  # text only: nothing to unpickle
        (module_bundle / name).read_text(encoding="utf-8")


def test_replay_reproduces_while_the_bug_is_there(module_bundle):
    bundle = repro.load_bundle(module_bundle)
    outcome = repro.replay(bundle, fuse=faulty_fuse(MLP0))
    assert outcome.reproduces
    assert outcome.now.qualname == MLP0
    assert repro.replay_main(module_bundle, fuse=faulty_fuse(MLP0)) == 1


def test_replay_does_not_reproduce_once_fixed(module_bundle, capsys):
    fixed = faulty_fuse(MLP0, change=lambda out: out)
    assert repro.replay_main(module_bundle, fuse=fixed) == 0
    assert "does not reproduce (now: pass" in capsys.readouterr().out


def test_a_different_failure_elsewhere_is_not_this_one(module_bundle):
    elsewhere = faulty_fuse("model.layers.1.mlp")
    assert not repro.replay(repro.load_bundle(module_bundle), fuse=elsewhere).reproduces


def test_exceptions_are_bundled_with_their_traceback(llama, llama_inputs, tmp_path):
    paths = _bundles(llama, llama_inputs, tmp_path, faulty_fuse(MLP0, change=raising_change))
    kinds = {json.loads((p / "bundle.json").read_text())["kind"]: p for p in paths}
    assert set(kinds) == {"fused-forward-error", "module-error"}
    fields = json.loads((kinds["module-error"] / "bundle.json").read_text())
    assert fields["error"] == "RuntimeError: fused kernel exploded on shape 2x6"
    assert "raising_change" in fields["detail"]
    assert fields["observed"] is None


def test_identical_failures_share_one_bundle(llama, llama_inputs, tmp_path):
    both_layers = faulty_fuse([MLP0, "model.layers.1.mlp"])
    paths = _bundles(llama, llama_inputs, tmp_path, both_layers)
    assert len(paths) == 3  # model-parity + two module-parity failures ...
    assert len(set(paths)) == 2  # ... of one signature: one bundle for both layers
    again = _bundles(llama, llama_inputs, tmp_path, both_layers)
    assert set(again) == set(paths)
    assert len(os.listdir(tmp_path)) == 2


def test_a_model_without_config_gets_no_bundle(tmp_path):
    from harness.check import Subject
    from harness.results import Failure

    subject = Subject("x", None, None, CheckOptions())
    assert (
        repro.write_bundle(tmp_path, Failure("model-parity", None, None, None, "m"), subject)
        is None
    )


# --- malformed bundles -----------------------------------------------------------------------


def _corrupt(bundle: Path, tmp_path: Path, edit) -> Path:
    copy = tmp_path / "corrupt"
    copy.mkdir()
    fields = json.loads((bundle / "bundle.json").read_text())
    text = edit(fields)
    (copy / "bundle.json").write_text(text if isinstance(text, str) else json.dumps(fields))
    return copy


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda f: f.pop("seed"), "field 'seed' is missing"),
        (lambda f: f.update(seed="0"), "field 'seed' must be int, found str"),
        (lambda f: f.update(seed=True), "field 'seed' must be int, found bool"),
        (lambda f: f.update(config=[]), "field 'config' must be dict, found list"),
        (lambda f: f.update(qualname=3), "field 'qualname' must be str or null"),
        (lambda f: f.update(kind="oops"), "field 'kind' must be one of"),
        (lambda f: f.update(dtype="float8"), "field 'dtype' must be one of"),
        (lambda f: f.update(format=99), "field 'format' is 99"),
        (lambda f: "{not json", "not valid JSON"),
        (lambda f: "[1, 2]", "expected a JSON object"),
    ],
)
def test_malformed_bundles_are_clear_errors(module_bundle, tmp_path, capsys, edit, message):
    corrupt = _corrupt(module_bundle, tmp_path, edit)
    with pytest.raises(repro.BundleError, match=re.escape(message)):
        repro.load_bundle(corrupt)
    assert repro.replay_main(corrupt) == 2
    assert message in capsys.readouterr().out


def test_missing_bundle_json_and_missing_directory(tmp_path):
    with pytest.raises(repro.BundleError, match=r"bundle\.json: missing"):
        repro.load_bundle(tmp_path)
    with pytest.raises(repro.BundleError, match="not a directory"):
        repro.load_bundle(tmp_path / "nope")


def test_a_config_that_no_longer_builds_is_a_bundle_error(module_bundle, tmp_path, capsys):
    corrupt = _corrupt(module_bundle, tmp_path, lambda f: f.update(model_type="no-such-model"))
    assert repro.replay_main(corrupt) == 2
    assert "cannot rebuild the model" in capsys.readouterr().out


# --- the standalone script -------------------------------------------------------------------


def _run_script(bundle: Path, plugins: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "FUSION_HARNESS_TEST_PLUGINS": plugins}
    return subprocess.run(
        [sys.executable, "repro.py"],
        cwd=bundle,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_repro_script_exit_status(module_bundle):
    broken = _run_script(module_bundle, plugins="tests.harness.plugin_faulty_fusion")
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "REPRODUCES" in broken.stdout
    fixed = _run_script(module_bundle)  # real fusion.fuse: the fault is not there
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "does not reproduce" in fixed.stdout
