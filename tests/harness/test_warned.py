"""harness.warned: warnings and library log records captured as comparable lines."""

from __future__ import annotations

import logging
import warnings

import pytest
import transformers

from harness import warned


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
