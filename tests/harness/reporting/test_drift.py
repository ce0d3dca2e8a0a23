"""harness.reporting.drift: a run judged against the nearest line's golden plan, what it gained and lost
per module class with the fusers' reasons, the --fail-on-drift-loss gate, and `tox -e latest`
which runs it against the newest releases."""

from __future__ import annotations

import configparser
import dataclasses
import json
from pathlib import Path

import pytest

from harness import cli
from harness.base.results import ArchResult, Refusal, ResultsWriter
from harness.reporting import drift, plans

REPO = Path(__file__).resolve().parents[3]

TRACE_STOP = (
    "the trace stops at `attn_output, attn_weights = attention_interface(self, query_states)` "
    "in LlamaAttention.forward: TypeError: get_interface() got an unexpected keyword"
)


def _golden(entries: dict, line: str = "5.24", path: Path | None = None) -> plans.Golden:
    return plans.Golden(
        path=path or Path(f"{line}.json"),
        line=line,
        versions={},
        options=dict(plans.GOLDEN_OPTIONS),
        architectures=entries,
    )


def _pass(plan: dict) -> dict:
    return {"status": "pass", "plan": plan}


def _result(name: str, status: str = "pass", **fields) -> ArchResult:
    return ArchResult(name, status, "float32", "cpu", 0, 0.1, **fields)


LLAMA_524 = _pass(
    {
        "LlamaAttention": {"applied": {"qkv": 2}},
        "LlamaMLP": {"applied": {"glu": 2}},
        "LlamaRMSNorm": {"applied": {"rmsnorm": 5}},
    }
)


# ------------------------------------------------------------------ the reference


@pytest.mark.parametrize(
    ("line", "available", "chosen"),
    [
        ("5.24", ["4.57", "5.0", "5.24"], "5.24"),  # its own plan
        ("5.25", ["4.57", "5.0", "5.24"], "5.24"),  # a new release: the one before it
        ("5.10", ["4.57", "5.0", "5.24"], "5.0"),  # between: the newest older line
        ("5.3", ["5.24", "5.10"], "5.10"),  # none older: the oldest newer line
        ("5.25", [], None),
    ],
)
def test_the_reference_is_the_line_itself_else_the_nearest_older_line(line, available, chosen):
    assert drift.reference_line(line, available) == chosen


def test_golden_lines_are_read_from_the_directory_in_version_order(tmp_path):
    for name in ("5.24.json", "5.0.json", "4.57.json", "5.10.json", "notes.json", "x.txt"):
        (tmp_path / name).write_text("{}")
    assert drift.golden_lines(tmp_path) == ["4.57", "5.0", "5.10", "5.24"]
    assert drift.golden_lines(tmp_path / "missing") == []


# ------------------------------------------------------------------ the drift


def test_a_lost_fusion_names_the_class_the_fuser_and_the_fusers_reasons():
    """What 5.25 did to Llama before the tracer saw through its wrappers: qkv stopped at the
    trace and sibling merged the projections instead."""
    now = _result(
        "llama",
        applied_by_class={
            "LlamaAttention": {"sibling": 2},
            "LlamaMLP": {"glu": 2},
            "LlamaRMSNorm": {"rmsnorm": 5},
        },
        refusals=[Refusal("qkv", "LlamaAttention", TRACE_STOP, 2, "model.layers.0.self_attn")],
    )
    found = drift.drift([now], _golden({"llama": LLAMA_524}), line="5.25")
    assert not found.own and found.compared == 1
    (lost,) = found.losses
    assert (lost.cls, lost.fuser, lost.before, lost.after) == ("LlamaAttention", "qkv", 2, 0)
    assert lost.architectures == ("llama",)
    assert lost.reasons == (f"qkv refuses: {TRACE_STOP}", "now fused by sibling (2)")
    # fusers refusing for the same reason share one line, the lost fuser first
    same = dataclasses.replace(
        now,
        refusals=[
            Refusal(f, "LlamaAttention", TRACE_STOP, 2, "model.layers.0.self_attn")
            for f in ("glu", "qkv")
        ],
    )
    (lost,) = drift.drift([same], _golden({"llama": LLAMA_524}), line="5.25").losses
    assert lost.reasons[0] == f"qkv, glu refuse: {TRACE_STOP}"
    (gained,) = found.gains
    assert (gained.cls, gained.fuser, gained.before, gained.after) == (
        "LlamaAttention",
        "sibling",
        0,
        2,
    )
    text = drift.format_drift(found, gate=True)
    assert "Transformers 5.24's golden plan, the nearest line (no golden plan for 5.25)" in text
    assert "lost   LlamaAttention: qkv 2 -> 0 instances (llama)" in text
    assert "- qkv refuses: the trace stops at `attn_output" in text
    assert "gained LlamaAttention: sibling 0 -> 2 instances (llama)" in text
    assert text.endswith(
        "2 fused instances lost over 1 (class, fuser) pairs, 2 gained: exit 4 "
        "(--fail-on-drift-loss)"
    )


def test_a_loss_without_a_recorded_refusal_is_itself_a_finding():
    now = _result("llama", applied_by_class={"LlamaMLP": {"glu": 1}})
    golden = _golden({"llama": _pass({"LlamaMLP": {"applied": {"glu": 2}}})})
    (lost,) = drift.drift([now], golden, line="5.25").losses
    assert (lost.before, lost.after) == (2, 1)
    assert lost.reasons == (drift.SILENT,)


def test_a_class_gone_from_the_plan_and_a_model_that_no_longer_builds_say_why():
    gone = _result("llama", applied_by_class={"LlamaMLP": {"glu": 2}})
    broken = _result("gpt2", "build-error", message="BuildError: gpt2 needs 3 heads")
    golden = _golden(
        {
            "llama": _pass({"LlamaMLP": {"applied": {"glu": 2}}}),
            "gpt2": _pass({"GPT2Attention": {"applied": {"sibling": 2}}}),
        }
    )
    golden.architectures["llama"]["plan"]["LlamaAttention"] = {"applied": {"qkv": 2}}
    found = drift.drift([gone, broken], golden, line="5.25")
    by_class = {c.cls: c for c in found.losses}
    assert by_class["LlamaAttention"].reasons == (
        "LlamaAttention is not in this run's plan (renamed, or no longer in the model)",
    )
    assert by_class["GPT2Attention"].reasons == (
        "no fusion plan: build-error (BuildError: gpt2 needs N heads)",
    )
    assert found.statuses == ["gpt2: build-error (was pass): BuildError: gpt2 needs N heads"]


def test_losses_of_one_class_sum_over_architectures_and_new_architectures_are_listed():
    a = _result("a", applied_by_class={"Shared": {"glu": 1}})
    b = _result("b", applied_by_class={"Shared": {"glu": 1}})
    new = _result("n", applied_by_class={"New": {"glu": 1}})
    shared = _pass({"Shared": {"applied": {"glu": 2}}})
    found = drift.drift([a, b, new], _golden({"a": shared, "b": shared}), line="5.25")
    (lost,) = found.losses
    assert (lost.before, lost.after, lost.architectures) == (4, 2, ("a", "b"))
    assert found.new == ["n"] and found.compared == 2 and not found.gains


def test_no_drift_and_the_gate():
    same = _result(
        "llama",
        applied_by_class={
            "LlamaAttention": {"qkv": 2},
            "LlamaMLP": {"glu": 2},
            "LlamaRMSNorm": {"rmsnorm": 5},
        },
    )
    found = drift.drift([same], _golden({"llama": LLAMA_524}), line="5.25")
    assert not (found.losses or found.gains or found.statuses)
    assert drift.format_drift(found).endswith("  no drift")
    assert drift.exit_status(0, found, gate=True) == 0
    lost = drift.drift([_result("llama")], _golden({"llama": LLAMA_524}), line="5.25")
    assert drift.exit_status(0, lost, gate=False) == 0
    assert drift.exit_status(0, lost, gate=True) == drift.EXIT_DRIFT_LOSS
    assert drift.exit_status(3, lost, gate=True) == drift.EXIT_DRIFT_LOSS
    assert drift.exit_status(1, lost, gate=True) == 1  # a fusion failure says more
    assert drift.exit_status(130, lost, gate=True) == 130


# ------------------------------------------------------------------ the command line


def _older_line(line: str) -> str:
    """A line just before `line` (its golden file's stand-in name)."""
    major, minor = map(int, line.split("."))
    return f"{major}.{minor - 1}" if minor else f"{major - 1}.99"


@pytest.fixture
def renamed_golden(tmp_path, monkeypatch) -> Path:
    """A golden directory holding only the installed line's committed plan, renamed to the
    line before it: the installed line then has no golden plan and is judged against it."""
    line = plans.transformers_line()
    source = REPO / "corpus" / "expected" / f"{line}.json"
    if not source.exists():
        pytest.skip(f"no committed golden plan for Transformers {line}")
    directory = tmp_path / "expected"
    directory.mkdir()
    older = _older_line(line)
    doc = json.loads(source.read_text())
    doc["transformers_line"] = older
    (directory / f"{older}.json").write_text(plans.dumps(doc))
    monkeypatch.setenv(plans.EXPECTED_DIR_ENV, str(directory))
    return directory / f"{older}.json"


def _with_llama(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc["architectures"]["llama"]["plan"])
    path.write_text(plans.dumps(doc))


def _run(tmp_path: Path, *extra: str) -> list[str]:
    base = ["run", "--arch", "llama", "-j", "1", "--lifecycle", "off"]
    return [*base, "--results", str(tmp_path / "r.jsonl"), *extra]


def test_run_on_a_line_without_a_golden_plan_prints_the_drift_and_gates_a_loss(
    tmp_path, renamed_golden, capsys
):
    line, older = plans.transformers_line(), renamed_golden.stem
    json_path = tmp_path / "s.json"
    assert cli.main([*_run(tmp_path, "--fail-on-drift-loss", "--json", str(json_path))]) == 0
    out = capsys.readouterr().out
    assert (
        f"drift against Transformers {older}'s golden plan, the nearest line (no golden plan "
        f"for {line}): {renamed_golden}; 1 architectures compared"
    ) in out
    assert out.splitlines()[-2] == "  no drift"  # the same plan under another name
    assert json.loads(json_path.read_text())["drift"]["reference_line"] == older

    # the reference fused one more RMSNorm instance and a class this run does not have
    def more(plan: dict) -> None:
        plan["LlamaRMSNorm"]["applied"]["rmsnorm"] += 1
        plan["LlamaGone"] = {"applied": {"glu": 1}}

    _with_llama(renamed_golden, more)
    assert cli.main(_run(tmp_path)) == 0  # reported, not gated
    out = capsys.readouterr().out
    assert "lost   LlamaRMSNorm: rmsnorm 6 -> 5 instances (llama)" in out
    assert "lost   LlamaGone: glu 1 -> 0 instances (llama)" in out
    assert "not a failure without --fail-on-drift-loss" in out
    assert cli.main(_run(tmp_path, "--fail-on-drift-loss")) == drift.EXIT_DRIFT_LOSS
    captured = capsys.readouterr()
    assert "exit 4 (--fail-on-drift-loss)" in captured.out
    assert "exit 4: no fusion failure; fusions lost against" in captured.err
    assert "LlamaGone glu, LlamaRMSNorm rmsnorm" in captured.err

    # `merge` of the same results judges the same drift; `report` renders it
    results = str(tmp_path / "r.jsonl")
    assert cli.main(["merge", results, "--fail-on-drift-loss"]) == drift.EXIT_DRIFT_LOSS
    assert "lost   LlamaGone: glu 1 -> 0 instances (llama)" in capsys.readouterr().out
    assert cli.main(["report", results]) == 0
    report = capsys.readouterr().out
    assert "### Drift against the nearest line" in report
    assert f"No golden plan for Transformers {line}: judged against Transformers {older}'s" in (
        report
    )
    assert "- `LlamaGone: glu 1 -> 0 instances (llama)`" in report


def test_the_gate_refuses_what_it_cannot_judge_before_the_sweep(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(plans.EXPECTED_DIR_ENV, str(tmp_path / "none"))
    assert cli.main(_run(tmp_path, "--fail-on-drift-loss")) == 2
    assert "--fail-on-drift-loss: no golden plan in" in capsys.readouterr().err
    monkeypatch.delenv(plans.EXPECTED_DIR_ENV)
    assert cli.main(_run(tmp_path, "--fail-on-drift-loss", "--dtype", "bfloat16")) == 2
    assert "golden plans are recorded with" in capsys.readouterr().err
    assert not (tmp_path / "r.jsonl").exists()  # refused before the sweep


def test_run_help_documents_the_gate(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--fail-on-drift-loss" in text and "4 with --fail-on-drift-loss" in text
    assert "4 (run, merge with --fail-on-drift-loss)" in " ".join(cli.__doc__.split())


def test_a_results_file_of_a_line_with_its_own_plan_prints_no_drift_section(tmp_path, capsys):
    """The installed line's own golden plan judges it (the conformance suite's business):
    the section is printed only when the plans differ."""
    path = tmp_path / "r.jsonl"
    line = plans.transformers_line()
    if not plans.golden_path(line).exists():
        pytest.skip(f"no committed golden plan for Transformers {line}")
    entry = plans.load().architectures["llama"]
    applied = {cls: d["applied"] for cls, d in entry["plan"].items() if "applied" in d}
    with ResultsWriter(path, append=False) as writer:
        writer.write(_result("llama", applied_by_class=applied))
    assert cli.main(["merge", str(path), "--fail-on-drift-loss"]) == 0
    assert "drift against" not in capsys.readouterr().out


# ------------------------------------------------------------------ tox -e latest


def test_the_latest_env_pins_nothing_and_gates_on_drift():
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(REPO / "tox.ini")
    env = tox["testenv:latest"]
    assert set(env["deps"].split()) == {"torch", "transformers"}
    assert (
        "pip install --upgrade --upgrade-strategy eager torch transformers" in (env["commands_pre"])
    )
    assert "fusion-harness run --fail-on-drift-loss" in env["commands"]
    assert "fusion-harness report" in env["commands"]
    constraints = env["setenv"].split("=", 1)[1].strip().replace("{toxinidir}", str(REPO))
    pinned = [
        line
        for line in Path(constraints).read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert pinned == [], "tox -e latest must pin nothing"
