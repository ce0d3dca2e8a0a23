"""harness.peers.liger_findings: Liger's results tabled with each failure's owner; a failure
no rule knows is `unclassified` and fails the command."""

from __future__ import annotations

import dataclasses
import json

from harness.base.results import ArchResult, Failure, ModuleResult
from harness.peers import liger_findings

WARNS = (
    "only the fused model warns: FutureWarning: `past_key_values` is deprecated and will be "
    "removed in version 5.40.0 for `LlamaModel.forward`. Use `cache` instead."
)


def _result(architecture: str, *messages: str, status: str = "fail") -> ArchResult:
    failures = [Failure("fused-warning", None, None, None, m, signature=m[:20]) for m in messages]
    return ArchResult(
        architecture, status, "float32", "cpu", 0, 1.0,
        message=(messages[0] if messages else "") + " [liger applied: x; 9 kernel launch(es) (k x9)]",
        unfused_error=2e-7, fused_error=3e-7, tolerance=1e-6, failures=failures,
        modules=[ModuleResult("model.norm", "LlamaRMSNorm", "liger:rms_norm", "pass", 1e-7, 1e-7, 1e-6)],
        lifecycle={"generate": {"verdict": "pass", "detail": ""}, "route": {"verdict": "n/a", "detail": ""}},
        system="liger",
    )  # fmt: skip


def test_known_findings_are_classified_by_owner():
    generate = "lifecycle generate: token 2 of row 1 differs (unfused margin 0.00728)"
    assert liger_findings.classify(_result("llama", WARNS)) == [("Liger's", "deprecated-arguments")]
    assert liger_findings.classify(_result("exaone4", generate, WARNS)) == [
        ("Liger's", "rope-decode-stride"),
        ("Liger's", "deprecated-arguments"),
    ]
    owner, text = liger_findings.classify(_result("llama", generate))[0]
    assert owner == "unclassified" and text.startswith("lifecycle generate")  # not a RoPE arch


def test_the_table_shows_parity_apart_from_the_status(tmp_path):
    row = liger_findings.table([_result("llama", WARNS)]).splitlines()[2]
    assert row.startswith("| llama | fail | ok 3e-07 <= 1e-06 | 1 pass | 1 pass | 9 |")
    assert row.endswith("Liger's: deprecated-arguments |")
    over = dataclasses.replace(_result("llama"), fused_error=2e-6, status="pass")
    assert "OVER 2e-06 > 1e-06" in liger_findings.table([over])
    not_applied = dataclasses.replace(_result("llama"), message="not-applied: no Liger Triton")
    assert "| llama | not-applied |" in liger_findings.table([not_applied])


def test_main_exits_1_on_an_unclassified_failure(tmp_path, capsys):
    path = tmp_path / "liger.jsonl"
    rows = [_result("llama", WARNS), _result("qwen2", "something new")]
    path.write_text("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in rows))
    assert liger_findings.main([str(path)]) == 1
    assert "unclassified: something new" in capsys.readouterr().out
    path.write_text(json.dumps(dataclasses.asdict(rows[0])) + "\n")
    assert liger_findings.main([str(path)]) == 0
