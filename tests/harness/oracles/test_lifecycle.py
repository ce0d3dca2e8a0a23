"""harness.oracles.lifecycle: each operation passes on real fusion, and catches the defect it exists
for when a fuse is made wrong on purpose (fault injection through `check_model`'s `fuse`)."""

from __future__ import annotations

import copy
import dataclasses
import types

import pytest
import torch
from torch import nn

import fusion
from fusion.runtime import linear_forward
from fusion.runtime.bound import BoundForward
from fusion.runtime.merged import MergedLinear
from harness.base.results import ArchResult
from harness.oracles import lifecycle
from harness.reporting import plans
from harness.runner.arch_check import CheckOptions, check_model
from tests.fusion import merged_paths

QUICK_OPS = set(lifecycle.OPERATIONS) - {"compile"}


def _run(model, inputs, fuse, mode: str = "quick") -> ArchResult:
    return check_model("llama", model, inputs, CheckOptions(lifecycle=mode), fuse=fuse).result


def _verdicts(result: ArchResult) -> dict[str, str]:
    return {op: v["verdict"] for op, v in result.lifecycle.items()}


def test_real_fusion_passes_every_operation(llama, llama_inputs):
    result = _run(llama, llama_inputs, fusion.fuse)
    assert result.status == "pass", result.message
    verdicts = _verdicts(result)
    assert {op for op, v in verdicts.items() if v == "pass"} == QUICK_OPS, result.lifecycle
    assert verdicts["compile"] == "n/a"
    assert result.lifecycle["compile"]["detail"] == lifecycle.NOT_COMPILED


def _static_cache_fault_fuse(model):
    """Fuse, then give the model logits that are wrong only when it generates with a
    `StaticCache`: the defect of an attention rewrite that mishandles a preallocated cache."""
    from transformers import StaticCache

    fusion.fuse(model)

    def hook(module, args, kwargs, output):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, StaticCache):
            output.logits = output.logits.roll(1, -1)
        return output

    model.register_forward_hook(hook, with_kwargs=True)


def test_a_fault_only_with_a_static_cache_fails_generate(llama, llama_inputs):
    result = _run(llama, llama_inputs, _static_cache_fault_fuse)
    generate = result.lifecycle["generate"]
    assert generate["verdict"] == "fail", generate
    assert "with a static cache" in generate["detail"]


def test_generate_judges_both_caches(llama, llama_inputs):
    detail = _run(llama, llama_inputs, fusion.fuse).lifecycle["generate"]["detail"]
    assert "tokens identical, and with a static cache" in detail, detail


def test_off_records_nothing(llama, llama_inputs):
    assert _run(llama, llama_inputs, fusion.fuse, mode="off").lifecycle == {}


def _stale_forward(self, x):
    """A merged linear that computes with a snapshot of its weight taken at the first call:
    the stale-cache defect, in miniature. Patched on the class (a class swap would fail
    the fused forward's guards, which would then run the original)."""
    if "_snapshot" not in self.__dict__:
        self.__dict__["_snapshot"] = self.stacked_weight.detach().clone()
    return nn.functional.linear(x, self.__dict__["_snapshot"], self.stacked_bias)


def test_a_stale_weight_copy_fails_edits_and_loads(llama, llama_inputs, monkeypatch):
    merged_paths.inject(monkeypatch, _stale_forward)
    result = _run(llama, llama_inputs, fusion.fuse)
    verdicts = _verdicts(result)
    assert verdicts["edit-weights"] == "fail"
    assert "logits after p.data.mul_" in result.lifecycle["edit-weights"]["detail"]
    assert verdicts["load-state-dict"] == "fail"
    assert result.status == "fail" and result.message.startswith("lifecycle ")
    assert any(f.kind == "lifecycle" for f in result.failures)


def _fused_keys_fuse(model):
    """Fusion whose merged modules register their stacked weight (the old layout's
    `qkv_proj.weight` keys in the checkpoint: the old save_pretrained defect)."""
    report = fusion.fuse(model)
    for module in model.modules():
        if isinstance(module, MergedLinear):
            module.register_buffer("weight", module.stacked_weight)
    return report


def test_fused_keys_in_the_checkpoint_fail_save_pretrained(llama, llama_inputs):
    result = _run(llama, llama_inputs, _fused_keys_fuse)
    assert _verdicts(result)["save-pretrained"] == "fail"
    assert "checkpoint keys differ" in result.lifecycle["save-pretrained"]["detail"]


def _shared_storage_fuse(model, monkeypatch):
    """Fusion whose state-dict slices share the merged weight's storage (the old defect
    that made accelerate's save_model drop k_proj and v_proj)."""
    from fusion.runtime import checkpoint

    monkeypatch.setattr(checkpoint, "_own_storage", lambda piece: piece)
    return fusion.fuse(model)


def test_state_dict_slices_sharing_storage_fail_save_pretrained(llama, llama_inputs, monkeypatch):
    result = _run(llama, llama_inputs, lambda model: _shared_storage_fuse(model, monkeypatch))
    assert _verdicts(result)["save-pretrained"] == "fail", result.lifecycle
    assert "share storage" in result.lifecycle["save-pretrained"]["detail"]


def _method_fuse(model):
    """Rewritten forwards bound with types.MethodType (the old torch.save defect)."""
    report = fusion.fuse(model)
    for module in model.modules():
        bound = module.__dict__.get("forward")
        if isinstance(bound, BoundForward):
            module.forward = types.MethodType(bound.fn, module)
    return report


def test_a_forward_lost_by_pickling_fails_torch_save(llama, llama_inputs):
    result = _run(llama, llama_inputs, _method_fuse)
    assert _verdicts(result)["torch-save"] == "fail", result.lifecycle


def _lm_head_forward_fuse(model):
    """Fusion plus `decode_linear`'s forward on the LM head (tiny models' linears are under
    its size rule)."""
    report = fusion.fuse(model)
    linear_forward.install(model.lm_head, "auto")
    return report


def test_a_linear_forward_lost_by_pickling_fails_torch_save(llama, llama_inputs, monkeypatch):
    """A `LinearForward` counts as fused state: a copy that lost it (pickled as the module's
    `forward` looked up before its state is restored: the class's own) is not the fused
    model, though it computes like it."""
    passing = _run(llama, llama_inputs, _lm_head_forward_fuse)
    assert _verdicts(passing)["torch-save"] == "pass", passing.lifecycle["torch-save"]
    monkeypatch.setattr(
        linear_forward.LinearForward, "__reduce__", lambda self: (getattr, (self.module, "forward"))
    )
    result = _run(llama, llama_inputs, _lm_head_forward_fuse)
    verdicts = _verdicts(result)
    assert verdicts["torch-save"] == "fail" and verdicts["deepcopy"] == "pass", result.lifecycle


def _stacked_while_training(self, x):
    """A merged linear that runs the stacked GEMM even while a gradient is recorded: the
    stacked weight is no Parameter, so the shards never get a gradient (the defect that
    made an optimiser built before fusing stop training the merged weights)."""
    return nn.functional.linear(x, self.stacked_weight, self.stacked_bias)


def test_shards_that_stop_training_fail_train(llama, llama_inputs, monkeypatch):
    merged_paths.inject(monkeypatch, _stacked_while_training)
    result = _run(llama, llama_inputs, fusion.fuse)
    assert _verdicts(result)["train"] == "fail"
    assert "has no gradient where the unfused model has one" in result.lifecycle["train"]["detail"]
    assert _verdicts(result)["optimizer-before-fuse"] == "fail"


def test_an_operation_the_unfused_model_cannot_do_is_not_applicable(
    llama, llama_inputs, monkeypatch
):
    def refuse(*args, **kwargs):
        raise RuntimeError("no saving here")

    monkeypatch.setattr(type(llama), "save_pretrained", refuse)
    result = _run(llama, llama_inputs, fusion.fuse)
    assert result.lifecycle["save-pretrained"] == {
        "verdict": "n/a",
        "detail": "unfused model: save_pretrained raises: RuntimeError: no saving here",
    }
    assert result.status == "pass"


def test_full_mode_compiles_the_selection(llama, llama_inputs):
    assert "llama" in lifecycle.COMPILE_SELECTION
    result = _run(llama, llama_inputs, fusion.fuse, mode="full")
    assert result.lifecycle["compile"]["verdict"] == "pass", result.lifecycle["compile"]


def test_unknown_mode_is_refused(llama):
    with pytest.raises(ValueError, match="lifecycle mode"):
        lifecycle.check("llama", llama, llama, {}, torch.float32, None, None, mode="maybe")


def test_golden_entries_carry_and_compare_verdicts(llama, llama_inputs):
    result = _run(llama, llama_inputs, fusion.fuse)
    entry = plans.entry_of(result)
    assert entry["lifecycle"] == {op: "pass" for op in QUICK_OPS}  # skipped compile left out
    broken = dict(entry, lifecycle={**entry["lifecycle"], "torch-save": "fail"})
    assert plans.diff_entry(entry, broken) == ["lifecycle torch-save: fail (expected pass)"]
    without = {k: v for k, v in entry.items() if k != "lifecycle"}
    assert plans.diff_entry(entry, without) == []  # a run with lifecycle off compares the rest


def _float32_forward(self, x):
    """A merged linear that computes in float32 whatever autocast says (issue 24, defect 1,
    in miniature)."""
    with torch.autocast(x.device.type, enabled=False):
        return torch.cat([nn.functional.linear(x.float(), w, b) for w, b in self._current()], -1)


def test_a_kernel_blind_to_autocast_fails_autocast(llama, llama_inputs, monkeypatch):
    merged_paths.inject(monkeypatch, _float32_forward)
    result = _run(llama, llama_inputs, fusion.fuse)
    assert _verdicts(result)["autocast"] == "fail", result.lifecycle
    assert (
        "returns torch.float32 where the modules it replaced returned torch.bfloat16"
        in (result.lifecycle["autocast"]["detail"])
    )
    # the same fused model without autocast: every other operation still agrees
    assert _verdicts(result)["edit-weights"] == "pass"


def _medium_precision_moves(module, args, output):
    """Stands for a dense kernel that honours `medium` precision (bf16 passes on AMX). It moves
    the logits by far more than the CPU's own GEMMs do on a machine that honours the setting
    too (bf16 rounding of logits of magnitude about 1), so the test means the same there."""
    if torch.backends.mkldnn.matmul.fp32_precision == "bf16":  # what "medium" sets on CPU
        output.logits = output.logits + 1.0
    return output


def _blind_to_precision_fuse(model):
    """The fused model drops the unfused one's sensitivity to the setting (its hook), as a
    kernel that ignores `set_float32_matmul_precision` would."""
    model._forward_hooks.clear()
    return fusion.fuse(model)


def _medium_precision_nudges(module, args, output):
    """Stands for the CPU's own GEMM honouring `medium` (as on AMX) in a layer no fusion
    touches: both models' logits move a little under the setting."""
    if torch.backends.mkldnn.matmul.fp32_precision == "bf16":
        return output + 1e-2
    return output


@pytest.mark.parametrize("own_gemms_honour", [False, True], ids=["gemms-ignore", "gemms-honour"])
def test_a_kernel_blind_to_matmul_precision_fails(llama, llama_inputs, own_gemms_honour):
    """Fails on either kind of CPU: where the machine's own GEMMs ignore the setting (the
    fused logits stay bit-identical) and where they honour it (the layers left alone move
    the fused logits a little, the blind kernel hides the rest)."""
    if own_gemms_honour:
        llama.lm_head.register_forward_hook(_medium_precision_nudges)  # in both models
    llama.register_forward_hook(_medium_precision_moves)
    result = _run(llama, llama_inputs, _blind_to_precision_fuse)
    assert _verdicts(result)["matmul-precision"] == "fail", result.lifecycle
    assert torch.backends.mkldnn.matmul.fp32_precision != "bf16"  # restored


def test_matmul_precision_passes_where_both_honour_it(llama, llama_inputs):
    llama.register_forward_hook(_medium_precision_moves)
    result = _run(llama, llama_inputs, fusion.fuse)
    assert result.lifecycle["matmul-precision"]["verdict"] == "pass", result.lifecycle
    assert "moved both" in result.lifecycle["matmul-precision"]["detail"]


def _norm_without_call_fuse(model):
    """residual_norm whose helper runs the norm's kernel even when hooks are installed:
    the global-backward-hook defect of issue 24 (defect 5)."""
    from fusion.fusers.residual_norm.runtime import HELPER

    report = fusion.fuse(model)
    for module in model.modules():
        if HELPER in module.__dict__:
            module.__dict__[HELPER] = lambda a, b, norm: norm.forward.add_forward(a, b)
    return report


def test_a_norm_run_without_its_call_fails_train_global_hook(llama, llama_inputs):
    result = _run(llama, llama_inputs, _norm_without_call_fuse)
    verdicts = _verdicts(result)
    assert verdicts["train-global-hook"] == "fail", result.lifecycle
    assert verdicts["train"] == "pass"  # without the hook the helper computes the same
    assert not torch.nn.modules.module._global_backward_hooks  # removed again


def test_guards_that_miss_a_replaced_child_fail_lora_and_the_round_trip(
    llama, llama_inputs, monkeypatch
):
    """Guards blind to a replaced child (the defect: a LoRA wrapper installed after fusing
    is never called, the fused forward keeps computing without the adapter)."""
    from fusion.runtime.guards import ChildGuard

    monkeypatch.setattr(ChildGuard, "failure", lambda self, module: None)
    result = _run(llama, llama_inputs, fusion.fuse)
    verdicts = _verdicts(result)
    assert verdicts["lora-after-fuse"] == "fail", result.lifecycle["lora-after-fuse"]
    assert verdicts["guard-round-trip"] == "fail", result.lifecycle["guard-round-trip"]
    # quantized q/k/v never called: the merged product keeps computing in float
    detail = result.lifecycle["quantize-dynamic"]["detail"]
    assert verdicts["quantize-dynamic"] == "fail" and "quantized logits" in detail, detail


class _SwappedLinear(nn.Linear):
    """What `decode_linear` once made of a plain linear: a subclass computing `nn.Linear`'s
    function, which type-keyed tools no longer see as an `nn.Linear`."""


def _class_swapping_fuse(model):
    report = fusion.fuse(model)
    for name, module in model.named_modules():
        if type(module) is nn.Linear and name.endswith((".o_proj", ".down_proj", "lm_head")):
            module.__class__ = _SwappedLinear
    return report


def test_class_swapped_linears_fail_quantize_dynamic(llama, llama_inputs):
    """Regression (issue 43): linears class-swapped by fusion stay float under
    `quantize_dynamic(model, {nn.Linear})`, where the unfused model's are quantized."""
    passing = _run(llama, llama_inputs, fusion.fuse).lifecycle["quantize-dynamic"]
    assert passing["verdict"] == "pass" and "modules quantized as unfused" in passing["detail"]
    result = _run(llama, llama_inputs, _class_swapping_fuse)
    verdict = result.lifecycle["quantize-dynamic"]
    assert verdict["verdict"] == "fail", verdict
    assert "not quantized" in verdict["detail"] and "_SwappedLinear" in verdict["detail"]
    assert result.status == "fail"


def test_a_model_that_cannot_be_quantized_is_n_a(llama, llama_inputs, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("no quantized engine here")

    monkeypatch.setattr(torch.ao.quantization, "quantize_dynamic", refuse)
    verdict = _run(llama, llama_inputs, fusion.fuse).lifecycle["quantize-dynamic"]
    assert verdict == {
        "verdict": "n/a",
        "detail": "unfused model: quantize_dynamic raises: RuntimeError: no quantized engine here",
    }


def test_peft_that_cannot_load_adapters_into_the_unfused_model_is_n_a(
    llama, llama_inputs, monkeypatch
):
    """Regression (the 5.0 conformance run: PEFT 0.21's `set_peft_model_state_dict` raises
    TypeError over Transformers 5.0's weight conversions, on any model): the unfused
    model's own limit is `n/a`, not a fusion failure."""
    import peft

    def broken(model, state, *args, **kwargs):
        raise TypeError("WeightRenaming.convert() got an unexpected keyword argument")

    monkeypatch.setattr(peft, "set_peft_model_state_dict", broken)
    result = _run(llama, llama_inputs, fusion.fuse)
    verdict = result.lifecycle["lora-after-fuse"]
    assert _verdicts(result)["lora-after-fuse"] == "n/a", verdict
    assert "unfused model: PEFT's set_peft_model_state_dict raises: TypeError" in str(verdict)


def test_the_route_is_checked(llama, llama_inputs, monkeypatch):
    """`route` passes on a correct fusion (the originals ran on the fused state) and fails
    when the route computes something else (its shards' weights off by 1%)."""
    from tests.fusion import merged_paths

    verdicts = _verdicts(_run(llama, llama_inputs, fusion.fuse))
    assert verdicts["route"] == "pass"
    merged_paths.stale_route(monkeypatch, 1.01)
    result = _run(llama, llama_inputs, fusion.fuse)
    assert _verdicts(result)["route"] == "fail", result.lifecycle["route"]


def test_the_route_by_row_bucket_is_checked(llama, llama_inputs, monkeypatch):
    """`route` also runs the model under winners only at rows the inputs never use (the
    process's quiet lane closed: the routes are taken by the row-bucket rule,
    `KernelPolicy.won_rows`) and compares it: a fault only there (the shards' weights off
    by 1% whenever a route is taken with the lane closed) fails it."""
    from tests.fusion import merged_paths

    result = _run(llama, llama_inputs, fusion.fuse)
    assert _verdicts(result)["route"] == "pass"
    assert "winners only at" in str(result.lifecycle["route"])
    merged_paths.stale_route(monkeypatch, 1.01, off_the_lane=True)
    result = _run(llama, llama_inputs, fusion.fuse)
    assert _verdicts(result)["route"] == "fail", result.lifecycle["route"]


# --------------------------------------------------------------------------------------------
# edit-attributes


class _NormForward:
    """An instance-level forward installed on an RMSNorm by a test fuse (marked as fusion
    marks its own): `frozen` computes with the `variance_epsilon` read at fuse time (the
    defect: a value copied at fuse time), otherwise it reads it at each call, as the class
    forward does."""

    fusion_installed = True

    def __init__(self, norm: nn.Module, frozen: bool) -> None:
        self.norm = norm
        self.eps = norm.variance_epsilon if frozen else None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        eps = self.norm.variance_epsilon if self.eps is None else self.eps
        variance = hidden.float().pow(2).mean(-1, keepdim=True)
        return self.norm.weight * (hidden.float() * torch.rsqrt(variance + eps)).to(hidden.dtype)


def _norm_fuse(frozen: bool):
    def fuse(model: nn.Module) -> None:
        for module in model.modules():
            if type(module).__name__ == "LlamaRMSNorm":
                module.forward = _NormForward(module, frozen)

    return fuse


def _linear_head_fuse(model: nn.Module) -> None:
    """Changes only `lm_head`, whose forward reads no plain attribute (weight and bias)."""
    model.lm_head.forward = types.MethodType(nn.Linear.forward, model.lm_head)


def _edit_attributes(model, inputs, fuse) -> lifecycle.OpVerdict:
    """`edit-attributes` alone on `model` fused by `fuse` (the other operations cost seconds)."""
    unfused = copy.deepcopy(model)
    fuse(model)
    ctx = lifecycle.Context("llama", unfused, model, inputs, torch.float32, None, None, fuse)
    logits = lifecycle.core._logits(unfused, ctx), lifecycle.core._logits(model, ctx)
    ctx = dataclasses.replace(ctx, unfused_logits=logits[0], fused_logits=logits[1])
    return lifecycle.run_operation("edit-attributes", ctx)


def test_a_value_frozen_at_fuse_time_fails_edit_attributes(llama, llama_inputs):
    verdict = _edit_attributes(llama, llama_inputs, _norm_fuse(frozen=True))
    assert verdict.verdict == "fail", verdict
    assert verdict.detail.startswith(
        "logits after model.layers.0.input_layernorm.variance_epsilon 1e-06 -> 0.100001: "
        "max difference"
    ), verdict.detail
    assert "3 of 3 edits disagree" in verdict.detail


def test_values_read_live_pass_edit_attributes(llama, llama_inputs):
    verdict = _edit_attributes(llama, llama_inputs, _norm_fuse(frozen=False))
    assert verdict == lifecycle.OpVerdict("pass", "3 attribute edits agree (3 moved the logits)")
    # put back in the twins, not the models the check was given
    assert all(
        m.variance_epsilon == 1e-6 for m in llama.modules() if hasattr(m, "variance_epsilon")
    )


@pytest.mark.parametrize("fuse", [lambda model: None, _linear_head_fuse], ids=["nothing", "head"])
def test_nothing_editable_is_not_applicable(llama, llama_inputs, fuse):
    verdict = _edit_attributes(llama, llama_inputs, fuse)
    assert verdict.verdict == "n/a", verdict
    assert "no module fusion changed reads a plain attribute" in verdict.detail


def test_one_edit_per_role_and_each_kind_of_value(llama):
    fused = copy.deepcopy(llama)
    for module in fused.modules():  # every module changed
        module.forward = types.MethodType(type(module).forward, module)
    edits = {e.describe(): e.reader for e in lifecycle.attribute_edits(llama, fused)}
    # layer 1's norms are the same role as layer 0's: edited once; its layer_idx differs
    assert edits["model.layers.0.input_layernorm.variance_epsilon 1e-06 -> 0.100001"] == (
        "model.layers.0.input_layernorm"
    )
    assert not any(e.startswith("model.layers.1.input_layernorm") for e in edits)
    assert "model.layers.1.self_attn.layer_idx 1 -> 2" in edits
    assert "model.layers.0.self_attn.scaling 0.25 -> 0.375" in edits
    assert not any(".training " in e for e in edits)
    assert [lifecycle.edited_value(v) for v in (True, 2, 1, 0.5, 1e-6, "none", "relu")] == [
        False, 1, 2, 0.75, 0.100001, "tanh", None,
    ]  # fmt: skip


class _Reader(nn.Module):
    """Reads `self.a`, `self.inner.b`, `getattr(self, "c")`, `self.d` in a helper, calls
    `self.inner`."""

    def forward(self, x):
        return self.helper(self.inner(x) * self.a + self.inner.b + getattr(self, "c", 0))

    def helper(self, x):
        return x * self.d


def test_self_reads_follow_helpers_children_and_getattr():
    reads = lifecycle.self_reads(_Reader)
    assert reads.paths == {("a",), ("inner",), ("inner", "b"), ("c",), ("d",), ("helper",)}
    assert reads.called == {"helper", "inner"}


def _attention_fuse(model: nn.Module) -> None:
    """Installs each attention's own class forward on the instance (a rewrite computing the
    original): its `head_dim` edit makes the unfused model raise."""
    for layer in model.model.layers:
        layer.self_attn.forward = types.MethodType(type(layer.self_attn).forward, layer.self_attn)


def test_an_edit_the_unfused_model_rejects_is_not_judged(llama, llama_inputs):
    verdict = _edit_attributes(llama, llama_inputs, _attention_fuse)
    assert verdict.verdict == "pass", verdict
    assert verdict.detail.endswith("; 1 rejected by the unfused model"), verdict.detail


def test_only_the_selected_operations_run_the_others_are_n_a(llama, llama_inputs):
    """A system to which only some operations apply (liger: generate, train, save) gets
    those verdicts; every other operation is n/a with the reason, never a pass."""
    fused = copy.deepcopy(llama)
    with torch.no_grad():
        logits = llama(**llama_inputs).logits
    cycle = lifecycle.check(
        "llama", llama, fused, llama_inputs, torch.float32, logits, logits,
        fuse=lambda model: None, only=("generate", "train"), not_selected="not for this system",
    )  # fmt: skip
    assert list(cycle) == list(lifecycle.OPERATIONS)
    assert cycle["generate"]["verdict"] == "pass" and cycle["train"]["verdict"] == "pass"
    others = {op: v for op, v in cycle.items() if op not in ("generate", "train")}
    assert {v["verdict"] for v in others.values()} == {"n/a"}
    assert {v["detail"] for v in others.values()} == {"not for this system"}


def test_the_compiled_quiet_lane_is_checked(llama, llama_inputs, monkeypatch):
    """`compile` also compiles the fused model on the quiet lane (routes open, nothing
    measured), where compiled code traces the classes' originals, and fails when that
    computes something else (a fault only on the route: its shards' weights off by 1%)."""
    from tests.fusion import merged_paths

    merged_paths.stale_route(monkeypatch, 1.01)
    result = _run(llama, llama_inputs, fusion.fuse, mode="full")
    verdict = result.lifecycle["compile"]
    assert verdict["verdict"] == "fail" and "quiet lane" in verdict["detail"], verdict


def test_compiled_stacked_products_are_checked_after_weights_move(llama, llama_inputs, monkeypatch):
    """`compile` moves every weight after the compiled call (`p.data = ...`, which breaks the
    merged projections' views; Dynamo guards neither) and compares again: with the fast
    kernels pinned on (`eligible`, one-row size rule off) and the compiled stacked product's
    run-time view check taken away, the compiled model reads the stale stacked weight, and
    the check fails; with it, it passes."""
    from fusion.kernels import onednn as onednn_backend
    from fusion.kernels import ops
    from fusion.kernels.native import gemm as native_gemm
    from fusion.kernels.policy import POLICY

    monkeypatch.setattr(onednn_backend, "ROW_MIN_ELEMENTS", 0)
    monkeypatch.setattr(native_gemm, "MIN_ELEMENTS", 0)
    POLICY.use("eligible")
    result = _run(llama, llama_inputs, fusion.fuse, mode="full")
    assert result.lifecycle["compile"]["verdict"] == "pass", result.lifecycle["compile"]
    ran: list[bool] = []
    monkeypatch.setattr(ops, "stacked_views_hold", lambda *a: ran.append(True) or True)
    result = _run(llama, llama_inputs, fusion.fuse, mode="full")
    verdict = result.lifecycle["compile"]
    assert ran, "no compiled stacked product ran: the check was not exercised"
    assert verdict["verdict"] == "fail" and "weight moved" in verdict["detail"], verdict
