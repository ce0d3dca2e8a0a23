"""harness.runner.own_model_check and `fusion-harness check PATH`: a user's own model, checked locally."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

import corpus
import fusion
from harness import cli
from harness.oracles import lifecycle
from harness.runner import own_model_check, own_model_memory
from harness.runner.arch_check import CheckOptions
from harness.runner.own_model_check import OwnModelError
from tests.harness.fakes import faulty_fuse

LLAMA_3_2_1B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-05,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
"""Llama-3.2-1B's sizes, written by hand (nothing is downloaded): 1,235,814,400 parameters."""

ARCHITECTURES = ("llama", "mixtral", "deepseek_v3")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """save_pretrained directories of the corpus's tiny llama, mixtral and deepseek_v3, built
    with seed 3 (the checks run with seed 0, so loaded weights differ from random ones)."""
    root = tmp_path_factory.mktemp("checkpoints")
    saved = {}
    for name in ARCHITECTURES:
        model = corpus.build(name, seed=3)
        model.save_pretrained(root / name)
        saved[name] = root / name
    return saved


def _write_config(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    file = directory / "config.json"
    file.write_text(json.dumps(config), encoding="utf-8")
    return file


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("fusion-harness check tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


# ---------------------------------------------------------------------------------------------
# Validation: only local paths, only plain configs


def test_a_path_that_does_not_exist_is_refused(tmp_path):
    with pytest.raises(OwnModelError, match="does not exist; fusion-harness check never downloads"):
        own_model_check.resolve_source(str(tmp_path / "missing"))


def test_a_hub_id_is_refused_saying_it_never_downloads(tmp_path, monkeypatch, no_network, capsys):
    monkeypatch.chdir(tmp_path)  # no local directory of that name
    with pytest.raises(OwnModelError, match=r"looks like a Hub model id.*never downloads"):
        own_model_check.resolve_source("meta-llama/Llama-3.2-1B")
    assert cli.main(["check", "meta-llama/Llama-3.2-1B", "--tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusion-harness: error: 'meta-llama/Llama-3.2-1B' looks like a Hub")
    assert "never downloads" in err


def test_a_local_directory_named_like_a_hub_id_is_used(tmp_path, monkeypatch, checkpoints):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "meta-llama").mkdir()
    (tmp_path / "meta-llama" / "Llama-3.2-1B").symlink_to(checkpoints["llama"])
    source = own_model_check.resolve_source("meta-llama/Llama-3.2-1B")
    assert source.config_file == checkpoints["llama"] / "config.json"
    assert [p.name for p in source.weights] == ["model.safetensors"]


def test_a_directory_without_config_json_is_refused(tmp_path):
    with pytest.raises(OwnModelError, match=r"has no config\.json"):
        own_model_check.resolve_source(str(tmp_path))


def test_pickled_weights_are_refused_not_replaced_by_random_ones(tmp_path):
    _write_config(tmp_path, LLAMA_3_2_1B)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(OwnModelError, match=r"only as pickles.*or use --tiny"):
        own_model_check.resolve_source(str(tmp_path))
    assert own_model_check.resolve_source(str(tmp_path), tiny=True).weights == ()  # loads none


def test_a_bare_config_file_is_a_source_without_weights(tmp_path):
    file = _write_config(tmp_path, LLAMA_3_2_1B)
    source = own_model_check.resolve_source(str(file))
    assert (source.config_file, source.weights, source.directory) == (file, (), None)


@pytest.mark.parametrize(
    ("extra", "phrase"),
    [
        ({"auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}, "custom code"),
        ({"trust_remote_code": True}, "custom code"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "can load code"),
        ({"_attn_implementation": "kernels-community/flash-attn"}, "refused"),
        ({"note": "see https://example.com/model"}, "a URL in a config"),
    ],
)
def test_configs_that_load_code_or_reach_the_network_are_refused(tmp_path, extra, phrase):
    file = _write_config(tmp_path, {**LLAMA_3_2_1B, **extra})
    with pytest.raises(OwnModelError, match=phrase):
        own_model_check.read_config_dict(file)


def test_auto_map_is_refused_by_the_command(tmp_path, capsys):
    _write_config(tmp_path, {**LLAMA_3_2_1B, "auto_map": {"AutoConfig": "x.XConfig"}})
    assert cli.main(["check", str(tmp_path), "--tiny"]) == 2
    assert "auto_map" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        ("[1, 2]", "expected a JSON object"),
        ("{not json", "not a JSON config"),
        ("[" * 40 + "]" * 40, "expected a JSON object"),
        ('{"a": ' + "[" * 20 + "]" * 20 + "}", "nested more than"),
    ],
)
def test_malformed_configs_are_refused(tmp_path, text, phrase):
    file = tmp_path / "config.json"
    file.write_text(text, encoding="utf-8")
    with pytest.raises(OwnModelError, match=phrase):
        own_model_check.read_config_dict(file)


@pytest.mark.parametrize(
    ("config", "phrase"),
    [
        ({"hidden_size": 8}, "has no model_type"),
        pytest.param(  # the corpus looks for the type among every class's configs: 7-12 s
            {"model_type": "no-such-model"},
            "unknown to the installed Transformers",
            marks=pytest.mark.slow,
        ),
        ({"model_type": "vit"}, "has no causal-LM class"),
    ],
)
def test_configs_the_check_cannot_run_are_refused(config, phrase):
    with pytest.raises(OwnModelError, match=phrase):
        own_model_check.load_config(config)


# ---------------------------------------------------------------------------------------------
# Tiny, size, memory


def test_tiny_shrinks_a_real_config_by_the_corpus_rules():
    config, arch = own_model_check.load_config(LLAMA_3_2_1B)
    tiny, reference = own_model_check.shrink_config(config, arch), corpus.tiny_config("llama")
    sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    sizes += ("num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")
    assert {s: getattr(tiny, s) for s in sizes} == {s: getattr(reference, s) for s in sizes}
    assert tiny.tie_word_embeddings and tiny.rms_norm_eps == 1e-05  # the user's, not shrunk
    assert config.hidden_size == 2048  # untouched


def test_parameters_are_counted_without_memory():
    config, arch = own_model_check.load_config(LLAMA_3_2_1B)
    assert own_model_check.count_parameters(config, arch) == 1_235_814_400


def test_memory_estimate_is_three_models_plus_the_lifecycle_peak():
    off = own_model_memory.estimate_memory(1000, "float32", "off")
    assert off.items == (("unfused", 4000), ("fused copy", 4000), ("float64 reference", 8000))
    assert (off.total, off.disk) == (16_000, 0)
    quick = own_model_memory.estimate_memory(1000, "bfloat16", "quick")
    assert quick.total == 2000 + 2000 + 8000 + own_model_memory.LIFECYCLE_COPIES * 2000 == 40_000
    assert quick.disk == 4000
    assert "40 kB for 1,000 parameters in bfloat16" in quick.format()
    assert "lifecycle peak (14 model copies) 28 kB" in quick.format()


def test_mem_available_is_read_from_meminfo(tmp_path):
    text = "MemTotal:       32000000 kB\nMemFree:  100 kB\nMemAvailable:   2048 kB\n"
    assert own_model_memory.parse_mem_available(text) == 2048 * 1024
    assert own_model_memory.parse_mem_available("MemTotal: 1 kB\n") is None
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(text, encoding="ascii")
    assert own_model_memory.available_memory("cpu", meminfo) == (2048 * 1024, "MemAvailable")
    assert own_model_memory.available_memory("cpu", tmp_path / "absent") is None


def test_an_estimate_over_the_available_memory_is_refused_unless_forced():
    estimate = own_model_memory.estimate_memory(1000, "float32", "off")  # 16 kB
    assert "MemAvailable 16 kB" in own_model_memory.check_memory(
        estimate, (16_000, "MemAvailable"), force=False
    )
    with pytest.raises(OwnModelError, match=r"would not fit.*--force"):
        own_model_memory.check_memory(estimate, (15_999, "MemAvailable"), force=False)
    assert own_model_memory.check_memory(estimate, (15_999, "MemAvailable"), force=True).endswith(
        "over it, --force"
    )
    with pytest.raises(OwnModelError, match="does not report its available memory"):
        own_model_memory.check_memory(estimate, None, force=False)
    with pytest.raises(OwnModelError, match="cannot estimate"):
        own_model_memory.check_memory(None, (10**12, "MemAvailable"), force=False)


def test_a_real_size_model_that_does_not_fit_is_refused_before_building(
    tmp_path, monkeypatch, capsys
):
    _write_config(tmp_path, LLAMA_3_2_1B)
    monkeypatch.setattr(
        own_model_memory, "available_memory", lambda device: (8 * 10**9, "MemAvailable")
    )
    monkeypatch.setattr(own_model_check, "build_model", _never_called)
    assert cli.main(["check", str(tmp_path), "--lifecycle", "off"]) == 2
    out, err = capsys.readouterr()
    assert "1,235,814,400 parameters; random weights (no safetensors weights" in out
    # 1,235,814,400 x (4 + 4 + 8) bytes
    assert "memory estimate 19.8 GB for 1,235,814,400 parameters in float32" in err
    assert "MemAvailable 8 GB: the check would not fit" in err


def _never_called(*args, **kwargs):
    raise AssertionError("built a model the memory estimate should have refused")


def test_checkpoint_weights_are_loaded_not_drawn(checkpoints):
    prepared = own_model_check.prepare(str(checkpoints["llama"]), tiny=False)
    assert prepared.checkpoint_weights and prepared.parameters == 106_816
    model, notes = own_model_check.build_model(prepared, CheckOptions(seed=0))
    saved = corpus.build("llama", seed=3).state_dict()
    assert notes == []
    assert model.state_dict().keys() == saved.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    random = own_model_check.build_model(
        own_model_check.prepare(str(checkpoints["llama"]), tiny=True), CheckOptions()
    )
    assert not torch.equal(random[0].model.norm.weight, saved["model.norm.weight"])


# ---------------------------------------------------------------------------------------------
# The command, in process


@pytest.mark.parametrize("tiny", [False, True], ids=["real-size", "tiny"])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_check_passes_a_saved_checkpoint(checkpoints, name, tiny, tmp_path, capsys, no_network):
    record = tmp_path / "result.json"
    argv = ["check", str(checkpoints[name]), "--lifecycle", "off", "--json", str(record)]
    argv += ["--repro-dir", str(tmp_path / "bundles"), *(["--tiny"] if tiny else [])]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    weights = "random weights (--tiny" if tiny else "checkpoint weights (model.safetensors)"
    assert f"checking {checkpoints[name]}: {name} (" in out and weights in out
    assert "memory estimate" in out and "fusion plan" in out
    (row,) = [line for line in out.splitlines() if line.startswith(f"{name} ")]
    assert row.split()[-5] == "pass", row
    document = json.loads(record.read_text(encoding="utf-8"))
    (result,) = document["results"]
    assert (result["architecture"], result["status"], document["exit_status"]) == (name, "pass", 0)
    assert document["options"]["source"]["weights"] == ("random" if tiny else "checkpoint")
    assert result["applied"] and result["versions"]["transformers"]
    assert not (tmp_path / "bundles").exists()


def test_check_of_a_bare_real_config_with_tiny_is_fast_and_green(tmp_path, capsys):
    file = _write_config(tmp_path, LLAMA_3_2_1B)
    assert cli.main(["check", str(file), "--tiny", "--lifecycle", "off"]) == 0
    out = capsys.readouterr().out
    # the corpus's tiny llama less its untied head (256 x 64): the user's tied embeddings kept
    assert "llama (LlamaForCausalLM, shrunk with the corpus rules (--tiny)), 90,432" in out


def test_a_fusion_failure_exits_1_with_a_repro_bundle(checkpoints, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fusion, "fuse", faulty_fuse("model.layers.0.mlp"))
    bundles = tmp_path / "bundles"
    argv = ["check", str(checkpoints["llama"]), "--lifecycle", "off", "--repro-dir", str(bundles)]
    assert cli.main(argv) == 1
    out, err = capsys.readouterr()
    assert "llama: fail: model.layers.0.mlp (LlamaMLP) [fake-glu]" in out
    written = sorted(bundles.iterdir())  # the module's failure and the logits'
    assert [b.name.split("--")[1] for b in written] == ["model-parity", "module-parity"]
    for bundle in written:
        assert f"repro bundle: {bundle}" in out
        assert json.loads((bundle / "bundle.json").read_text())["config"]["hidden_size"] == 64
    assert "note: a repro bundle rebuilds the model from its config with random weights" in out
    assert "exit 1: fusion failure(s) in llama" in err


def test_a_damaged_safetensors_file_is_named_with_its_problem(checkpoints, tmp_path, capsys):
    """Before: exit 3, blaming "the corpus cannot build ... llama", the reason only in stdout
    after the legend. A file that is not whole safetensors is unusable input: exit 2, one line
    naming it, before anything is built."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_bytes((checkpoints["llama"] / "config.json").read_bytes())
    weights = broken / "model.safetensors"
    for data, problem in (
        (b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage", "not a safetensors file (its header"),
        ((checkpoints["llama"] / "model.safetensors").read_bytes()[:-100], "truncated: "),
        (b"\x01\x02", "truncated: 2 bytes, not even a safetensors header"),
    ):
        weights.write_bytes(data)
        assert cli.main(["check", str(broken), "--lifecycle", "off"]) == 2
        out, err = capsys.readouterr()
        assert err.startswith(f"fusion-harness: error: {weights.resolve()}: {problem}"), err
        assert err.count("\n") == 1 and not out
    assert own_model_check.safetensors_problem(checkpoints["llama"] / "model.safetensors") is None
    # --tiny loads no weights: the damaged file does not matter there
    assert cli.main(["check", str(broken), "--tiny", "--lifecycle", "off"]) == 0


def test_a_checkpoint_that_does_not_load_is_a_corpus_style_problem(
    checkpoints, capsys, monkeypatch
):
    def refuse(*args, **kwargs):
        raise ValueError("this model does not load")

    monkeypatch.setattr(own_model_check, "build_model", refuse)
    assert cli.main(["check", str(checkpoints["llama"]), "--lifecycle", "off"]) == 3
    out, err = capsys.readouterr()
    assert "llama: build-error" in out
    assert "exit 3: no fusion failure" in err
    argv = ["check", str(checkpoints["llama"]), "--lifecycle", "off", "--strict-corpus"]
    assert cli.main(argv) == 1


def test_check_explains_itself(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["check", "--help"])
    assert exit_info.value.code == 0
    assert "nothing is ever downloaded" in " ".join(capsys.readouterr().out.split())


def test_check_with_the_lifecycle_passes_a_saved_llama(checkpoints, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the default repro-bundles/ directory
    assert cli.main(["check", str(checkpoints["llama"]), "--json", "r.json"]) == 0
    (result,) = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))["results"]
    verdicts = {op: v["verdict"] for op, v in result["lifecycle"].items()}
    assert set(verdicts.values()) <= {"pass", "n/a"}, result["lifecycle"]
    assert all(verdicts[op] == "pass" for op in ("generate", "train", "save-pretrained"))
    assert verdicts["compile"] == "n/a"  # quick: not compiled
    out, err = capsys.readouterr()
    assert "lifecycle peak (14 model copies)" in out
    # progress: one stderr line per step (not a terminal), every lifecycle operation run
    steps = [line.rsplit(", ", 1)[0] for line in err.splitlines() if line.startswith("check: ")]
    assert steps[0] == "check: loading the checkpoint's weights"
    ran = [op for op, v in result["lifecycle"].items() if v["detail"] != lifecycle.NOT_COMPILED]
    assert [s.split()[2] for s in steps if s.startswith("check: lifecycle ")] == ran
    assert not any(line.startswith("check: ") for line in out.splitlines())


# --- what users hold: Hub snapshot folders and GGUF files ---------------------------------------


def test_a_hub_cache_folder_checks_its_snapshot(checkpoints, tmp_path):
    """A `models--ORG--NAME` folder as the Hub cache lays it out: the snapshot `refs/main`
    names (symlinked files, as the cache has them), else the only one."""
    cache = tmp_path / "models--me--tiny-llama"
    snapshot = cache / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for file in checkpoints["llama"].iterdir():
        (snapshot / file.name).symlink_to(file)
    assert own_model_check.resolve_source(str(cache)).path == snapshot.resolve()
    (cache / "snapshots" / "def456").mkdir()
    with pytest.raises(OwnModelError, match=r"has no config\.json"):
        own_model_check.resolve_source(str(cache))  # two snapshots, no ref: which one?
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text("abc123")
    source = own_model_check.resolve_source(str(cache))
    assert source.path == snapshot.resolve() and [w.name for w in source.weights] == [
        "model.safetensors"
    ]


def test_a_file_named_gguf_that_is_not_gguf_is_refused_naming_it(tmp_path, capsys):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 a zip, not a model")
    assert cli.main(["check", str(fake)]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"fusion-harness: error: {fake}: not a GGUF file (it does not start with GGUF's magic bytes)\n"
    )
    # a directory holding one .gguf file means that file
    assert cli.main(["check", str(tmp_path)]) == 2
    assert "not a GGUF file" in capsys.readouterr().err


def test_gguf_without_the_gguf_package_says_how_to_install_it(tmp_path, monkeypatch):
    real = tmp_path / "model.gguf"
    real.write_bytes(b"GGUF\x03\x00\x00\x00")
    find_spec = own_model_check.importlib.util.find_spec
    monkeypatch.setattr(
        own_model_check.importlib.util, "find_spec", lambda n: None if n == "gguf" else find_spec(n)
    )
    with pytest.raises(
        OwnModelError, match=r"needs the gguf package\(s\): pip install 'fusion-harness\[gguf\]'"
    ):
        own_model_check.prepare(str(real), tiny=False)
