"""harness.peers.liger_globals: a monkey patch's changes to module functions, classes, class
attributes and torch found, restored, and replayed reentrantly around a patched model's
calls; modules first imported during the patch dropped. No liger-kernel needed: the patch
here is hand-made, as Liger's are."""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch.nn.functional as F

from harness.peers.liger_globals import MISSING, Changes, Snapshot

NAME = "transformers.fake_modeling_for_liger_globals_test"


@pytest.fixture
def fake_module():
    """A Transformers-like modeling module with a function and a class, registered in
    sys.modules for the test only."""
    module = types.ModuleType(NAME)

    def apply_rotary_pos_emb(q, k):
        return q, k

    class FakeForCausalLM:
        def forward(self):
            return "original"

    FakeForCausalLM.__module__ = NAME
    FakeForCausalLM.__qualname__ = "FakeForCausalLM"
    module.apply_rotary_pos_emb = apply_rotary_pos_emb
    module.FakeForCausalLM = FakeForCausalLM
    sys.modules[NAME] = module
    yield module
    sys.modules.pop(NAME, None)
    sys.modules.pop(NAME + "_new", None)


def _patch(module) -> None:
    """What Liger's apply functions do, in miniature."""
    module.apply_rotary_pos_emb = lambda q, k: ("liger", q, k)
    module.FakeForCausalLM.forward = lambda self: "liger"
    module.LigerOnly = object()
    F.cross_entropy = lambda *a, **k: "liger ce"
    sys.modules[NAME + "_new"] = types.ModuleType(NAME + "_new")


def test_changes_are_found_and_restore_puts_everything_back(fake_module):
    rope, forward, ce = (
        fake_module.apply_rotary_pos_emb,
        fake_module.FakeForCausalLM.forward,
        F.cross_entropy,
    )
    snapshot = Snapshot.take()
    _patch(fake_module)
    changes = snapshot.changes()
    where = {c.where() for c in changes}
    assert {
        "fake_modeling_for_liger_globals_test.apply_rotary_pos_emb",
        "fake_modeling_for_liger_globals_test.FakeForCausalLM.forward",
        "fake_modeling_for_liger_globals_test.LigerOnly",
        "functional.cross_entropy",
    } <= where
    added = next(c for c in changes if c.name == "LigerOnly")
    assert added.old is MISSING
    dropped = snapshot.restore()
    assert dropped == [NAME + "_new"] and NAME + "_new" not in sys.modules
    assert fake_module.apply_rotary_pos_emb is rope
    assert fake_module.FakeForCausalLM.forward is forward
    assert not hasattr(fake_module, "LigerOnly")
    assert F.cross_entropy is ce
    assert snapshot.changes() == []
    snapshot.restore()  # safe twice


def test_changes_install_only_while_entered_and_reentrantly(fake_module):
    rope = fake_module.apply_rotary_pos_emb
    snapshot = Snapshot.take()
    _patch(fake_module)
    scoped = Changes(snapshot.changes())
    snapshot.restore()
    assert fake_module.FakeForCausalLM().forward() == "original"
    assert scoped.enter() is True
    assert scoped.enter() is False  # nested call: already installed
    assert fake_module.FakeForCausalLM().forward() == "liger"
    assert fake_module.apply_rotary_pos_emb(1, 2) == ("liger", 1, 2)
    assert scoped.exit() is False  # the inner exit keeps them
    assert fake_module.apply_rotary_pos_emb(1, 2) == ("liger", 1, 2)
    assert scoped.exit() is True
    assert fake_module.apply_rotary_pos_emb is rope
    assert not hasattr(fake_module, "LigerOnly")
    assert scoped.exit() is False  # unbalanced exit: nothing to undo
    assert copy.deepcopy(scoped) is scoped  # a copied model drives the same installation
