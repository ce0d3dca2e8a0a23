"""A pytest plugin that runs any test suite under fusion.

    python -m pytest -p harness.pytest_fusion --fusion tests/          # fuse every model
    python -m pytest -p harness.pytest_fusion --fusion-outcomes base.jsonl tests/
    python -m pytest -p harness.pytest_fusion --fusion --fusion-outcomes fused.jsonl tests/
    python -m harness.pytest_fusion base.jsonl fused.jsonl             # what fusion broke

With `--fusion`, every Transformers `PreTrainedModel` the tests build is passed through
`fusion.fuse`, once per model:

- right after construction (`post_init`, which every model's `__init__` ends with). A model
  built inside another model's `__init__` (a text model inside a causal LM, a vision tower)
  is not fused on its own: the outer model is fused whole when its own construction ends.
- right after `from_pretrained` returns, not during it: the loader writes the checkpoint's
  unfused keys into the model it constructed, which must therefore still be unfused. The
  loading info it returns (`output_loading_info=True`) then describes the model returned:
  a missing `q_proj.weight` is reported as the fused `qkv_proj.weight` it loads into
  (`fusion.inspection.fused_names`), so missing keys name the returned model's parameters,
  as they do unfused.

`--fusion-system NAME` puts another system under test (harness.runner.systems) in fusion.fuse's place:
`inductor` compiles every such model in place with torch.compile (Inductor), and
`inductor-freezing` with Inductor's freezing; each record then carries `"system": NAME`
(records of the default system, fusion, are unchanged). An Inductor system resets Dynamo
for each model it compiles (harness.runner.systems), so models compiled earlier recompile on their
next call: slower, never wrong.

Each test's fusions (model class, fusions per fuser) and outcome are recorded; with
`--fusion-outcomes FILE` one JSON line per test is written (also without `--fusion`, for the
baseline run), and `python -m harness.pytest_fusion BASE FUSED` lists the tests that pass
unfused and fail fused, grouped by cause (the exception type and the first line of its
message, numbers folded).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_STATE = threading.local()
"""Per thread: `loading` (depth of from_pretrained calls) and `fused` (records of the
current test). Explicit and per-thread: a test that builds models in threads records each."""

_KEY = pytest.StashKey[dict[str, Any]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fusion", "run the suite with every Transformers model fused")
    group.addoption(
        "--fusion",
        action="store_true",
        help="fuse every PreTrainedModel the tests build (after construction and after "
        "from_pretrained), with fusion.fuse",
    )
    group.addoption(
        "--fusion-backend", default="auto", help="kernel backend for fusion.fuse (default auto)"
    )
    group.addoption(
        "--fusion-system",
        default="fusion",
        metavar="NAME",
        help="with --fusion, the system under test applied to every model (harness.runner.systems): "
        "fusion (default), inductor or inductor-freezing",
    )
    group.addoption(
        "--fusion-outcomes",
        type=Path,
        default=None,
        metavar="FILE",
        help="write one JSON line per test: outcome, failure cause and the fusions applied",
    )


def _records() -> list[dict[str, Any]]:
    if not hasattr(_STATE, "fused"):
        _STATE.fused = []
    return _STATE.fused


def _loading() -> int:
    return getattr(_STATE, "loading", 0)


def _inside_outer_init(model: Any) -> bool:
    """Is `model` being built inside the `__init__` of another PreTrainedModel?"""
    from transformers import PreTrainedModel

    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            owner = frame.f_locals.get("self")
            if owner is not model and isinstance(owner, PreTrainedModel):
                return True
        frame = frame.f_back
    return False


def _fuse(model: Any, system: str, backend: str, when: str) -> None:
    """Apply the system under test to `model` once (a second call is a no-op) and record it.

    `fusion` runs fusion.fuse with `backend`; another system runs its `apply` (in place).
    """
    import fusion
    from harness.runner import systems

    if getattr(model, "_fusion_plugin_fused", False):
        return
    if system == systems.DEFAULT:
        report = fusion.fuse(model, backend=backend)
    else:
        report = systems.get(system).apply(model).report
    object.__setattr__(model, "_fusion_plugin_fused", True)
    record = {
        "model": type(model).__name__,
        "when": when,
        "applied": dict(report.counts()) if report is not None else {},
    }
    if system != systems.DEFAULT:
        record["system"] = system
    _records().append(record)


def _rename_missing(model: Any, info: Any) -> None:
    """Rewrite `info["missing_keys"]` (a loader's, in unfused names) to the fused model's
    parameter names, in place, keeping the container type. A fused parameter is missing when
    any slice of it was (its other slices loaded, but the tensor as a whole holds
    initialised values)."""
    from fusion.inspection import fused_names

    if not isinstance(info, dict) or not isinstance(info.get("missing_keys"), (list, set)):
        return
    names = fused_names(model)
    missing = info["missing_keys"]
    renamed = list(dict.fromkeys(names.get(key, key) for key in missing))
    info["missing_keys"] = type(missing)(renamed)


@contextlib.contextmanager
def _patched(system: str, backend: str) -> Iterator[None]:
    """Wrap `post_init` and `from_pretrained` of `PreTrainedModel` for the session."""
    from transformers import PreTrainedModel

    original_post_init = PreTrainedModel.post_init
    original_from_pretrained = PreTrainedModel.from_pretrained.__func__

    def post_init(self, *args, **kwargs):
        result = original_post_init(self, *args, **kwargs)
        if not _loading() and not _inside_outer_init(self):
            _fuse(self, system, backend, "constructed")
        return result

    def from_pretrained(cls, *args, **kwargs):
        _STATE.loading = _loading() + 1
        try:
            model = original_from_pretrained(cls, *args, **kwargs)
        finally:
            _STATE.loading -= 1
        if not _loading():
            fused = model[0] if isinstance(model, tuple) else model
            if isinstance(fused, PreTrainedModel):
                _fuse(fused, system, backend, "from_pretrained")
                if isinstance(model, tuple) and len(model) == 2:
                    _rename_missing(fused, model[1])
        return model

    PreTrainedModel.post_init = post_init
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    try:
        yield
    finally:
        PreTrainedModel.post_init = original_post_init
        PreTrainedModel.from_pretrained = classmethod(original_from_pretrained)


_CONFIG: dict[str, pytest.Config] = {}
"""The session's config, for `pytest_runtest_logreport` (which is not handed one)."""


def pytest_configure(config: pytest.Config) -> None:
    state: dict[str, Any] = {"outcomes": {}, "patch": None}
    config.stash[_KEY] = state
    _CONFIG["config"] = config
    if config.getoption("--fusion"):
        from harness.runner import systems

        system = config.getoption("--fusion-system")
        if system not in systems.NAMES:
            raise pytest.UsageError(
                f"--fusion-system {system!r}: known systems are {', '.join(systems.NAMES)}"
            )
        patch = _patched(system, config.getoption("--fusion-backend"))
        patch.__enter__()
        state["patch"] = patch


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(_KEY, None)
    if state is None:
        return
    if state["patch"] is not None:
        state["patch"].__exit__(None, None, None)
    path = config.getoption("--fusion-outcomes")
    if path is not None and not hasattr(config, "workerinput"):  # xdist: the controller writes
        lines = [json.dumps({"test": k, **v}, sort_keys=True) for k, v in state["outcomes"].items()]
        Path(path).write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _STATE.fused = []
    try:
        return (yield)
    finally:
        _STATE.fused = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Attach this test's fusions and, on failure, its cause to the report: reports (not
    this process's state) reach the xdist controller, which writes the outcomes file."""
    report = yield
    records = list(_records())
    if records:
        report.user_properties.append(("fusion", records))
    if report.failed:
        report.user_properties.append(("fusion_cause", cause_of(call)))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Fold one report (a phase, or a subtest's) into its test's outcome. Runs where the
    outcomes are written: in the only process, or in the xdist controller."""
    config = _CONFIG.get("config")
    state = config.stash.get(_KEY, None) if config is not None else None
    if state is None or hasattr(config, "workerinput"):
        return
    entry = state["outcomes"].setdefault(
        report.nodeid, {"outcome": "passed", "cause": None, "fusions": []}
    )
    props = dict(report.user_properties)
    if "fusion" in props and not entry["fusions"]:
        entry["fusions"] = props["fusion"]
    if report.failed and entry["outcome"] != "failed":
        crash = getattr(report.longrepr, "reprcrash", None)
        fallback = fold(crash.message) if crash is not None else "unknown"
        entry["outcome"], entry["cause"] = "failed", props.get("fusion_cause", fallback)
    elif report.skipped and report.when in ("setup", "call") and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"


def fold(message: str) -> str:
    """The first line of `message`, numbers and addresses folded, at most 200 characters."""
    first = message.strip().splitlines()[0] if message.strip() else ""
    first = re.sub(r"0x[0-9a-fA-F]+", "0x_", first)
    return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", first)[:200]


def cause_of(call: pytest.CallInfo) -> str:
    """A failure's cause: exception type and first message line, numbers and addresses
    folded, so the same defect in many tests is one group."""
    excinfo = call.excinfo
    if excinfo is None:
        return "unknown"
    return f"{excinfo.type.__name__}: {fold(str(excinfo.value))}"


def compare(base: dict[str, dict], fused: dict[str, dict]) -> dict[str, list[str]]:
    """{cause: [tests]} of the tests that passed in `base` and fail in `fused`."""
    groups: dict[str, list[str]] = {}
    for test, outcome in fused.items():
        if outcome["outcome"] == "failed" and base.get(test, {}).get("outcome") == "passed":
            groups.setdefault(outcome["cause"] or "unknown", []).append(test)
    return dict(sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])))


def _load(path: Path) -> dict[str, dict]:
    outcomes = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            record = json.loads(line)
            outcomes[record["test"]] = record
        except (ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"{path}:{number}: not an outcomes line ({exc})") from None
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.pytest_fusion",
        description="Tests that pass unfused and fail fused, grouped by cause, from two "
        "--fusion-outcomes files. Exit status 1 when there is any.",
    )
    parser.add_argument("base", type=Path, help="outcomes of the run without --fusion")
    parser.add_argument("fused", type=Path, help="outcomes of the run with --fusion")
    args = parser.parse_args(argv)
    base, fused = _load(args.base), _load(args.fused)
    groups = compare(base, fused)
    fusions: Counter[str] = Counter()
    for outcome in fused.values():
        for record in outcome.get("fusions", []):
            fusions.update(record["applied"])
    passed = sum(o["outcome"] == "passed" for o in base.values())
    broken = sum(len(tests) for tests in groups.values())
    print(f"{passed} tests pass unfused; {broken} of them fail fused")
    print(
        "fusions applied: " + (", ".join(f"{f} {n}" for f, n in sorted(fusions.items())) or "none")
    )
    for cause, tests in groups.items():
        print(f"\n{len(tests)} x {cause}")
        for test in tests:
            print(f"    {test}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
