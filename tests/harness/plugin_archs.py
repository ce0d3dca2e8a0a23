"""Test plugin: architectures that abort, hang or build slowly (never part of the corpus).

Named in FUSION_HARNESS_TEST_PLUGINS (or CheckOptions.plugins) by the crash-isolation tests.
"""

from __future__ import annotations

import os
import time

import corpus


def _abort(**_kwargs):
    os.abort()  # SIGABRT, as a crashing native kernel would


def _hang(**_kwargs):
    marker = os.environ.get("HARNESS_TEST_HANG_MARKER")
    if marker:  # tells a test the worker is now inside the task
        with open(marker, "a") as f:
            f.write(f"{os.getpid()}\n")
    time.sleep(3600)  # a native call that never returns


def _slow_llama(**kwargs):
    time.sleep(float(os.environ.get("HARNESS_TEST_SLOW_SECONDS", "0.5")))
    return corpus.build("llama", **kwargs)


def _raise(**_kwargs):
    raise ValueError("this test architecture never builds")


def _sys_exit(**_kwargs):
    raise SystemExit(3)  # a library that calls sys.exit on a config it dislikes


HARNESS_ARCHITECTURES = {
    "harness-test-abort": _abort,
    "harness-test-hang": _hang,
    "harness-test-slow-llama": _slow_llama,
    "harness-test-unbuildable": _raise,
    "harness-test-sys-exit": _sys_exit,
}
