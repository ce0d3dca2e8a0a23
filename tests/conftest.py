"""Hypothesis settings profiles for the whole test suite.

Select one with `HYPOTHESIS_PROFILE=<name>` (default "ci"). Profiles are process-wide, so
they live here rather than next to one package's tests.

- "ci": derandomized (the same examples on every run and machine: CI is never flaky), no
  example database, 1000 examples per property unless a test sets its own count.
- "slow": randomized, 20x more examples; a soak run after changing an analysis, e.g.
  `HYPOTHESIS_PROFILE=slow python -m pytest tests/fusion/analysis/test_alias.py`.
- "dev": a quick randomized smoke run while editing.

Test selection (markers declared in pyproject.toml): a run that names no test paths and no
`-m` expression, i.e. the README's `python -m pytest -n auto`, selects
`not slow and not conformance` (DEFAULT_SELECTION): the unit tests, a few minutes on two
cores. `-m slow` runs the long suites (CI runs them in a step of their own), `-m conformance`
or `tox -e conformance` the corpus conformance suite, `-m ""` everything. Naming paths
(`pytest tests/fuzz`, as tox's fuzz and bench environments and scripts/gpu_check.sh do)
selects everything in them. Whole modules owned elsewhere are marked slow here (SLOW_PATHS),
single tests with `@pytest.mark.slow` where they are. A test marked `gpu` is skipped, with
that reason, where torch sees no CUDA device: GPU tests need no skipif of their own.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

from fusion.kernels import REGISTRY
from fusion.kernels.calibration import Table
from fusion.kernels.native.gemm import NATIVE
from fusion.kernels.onednn import ROW_MACHINE
from fusion.kernels.policy import POLICY
from fusion.trace.tracer import FP32_PRECISION_KEYS, preserved_globals
from harness.runner.shard import Shard, ShardError

DEFAULT_SELECTION = "not slow and not conformance"

SLOW_PATHS = (
    "tests/fuzz/test_fuzz_fusion.py",  # the fuzzer at its CI size (`tox -e fuzz`: full size)
    "tests/corpus/test_all_architectures.py",  # every corpus architecture built and run
    "tests/fusion/kernels/triton/test_backend.py",  # Triton kernels in the interpreter
    "tests/bench/",  # benchmark smoke runs (`tox -e bench` times them)
)
"""Test files (or directories, ending in "/") whose every test is `slow`: each takes minutes
on two CPU cores. Paths are relative to the repository root."""

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_addoption(parser: pytest.Parser) -> None:
    """The conformance suite's sharding options (tests/conformance/conftest.py applies
    them); registered here, the tests' root, so pytest knows them however it is started."""
    group = parser.getgroup("fusion-harness conformance")
    group.addoption(
        "--shard",
        metavar="K/N",
        help="conformance suite: run shard K of N, the architectures `fusion-harness run "
        "--shard K/N` checks (a stable partition: sorted names round-robin, or balanced by "
        "--shard-balance); the whole-suite tests run in shard 1",
    )
    group.addoption(
        "--shard-balance",
        metavar="RESULTS.jsonl",
        help="with --shard: balance shards by the seconds per architecture recorded in an "
        "earlier results file (every shard must be given the same file)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Apply DEFAULT_SELECTION to a run that names no paths and gives no `-m` (not even an
    empty one: `-m ""` asks for everything). A bad --shard is a usage error before anything
    is collected."""
    shard_text = config.getoption("--shard")
    if shard_text is not None:
        try:
            Shard.parse(shard_text)
        except ShardError as exc:
            raise pytest.UsageError(str(exc)) from exc
    given = [*config.invocation_params.args, *shlex.split(os.environ.get("PYTEST_ADDOPTS", ""))]
    chose_marks = any(str(arg).startswith("-m") and not str(arg).startswith("--") for arg in given)
    named_paths = config.args_source != pytest.Config.ArgsSource.TESTPATHS
    if not chose_marks and not named_paths and not config.option.markexpr:
        config.option.markexpr = DEFAULT_SELECTION


@pytest.hookimpl(tryfirst=True)  # before the -m expression deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_gpu = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    cuda = torch.cuda.is_available()
    for item in items:
        path = os.path.relpath(str(item.path), REPO).replace(os.sep, "/")
        if any(path == p or (p.endswith("/") and path.startswith(p)) for p in SLOW_PATHS):
            item.add_marker(pytest.mark.slow)
        if not cuda and item.get_closest_marker("gpu") is not None:
            item.add_marker(no_gpu)


settings.register_profile(
    "ci",
    max_examples=1000,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "slow",
    max_examples=20_000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _global_torch_state() -> Iterator[None]:
    """Whatever a test leaves behind (a hazard forward stopped half-way, a precision
    setting, grad or autocast mode), the next test starts from the same global state:
    otherwise results depend on which tests an xdist worker ran before (a `medium`
    precision left on made a later lifecycle test see no change to judge)."""
    with preserved_globals():
        yield
    try:
        torch.get_float32_matmul_precision()
        _ = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    except RuntimeError:
        # The legacy and per-backend precision APIs were mixed (PyTorch then refuses to
        # answer either): every setting back to its default, as in a new process.
        for backend, op in FP32_PRECISION_KEYS:
            torch._C._set_fp32_precision_setter(backend, op, "none")


@pytest.fixture(scope="package")
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one intra-op thread (as the sweep's workers do, and as
    xdist supplies the parallelism); packages that time or sweep models use it autouse."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _drop_kernel_overrides() -> None:
    """Undo what a test may have pretended about the kernels: the native kernel's answer
    back to this machine's (`stop_pretending`, not `reset`: resolving again costs a build
    and a probe per test), the oneDNN row check forgotten (making it again reads a few torch
    attributes), and every `install`ed backend removed (the constructed ones stay)."""
    NATIVE.stop_pretending()
    ROW_MACHINE.reset()
    REGISTRY.uninstall()


@pytest.fixture(autouse=True)
def _kernel_policy() -> Iterator[None]:
    """Every test starts from the default kernel policy with nothing measured (every fused
    product on its reference), whatever this machine's calibration table or
    `FUSION_KERNELS` say, and with no kernel pretences: a test that wants a fast kernel
    asks for it (`POLICY.use`, `POLICY.set_table`, a pinned backend, or the pretences of
    `NATIVE`, `ROW_MACHINE` and `REGISTRY`), and the next test starts clean again.

    Routes are closed (`KernelPolicy.routing`), as the harness judges: with nothing measured
    every rewritten forward whose kernels are merged products would otherwise run its
    class's original, and the rewrites (what a machine that measured a kernel faster runs)
    would go untested. Tests of the route open them (`tests/fusion/runtime/test_routes.py`,
    `merged_paths.measured_references`)."""
    POLICY.reset()
    POLICY.use("measured")
    POLICY.set_table(Table("tests"))
    POLICY.routes = False
    _drop_kernel_overrides()
    yield
    POLICY.reset()
    _drop_kernel_overrides()
