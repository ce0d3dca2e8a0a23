"""Lifecycle parity (docs/design.md, oracle 6): a fused model is judged against its unfused twin on
what users do after fusing, not only on one eval forward.

Each operation gets its own verdict, `pass`, `fail` or `n/a`, with a one-line detail:

- `generate`: greedy `generate` with the model's default cache; the tokens must be identical.
  Tokens that diverge where the unfused model's top two scores are closer than the rounding
  allowance are a near-tie, not a verdict (`n/a`, with the margin).
- `train`: one training-mode forward and backward (labels = inputs), same seed: the loss and
  every gradient, mapped back to unfused parameter names (`fusion.inspection.unfused_named`);
  a frozen parameter must stay without gradient; then one SGD step and an eval forward.
- `save-pretrained`: `state_dict()` entries must share storage exactly where the unfused
  model's do (savers that deduplicate by storage, such as accelerate's `save_model`, keep one
  name per storage); `save_pretrained` of both; the fused checkpoint must hold the unfused
  keys with bit-identical tensors, and the stock class's `from_pretrained` of it must give the
  unfused logits.
- `load-state-dict`: after a first forward, both load the same (scaled) unfused state dict,
  strictly; logits must agree.
- `edit-weights`: after a first forward, every parameter is scaled by 0.75 through each
  spelling users write (`p.data.mul_`, in-place under `no_grad`, `copy_`, `set_`,
  `p.data = ...`, an optimiser step); logits must agree after each. A stale cached copy of a
  weight anywhere in the fused model shows here.
- `edit-attributes`: after a first forward, every plain (bool, int, float, str) attribute that
  the original forward of a module fusion changed reads (`self.<name>` in its class forward
  and the methods of its own it calls), and those of the children it calls or reads
  (`self.<child>(...)`, `self.<child>.<name>`: a norm's `variance_epsilon`, a router's
  `top_k`, an activation's `approximate`), is changed in both models, one at a time
  (`attribute_edits`): the logits must agree after each, and again once it is put back. A
  value fusion froze at fuse time shows here. An edit the unfused model rejects is not judged.
- `deepcopy`, `torch-save`: the copy (`copy.deepcopy`; `torch.save` + `torch.load` of the whole
  model) must still be fused and give the fused model's logits bit for bit.
- `autocast`: an eval forward under `torch.autocast(<device>, dtype=torch.bfloat16)`. Every
  module the two models share (same qualified name) must return the dtype the unfused one
  returns (a kernel that ignores autocast computes in float32 where the unfused op would
  not: within rounding of the float32 result, so values alone cannot show it), and the
  logits must agree to bfloat16 rounding.
- `matmul-precision`: an eval forward under `torch.set_float32_matmul_precision("medium")`.
  The logits must agree within the allowance plus how far the setting moved the unfused
  logits; where it moved them at all, the fused logits must move by at least a quarter as
  much (a kernel that ignores the setting leaves them bit-identical, or moved only by the
  layers around it on a CPU whose own GEMMs honour it). On a CPU whose GEMMs ignore the
  setting both stay put and the detail says so.
- `optimizer-before-fuse`: an AdamW optimiser is built on an unfused copy, the copy is
  fused, then three training steps on it and on an unfused twin (its own AdamW): every
  Parameter the unfused steps moved must have moved, by the same amount up to rounding
  (an optimiser holds Parameter objects: a fusion that replaced them leaves the ones it
  trains outside the model), and the logits must agree after the steps.
- `parameters`: fusing an unfused copy keeps its Parameter objects (same identities, in
  the same order), and the fused model's `named_parameters()`, `named_buffers()` and
  `state_dict()` keys are the unfused model's, in order, with the same `requires_grad`;
  every module name of the unfused model is still there (fused-only modules such as a
  `qkv_proj` may be added) and its tensor- and expert-parallel plans (`_tp_plan`,
  `_ep_plan`) are the unfused model's.
- `guard-round-trip`: a child a rewritten forward's guards watch (a merged projection's
  shard first) is replaced in both models by a wrapper that doubles its output, as a LoRA
  or any user replacement would: the logits must agree (the fused forward falls back to
  the original, and counts it); with the child put back, the logits agree again and the
  fused forward runs fused. `n/a` where no rewritten forward guards a child.
- `route`: with a calibration table measuring every merged product to lose at every row
  bucket (what `fusion.calibrate` writes where fusion only costs), the rewritten forwards
  that call merged projections run their classes' originals on the fused state
  (`FusedForward.routed`): the logits must agree with the unfused model's, and a route must have
  been taken. `n/a` without such a forward, or outside the `measured` policy mode.
- `quantize-dynamic`: `torch.ao.quantization.quantize_dynamic(model, {nn.Linear},
  dtype=torch.qint8)` of copies of both models (the fused one after its first forward): the
  quantized modules must be the unfused model's, name for name and type for type (a type-keyed
  tool must see exactly the unfused types: a fused linear of another class stays float), and
  the logits must agree within the allowance, plus a quarter of how far quantisation moved
  the unfused logits where the two float models are not bit-identical (a float rounding
  difference may move an activation across a quantisation step). `n/a` with the unfused
  model's error where it cannot be quantized or run quantized.
- `lora-after-fuse`: PEFT LoRA adapters (`inject_adapter_in_model`, rank 4, random A and
  B) on up to two names of merged projections (`q_proj`, `v_proj`, ...) in both models,
  with the same adapter weights: the adapters' names must be the same, the logits must
  agree, and so must a training step (every gradient, the adapters' included). `n/a`
  without PEFT or without a merged projection.
- `train-global-hook`: the `train` check with a global full backward hook
  (`register_module_full_backward_hook`) that doubles the input gradient of every module
  whose class name contains "Norm", as a user's gradient-scaling hook would: a fused
  kernel that runs a norm without `__call__` skips it.
- `compile`: `torch.compile(fused)` (Dynamo with its `eager` backend: graph capture is what can
  break, and Inductor's C++ build would cost minutes per model on CPU) must give the fused
  logits, and must trace fullgraph wherever the unfused model does. Dynamo costs seconds per architecture, so
  `quick` (the sweep's default) skips it, `full` (conformance) runs it for `COMPILE_SELECTION`
  (one per fuser family) and `all` for every architecture.

An operation the *unfused* model cannot do (no `generate`, a save that raises) is `n/a` with
the unfused error: that is the model's limit, not a fusion defect. Anything the fused model
alone gets wrong or raises is `fail`.

Tolerance: two float computations of one function differ by rounding. Logits are compared
with an allowance of `4 x` the fused-vs-unfused difference the plain forward showed plus a
dtype floor relative to the logits' scale; a changed function (a stale weight: 18-68% off)
is orders of magnitude beyond it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch import nn

import fusion
from harness.oracles.lifecycle.core import (
    COMPILE_SELECTION,
    MODES,
    NOT_COMPILED,
    NOT_INSTALLED,
    OPERATIONS,
    VERDICTS,
    Context,
    OpVerdict,
    _compiles,
    _run,
    collecting_copies,
    not_installed,
)
from harness.oracles.lifecycle.edits import (
    AttributeEdit,
    EditOutcome,
    SelfReads,
    _edit_attributes,
    _edit_weights,
    attribute_edits,
    changed_modules,
    edited_value,
    judge_edit,
    self_reads,
)
from harness.oracles.lifecycle.execution import (
    _autocast,
    _compile,
    _generate,
    _matmul_precision,
    _quantize_dynamic,
    quantized_modules,
)
from harness.oracles.lifecycle.guards import (
    Doubled,
    _guard_round_trip,
    _route,
    double_child,
    dtype_mismatch,
    guarded_children,
    output_dtypes,
    watched_children,
)
from harness.oracles.lifecycle.persistence import (
    _deepcopy,
    _load_state_dict,
    _save_pretrained,
    _torch_save,
)
from harness.oracles.lifecycle.training import (
    _lora_after_fuse,
    _optimizer_before_fuse,
    _parameters,
    _train,
    _train_global_hook,
)

__all__ = [
    "COMPILE_SELECTION",
    "MODES",
    "NOT_COMPILED",
    "NOT_INSTALLED",
    "OPERATIONS",
    "VERDICTS",
    "AttributeEdit",
    "Context",
    "Doubled",
    "EditOutcome",
    "OpVerdict",
    "SelfReads",
    "attribute_edits",
    "changed_modules",
    "check",
    "double_child",
    "dtype_mismatch",
    "edited_value",
    "guarded_children",
    "judge_edit",
    "not_installed",
    "output_dtypes",
    "quantized_modules",
    "run_operation",
    "self_reads",
    "watched_children",
]


def check(
    architecture: str,
    unfused: nn.Module,
    fused: nn.Module,
    inputs: Mapping[str, Any],
    dtype: torch.dtype,
    unfused_logits: torch.Tensor,
    fused_logits: torch.Tensor,
    *,
    mode: str = "quick",
    fuse: Callable[[nn.Module], Any] | None = None,
    progress: Callable[[str], None] | None = None,
    only: Collection[str] | None = None,
    not_selected: str = "not selected",
) -> dict[str, dict[str, str]]:
    """{operation: {"verdict", "detail"}} for every operation of `OPERATIONS` (empty when
    `mode` is `off`). Never raises for a model-side problem; `unfused` and `fused` are left as
    they were (every operation works on deep copies). `fuse` is how `fused` was made from
    `unfused` (default `fusion.fuse`), for the operations that fuse a copy themselves.
    `progress` is told each operation as it starts ("lifecycle train (2/15)"). `only`, when
    given, selects the operations that run (a system to which only some apply); every other
    one is `n/a` with `not_selected` as its detail, never a pass."""
    if mode not in MODES:
        raise ValueError(f"lifecycle mode {mode!r} is not one of {MODES}")
    if mode == "off":
        return {}
    ctx = Context(
        architecture,
        unfused,
        fused,
        inputs,
        dtype,
        unfused_logits,
        fused_logits,
        fusion.fuse if fuse is None else fuse,
    )
    results: dict[str, dict[str, str]] = {}
    with collecting_copies() as collect:
        for number, (name, operation) in enumerate(_OPERATIONS.items(), start=1):
            if only is not None and name not in only:
                verdict = OpVerdict("n/a", not_selected)
            elif name == "compile" and not _compiles(mode, architecture):
                verdict = OpVerdict("n/a", NOT_COMPILED)
            else:
                if progress is not None:
                    progress(f"lifecycle {name} ({number}/{len(_OPERATIONS)})")
                verdict = _run(operation, ctx)
                collect()  # an operation's copies (reference cycles) go before the next one's
            results[name] = verdict.record()
    ctx.shared.clear()
    return results


def run_operation(name: str, ctx: Context) -> OpVerdict:
    """The verdict of the one operation `name` of `OPERATIONS` on `ctx` (what `check` runs
    for each; never raises for a model-side problem)."""
    return _run(_OPERATIONS[name], ctx)


_OPERATIONS: dict[str, Callable[[Context], str]] = {
    "generate": _generate,
    "train": _train,
    "save-pretrained": _save_pretrained,
    "load-state-dict": _load_state_dict,
    "edit-weights": _edit_weights,
    "edit-attributes": _edit_attributes,
    "deepcopy": _deepcopy,
    "torch-save": _torch_save,
    "autocast": _autocast,
    "matmul-precision": _matmul_precision,
    "optimizer-before-fuse": _optimizer_before_fuse,
    "parameters": _parameters,
    "guard-round-trip": _guard_round_trip,
    "route": _route,
    "quantize-dynamic": _quantize_dynamic,
    "lora-after-fuse": _lora_after_fuse,
    "train-global-hook": _train_global_hook,
    "compile": _compile,
}
assert tuple(_OPERATIONS) == OPERATIONS
