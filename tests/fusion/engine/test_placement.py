"""fusion.engine.placement: fused models keep a valid tensor-parallel plan; models placed by another
engine (tensor-parallel DTensors, accelerate dispatch hooks) are refused, never fused wrong."""

from __future__ import annotations

import copy
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fusion
from fusion.engine import placement
from tests.fusion.tiny_models import tiny_model, token_ids

REPO = Path(__file__).resolve().parents[3]

LLAMA_PLAN = {
    "embed_tokens": "embedding_rowwise",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


def test_wildcard_replaces_layer_numbers_only() -> None:
    assert placement.wildcard("model.layers.12.mlp.experts.3") == "model.layers.*.mlp.experts.*"
    assert placement.wildcard("0.proj") == "*.proj"
    assert placement.wildcard("model.fc1.weight") == "model.fc1.weight"


def test_prune_plan_drops_whole_blocks() -> None:
    pruned = placement.prune_plan(LLAMA_PLAN, ["layers.*.self_attn.q_proj"])
    # o_proj goes with q/k/v: rowwise would expect a colwise-sharded input
    assert pruned == {k: v for k, v in LLAMA_PLAN.items() if ".self_attn." not in k}
    pruned = placement.prune_plan(LLAMA_PLAN, ["layers.*.self_attn", "layers.*.mlp"])
    assert pruned == {"embed_tokens": "embedding_rowwise"}
    # a fused norm outside any planned block leaves the plan as it is (a new dict)
    same = placement.prune_plan(LLAMA_PLAN, ["layers.*.input_layernorm", "norm"])
    assert same == LLAMA_PLAN and same is not LLAMA_PLAN


def test_prune_plan_empties_what_it_cannot_split() -> None:
    # an entry on a module containing the fused one: no parent block to drop alone
    assert placement.prune_plan({"layers": "sequence_parallel"}, ["layers.*.mlp"]) == {}
    # a style whose output crosses blocks: dropping one block could leave another wrong
    plan = {**LLAMA_PLAN, "layers.*.input_layernorm": "sequence_parallel"}
    assert placement.prune_plan(plan, ["layers.*.mlp"]) == {}
    assert placement.prune_plan(plan, ["norm"]) == plan  # nothing to drop: kept
    assert placement.prune_plan({"lm_head": "colwise_gather_output"}, ["lm_head"]) == {}


def _plan_names(model: nn.Module) -> set[str]:
    names = [*dict(model.named_modules()), *dict(model.named_parameters())]
    return {placement.wildcard(n) for n in names}


def test_fused_model_plan_names_only_what_exists() -> None:
    model = tiny_model("qwen3")
    unfused_plan = dict(model.tp_plan)
    assert any("q_proj" in key for key in unfused_plan)
    report = fusion.fuse(model)
    assert report.counts()["qkv"] == 2
    names = _plan_names(model)
    for owner in (model, model.model):
        plan = owner.tp_plan
        assert plan, "the plan keeps what fusion left alone"
        prefix = "model." if owner is model.model else ""
        assert all(f"{prefix}{key}" in names for key in plan), plan
    # Every fusion keeps the names a plan holds: q_norm / k_norm become FusedRMSNorm with
    # the same Parameter under the same name; merged projections (qkv, glu) and the
    # residual_norm rewrite keep every child in place, guarded. So the plan stays whole.
    assert model.tp_plan == unfused_plan
    # the class and config plans (shared with every unfused model) are untouched
    assert type(model)._tp_plan == {"lm_head": "colwise_gather_output"}
    assert "layers.*.self_attn.q_proj" in model.config.base_model_tp_plan
    assert tiny_model("qwen3").tp_plan == unfused_plan


def test_merging_keeps_the_plan_and_a_plan_applied_later_meets_the_guards() -> None:
    """Llama (no norms inside its blocks): fusing merges q/k/v and gate/up but keeps every
    plan entry, since the merged children stay; hooks a plan would put on one of them make
    the rewritten forward fall back, so the result is the unfused model's."""
    model = tiny_model("llama")
    unfused_plan = dict(model.tp_plan)
    reference = tiny_model("llama")
    report = fusion.fuse(model)
    assert report.counts()["qkv"] == 2 and report.counts()["glu"] == 2
    assert model.tp_plan == unfused_plan
    names = _plan_names(model)
    assert all(key in names for key in model.tp_plan)
    attention = model.model.layers[0].self_attn
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    for child in (attention.q_proj, model.model.layers[0].mlp.up_proj):
        # a colwise-style output hook, as a plan's would be: doubles the projection
        handle = child.register_forward_hook(lambda m, args, out: out * 2)
        theirs = getattr(
            reference.model.layers[0], "self_attn" if child is attention.q_proj else "mlp"
        )
        twin = getattr(theirs, "q_proj" if child is attention.q_proj else "up_proj")
        twin_handle = twin.register_forward_hook(lambda m, args, out: out * 2)
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, reference(ids).logits)
        handle.remove()
        twin_handle.remove()


class _Recorder:
    """An accelerate ModelHook that records the calls it sees (hooks run around forward)."""

    def __new__(cls):
        from accelerate.hooks import ModelHook

        class Recorder(ModelHook):
            calls = 0

            def pre_forward(self, module, *args, **kwargs):
                type(self).calls += 1
                return args, kwargs

        return Recorder()


def test_accelerate_hooks_refuse_the_subtree() -> None:
    from accelerate.hooks import add_hook_to_module

    model = tiny_model("llama")
    ids = token_ids()
    with torch.no_grad():
        expected = model(ids).logits
    hook = _Recorder()
    add_hook_to_module(model.model.layers[0].self_attn.q_proj, hook)
    report = fusion.fuse(model)
    refused = [s for s in report.skipped if s.qualname == "model.layers.0.self_attn"]
    assert refused and "accelerate hook" in refused[0].reason
    assert "model.layers.1.self_attn" in {a.qualname for a in report.applied}
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected)
    assert type(hook).calls == 1  # the hooked projection still runs as a module


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A one-process gloo group, so real DTensors can be built; torn down after."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def test_dtensor_weights_refuse_the_merge(one_rank_group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = tiny_model("llama")
    mesh = init_device_mesh("cpu", (1,))
    attention = model.model.layers[0].self_attn
    sharded = {}
    for name in ("q_proj", "k_proj", "v_proj"):
        linear = getattr(attention, name)
        linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Shard(0)]))
        sharded[name] = linear.weight
    reason = placement.placement_refusal(attention)
    assert reason is not None and reason.startswith("q_proj.weight is a DTensor")
    assert placement.placement_refusal(model.model.layers[1].self_attn) is None
    report = fusion.fuse(model)
    refused = {s.qualname: s.reason for s in report.skipped}
    assert "DTensor" in refused["model.layers.0.self_attn"]
    assert "model.layers.1.self_attn" in {a.qualname for a in report.applied}
    # the refused attention is exactly as it was: its projections, their DTensor weights,
    # the class forward (the two-process test below runs a real sharded model end to end)
    assert "forward" not in attention.__dict__
    assert {n: getattr(attention, n).weight for n in sharded} == sharded


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_tensor_parallel_two_processes(tmp_path: Path) -> None:
    """A tiny Llama saved locally, loaded with tp_plan="auto" by two gloo processes: the
    fused model (its sharded merges refused) gives the unfused logits, which match the
    single-process model's."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python")
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "llama")
    from tests.fusion.tp_worker import IDS

    with torch.no_grad():
        single = model(IDS).logits
    out = tmp_path / "ranks.pt"
    done = subprocess.run(
        [
            torchrun,
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            str(REPO / "tests" / "fusion" / "tp_worker.py"),
            str(tmp_path / "llama"),
            str(out),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = torch.load(out)
    assert result["param_type"] == "DTensor"  # really sharded
    assert "qkv" not in result["applied"] and "glu" not in result["applied"]
    assert any("is a DTensor" in reason for reason in result["reasons"])
    torch.testing.assert_close(result["fused"], result["unfused"], rtol=0, atol=0)
    torch.testing.assert_close(result["unfused"], single, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_device_map_offload_fused_or_refused(tmp_path: Path) -> None:
    """A model dispatched by accelerate (device_map with a layer offloaded to disk): fusing
    refuses every hooked module, and the logits stay the unfused ones."""
    from transformers import AutoModelForCausalLM

    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "llama")
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    dispatched = AutoModelForCausalLM.from_pretrained(
        tmp_path / "llama", device_map=device_map, offload_folder=tmp_path / "offload"
    ).eval()
    ids = token_ids()
    with torch.no_grad():
        expected = dispatched(ids).logits
        torch.testing.assert_close(expected, model(ids).logits)
    before = copy.copy(dict(dispatched.named_modules()))
    report = fusion.fuse(dispatched)
    assert not report.applied
    assert all("accelerate hook" in s.reason for s in report.skipped)
    assert dict(dispatched.named_modules()) == before
    with torch.no_grad():
        torch.testing.assert_close(dispatched(ids).logits, expected, rtol=0, atol=0)


def test_lora_before_fusing_is_refused_with_the_reason() -> None:
    """PEFT LoRA applied first wraps q_proj / v_proj: the attention is not merged, the report
    says why (naming the wrapped children), and the fused model computes the LoRA model's
    logits (the MLP and norms still fuse)."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        tiny_model("llama"), peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=4)
    )
    for name, param in model.named_parameters():
        if "lora_B" in name:  # LoRA starts at zero: make the adapter change the function
            torch.nn.init.normal_(param, std=0.1)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with torch.no_grad():
        expected = model(ids).logits
    report = fusion.fuse(model)
    assert "qkv" not in report.counts() and report.counts()["glu"] == 2
    reasons = [s.reason for s in report.skipped if s.qualname.endswith("layers.0.self_attn")]
    assert any(
        "adapter-wrapped projections are not merged: q_proj (peft.tuners.lora" in r
        and "v_proj" in r
        for r in reasons
    ), reasons
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected)
