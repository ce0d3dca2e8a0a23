"""pytest plugin for the fusion fuzzer: the fused/refused/crashed tally at the end of a run.

Loaded by tests/fuzz/conftest.py. Under pytest-xdist the controller never imports that
conftest, so a run that wants the tally merged across workers names this plugin itself:
`pytest -p tests.fuzz.plugin -n auto tests/fuzz` (the `fuzz` tox environment does).

- Every process tallies the examples it checks (`tests.fuzz.tally.SESSION_TALLY`).
- An xdist worker hands its tally to the controller (`workeroutput`), which merges them.
- The process that owns the terminal prints the table in the terminal summary and, when
  `FUZZ_TALLY_JSON=<path>` is set, writes it there as JSON.
- With `FUZZ_TALLY_JSON` set, every process also keeps its own running tally in
  `<path>.<worker>.partial` (rewritten every `Tally.every` examples): a run stopped or
  crashed hours in keeps what it checked, and `cat` shows how far a live one got. The
  controller removes them once the merged tally is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.fuzz.tally import SESSION_TALLY

TALLY_ENV = "FUZZ_TALLY_JSON"
_WORKER_KEY = "fusion_fuzz_tally"


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _partial(path: str, config: pytest.Config) -> Path:
    """This process's running tally file beside the merged one."""
    worker = config.workerinput["workerid"] if _is_worker(config) else "main"  # type: ignore[attr-defined]
    return Path(f"{path}.{worker}.partial")


def pytest_configure(config: pytest.Config) -> None:
    path = os.environ.get(TALLY_ENV)
    if path:
        SESSION_TALLY.checkpoint = _partial(path, config)


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if SESSION_TALLY.checkpoint is not None and SESSION_TALLY.counts:
        SESSION_TALLY.save(SESSION_TALLY.checkpoint)
    if _is_worker(config):
        config.workeroutput[_WORKER_KEY] = SESSION_TALLY.to_json()  # type: ignore[attr-defined]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist (controller side): merge a finished worker's tally."""
    tally = getattr(node, "workeroutput", {}).get(_WORKER_KEY)
    if tally:
        SESSION_TALLY.merge(tally)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if _is_worker(config) or not SESSION_TALLY.counts:
        return
    terminalreporter.section("fusion fuzzer tally (fused / refused / crashed per shape)")
    for line in SESSION_TALLY.lines():
        terminalreporter.write_line(line)
    path = os.environ.get(TALLY_ENV)
    if path:
        Path(path).write_text(json.dumps(SESSION_TALLY.to_json(), indent=2) + "\n")
        terminalreporter.write_line(f"tally written to {path}")
        for partial in Path(path).parent.glob(Path(path).name + ".*.partial"):
            partial.unlink()  # merged into the tally just written
