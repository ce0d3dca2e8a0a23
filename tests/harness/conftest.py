"""Shared fixtures of the harness tests: a tiny llama from the corpus and its inputs."""

from __future__ import annotations

import pytest
import torch

import corpus
from harness.check import CheckOptions, make_inputs


@pytest.fixture(scope="package", autouse=True)
def one_thread():
    """Tiny models run fastest on one intra-op thread (as the sweep's workers do)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def options() -> CheckOptions:
    return CheckOptions()


@pytest.fixture
def llama(options):
    return corpus.build("llama", seed=options.seed, dtype=torch.float32, device="cpu")


@pytest.fixture
def llama_inputs(llama, options):
    return make_inputs(llama, options)
