"""fusion.inspection: the read-only public view of a fused model, and `fuse(..., fusers=)`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import corpus
import fusion
from fusion import inspection


@pytest.fixture(scope="module")
def fused():
    model = corpus.build("llama", seed=0, dtype=torch.float32, device="cpu")
    report = fusion.fuse(model)
    return model, report


def test_fused_forwards_name_every_rewrite_and_their_watched_children(fused):
    model, report = fused
    forwards = inspection.fused_forwards(model)
    assert forwards, "a fused llama has installed forwards"
    names = dict(model.named_modules())
    for f in forwards:
        assert names[f.qualname] is f.module
        assert inspection.has_installed_forward(f.module)
    rewrites = [f for f in forwards if f.rewrite]
    assert rewrites
    assert all(f.failure is None for f in rewrites), "every guard holds right after fusing"
    attention = next(f for f in rewrites if f.qualname.endswith("self_attn"))
    watched = dict(attention.watched)
    assert watched, "a rewritten attention watches its plainly called children"
    for name, child in watched.items():
        assert getattr(attention.module, name) is child
    assert all(f.norm_variant is None for f in rewrites)
    assert {f.qualname for f in rewrites} <= {a.qualname for a in report.applied}


def test_the_view_changes_nothing_and_records_no_failure(fused):
    model, _ = fused
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for f in inspection.fused_forwards(model):
        assert inspection.guard_failures(f.module) == 0
    for check in inspection.guard_checks(model):
        assert check.holds()
    for f in inspection.fused_forwards(model):
        assert inspection.guard_failures(f.module) == 0
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_replaced_watched_child_fails_the_guard(fused):
    model, _ = fused
    import copy

    twin = copy.deepcopy(model)
    attention = next(f for f in inspection.fused_forwards(twin) if f.watched)
    name, child = attention.watched[0]
    setattr(attention.module, name, copy.deepcopy(child))
    again = inspection.fused_forward(attention.module, attention.qualname)
    assert again is not None and again.failure is not None


def test_merged_projections_keep_their_shards_names(fused):
    model, _ = fused
    merged = inspection.merged_projections(model)
    assert merged
    for m in merged:
        assert m.views_hold
        assert len(m.shard_names) >= 2
        assert m.kernel_shape[-1] == model.config.hidden_size
        assert len(m.kernel_shape) == len(m.shard_names) + 1
    qkv = next(m for m in merged if m.qualname.endswith("self_attn.qkv_proj"))
    assert qkv.shard_names == ("q_proj", "k_proj", "v_proj")


def test_guard_checks_cover_every_rewrite(fused):
    model, _ = fused
    checks = inspection.guard_checks(model)
    rewrites = [f.qualname for f in inspection.fused_forwards(model) if f.rewrite]
    assert [c.qualname for c in checks] == rewrites
    assert any(c.guards > 0 for c in checks)
    assert any(c.globals_watched > 0 for c in checks)


def test_names_and_re_exports(fused):
    model, _ = fused
    unfused = corpus.build("llama", seed=0, dtype=torch.float32, device="cpu")
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    assert set(inspection.unfused_named(model, tensors)) == {
        n for n, _ in unfused.named_parameters()
    }
    renamed = inspection.fused_names(model)
    everything = {n for n, _ in (*model.named_parameters(), *model.named_buffers())}
    assert set(renamed.values()) <= everything
    assert "qkv" in inspection.fuser_names()
    assert not inspection.is_moe_block(model.model.layers[0].mlp)
    with inspection.preserved_globals():
        pass
    source = inspection.method_source(type(unfused.model.layers[0]), "forward")
    assert source.name == "forward"
    assert inspection.fused_forwards(unfused) == []
    assert inspection.merged_projections(unfused) == []


def test_fuse_with_a_subset_of_fusers_applies_only_those():
    model = corpus.build("llama", seed=0, dtype=torch.float32, device="cpu")
    report = fusion.fuse(model, fusers=["qkv"])
    assert report.applied
    assert {a.fuser for a in report.applied} == {"qkv"}
    assert {a.fuser for a in fusion.plan(model, fusers=["glu"]).applied} <= {"glu"}


def test_unknown_fuser_names_raise_naming_them():
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"'nope'.*known: .*qkv"):
        fusion.fuse(model, fusers=["qkv", "nope"])
    with pytest.raises(ValueError, match="'nope'"):
        fusion.plan(model, fusers=["nope"])
    with pytest.raises(TypeError):
        fusion.fuse(model, fusers="qkv")
