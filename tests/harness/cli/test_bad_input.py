"""Every `fusion-harness` command, fed bad input: one line on stderr naming the file or flag and
the problem, exit 2, no traceback (issue 46's table, and then some).

The cases run in this process through `harness.cli.main`, as `python -m harness` does; each
fails before anything is built or timed, so the table costs seconds. A test keeps the table
covering every subcommand the parser has.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

import corpus
from harness import cli
from harness.runner import repro
from harness.runner.arch_check import check_model
from tests.harness.fakes import faulty_fuse
from tests.harness.runner.test_repro import MLP0, OFF

Make = Callable[[Path], list[str]]
"""Builds the bad input under a temporary directory; returns the command line."""


def _write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_bytes(data)
    return path


BINARY = b"\xff\xfe\x00" + bytes(range(256)) * 8
"""Not UTF-8 (0x80 and up alone), not JSON: what a user's stray binary file looks like."""


def _config(tmp: Path, **fields) -> str:
    return str(_write(tmp / "config.json", json.dumps(fields)))


HUGE_LLAMA = dict(
    model_type="llama",
    hidden_size=32768,
    intermediate_size=131072,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=32000,
)
"""Countable on the meta device, ~292 GB to build two layers of: refused with an estimate."""


def _checkpoint(tmp: Path) -> Path:
    path = tmp / "ckpt"
    corpus.build("llama", seed=0).save_pretrained(path)
    return path


def _truncated_checkpoint(tmp: Path) -> list[str]:
    path = _checkpoint(tmp)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    return ["check", str(path)]


def _bundle_naming_a_missing_module(tmp: Path) -> list[str]:
    model = corpus.build("llama", seed=0)
    checked = check_model(
        "llama", model, corpus.make_inputs(model, seed=0), OFF, fuse=faulty_fuse(MLP0)
    )
    result = repro.write_bundles(checked.result, checked.subject, tmp / "bundles")
    (bundle,) = [Path(f.bundle) for f in result.failures if f.kind == "module-parity"]
    fields = json.loads((bundle / "bundle.json").read_text())
    fields["qualname"] = "model.layers.7.mlp"  # the tiny llama has 2 layers
    (bundle / "bundle.json").write_text(json.dumps(fields))
    return ["repro", str(bundle)]


CASES: list[tuple[str, Make, str]] = [
    # run
    ("run -j 0", lambda t: ["run", "-j", "0"], "argument -j/--jobs: must be at least 1"),
    ("run --timeout -1", lambda t: ["run", "--timeout", "-1"], "argument --timeout: must be"),
    ("run --seed -1", lambda t: ["run", "--seed", "-1"], "argument --seed: must be at least 0"),
    ("run unknown arch", lambda t: ["run", "--arch", "lama"], "did you mean llama"),
    (
        "run --resume binary",
        lambda t: ["run", "--arch", "llama", "--resume", str(_write(t / "r.jsonl", BINARY))],
        "r.jsonl:1: not UTF-8 text",
    ),
    # list
    ("list -j 0", lambda t: ["list", "-j", "0"], "argument -j/--jobs: must be at least 1"),
    ("list --timeout 0", lambda t: ["list", "--timeout", "0"], "argument --timeout: must be"),
    # show
    ("show unknown arch", lambda t: ["show", "lama"], "no architecture named 'lama'"),
    # repro
    ("repro no bundle", lambda t: ["repro", str(t)], "bundle.json: missing"),
    (
        "repro binary bundle",
        lambda t: ["repro", str(_write(t / "b" / "bundle.json", BINARY).parent)],
        "bundle.json: not UTF-8 text",
    ),
    (
        "repro missing module",
        _bundle_naming_a_missing_module,
        "'model.layers.7.mlp' names no module",
    ),
    # bench
    (
        "bench --tokens 0",
        lambda t: ["bench", "--tokens", "0"],
        "argument --tokens: must be at least 1",
    ),
    ("bench --tokens -3", lambda t: ["bench", "--tokens", "-3"], "must be at least 1, got -3"),
    (
        "bench --budget 0",
        lambda t: ["bench", "--budget", "0"],
        "argument --budget: must be a positive",
    ),
    ("bench --threads 0", lambda t: ["bench", "--threads", "0"], "argument --threads: must be at"),
    ("bench --copies 0", lambda t: ["bench", "--copies", "0"], "argument --copies: must be at"),
    ("bench --arch", lambda t: ["bench", "--arch", "llama"], "bench does not take --arch"),
    # calibrate
    (
        "calibrate malformed JSON",
        lambda t: ["calibrate", "--config", str(_write(t / "c.json", '{"model_type": "llama",'))],
        "c.json: not a JSON config",
    ),
    (
        "calibrate binary config",
        lambda t: ["calibrate", "--config", str(_write(t / "c.json", BINARY))],
        "c.json: not a JSON config",
    ),
    (
        "calibrate unknown model type",
        lambda t: ["calibrate", "--config", _config(t, model_type="nosuch")],
        "'nosuch' is unknown to the installed Transformers",
    ),
    (
        "calibrate absurd sizes",
        lambda t: ["calibrate", "--config", _config(t, **HUGE_LLAMA)],
        "it would not fit",
    ),
    (
        "calibrate hidden_size 10**9",
        lambda t: ["calibrate", "--config", _config(t, model_type="llama", hidden_size=10**9)],
        "memory estimate 6.4e+07 TB",
    ),
    (
        "calibrate sizes too large to count",
        lambda t: [
            "calibrate",
            "--config",
            _config(t, model_type="llama", hidden_size=10**9, intermediate_size=4 * 10**9),
        ],
        "cannot estimate the memory",
    ),
    ("calibrate --tokens 0", lambda t: ["calibrate", "--tokens", "0"], "argument --tokens:"),
    ("calibrate --tokens x", lambda t: ["calibrate", "--tokens", "1,x"], "argument --tokens:"),
    ("calibrate --layers 0", lambda t: ["calibrate", "--layers", "0"], "argument --layers:"),
    ("calibrate --budget -1", lambda t: ["calibrate", "--budget", "-1"], "argument --budget:"),
    # perf
    ("perf --tokens 0", lambda t: ["perf", "--tokens", "0"], "--tokens '0'"),
    ("perf --budget 0", lambda t: ["perf", "--budget", "0"], "argument --budget: must be"),
    (
        "perf --layers 0",
        lambda t: ["perf", "--layers", "0"],
        "argument --layers/--perf-layers: must be",
    ),
    ("perf unknown arch", lambda t: ["perf", "--arch", "lama"], "did you mean llama"),
    # report
    (
        "report binary",
        lambda t: ["report", str(_write(t / "r.jsonl", BINARY))],
        "r.jsonl:1: not UTF-8 text",
    ),
    (
        "report empty",
        lambda t: ["report", str(_write(t / "r.jsonl", ""))],
        "r.jsonl holds no results",
    ),
    ("report missing", lambda t: ["report", str(t / "nope.jsonl")], "nope.jsonl: no such results"),
    # merge
    (
        "merge binary",
        lambda t: ["merge", str(_write(t / "r.jsonl", BINARY))],
        "r.jsonl:1: not UTF-8",
    ),
    ("merge empty", lambda t: ["merge", str(_write(t / "r.jsonl", ""))], "no results in any file"),
    # check
    ("check truncated safetensors", _truncated_checkpoint, "model.safetensors: truncated"),
    ("check missing path", lambda t: ["check", str(t / "nope")], "does not exist"),
    (
        "check binary config",
        lambda t: ["check", str(_write(t / "config.json", BINARY))],
        "config.json: not a JSON config",
    ),
    (
        "check unknown model type",
        lambda t: ["check", _config(t, model_type="nosuch")],
        "'nosuch' is unknown to the installed Transformers",
    ),
    ("check --seed x", lambda t: ["check", str(t), "--seed", "x"], "argument --seed: 'x' is not"),
]


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        status = cli.main(argv)
    except SystemExit as exc:  # argparse's usage errors
        status = exc.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.parametrize(("make", "phrase"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(make, phrase, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # default outputs (results/, repro-bundles/) land here
    monkeypatch.setenv("FUSION_HARNESS_CACHE", str(tmp_path / "cache"))
    argv = make(tmp_path)
    capsys.readouterr()  # what making the input printed (save_pretrained's bars)
    status, _, err = _run(argv, capsys)
    lines = err.strip().splitlines()
    assert status == 2, (argv, status, err)
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith("fusion-harness"), err
    assert phrase in lines[0], err
    assert len(lines[0]) < 600, "one short line, not a list of everything"


def test_the_table_walks_every_command():
    parser = cli.build_parser()
    (commands,) = [a for a in parser._actions if a.dest == "command"]
    covered = {make.split()[0] for make, _, _ in CASES}
    assert covered == set(commands.choices)
