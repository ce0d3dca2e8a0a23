"""harness.oracles.warned: warnings and library log records captured as comparable lines."""

from __future__ import annotations

import logging
import pickle
import warnings

import pytest
import transformers

from harness.oracles import warned


@pytest.fixture
def silenced():
    """Transformers' verbosity as the sweep's workers set it, restored after."""
    before = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(before)


def test_capture_sees_warnings_and_log_records_through_silencing_filters(silenced) -> None:
    library = logging.getLogger("transformers.models.llama")
    level = logging.getLogger("transformers").level
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        with warned.capture() as lines:
            warnings.warn("first at 0x7f3a2b1c0d90", DeprecationWarning, stacklevel=1)
            warnings.warn("first at 0x7f3a2b1c0d90", DeprecationWarning, stacklevel=1)
            library.warning("a log record\nwith a second line")
            library.info("below WARNING: not kept")
    assert lines == ["DeprecationWarning: first at 0x?", "logging.WARNING: a log record"]
    assert logging.getLogger("transformers").level == level  # restored


def test_capture_fills_the_list_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError), warned.capture() as lines:
        warnings.warn("before the error", UserWarning, stacklevel=1)
        raise RuntimeError("boom")
    assert lines == ["UserWarning: before the error"]


def test_capture_keeps_a_bounded_number_of_lines() -> None:
    with warned.capture() as lines:
        for i in range(warned.LIMIT + 5):
            warnings.warn(f"warning {i}", UserWarning, stacklevel=1)
    assert len(lines) == warned.LIMIT + 1 and lines[-1] == "... and 5 more"


def test_only_in_drops_the_baseline_and_the_count_line() -> None:
    assert warned.only_in(["a", "b", "... and 3 more"], ["a"]) == ["b"]


def test_each_line_keeps_the_module_that_raised_it(tmp_path) -> None:
    """A warning's origin is the module of its file; a log record's, its logger's name (torch's
    `torch._inductor` logger does not propagate to `torch`: its records count all the same,
    and its handlers are its own again afterwards)."""
    inductor = logging.getLogger("torch._inductor")
    before = (inductor.handlers[:], inductor.propagate, inductor.level)
    with warned.capture() as lines:
        warnings.warn_explicit(
            "from a file", UserWarning, filename=str(tmp_path / "pkg" / "mod.py"), lineno=3
        )
        logging.getLogger("torch._inductor.lowering").warning("from a logger")
    assert lines == ["UserWarning: from a file", "logging.WARNING: from a logger"]
    assert lines.origins["logging.WARNING: from a logger"] == "torch._inductor.lowering"
    assert (inductor.handlers, inductor.propagate, inductor.level) == before
    assert warned.module_of(str(tmp_path / "pkg" / "mod.py"), [str(tmp_path)]) == "pkg.mod"
    assert warned.module_of(str(tmp_path / "pkg" / "__init__.py"), [str(tmp_path)]) == "pkg"
    assert warned.module_of("/elsewhere/x.py", [str(tmp_path)]) == ""
    nested = [str(tmp_path), str(tmp_path / "pkg")]  # the longest entry that holds it wins
    assert warned.module_of(str(tmp_path / "pkg" / "mod.py"), nested) == "mod"


def test_split_by_origin_sets_apart_only_proven_origins() -> None:
    origins = {"a": "torch._dynamo.utils", "b": "torch._dynamo_fake", "c": "torch._inductor"}
    prefixes = ("torch._dynamo", "torch._inductor")
    assert warned.split_by_origin(["a", "b", "c", "d"], origins, prefixes) == (
        ["b", "d"],
        ["a", "c"],
    )
    assert warned.split_by_origin(["a"], origins, ()) == (["a"], [])


def test_lines_copy_and_pickle_with_their_origins() -> None:
    """A record crosses processes (the sweep's workers): Lines survive pickling."""
    lines = warned.Lines(["a", "b"], {"a": "torch._dynamo"})
    again = pickle.loads(pickle.dumps(lines))
    assert again == ["a", "b"] and again.origins == {"a": "torch._dynamo"}
