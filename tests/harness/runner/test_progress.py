"""harness.runner.progress: plain lines off a terminal, a bar (and visible problems) on one."""

from __future__ import annotations

import io

from harness.base.results import ArchResult
from harness.runner.progress import Progress, Steps


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _r(name: str, status: str = "pass", message: str = "") -> ArchResult:
    return ArchResult(name, status, "float32", "cpu", 0, 0.25, message=message)


def test_plain_lines_when_not_a_terminal():
    stream = io.StringIO()
    progress = Progress(stream)
    progress.start(12, initial=2)
    progress.advance(_r("llama"))
    progress.advance(_r("gpt2", "fail", "logits: bad"))
    progress.close()
    assert stream.getvalue().splitlines() == [
        "[ 3/12] llama: pass (0.25 s)",
        "[ 4/12] gpt2: fail (0.25 s): logits: bad",
    ]


def test_a_bar_on_a_terminal_still_prints_problems():
    stream = _Terminal()
    progress = Progress(stream)
    progress.start(2)
    progress.advance(_r("llama"))
    progress.advance(_r("gpt2", "crashed", "worker killed by SIGABRT"))
    progress.close()
    text = stream.getvalue()
    assert "gpt2: crashed (0.25 s): worker killed by SIGABRT" in text
    assert "llama: pass" not in text  # passes only move the bar
    assert "2/2" in text


def test_steps_are_one_line_each_off_a_terminal():
    stream = io.StringIO()
    steps = Steps("check", stream)
    steps("loading the checkpoint's weights")
    steps("lifecycle train (2/15)")
    steps.close()
    lines = stream.getvalue().splitlines()
    assert [line.rsplit(", ", 1)[0] for line in lines] == [
        "check: loading the checkpoint's weights",
        "check: lifecycle train (2/15)",
    ]
    assert all(line.endswith(" s") for line in lines) and "\r" not in stream.getvalue()


def test_steps_rewrite_one_status_line_on_a_terminal_and_erase_it():
    stream = _Terminal()
    steps = Steps("check", stream)
    steps("forwards")
    steps("lifecycle generate (1/15)")
    steps.close()
    text = stream.getvalue()
    assert "\n" not in text and text.count("\r\x1b[K") == 3 and text.endswith("\r\x1b[K")
