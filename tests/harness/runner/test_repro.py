"""harness.runner.repro: write a bundle, replay it (reproduces / fixed), reject malformed bundles."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.runner import repro
from harness.runner.arch_check import CheckOptions, check_model
from tests.harness.fakes import FAKE_FUSER, faulty_fuse, raising_change

REPO = Path(__file__).resolve().parents[3]
MLP0 = "model.layers.0.mlp"

OFF = CheckOptions(lifecycle="off")
"""Options for checks of fake fusers: they rebind forwards with closures, which the
lifecycle checks (tests/harness/oracles/test_lifecycle.py) rightly fail."""


def _bundles(llama, inputs, root: Path, fuse) -> list[Path]:
    checked = check_model("llama", llama, inputs, OFF, fuse=fuse)
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
    assert set(fields) == set(repro.FIELDS) | set(repro.OPTIONAL_FIELDS)
    assert fields["system"] == "fusion"
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
    from harness.base.results import Failure
    from harness.runner.arch_check import Subject

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
        (lambda f: f.update(system=3), "field 'system' must be str, found int"),
        (lambda f: f.update(system="tvm"), "field 'system' must be one of"),
        (lambda f: "{not json", "not valid JSON"),
        (lambda f: "[1, 2]", "expected a JSON object"),
    ],
)
def test_malformed_bundles_are_clear_errors(module_bundle, tmp_path, capsys, edit, message):
    corrupt = _corrupt(module_bundle, tmp_path, edit)
    with pytest.raises(repro.BundleError, match=re.escape(message)):
        repro.load_bundle(corrupt)
    assert repro.replay_main(corrupt) == 2
    assert message in capsys.readouterr().err


def test_a_bundle_without_a_system_is_fusion_and_one_with_replays_under_it(module_bundle, tmp_path):
    """Bundles written before systems existed have no `system` field: fusion's."""
    old = repro.load_bundle(_corrupt(module_bundle, tmp_path, lambda f: f.pop("system") and None))
    assert old.system == old.options.system == "fusion"
    assert "system" not in old.where()
    other = tmp_path / "other"
    other.mkdir()
    fields = {**json.loads((module_bundle / "bundle.json").read_text()), "system": "inductor"}
    (other / "bundle.json").write_text(json.dumps(fields))
    bundle = repro.load_bundle(other)
    assert bundle.options.system == "inductor" and "(system inductor)" in bundle.where()


def test_missing_bundle_json_and_missing_directory(tmp_path):
    with pytest.raises(repro.BundleError, match=r"bundle\.json: missing"):
        repro.load_bundle(tmp_path)
    with pytest.raises(repro.BundleError, match="not a directory"):
        repro.load_bundle(tmp_path / "nope")


def test_a_config_that_no_longer_builds_is_a_bundle_error(module_bundle, tmp_path, capsys):
    corrupt = _corrupt(module_bundle, tmp_path, lambda f: f.update(model_type="no-such-model"))
    assert repro.replay_main(corrupt) == 2
    assert "cannot rebuild the model" in capsys.readouterr().err


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


@pytest.mark.slow  # two replay subprocesses: tens of seconds
def test_repro_script_exit_status(module_bundle):
    broken = _run_script(module_bundle, plugins="tests.harness.plugin_faulty_fusion")
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "REPRODUCES" in broken.stdout
    fixed = _run_script(module_bundle)  # real fusion.fuse: the fault is not there
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "does not reproduce" in fixed.stdout


# --- bundles are untrusted input -----------------------------------------------------------


def _edited(module_bundle: Path, tmp_path: Path, edit) -> Path:
    """A copy of the bundle directory with bundle.json edited by `edit(fields)`."""
    copy = tmp_path / "edited"
    copy.mkdir(parents=True)
    fields = json.loads((module_bundle / "bundle.json").read_text())
    edit(fields)
    (copy / "bundle.json").write_text(json.dumps(fields))
    return copy


def _replay_refused(bundle: Path, capsys, message: str) -> str:
    """Replay must exit 2 (never 1, "reproduces") with `message` on stderr, building nothing."""
    assert repro.replay_main(bundle) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusion-harness: error: ") and message in err, err
    assert err.count("\n") == 1
    return err


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        # {}: Transformers' defaults, a 7B-parameter model (27 GB) before this check
        (lambda f: f.update(config={}), "not a tiny model"),
        (lambda f: f["config"].update(vocab_size=50_000_000), "vocab_size is 50000000"),
        (lambda f: f["config"].update(num_hidden_layers=4000), "num_hidden_layers is 4000"),
        (lambda f: f.update(batch=1_000_000), "field 'batch' must be between 1 and"),
        (lambda f: f.update(seq=10**9), "field 'seq' must be between 1 and"),
        (lambda f: f.update(seed=-1), "field 'seed' must be between"),
        (lambda f: f.update(device="cuda; rm -rf /"), "field 'device' must be cpu"),
    ],
)
def test_sizes_beyond_a_tiny_model_are_refused(module_bundle, tmp_path, capsys, edit, message):
    _replay_refused(_edited(module_bundle, tmp_path, edit), capsys, message)


def test_a_model_too_big_under_names_the_rules_do_not_know(module_bundle, tmp_path, monkeypatch):
    monkeypatch.setattr(repro, "MAX_PARAMETERS", 1000)  # the tiny llama has far more
    bundle = repro.load_bundle(module_bundle)
    with pytest.raises(repro.BundleError, match="parameters, more than the 1,000"):
        repro.rebuild(bundle)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda f: f["config"].update(_attn_implementation="kernels-community/flash-attn"),
            'config._attn_implementation: "kernels-community/flash-attn" refused',
        ),
        (
            lambda f: f["config"].update(attn_implementation="flash_attention_2"),
            "config.attn_implementation",
        ),
        (lambda f: f["config"].update(auto_map={"AutoModel": "x.Y"}), "config.auto_map: refused"),
        (lambda f: f["config"].update(trust_remote_code=True), "config.trust_remote_code"),
        (
            lambda f: f["config"].update(quantization_config={"quant_method": "bitsandbytes"}),
            "config.quantization_config",
        ),
        (
            lambda f: f["config"].update(text_config={"_experts_implementation": "org/kernels"}),
            "config.text_config._experts_implementation",
        ),
        (lambda f: f["config"].update(_name_or_path="https://x.test/m"), "a URL in a config"),
    ],
)
def test_config_fields_that_load_code_or_reach_the_network_are_refused(
    module_bundle, tmp_path, capsys, edit, message
):
    """Before: config fields reached Transformers unfiltered, `_attn_implementation` as far
    as the Hub kernel loader."""
    _replay_refused(_edited(module_bundle, tmp_path, edit), capsys, message)


def test_builtin_implementations_are_allowed(module_bundle, tmp_path):
    for value in ("eager", "sdpa", None):
        edited = _edited(
            module_bundle,
            tmp_path / str(value),
            lambda f, v=value: f["config"].update(_attn_implementation=v),
        )
        repro.load_bundle(edited)


def test_bundle_json_must_be_a_small_regular_file(module_bundle, tmp_path, capsys):
    """Before: a symlink to /dev/zero read until MemoryError, a FIFO hung, both exiting 1."""
    link = tmp_path / "link"
    link.mkdir()
    (link / "bundle.json").symlink_to("/dev/zero")
    _replay_refused(link, capsys, "a symbolic link")

    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "bundle.json")
    _replay_refused(fifo, capsys, "not a regular file")  # returns at once: no writer needed

    big = tmp_path / "big"
    big.mkdir()
    (big / "bundle.json").write_bytes(b" " * (repro.MAX_BUNDLE_BYTES + 1))
    _replay_refused(big, capsys, "more than the")

    directory = tmp_path / "directory"
    (directory / "bundle.json").mkdir(parents=True)
    _replay_refused(directory, capsys, "not a regular file")


def test_deeply_nested_json_is_a_clear_error(tmp_path, capsys):
    """Before: a RecursionError traceback, exit 1."""
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "bundle.json").write_text("[" * 100_000 + "]" * 100_000)
    _replay_refused(deep, capsys, "nested too deeply")
    shallow_but_deep = tmp_path / "deep2"
    shallow_but_deep.mkdir()
    (shallow_but_deep / "bundle.json").write_text('{"a":' * 50 + "1" + "}" * 50)
    _replay_refused(shallow_but_deep, capsys, "nested more than")


def test_untrusted_strings_are_printed_escaped(module_bundle, tmp_path, capsys):
    """Before: terminal escape sequences in `error`/`architecture` reached the terminal raw."""
    evil = "\x1b]0;pwned\x07\x1b[2J\x1b[31mred\u202e"

    def edit(f):
        f["architecture"] = "llama" + evil
        f["error"] = "boom" + evil

    edited = _edited(module_bundle, tmp_path, edit)
    code = repro.replay_main(edited, fuse=faulty_fuse(MLP0))
    captured = capsys.readouterr()
    assert code in (0, 1)
    printed = captured.out + captured.err
    assert "\x1b" not in printed and "\x07" not in printed and "\u202e" not in printed
    assert "\\x1b]0;pwned\\x07" in printed and "\\u202e" in printed


def test_a_replay_that_breaks_is_exit_2_never_1(module_bundle, capsys, monkeypatch):
    """Exit 1 means only "reproduces": an unexpected error in replay is 2, with one line."""

    def broken(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(repro, "replay", broken)
    _replay_refused(module_bundle, capsys, "replay of")


def test_every_corpus_config_is_within_the_bundle_bounds():
    """The bounds refuse no bundle the harness itself writes (every corpus architecture)."""
    import corpus

    checked = 0
    for name in corpus.architectures():
        config = corpus.tiny_config(name)
        fields = json.loads(config.to_json_string(use_diff=False))
        repro.check_config_safety(fields)
        try:
            rebuilt = corpus.config_from_dict(config.model_type, fields)
        except Exception:  # a config that does not round-trip through JSON: no bundle either
            continue
        repro.check_config_sizes(rebuilt)
        bundle = repro.Bundle(Path("."), {"architecture": name})
        assert repro._count_parameters(bundle, rebuilt) <= repro.MAX_PARAMETERS, name
        checked += 1
    assert checked > 100
