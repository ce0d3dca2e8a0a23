"""The post-fuse edit family (tests/fuzz/edits.py, `oracle.check_edit`): its sites are what
the original forwards read, its patches are undone, and the oracle notices a fused model
that froze what an edit changes (each fault injected through a stand-in `fusion.fuse`)."""

from __future__ import annotations

import copy
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from fusion.report import Applied, FusionReport
from tests.fuzz import oracle
from tests.fuzz.edits import (
    EDIT_KINDS,
    EditSpec,
    Halving,
    alternatives,
    attribute_sites,
    helper_sites,
    patches,
    resolve,
    self_reads,
)
from tests.fuzz.oracle import check_edit
from tests.fuzz.strategies import GeneratedModule
from tests.fuzz.tally import Tally

SOURCE = """\
import torch
from torch import nn


def double(t):
    return t * 2.0


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)
        self.act = nn.GELU()
        self.scale = 0.5
        self.enabled = True

    def helper(self, t):
        return t + 1.0

    def forward(self, x):
        y = self.act(self.proj(x)) * self.scale
        if self.enabled:
            y = self.helper(y)
        return double(y)


class GeneratedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Scaled()

    def forward(self, *args, **kwargs):
        return self.block(*args, **kwargs)


def build():
    return GeneratedModel()


def make_inputs(generator):
    return (torch.randn(2, 3, 8, generator=generator),), {}
"""

MODULE = GeneratedModule("glu_mlp", "GeneratedModel", SOURCE, (), ("handwritten",))


@pytest.fixture
def source(tmp_path: Path) -> Iterator[types.ModuleType]:
    """SOURCE imported from a file (the sites are read from its source text)."""
    with oracle.loaded(MODULE, tmp_path) as module:
        yield module


def _frozen_forward(block: nn.Module, scale: float, enabled: bool):
    """What a fusion that copied `scale`, `enabled`, the helper and the children at fuse
    time would run (the snapshot issue 43 is about)."""
    proj, act, helper = block.proj, block.act, type(block).helper

    def forward(x):
        y = nn.GELU.forward(act, nn.Linear.forward(proj, x)) * scale
        return (helper(block, y) if enabled else y) * 2.0

    return forward


def _snapshot_fuse(model: nn.Module) -> FusionReport:
    block = model.block
    block.forward = _frozen_forward(block, block.scale, block.enabled)
    return FusionReport(applied=[Applied("block", "snapshot", "Scaled", "frozen")])


def _honest_fuse(model: nn.Module) -> FusionReport:
    return FusionReport(applied=[Applied("block", "honest", "Scaled", "nothing frozen")])


def test_sites_are_what_the_original_forward_reads(source: types.ModuleType) -> None:
    model = source.build()
    assert self_reads(type(model.block)) == ("act", "proj", "scale", "enabled", "helper")
    assert self_reads(nn.GELU) == ("approximate",)
    sites = {(q, n): values for q, n, values in attribute_sites(model)}
    assert sites[("block", "scale")] == [1.0, 0.25, 0.75, 5.0]
    assert sites[("block", "enabled")] == [False]
    assert sites[("block.act", "approximate")] == ["tanh"]
    assert ("block", "proj") not in sites  # a child, not a scalar
    assert ("block", "helper", True) in helper_sites(model)
    assert alternatives("n", 2) == [1, 3]
    assert alternatives("name", "unknown string") == []


def test_every_kind_resolves_or_says_no_site(source: types.ModuleType) -> None:
    module = source
    model = module.build()
    for kind in EDIT_KINDS:
        edit = resolve(EditSpec(kind, 0, 0), model, module)
        assert edit is not None, kind  # this module offers every kind a site
        assert edit.kind == kind and edit.description
    with pytest.raises(ValueError, match="unknown edit kind"):
        resolve(EditSpec("no-such-kind", 0, 0), model, module)


def test_patches_are_undone_and_halving_follows_deepcopy(source: types.ModuleType) -> None:
    module = source
    forward, code = nn.Linear.forward, module.double.__code__
    with patches() as held:
        held.set(nn.Linear, "forward", lambda self, x: x)
        held.set(module.Scaled, "extra", 1)
        held.set(module.double, "__code__", (lambda t: t).__code__)
        assert module.double(3) == 3
    assert nn.Linear.forward is forward and module.double.__code__ is code
    assert "extra" not in vars(module.Scaled)

    model = module.build()
    model.block.forward = Halving(model.block.forward)
    twin = copy.deepcopy(model)
    assert twin.block.forward.inner.__self__ is twin.block  # not the original's forward
    x = torch.randn(2, 8)
    torch.testing.assert_close(twin(x), model(x))


@pytest.mark.parametrize(
    ("kind", "caught"),
    [
        ("attribute", True),  # a frozen scale or flag
        ("helper-method", True),  # the helper resolved at fuse time
        ("class-forward", True),  # the GELU class forward called directly
        ("shadow-setattr", False),  # the snapshot still reads block.proj: shadow missed too
        ("copy-copy", True),  # the copy's forward reads the original's values
    ],
)
def test_a_snapshot_fusion_fails_the_edit_family(
    kind: str, caught: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every site of the kind is tried: a snapshot fusion fails at least one of them."""
    monkeypatch.setattr(oracle.fusion, "fuse", _snapshot_fuse)
    failures = [
        check_edit(MODULE, EditSpec(kind, site, choice), 0, tmp_path).failure
        for site in range(4)
        for choice in range(2)
    ]
    found = [f for f in failures if f is not None]
    if caught:
        assert found, kind
        assert all(f.kind in ("module-parity", "gradient-parity") for f in found), found
        assert all(f.message.startswith("after ") for f in found), found
    else:
        assert all(f is None or f.kind != "edit-error" for f in failures)


@pytest.mark.parametrize("kind", EDIT_KINDS)
def test_an_honest_fusion_passes_every_edit(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A "fusion" that changes nothing passes every edit kind: the oracle's verdicts come
    from the fused model, not from the edits themselves."""
    monkeypatch.setattr(oracle.fusion, "fuse", _honest_fuse)
    tally = Tally()
    for choice in range(3):
        outcome = check_edit(MODULE, EditSpec(kind, choice, choice), 0, tmp_path)
        assert outcome.failure is None, (kind, outcome.failure)
        tally.record_edit("glu_mlp", kind, outcome)
    row = tally.families[f"edit-{kind}"]
    assert row["examples"] == 3 and row["failures"] == 0, row
    assert tally.counts["edit:glu_mlp"]["examples"] == 3
    assert any(line.startswith(f"edit-{kind}") for line in tally.lines())


KERNEL_SOURCE = """\
import torch
from torch import nn


def double(t):
    return t * 2.0


class Kernel(nn.Module):
    def forward(self, t):
        return double(t) + 1.0


kernel = Kernel()


class GeneratedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return kernel(self.proj(x))


def build():
    return GeneratedModel()


def make_inputs(generator):
    return (torch.randn(2, 3, 8, generator=generator),), {}
"""

KERNEL_MODULE = GeneratedModule(
    "attention", "GeneratedModel", KERNEL_SOURCE, (), ("module-global",)
)


def _kernel_snapshot_fuse(model: nn.Module) -> FusionReport:
    """A fusion that bound the global module's forward, as it was, at fuse time."""
    frozen = model.forward.__globals__["kernel"].forward
    proj = model.proj
    model.forward = lambda x: frozen(nn.Linear.forward(proj, x))
    return FusionReport(applied=[Applied("", "snapshot", "GeneratedModel", "frozen")])


def test_a_module_called_as_a_global_is_a_code_swap_site(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The code-swap kind patches a global module's class and instance `forward` (and
    swaps the helper it calls); a fusion that froze the module's forward fails the class and
    instance patches, an honest one passes all three."""
    descriptions = {}
    for fuse, label in ((_kernel_snapshot_fuse, "snapshot"), (_honest_fuse_root, "honest")):
        monkeypatch.setattr(oracle.fusion, "fuse", fuse)
        for site, choice in ((0, 0), (1, 0), (1, 1)):
            outcome = check_edit(KERNEL_MODULE, EditSpec("code-swap", site, choice), 0, tmp_path)
            descriptions[(label, site, choice)] = outcome.failure
    assert descriptions[("snapshot", 1, 0)] is not None  # Kernel.forward halved
    assert descriptions[("snapshot", 1, 1)] is not None  # kernel.forward = Halving(...)
    assert all(f is None for (label, *_), f in descriptions.items() if label == "honest")


def _honest_fuse_root(model: nn.Module) -> FusionReport:
    return FusionReport(applied=[Applied("", "honest", "GeneratedModel", "nothing frozen")])


GLU_SOURCE = """\
import torch
from torch import nn


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(8, 16, bias=False)
        self.up_proj = nn.Linear(8, 16, bias=False)
        self.down_proj = nn.Linear(16, 8, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class GeneratedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = Mlp()

    def forward(self, x):
        return self.mlp(x)


def build():
    return GeneratedModel()


def make_inputs(generator):
    return (torch.randn(1, 1, 8, generator=generator),), {}
"""

GLU_MODULE = GeneratedModule("glu_mlp", "GeneratedModel", GLU_SOURCE, (), ("handwritten",))


def test_the_compiled_weight_move_finds_a_stacked_weight_read_after_the_move(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`compiled-weight-move` (compile, run, `p.data = ...` on every weight, run again):
    the fused GLU passes, its compiled stacked product checking the views when it runs;
    with that check taken away, the compiled code reads the stacked weight the move left
    behind and the edit family fails on the stacked path."""
    from fusion.kernels import ops

    spec = EditSpec("compiled-weight-move", 0, 0)
    outcome = check_edit(GLU_MODULE, spec, 0, tmp_path)
    assert outcome.status == "fused" and "glu" in outcome.fusers, outcome
    assert outcome.failure is None, outcome.failure
    monkeypatch.setattr(ops, "stacked_views_hold", lambda *args: True)
    outcome = check_edit(GLU_MODULE, spec, 0, tmp_path)
    assert outcome.failure is not None and outcome.failure.kind == "module-parity", outcome
    assert "stacked product" in outcome.failure.message, outcome.failure
