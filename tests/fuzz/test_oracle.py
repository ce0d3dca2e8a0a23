"""The fuzzing oracle must notice every kind of failure it claims to (each is injected), and
its repro bundles must replay them from text alone."""

from __future__ import annotations

import dataclasses
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusion.engine import apply
from fusion.report import FusionReport
from fusion.runtime import merged as modules
from fusion.runtime import norm_forward
from fusion.runtime.merged import MergedLinear
from tests.fusion import merged_paths
from tests.fuzz.comparisons import relative_error
from tests.fuzz.oracle import check
from tests.fuzz.profiles import REPO
from tests.fuzz.repro import write_bundle
from tests.fuzz.strategies import GeneratedModule
from tests.fuzz.tally import Tally

SOURCE = """\
import torch
from torch import nn


def eager_attention_forward(module, query, key, value):
    weights = torch.softmax(query[..., :4] @ key.transpose(-1, -2), dim=-1)
    return weights @ value, weights


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(8, 8)
        self.k_proj = nn.Linear(8, 4)
        self.v_proj = nn.Linear(8, 4)
        self.o_proj = nn.Linear(4, 8)

    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class GeneratedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Attention()

    def forward(self, *args, **kwargs):
        return self.block(*args, **kwargs)


def build():
    return GeneratedModel()


def make_inputs(generator):
    return (torch.randn(2, 3, 8, generator=generator),), {}
"""

ATTENTION = GeneratedModule("attention", "GeneratedModel", SOURCE, (), ("handwritten",))
BROKEN = GeneratedModule(
    "attention",
    "GeneratedModel",
    SOURCE.replace("return self.o_proj(out)", "return self.o_proj(out[..., :3])"),
    (),
    (),
)


def _product(self: MergedLinear, x: torch.Tensor) -> torch.Tensor:
    """The merged product as the shards' current Parameters give it (gradient included)."""
    return torch.cat([F.linear(x, w, b) for w, b in self._current()], dim=-1)


def _scaled(self: MergedLinear, x: torch.Tensor) -> torch.Tensor:
    return _product(self, x) * 1.001


def _raising(self: MergedLinear, x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("injected kernel failure")


def _writes_input(self: MergedLinear, x: torch.Tensor) -> torch.Tensor:
    out = _product(self, x)
    x.mul_(2.0)
    return out


def _detached_weight(self: MergedLinear, x: torch.Tensor) -> torch.Tensor:
    """Same values, no weight gradient: the stacked weight (no Parameter) used while a
    gradient is recorded, or a projection moved out of its grad region."""
    return F.linear(x, self.stacked_weight, self.stacked_bias)


def _float32_under_autocast(self: MergedLinear, x: torch.Tensor) -> torch.Tensor:
    """A kernel blind to autocast (issue 24, defect 1)."""
    with torch.autocast(x.device.type, enabled=False):
        return _product(self, x.float())


def _past_the_dispatcher(self: MergedLinear, x: torch.Tensor) -> torch.Tensor:
    """A kernel that computes the product where no torch-function mode sees it (defect 2)."""
    with torch._C.DisableTorchFunction():
        return _product(self, x)


def test_correct_fusion_passes(tmp_path: Path) -> None:
    outcome = check(ATTENTION, 0, tmp_path)
    assert outcome.status == "fused" and outcome.failure is None
    assert outcome.fusers == ("qkv",)


@pytest.mark.parametrize(
    ("forward", "kind"),
    [
        (_scaled, "module-parity"),
        (_raising, "fused-forward-error"),
        (_writes_input, "input-state"),
        (_detached_weight, "gradient-parity"),
        (_float32_under_autocast, "ambient-state"),
        (_past_the_dispatcher, "ambient-state"),
    ],
)
def test_injected_kernel_faults_are_caught(
    forward, kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    merged_paths.inject(monkeypatch, forward)
    outcome = check(ATTENTION, 0, tmp_path)
    assert outcome.failure is not None and outcome.failure.kind == kind, outcome


def test_fuse_raising_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def run(model: nn.Module, **kwargs) -> FusionReport:
        raise RuntimeError("injected fuse failure")

    monkeypatch.setattr(apply, "run", run)
    outcome = check(ATTENTION, 0, tmp_path)
    assert outcome.failure is not None and outcome.failure.kind == "fuse-error"


def test_refusal_that_changes_the_module_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def run(model: nn.Module, **kwargs) -> FusionReport:
        model.block.extra = nn.Identity()
        return FusionReport()

    monkeypatch.setattr(apply, "run", run)
    outcome = check(ATTENTION, 0, tmp_path)
    assert outcome.failure is not None and outcome.failure.kind == "refused-but-changed"


def test_a_module_that_cannot_run_counts_as_crashed(tmp_path: Path) -> None:
    outcome = check(BROKEN, 0, tmp_path)
    assert outcome.status == "crashed" and outcome.failure is None
    tally = Tally()
    tally.record(BROKEN, outcome)
    assert tally.counts["attention"]["crashed"] == 1
    drew = dataclasses.replace(
        BROKEN, hazards=("region:k:no_grad",), features=("rotary:half", "region:all:none")
    )
    tally.record(drew, outcome)  # each family it drew counted once, however many labels
    assert {f: dict(row) for f, row in tally.families.items()} == {
        "region": {"crashed": 1, "examples": 1},
        "rotary": {"crashed": 1, "examples": 1},
    }
    merged = Tally()
    merged.merge(tally.to_json())
    assert merged.families == tally.families


def test_relative_error() -> None:
    a = torch.tensor([1.0, -2.0, float("nan")])
    assert relative_error(a, a.clone()) == 0.0
    assert relative_error(a, torch.tensor([1.0, -2.0, 0.0])) == float("inf")
    assert relative_error(a, torch.tensor([1.0, -2.2, float("nan")])) == pytest.approx(0.1)
    assert relative_error(torch.zeros(2), torch.zeros(3)) == float("inf")


def _replay(bundle: Path) -> int:
    return runpy.run_path(str(bundle / "repro.py"), run_name="fuzz_repro")["main"](bundle)


def test_the_stacked_split_path_is_judged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault only on the path one stacked product takes (the pieces of its split output),
    which the default policy never runs: the oracle's stacked pass finds it."""
    monkeypatch.setattr(modules, "_laid_out", lambda piece, layout: piece * 1.001)
    outcome = check(ATTENTION, 0, tmp_path)
    assert outcome.failure is not None and outcome.failure.kind == "module-parity", outcome
    assert "with one stacked product" in outcome.failure.message


def test_bundle_replays_from_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    merged_paths.inject(monkeypatch, _scaled)
    outcome = check(ATTENTION, 7, tmp_path)
    assert outcome.failure is not None
    bundle = write_bundle(tmp_path / "bundles", "fuzz--attention", ATTENTION, 7, outcome)
    names = sorted(p.name for p in bundle.iterdir())
    assert names == [
        "bundle.json",
        "forward.diff",
        "module.py",
        "original.py",
        "repro.py",
        "rewritten.py",
    ]
    for path in bundle.iterdir():
        path.read_text(encoding="utf-8")  # text only: nothing to unpickle
    fields = json.loads((bundle / "bundle.json").read_text())
    assert fields["seed"] == 7 and fields["kind"] == "module-parity"
    assert fields["generated"]["kind"] == "module-parity"
    assert (bundle / "module.py").read_text() == SOURCE
    assert "qkv_proj" in (bundle / "forward.diff").read_text()
    # The fault is still injected in this process: the failure reproduces.
    assert _replay(bundle) == 1
    monkeypatch.undo()
    assert _replay(bundle) == 0
    # A fresh process (only torch, transformers and the package) sees the fixed fusion.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(bundle / "repro.py")], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "does not reproduce" in done.stdout


def test_rewriting_a_bundle_replaces_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While Hypothesis shrinks, each smaller failure overwrites the shape's bundle."""
    merged_paths.inject(monkeypatch, _scaled)
    outcome = check(ATTENTION, 1, tmp_path)
    root = tmp_path / "bundles"
    write_bundle(root, "b", ATTENTION, 1, outcome)
    bundle = write_bundle(root, "b", ATTENTION, 2, outcome)
    assert json.loads((bundle / "bundle.json").read_text())["seed"] == 2
    assert [p.name for p in root.iterdir()] == ["b"]


def test_unusable_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    merged_paths.inject(monkeypatch, _scaled)
    outcome = check(ATTENTION, 1, tmp_path)
    bundle = write_bundle(tmp_path / "bundles", "b", ATTENTION, 1, outcome)
    (bundle / "bundle.json").write_text("{")
    assert _replay(bundle) == 2


def test_guards_blind_to_a_replaced_child_are_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The premise pass: a child the fused forward's guards watch is replaced after fusing
    (in both models); guards that miss it leave the fused forward computing without the
    replacement, and the outcome says so, replayably."""
    from fusion.runtime.guards import ChildGuard

    monkeypatch.setattr(ChildGuard, "failure", lambda self, module: None)
    outcome = check(ATTENTION, 0, tmp_path)
    assert outcome.failure is not None and outcome.failure.kind == "premise-change", outcome
    bundle = write_bundle(tmp_path / "bundles", "premise", ATTENTION, 0, outcome)
    assert _replay(bundle) == 1  # still injected: reproduces
    monkeypatch.undo()
    assert _replay(bundle) == 0


def test_a_checkpointed_tally_keeps_its_counts_on_disk(tmp_path) -> None:
    """A long fuzz run stopped part-way keeps what it checked: the running tally is on disk
    every `every` examples, the same counts `to_json` gives."""
    outcome = check(BROKEN, 0, tmp_path)
    checkpoint = tmp_path / "tally.json.gw0.partial"
    tally = Tally(checkpoint=checkpoint, every=2)
    tally.record(BROKEN, outcome)
    assert not checkpoint.exists()
    tally.record(BROKEN, outcome)
    assert json.loads(checkpoint.read_text())["counts"]["attention"]["crashed"] == 2
    tally.record(BROKEN, outcome)  # between checkpoints the file keeps the last one
    assert json.loads(checkpoint.read_text()) != tally.to_json()


def test_the_route_is_judged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault only on the route around a rewrite (its class's original forward run on the
    fused state, taken where a calibration measured every merged product to lose), which an
    uncalibrated machine never takes: the oracle's route pass finds it. The fault: the
    shards' weights off by 0.1% whenever the route is taken."""
    merged_paths.stale_route(monkeypatch, 1.001)
    outcome = check(ATTENTION, 0, tmp_path)
    assert outcome.failure is not None and outcome.failure.kind == "module-parity", outcome
    assert "on the route" in outcome.failure.message


def test_the_row_bucket_route_is_judged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault only on the route taken by the row-bucket rule (the process's quiet lane
    closed by winners at rows the inputs never have: `KernelPolicy.won_rows`): the oracle's
    row-bucket pass finds it, the lane pass before it does not."""
    merged_paths.stale_route(monkeypatch, 1.001, off_the_lane=True)
    outcome = check(ATTENTION, 0, tmp_path)
    assert outcome.failure is not None and outcome.failure.kind == "module-parity", outcome
    assert "on the row-bucket route" in outcome.failure.message


POW_NORM = GeneratedModule(
    "rmsnorm",
    "GeneratedModel",
    """\
import torch
from torch import nn


class PowNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64) * 0.1 + 1.0)
        self.eps = 1e-6

    def forward(self, x):
        return self.weight * (x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.eps, -0.5))


class GeneratedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = PowNorm()

    def forward(self, x):
        return self.norm(x)


def build():
    return GeneratedModel()


def make_inputs(generator):
    return (torch.randn(4, 96, 64, generator=generator),), {}
""",
    (),
    ("handwritten",),
)


def test_a_norm_kernel_an_ulp_off_in_bfloat16_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A norm-only fusion is compared bit for bit after the bfloat16 cast: a fused norm is
    proven per dtype pair (`pow(v, -0.5)` without an upcast only in float32/float64) and runs
    the original at any other, so one ulp of difference there is a kernel run where its
    proof does not reach. Shown with every pair taken as proven and a kernel one ulp off."""
    outcome = check(POW_NORM, 0, tmp_path)
    assert outcome.status == "fused" and outcome.failure is None, outcome.failure
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    original_init = norm_forward.NormForward.__init__
    kernel = norm_forward.norm_kernel

    def proven_everywhere(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.verified = frozenset((x, w) for x in dtypes for w in dtypes)

    def an_ulp_off(x, *args, **kwargs):
        out = kernel(x, *args, **kwargs)
        if out.dtype != torch.bfloat16:
            return out
        return torch.nextafter(out, torch.full_like(out, float("inf")))

    monkeypatch.setattr(norm_forward.NormForward, "__init__", proven_everywhere)
    monkeypatch.setattr(norm_forward, "norm_kernel", an_ulp_off)
    outcome = check(POW_NORM, 0, tmp_path)
    assert outcome.failure is not None and outcome.failure.kind == "ambient-state", outcome
    assert "bfloat16 cast" in outcome.failure.message
