"""Lifecycle parity (DESIGN.md, oracle 6): a fused model is judged against its unfused twin on
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
  logits, and must trace fullgraph wherever the unfused model does. Dynamo costs seconds per architecture (10-20 s on a loaded 2-core machine), so
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

import ast
import contextlib
import copy
import gc
import inspect
import io
import re
import tempfile
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fusion
from fusion import inspection
from fusion.errors import RewriteRefused
from fusion.inspection import preserved_globals, unfused_named
from fusion.kernels.calibration import Entry, Table
from fusion.kernels.policy import MAX_BUCKET, POLICY, row_bucket
from harness.oracles import localise
from harness.oracles.parity import logits_of

MODES = ("off", "quick", "full", "all")
"""`off`: no lifecycle checks; `quick`: every operation but `compile`; `full`: `compile` too,
for `COMPILE_SELECTION`; `all`: `compile` for every architecture."""

OPERATIONS = (
    "generate",
    "train",
    "save-pretrained",
    "load-state-dict",
    "edit-weights",
    "edit-attributes",
    "deepcopy",
    "torch-save",
    "autocast",
    "matmul-precision",
    "optimizer-before-fuse",
    "parameters",
    "guard-round-trip",
    "route",
    "quantize-dynamic",
    "lora-after-fuse",
    "train-global-hook",
    "compile",
)

COMPILE_SELECTION = frozenset({"llama", "qwen3", "gemma2", "qwen3_moe", "deepseek_v3", "olmo2"})
"""Architectures `quick` compiles: a dense GQA model, q/k norms, a GELU-tanh GLU with
offset norms, an MoE model, MLA with MoE, and in-place q/k writes (OLMo 2's clamp)."""

VERDICTS = ("pass", "fail", "n/a")

_FLOOR = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 2e-2, torch.float16: 4e-3}
"""Allowance relative to the logits' scale, per dtype (a few units of rounding)."""


@dataclass(frozen=True)
class OpVerdict:
    verdict: str
    detail: str = ""

    def record(self) -> dict[str, str]:
        return {"verdict": self.verdict, "detail": self.detail}


class _NotApplicable(Exception):
    """The unfused model cannot do this operation: the verdict is `n/a`."""


class _Failed(Exception):
    """The fused model does this operation differently: the verdict is `fail`."""


@dataclass(frozen=True)
class Context:
    """What every operation needs: both models (already run once), inputs, dtype and the
    reference logits and allowance from the plain forward."""

    architecture: str
    unfused: nn.Module
    fused: nn.Module
    inputs: Mapping[str, Any]
    dtype: torch.dtype
    unfused_logits: torch.Tensor
    fused_logits: torch.Tensor
    fuse: Callable[[nn.Module], Any] = fusion.fuse
    """How the fused model was fused (applied again to unfused copies)."""
    shared: dict[str, Any] = field(default_factory=dict)
    """Work two operations share (`_fused_late`: one copy fused after an optimiser)."""

    @property
    def allowance(self) -> float:
        base = float((self.fused_logits.double() - self.unfused_logits.double()).abs().max())
        scale = float(self.unfused_logits.double().abs().max())
        return 4 * base + _FLOOR.get(self.dtype, 1e-5) * max(scale, 1.0)


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
) -> dict[str, dict[str, str]]:
    """{operation: {"verdict", "detail"}} for every operation of `OPERATIONS` (empty when
    `mode` is `off`). Never raises for a model-side problem; `unfused` and `fused` are left as
    they were (every operation works on deep copies). `fuse` is how `fused` was made from
    `unfused` (default `fusion.fuse`), for the operations that fuse a copy themselves.
    `progress` is told each operation as it starts ("lifecycle train (2/15)")."""
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
    for number, (name, operation) in enumerate(_OPERATIONS.items(), start=1):
        if name == "compile" and not _compiles(mode, architecture):
            verdict = OpVerdict("n/a", NOT_COMPILED)
        else:
            if progress is not None:
                progress(f"lifecycle {name} ({number}/{len(_OPERATIONS)})")
            verdict = _run(operation, ctx)
            gc.collect()  # an operation's copies (reference cycles) go before the next one's
        results[name] = verdict.record()
    ctx.shared.clear()
    return results


NOT_COMPILED = "not run in this mode (`--lifecycle full` compiles a selection, `all` every model)"
"""The detail of a `compile` verdict the mode skipped (`harness.reporting.plans` ignores it)."""

NOT_INSTALLED = "not installed: "
"""How the detail of an operation that needs a missing optional package starts ("not
installed: peft (pip install peft)"): recorded `n/a` (results files and golden plans keep their
format), shown "not run" with that reason (`harness.reporting.summary.shown_verdict`), since nothing was
tried and the unfused model may well be able to do it."""


def not_installed(package: str) -> str:
    """The n/a detail of an operation whose optional `package` does not import here."""
    return f"{NOT_INSTALLED}{package} (pip install {package})"


def _compiles(mode: str, architecture: str) -> bool:
    return mode == "all" or (mode == "full" and architecture in COMPILE_SELECTION)


def run_operation(name: str, ctx: Context) -> OpVerdict:
    """The verdict of the one operation `name` of `OPERATIONS` on `ctx` (what `check` runs
    for each; never raises for a model-side problem)."""
    return _run(_OPERATIONS[name], ctx)


def _run(operation: Callable[[Context], str], ctx: Context) -> OpVerdict:
    try:
        return OpVerdict("pass", operation(ctx))
    except _NotApplicable as exc:
        return OpVerdict("n/a", str(exc))
    except _Failed as exc:
        return OpVerdict("fail", str(exc))
    except Exception as exc:  # the fused side raised where the unfused side did not
        return OpVerdict("fail", f"raises: {localise.one_line(exc)}")


def _unfused(what: str, action: Callable[[], Any]) -> Any:
    """Run an unfused-side `action`; its exception makes the operation `n/a`."""
    try:
        return action()
    except Exception as exc:
        raise _NotApplicable(f"unfused model: {what} raises: {localise.one_line(exc)}") from exc


def _cast(inputs: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    return {
        k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in inputs.items()
    }


def _logits(model: nn.Module, ctx: Context) -> torch.Tensor:
    with torch.no_grad():
        return logits_of(model(**_cast(ctx.inputs, ctx.dtype)))


def _compare(what: str, got: torch.Tensor, want: torch.Tensor, allowance: float) -> float:
    """The max difference; raises _Failed when over `allowance` (NaN never passes)."""
    if got.shape != want.shape:
        raise _Failed(f"{what}: shape {tuple(got.shape)}, unfused {tuple(want.shape)}")
    diff = float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
    if not diff <= allowance:
        raise _Failed(f"{what}: max difference {diff:.3g} > allowed {allowance:.3g}")
    return diff


def _twins(ctx: Context) -> tuple[nn.Module, nn.Module]:
    return copy.deepcopy(ctx.unfused), copy.deepcopy(ctx.fused)


# --------------------------------------------------------------------------------------------
# The operations. Each returns its pass detail or raises _NotApplicable / _Failed.


def _generate(ctx: Context) -> str:
    unfused, fused = ctx.unfused, ctx.fused
    can = getattr(unfused, "can_generate", None)
    if not callable(can) or not can():
        raise _NotApplicable("the model cannot generate")
    kwargs = {k: v for k, v in _cast(ctx.inputs, ctx.dtype).items() if k != "use_cache"}
    options = dict(
        max_new_tokens=3,
        do_sample=False,
        num_beams=1,
        output_scores=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        want = _unfused("generate", lambda: unfused.generate(**kwargs, **options))
        got = fused.generate(**kwargs, **options)
    if torch.equal(got.sequences, want.sequences):
        return f"{want.sequences.shape[-1] - kwargs['input_ids'].shape[-1]} tokens identical"
    if got.sequences.shape != want.sequences.shape:
        raise _Failed(
            f"sequences of shape {tuple(got.sequences.shape)}, unfused "
            f"{tuple(want.sequences.shape)}"
        )
    prompt = kwargs["input_ids"].shape[-1]
    differs = (got.sequences != want.sequences).nonzero()
    row, col = (int(i) for i in differs[0])
    step = col - prompt
    scores = want.scores[step][row].double()
    margin = float(scores[want.sequences[row, col]] - scores[got.sequences[row, col]])
    if margin <= ctx.allowance:
        raise _NotApplicable(
            f"tokens diverge at step {step} on a near-tie (unfused margin {margin:.3g} <= "
            f"allowed {ctx.allowance:.3g}): not judged"
        )
    raise _Failed(f"token {step} of row {row} differs (unfused margin {margin:.3g})")


def _accepts(model: nn.Module, name: str) -> bool:
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


def _train_step(model: nn.Module, ctx: Context) -> torch.Tensor:
    model.train()
    kwargs = _cast(ctx.inputs, ctx.dtype)
    labels = kwargs.get("input_ids")
    if labels is not None and _accepts(model, "labels"):
        kwargs["labels"] = labels
    torch.manual_seed(0)  # dropout and router jitter draw the same numbers on both sides
    output = model(**kwargs)
    loss = getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        loss = logits_of(output).float().square().mean()
    loss.backward()
    return loss.detach()


def _train(ctx: Context) -> str:
    unfused, fused = _twins(ctx)
    return _train_twins(ctx, unfused, fused, unfused_named)


def _train_twins(
    ctx: Context,
    unfused: nn.Module,
    fused: nn.Module,
    rename: Callable[[nn.Module, dict[str, Any]], dict[str, Any]],
) -> str:
    """One training step of both: the loss and every gradient (the fused model's mapped to
    unfused names by `rename`) must agree, then an SGD step, and the eval logits after it."""
    want_loss = _unfused("a training step", lambda: _train_step(unfused, ctx))
    got_loss = _train_step(fused, ctx)
    rtol = 1e-3 if ctx.dtype in (torch.float32, torch.float64) else 5e-2
    _compare("loss", got_loss, want_loss, rtol * max(float(want_loss.abs()), 1.0))
    want = {n: p.grad for n, p in unfused.named_parameters()}
    got = rename(fused, {n: p.grad for n, p in fused.named_parameters()})
    if set(got) != set(want):
        extra, lost = sorted(set(got) - set(want)), sorted(set(want) - set(got))
        raise _Failed(f"parameters differ after mapping: extra {extra[:3]}, missing {lost[:3]}")
    scale = max((float(g.abs().max()) for g in want.values() if g is not None), default=0.0)
    for name, grad in want.items():
        other = got[name]
        if (grad is None) != (other is None):
            if other is not None:
                raise _Failed(f"{name} has a gradient the unfused model does not")
            raise _Failed(f"{name} has no gradient where the unfused model has one")
        if grad is not None:
            allowed = rtol * float(grad.abs().max()) + 1e-5 * scale
            _compare(f"gradient of {name}", other, grad, allowed)
    for model in (unfused, fused):
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param.sub_(0.1 * param.grad)
        model.eval()
    after = _logits(unfused, ctx)
    # Gradients that agree to rounding give steps that agree to rounding times the step: the
    # allowance grows with how far the step moved the unfused logits. A step that trains the
    # wrong weights (or misses the merged ones) differs by the step itself.
    moved = float((after.double() - ctx.unfused_logits.double()).abs().max())
    _compare("logits after an SGD step", _logits(fused, ctx), after, ctx.allowance + rtol * moved)
    return f"loss, {sum(g is not None for g in want.values())} gradients and a step agree"


def _safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def _storage_groups(model: nn.Module) -> list[list[str]]:
    """`state_dict()` keys grouped by storage (groups of two or more), the grouping that
    accelerate, safetensors and Transformers apply before saving."""
    from transformers.pytorch_utils import id_tensor_storage

    groups: dict[Any, list[str]] = {}
    for key, tensor in model.state_dict().items():
        groups.setdefault(id_tensor_storage(tensor), []).append(key)
    return sorted(group for group in groups.values() if len(group) > 1)


def _save_pretrained(ctx: Context) -> str:
    if not hasattr(ctx.unfused, "save_pretrained"):
        raise _NotApplicable("the model has no save_pretrained")
    shared, unfused_shared = _storage_groups(ctx.fused), _storage_groups(ctx.unfused)
    if shared != unfused_shared:
        extra = [group for group in shared if group not in unfused_shared]
        raise _Failed(
            f"state_dict entries share storage where the unfused model's do not: {extra[:2]} "
            "(savers that keep one name per storage would drop the others)"
        )
    with tempfile.TemporaryDirectory() as root:
        mine, theirs = Path(root, "unfused"), Path(root, "fused")
        with _quiet():
            _unfused("save_pretrained", lambda: ctx.unfused.save_pretrained(mine))
            ctx.fused.save_pretrained(theirs)
        want, got = _safetensors(mine), _safetensors(theirs)
        if set(got) != set(want):
            extra, lost = sorted(set(got) - set(want)), sorted(set(want) - set(got))
            raise _Failed(f"checkpoint keys differ: extra {extra[:3]}, missing {lost[:3]}")
        for key, tensor in want.items():
            if got[key].dtype != tensor.dtype or not torch.equal(got[key], tensor):
                raise _Failed(f"checkpoint tensor {key} is not bit-identical")
        cls = type(ctx.unfused)
        load = dict(dtype=ctx.dtype)
        reloaded = _unfused("from_pretrained", lambda: _from_pretrained(cls, mine, load))
        with _quiet():
            stock = _from_pretrained(cls, theirs, load)
    want_logits = _logits(reloaded, ctx)
    _compare("stock from_pretrained logits", _logits(stock, ctx), want_logits, 0.0)
    return f"{len(want)} tensors bit-identical; stock {cls.__name__} reloads them"


def _from_pretrained(cls: type, directory: Path, load: dict[str, Any]) -> nn.Module:
    with _quiet():
        model = cls.from_pretrained(directory, **load)
    return model.eval()


@contextlib.contextmanager
def _quiet():
    """Silence Transformers' progress bars and load reports for the checks' own saves."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        hf_logging.set_verbosity(verbosity)


def _load_state_dict(ctx: Context) -> str:
    unfused, fused = _twins(ctx)
    _logits(fused, ctx)  # "after the first forward": anything cached is warm
    state = {
        key: value * 0.75 if value.is_floating_point() else value.clone()
        for key, value in ctx.unfused.state_dict().items()
    }
    _unfused("load_state_dict", lambda: unfused.load_state_dict(dict(state)))
    fused.load_state_dict(dict(state))
    diff = _compare("logits", _logits(fused, ctx), _logits(unfused, ctx), ctx.allowance)
    return f"strict load of {len(state)} unfused keys; logits within {diff:.3g}"


def _scale_data(p: torch.Tensor) -> None:
    p.data.mul_(0.75)


def _scale_no_grad(p: torch.Tensor) -> None:
    with torch.no_grad():
        p.mul_(0.75)


def _scale_copy(p: torch.Tensor) -> None:
    with torch.no_grad():
        p.copy_(p * 0.75)


def _scale_set(p: torch.Tensor) -> None:
    with torch.no_grad():
        p.set_((p * 0.75).contiguous())


def _scale_data_assign(p: torch.Tensor) -> None:
    p.data = p.data * 0.75


_SPELLINGS: dict[str, Callable[[torch.Tensor], None]] = {
    "p.data.mul_": _scale_data,
    "no_grad p.mul_": _scale_no_grad,
    "p.copy_": _scale_copy,
    "p.set_": _scale_set,
    "p.data = ...": _scale_data_assign,
}


def _optimizer_scale(model: nn.Module) -> None:
    """An SGD step whose gradient is 0.25 p: p <- 0.75 p, as an optimiser writes it."""
    params = [p for p in model.parameters() if p.is_floating_point()]
    for p in params:
        p.grad = 0.25 * p.detach()
    torch.optim.SGD(params, lr=1.0).step()
    for p in params:
        p.grad = None


def _edit_weights(ctx: Context) -> str:
    unfused, fused = _twins(ctx)
    _logits(fused, ctx)
    _logits(unfused, ctx)
    edits: list[tuple[str, Callable[[nn.Module], None]]] = [
        (name, _each_parameter(spelling)) for name, spelling in _SPELLINGS.items()
    ]
    edits.append(("optimizer step", _optimizer_scale))
    for name, edit in edits:
        _unfused(f"editing weights by {name}", lambda edit=edit: edit(unfused))
        edit(fused)
        _compare(f"logits after {name}", _logits(fused, ctx), _logits(unfused, ctx), ctx.allowance)
    return f"{len(edits)} spellings of an in-place weight edit seen"


def _each_parameter(spelling: Callable[[torch.Tensor], None]) -> Callable[[nn.Module], None]:
    def edit(model: nn.Module) -> None:
        for param in model.parameters():
            if param.is_floating_point():
                spelling(param)

    return edit


PLAIN_TYPES = (bool, int, float, str)
"""The attribute values `edit-attributes` changes: what a config puts on a module."""

EDIT_LIMIT = 40
"""At most this many attribute edits per model (after one per role: `attribute_edits`)."""

_STRING_EDITS = {"none": "tanh", "tanh": "none", "softmax": "sigmoid", "sigmoid": "softmax"}
"""The strings `edit-attributes` knows another valid value of (GELU's `approximate`, a
router's scoring function); any other string is left alone."""

_NOT_CONFIG = frozenset({"training"})
"""Plain attributes that are modes, not configuration (`train()`/`eval()` set them)."""


@dataclass(frozen=True)
class AttributeEdit:
    """`<owner>.<name>`: `old` -> `new`, read by the original forward of `reader` (a module
    fusion changed: `owner` itself or its parent)."""

    owner: str
    name: str
    old: Any
    new: Any
    reader: str

    def describe(self) -> str:
        where = f"{self.owner}.{self.name}" if self.owner else self.name
        return f"{where} {self.old!r} -> {self.new!r}"


def edited_value(value: Any) -> Any:
    """Another valid value of a plain attribute, or None (no known alternative): a bool
    flipped; an int moved by one, staying at least 1 (`top_k` 2 -> 1, `layer_idx` 0 -> 1);
    a float x1.5, or +0.1 when small (an `eps` of 1e-6 moved by half of itself moves no
    logit past rounding); a known string to its alternative (`_STRING_EDITS`)."""
    kind = type(value)
    if kind is bool:
        return not value
    if kind is int:
        return value - 1 if value > 1 else value + 1
    if kind is float:
        return value * 1.5 if abs(value) >= 0.1 else value + 0.1
    if kind is str:
        return _STRING_EDITS.get(value)
    return None


def changed_modules(unfused: nn.Module, fused: nn.Module) -> list[str]:
    """Qualified names (the unfused model's order) of the modules fusion changed: another
    class at that name in the fused model (a replaced module: a fused norm, a fused MoE
    block) or an instance-level `forward` the unfused module does not have (a rewritten
    forward, a fused forward installed on a kept module)."""
    fused_modules = dict(fused.named_modules())
    changed = []
    for qualname, module in unfused.named_modules():
        other = fused_modules.get(qualname)
        if other is None:
            continue
        if type(other) is not type(module) or (
            "forward" in other.__dict__ and "forward" not in module.__dict__
        ):
            changed.append(qualname)
    return changed


@dataclass(frozen=True)
class SelfReads:
    """What a forward (and the methods of its own class it calls) reads of `self`:
    `paths` are `(name,)` for `self.<name>` and `(child, name)` for `self.<child>.<name>`;
    `called` the names called as `self.<name>(...)`."""

    paths: frozenset[tuple[str, ...]]
    called: frozenset[str]


def self_reads(cls: type, method: str = "forward", limit: int = 16) -> SelfReads:
    """The `SelfReads` of `cls.<method>`, following `self.<m>(...)` calls to functions of
    `cls` (up to `limit` methods). A method whose source is unavailable reads nothing here:
    this is what the check edits, so an unreadable forward gets fewer edits, never a wrong
    verdict."""
    paths: set[tuple[str, ...]] = set()
    called: set[str] = set()
    todo, seen = [method], set()
    while todo and len(seen) < limit:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            funcdef = inspection.method_source(cls, name)
        except RewriteRefused:
            continue
        found = _function_reads(funcdef)
        paths |= found.paths
        called |= found.called
        todo += [
            n for n in found.called if n not in seen and inspect.isfunction(getattr(cls, n, None))
        ]
    return SelfReads(frozenset(paths), frozenset(called))


def _function_reads(funcdef: ast.FunctionDef) -> SelfReads:
    positional = funcdef.args.posonlyargs + funcdef.args.args
    if not positional:
        return SelfReads(frozenset(), frozenset())
    me = positional[0].arg
    paths: set[tuple[str, ...]] = set()
    called: set[str] = set()
    for node in ast.walk(funcdef):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            path = _self_path(node, me)
            if path is not None and len(path) <= 2:
                paths.add(path)
        if isinstance(node, ast.Call):
            path = _self_path(node.func, me) if isinstance(node.func, ast.Attribute) else None
            if path is not None and len(path) == 1:
                called.add(path[0])
            if _is_getattr_of(node, me):  # getattr(self, "name", default)
                paths.add((node.args[1].value,))
    return SelfReads(frozenset(paths), frozenset(called))


def _self_path(node: ast.Attribute, me: str) -> tuple[str, ...] | None:
    """`self.a.b` -> ("a", "b"); None when the chain does not start at `me`."""
    names: list[str] = []
    current: ast.AST = node
    while isinstance(current, ast.Attribute):
        names.append(current.attr)
        current = current.value
    if not (isinstance(current, ast.Name) and current.id == me):
        return None
    return tuple(reversed(names))


def _is_getattr_of(node: ast.Call, me: str) -> bool:
    return (
        isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) >= 2
        and isinstance(node.args[0], ast.Name)
        and node.args[0].id == me
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    )


def attribute_edits(unfused: nn.Module, fused: nn.Module) -> list[AttributeEdit]:
    """The edits `edit-attributes` makes: for each module fusion changed
    (`changed_modules`), each plain attribute (`PLAIN_TYPES`, public, not a mode) its
    original class forward reads, then each one read by the forwards of the children it
    calls (and of theirs: `CHILD_DEPTH`) or read of a child directly, each with another
    valid value (`edited_value`). One per role: layers differ only by their index, so
    `model.layers.*.input_layernorm.eps` of one value is edited once (the first layer's),
    attributed to the module itself where fusion changed it; at most `EDIT_LIMIT`. Values
    are read from the unfused model (what the original forward sees)."""
    modules = dict(unfused.named_modules())
    memo: dict[type, SelfReads] = {}
    edits: list[AttributeEdit] = []
    roles: set[tuple[str, str, str]] = set()

    def add(owner: str, name: str, reader: str) -> None:
        module = modules[owner]
        if name.startswith("_") or name in _NOT_CONFIG or name in module._modules:
            return
        value = getattr(module, name, None)
        if type(value) not in PLAIN_TYPES:
            return
        new = edited_value(value)
        role = (_ROLE.sub("*", owner), name, repr(value))
        if new is None or role in roles:
            return
        roles.add(role)
        edits.append(AttributeEdit(owner, name, value, new, reader))

    changed = changed_modules(unfused, fused)
    for reader in changed:
        for path in _own_reads(type(modules[reader]), memo):
            add(reader, path, reader)
    # deepest first: what a changed child (a MoE block under a rewritten layer) reads of
    # its own children is attributed to it, not to the layer
    for reader in sorted(changed, key=lambda q: -q.count(".")):
        for owner, name in _child_reads(reader, modules[reader], CHILD_DEPTH, memo):
            add(owner, name, reader)
    return edits[:EDIT_LIMIT]


CHILD_DEPTH = 3
"""How far below a changed module `attribute_edits` follows called children: a rewritten
decoder layer calls its MoE block, which calls its experts, which call their activation."""


def _own_reads(cls: type, memo: dict[type, SelfReads]) -> list[str]:
    """The names `cls.forward` reads as `self.<name>`, sorted."""
    if cls not in memo:
        memo[cls] = self_reads(cls)
    return sorted(path[0] for path in memo[cls].paths if len(path) == 1)


def _child_reads(
    qualname: str, module: nn.Module, depth: int, memo: dict[type, SelfReads]
) -> list[tuple[str, str]]:
    """(owner, name) of what `module`'s forward reads of its children: `self.<child>.<name>`
    directly, and what the forwards of the children it calls read of themselves (and,
    `depth` levels down, of theirs)."""
    if type(module) not in memo:
        memo[type(module)] = self_reads(type(module))
    reads = memo[type(module)]
    found: list[tuple[str, str]] = []
    for path in sorted(reads.paths):
        if len(path) == 2 and module._modules.get(path[0]) is not None:
            found.append((_child(qualname, path[0]), path[1]))
    for name in sorted(reads.called):
        child = module._modules.get(name)
        if child is None:
            continue
        where = _child(qualname, name)
        found += [(where, attr) for attr in _own_reads(type(child), memo)]
        if depth > 1:
            found += _child_reads(where, child, depth - 1, memo)
    return found


_ROLE = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")
"""A layer index in a qualified name (`layers.0.mlp` -> `layers.*.mlp`)."""


def _child(qualname: str, name: str) -> str:
    return f"{qualname}.{name}" if qualname else name


_ABSENT = object()


def _assign(module: nn.Module, name: str, value: Any) -> Callable[[], None]:
    """Set `module.<name> = value` as a user would; returns what puts it back (the old
    value, or no instance entry where there was none)."""
    before = getattr(module, name, _ABSENT)
    had = name in module.__dict__
    setattr(module, name, value)

    def restore() -> None:
        if before is not _ABSENT:
            setattr(module, name, before)
        if not had:
            module.__dict__.pop(name, None)

    return restore


@dataclass(frozen=True)
class EditOutcome:
    """One edit judged: `verdict` is `agree`, `rejected` (the unfused model raised: not
    judged) or `differs`; `detail` says how; `moved` whether the edit moved the unfused
    logits (an edit that moves nothing, a dropout rate in eval mode, shows nothing)."""

    edit: AttributeEdit
    verdict: str
    detail: str = ""
    moved: bool = False


def judge_edit(
    edit: AttributeEdit,
    unfused: nn.Module,
    fused: nn.Module,
    ctx: Context,
    base: tuple[torch.Tensor, torch.Tensor],
) -> EditOutcome:
    """`edit` made on both models (already run once; `base`: their logits before it), the
    logits compared, then put back in both. Raises _Failed where putting it back does not
    give the fused model's logits again (its later edits would be judged on a stale state)
    or the fused model cannot take the edit."""
    what = edit.describe()
    try:
        fused_owner = fused.get_submodule(edit.owner)
    except AttributeError as exc:
        raise _Failed(f"{what}: the fused model has no module {edit.owner}") from exc
    restore = None
    try:
        restore = _assign(unfused.get_submodule(edit.owner), edit.name, edit.new)
        want = _logits(unfused, ctx)
    except Exception as exc:
        return EditOutcome(edit, "rejected", f"{what}: {localise.one_line(exc)}")
    finally:
        if restore is not None:
            restore()
    if not bool(torch.isfinite(want).all()):  # nothing to compare: NaN never agrees
        return EditOutcome(edit, "rejected", f"{what}: the unfused logits are not finite")
    try:
        restore = _assign(fused_owner, edit.name, edit.new)
        try:
            got = _logits(fused, ctx)
        finally:
            restore()
    except Exception as exc:
        raise _Failed(f"{what}: the fused model raises: {localise.one_line(exc)}") from exc
    moved = not torch.equal(want, base[0])
    if moved:  # an edit that moved nothing cannot have left a moved state behind
        _compare(f"logits with {what} put back", _logits(fused, ctx), base[1], ctx.allowance)
    try:
        _compare(f"logits after {what}", got, want, ctx.allowance)
    except _Failed as exc:
        return EditOutcome(edit, "differs", str(exc), moved)
    return EditOutcome(edit, "agree", "", moved)


def _edit_attributes(ctx: Context) -> str:
    unfused, fused = _twins(ctx)
    edits = attribute_edits(unfused, fused)
    if not edits:
        raise _NotApplicable(
            "no module fusion changed reads a plain attribute (bool/int/float/str)"
        )
    base = (_logits(unfused, ctx), _logits(fused, ctx))  # the first forward
    outcomes = [judge_edit(edit, unfused, fused, ctx, base) for edit in edits]
    differs = [o for o in outcomes if o.verdict == "differs"]
    rejected = [o for o in outcomes if o.verdict == "rejected"]
    if differs:
        others = ", ".join(f"{o.edit.owner}.{o.edit.name}" for o in differs[1:4])
        more = f"; also {others}" + (" ..." if len(differs) > 4 else "") if others else ""
        raise _Failed(
            f"{differs[0].detail} (read by {differs[0].edit.reader}); "
            f"{len(differs)} of {len(edits)} edits disagree{more}"
        )
    agreed = len(outcomes) - len(rejected)
    if not agreed:
        raise _NotApplicable(
            f"unfused model: every attribute edit raises ({len(rejected)}; first "
            f"{rejected[0].detail})"
        )
    moved = sum(o.moved for o in outcomes)
    detail = f"{agreed} attribute edits agree ({moved} moved the logits)"
    return detail + (f"; {len(rejected)} rejected by the unfused model" if rejected else "")


def _fused_state(model: nn.Module) -> tuple[int, int, int]:
    """(instance-level forwards, rewritten forwards whose guards hold, merged projections
    whose Parameters still view their stacked weight): what a copy must keep to still be
    the fused model, not merely compute like it."""
    forwards = [
        m
        for m in model.modules()
        # one fusion installed (a `LinearForward` too), or a bound function other than the
        # class's own (a pickled bound method restores as that, which is no rewrite)
        if "forward" in m.__dict__
        and (
            inspection.has_installed_forward(m)
            or getattr(m.__dict__["forward"], "__func__", None) not in (None, type(m).forward)
        )
    ]
    guarded = sum(f.rewrite and f.failure is None for f in inspection.fused_forwards(model))
    stacked = sum(p.views_hold for p in inspection.merged_projections(model))
    return len(forwards), guarded, stacked


def _same_fused(copied: nn.Module, ctx: Context, what: str) -> str:
    want, got = _fused_state(ctx.fused), _fused_state(copied)
    if got != want:
        raise _Failed(
            f"{what} has {got[0]} instance forwards ({got[1]} guarded rewrites holding) and "
            f"{got[2]} stacked merges; the fused model {want[0]} ({want[1]}) and {want[2]}"
        )
    logits = _logits(copied, ctx)
    if not torch.equal(logits, ctx.fused_logits):
        _compare(f"{what} logits", logits, ctx.fused_logits, 0.0)
    return f"still fused ({got[1]} rewritten forwards, {got[2]} stacked), logits bit-identical"


def _deepcopy(ctx: Context) -> str:
    return _same_fused(copy.deepcopy(ctx.fused), ctx, "the deep copy")


def _torch_save(ctx: Context) -> str:
    buffer = io.BytesIO()
    _unfused("torch.save", lambda: torch.save(ctx.unfused, io.BytesIO()))
    torch.save(ctx.fused, buffer)
    buffer.seek(0)
    return _same_fused(torch.load(buffer, weights_only=False), ctx, "the reloaded model")


def _device_type(model: nn.Module) -> str:
    first = next(iter(model.parameters()), None)
    return "cpu" if first is None else first.device.type


def watched_children(model: nn.Module) -> set[int]:
    """ids of the modules a rewritten forward's guards watch as plainly called
    (`fusion.inspection.FusedForward.watched`): a hook on one of them makes that forward run its original
    instead, so an oracle that hooks them would judge the unfused path."""
    return {id(child) for f in inspection.fused_forwards(model) for _, child in f.watched}


@contextlib.contextmanager
def output_dtypes(model: nn.Module):
    """Yields a dict that fills, while the block runs, with {qualified name: dtype of the
    module's first tensor output} for every module of `model` called (first call wins),
    except the modules fused forwards' guards watch (`watched_children`): they are not
    hooked, so the fused path stays the one judged."""
    dtypes: dict[str, torch.dtype] = {}
    watched = watched_children(model)
    names = {id(m): n for n, m in model.named_modules()}

    def record(module: nn.Module, args: Any, output: Any) -> None:
        first = output if isinstance(output, torch.Tensor) else None
        if first is None and isinstance(output, (tuple, list)) and output:
            first = output[0] if isinstance(output[0], torch.Tensor) else None
        name = names.get(id(module))
        if first is not None and name is not None:
            dtypes.setdefault(name, first.dtype)

    handles = [m.register_forward_hook(record) for m in model.modules() if id(m) not in watched]
    try:
        yield dtypes
    finally:
        for handle in handles:
            handle.remove()


def dtype_mismatch(want: dict[str, torch.dtype], got: dict[str, torch.dtype]) -> str | None:
    """Where the fused model's module outputs (`got`, from `output_dtypes`) have another
    dtype than the unfused model's (`want`), or None: a module both have (same name) must
    return the same dtype; a module only the fused model has (a merged projection) must
    return a dtype one of the modules only the unfused model has under the same parent (the
    ones it replaced) returned. Its output feeds code the two models share, where a float32
    value would be silently promoted or rounded, so values alone may not show it."""

    def parent(name: str) -> str:
        return name.rpartition(".")[0]

    for name in sorted(set(want) & set(got)):
        if got[name] != want[name]:
            return f"{name or 'the model'} returns {got[name]}, unfused {want[name]}"
    for name in sorted(set(got) - set(want)):
        replaced = {
            dtype
            for other, dtype in want.items()
            if other not in got and parent(other) == parent(name)
        }
        if replaced and got[name] not in replaced:
            shown = ", ".join(sorted(str(d) for d in replaced))
            return f"{name} returns {got[name]} where the modules it replaced returned {shown}"
    return None


def _autocast(ctx: Context) -> str:
    device = _device_type(ctx.unfused)
    unfused, fused = _twins(ctx)

    def run(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.dtype]]:
        with torch.autocast(device, dtype=torch.bfloat16), output_dtypes(model) as dtypes:
            return _logits(model, ctx), dtypes

    want, want_dtypes = _unfused("a forward under autocast", lambda: run(unfused))
    got, got_dtypes = run(fused)
    mismatch = dtype_mismatch(want_dtypes, got_dtypes)
    if mismatch:
        raise _Failed(f"under autocast {mismatch}")
    if got.dtype != want.dtype:
        raise _Failed(f"under autocast the logits are {got.dtype}, unfused {want.dtype}")
    scale = float(want.double().abs().max()) if want.numel() else 0.0
    allowance = ctx.allowance + _FLOOR[torch.bfloat16] * max(scale, 1.0)
    diff = _compare("logits under autocast", got, want, allowance)
    return f"{len(got_dtypes)} modules return the unfused dtypes; logits within {diff:.3g}"


# How much less than the unfused logits the fused ones may move under a reduced matmul
# precision before a kernel is taken to ignore it (a blind kernel moves them by zero, or only
# by what the layers around it move; an honest one by about as much as unfused).
_PRECISION_MOVE_RATIO = 4.0


def _matmul_precision(ctx: Context) -> str:
    unfused, fused = _twins(ctx)
    with preserved_globals():  # puts the caller's precision back, whichever API set it
        torch.set_float32_matmul_precision("medium")
        want = _unfused("a forward at matmul precision medium", lambda: _logits(unfused, ctx))
        got = _logits(fused, ctx)
    moved = float((want.double() - ctx.unfused_logits.double()).abs().max())
    diff = _compare("logits at matmul precision medium", got, want, ctx.allowance + 4 * moved)
    if moved == 0.0:
        return f"logits within {diff:.3g} (the setting changes no unfused logit here)"
    fused_moved = float((got.double() - ctx.fused_logits.double()).abs().max())
    if fused_moved < moved / _PRECISION_MOVE_RATIO:
        # Both models round the same matmul inputs the same way under the setting, so an
        # honest fused model moves about as far as the unfused one; bit-identity alone is
        # not the test: on a CPU whose own GEMMs honour the setting (AMX), the layers a
        # fusion leaves alone move the fused logits too while a blind kernel still hides
        # most of the unfused movement.
        raise _Failed(
            f"the setting moves the unfused logits by {moved:.3g} and the fused ones by only "
            f"{fused_moved:.3g}: a fused kernel ignores it"
        )
    return (
        f"logits within {diff:.3g}; the setting moved both (unfused by {moved:.3g}, "
        f"fused by {fused_moved:.3g})"
    )


def _fused_late(ctx: Context) -> tuple[nn.Module, torch.optim.Optimizer, list[int]]:
    """An unfused copy, an AdamW optimiser built on it, then the copy fused: (the copy, its
    optimiser, its Parameters' identities before fusing). Made once per check."""
    if "late" not in ctx.shared:
        late = copy.deepcopy(ctx.unfused)
        identities = [id(p) for p in late.parameters()]
        # eps=1: AdamW's update stays linear in small gradients, so gradients equal up to
        # rounding (what `train` checks) give updates equal up to rounding; with the default
        # eps a gradient at rounding-noise level is normalised to a full step of either sign.
        optimizer = torch.optim.AdamW(late.parameters(), lr=1e-2, eps=1.0)
        ctx.fuse(late)  # after the optimiser holds its Parameters
        ctx.shared["late"] = (late, optimizer, identities)
    return ctx.shared["late"]


def _optimizer_before_fuse(ctx: Context) -> str:
    unfused = copy.deepcopy(ctx.unfused)
    before = {name: p.detach().clone() for name, p in unfused.named_parameters()}
    late, late_optimizer, _ = _fused_late(ctx)
    optimizers = [torch.optim.AdamW(unfused.parameters(), lr=1e-2, eps=1.0), late_optimizer]
    rtol = 1e-3 if ctx.dtype in (torch.float32, torch.float64) else 5e-2
    for _ in range(3):
        for model, optimizer in zip((unfused, late), optimizers):
            optimizer.zero_grad(set_to_none=True)
            if model is unfused:
                _unfused("a training step", lambda: _train_step(unfused, ctx))
            else:
                _train_step(late, ctx)
            optimizer.step()
    got = dict(late.named_parameters())
    moved_count = 0
    for name, param in unfused.named_parameters():
        other = got.get(name)
        if other is None:
            raise _Failed(f"the fused model has no parameter {name}")
        moved = float((param.detach().double() - before[name].double()).abs().max())
        if moved == 0.0:
            continue
        moved_count += 1
        if torch.equal(other.detach(), before[name]):
            raise _Failed(f"{name} was never updated by the optimiser built before fusing")
        allowed = rtol * moved + 1e-6 * float(before[name].abs().max())
        _compare(f"{name} after 3 AdamW steps", other.detach(), param.detach(), allowed)
    for model in (unfused, late):
        model.eval()
    after = _logits(unfused, ctx)
    moved = float((after.double() - ctx.unfused_logits.double()).abs().max())
    _compare("logits after the steps", _logits(late, ctx), after, ctx.allowance + rtol * moved)
    return f"{moved_count} parameters trained as unfused by an optimiser built before fusing"


def _parameters(ctx: Context) -> str:
    late, _, identities = _fused_late(ctx)
    if [id(p) for p in late.parameters()] != identities:
        raise _Failed("fusing replaced or reordered Parameter objects")
    for what, listing in (
        ("named_parameters()", lambda m: [(n, p.requires_grad) for n, p in m.named_parameters()]),
        ("named_buffers()", lambda m: [n for n, _ in m.named_buffers()]),
        ("state_dict() keys", lambda m: list(m.state_dict())),
    ):
        want, got = listing(ctx.unfused), listing(ctx.fused)
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
            where = min(len(got), len(want)) if first is None else first
            raise _Failed(
                f"{what} differ at position {where}: "
                f"{got[where] if where < len(got) else 'nothing'}, unfused "
                f"{want[where] if where < len(want) else 'nothing'}"
            )
    kept = {name for name, _ in ctx.fused.named_modules()}
    gone = [name for name, _ in ctx.unfused.named_modules() if name not in kept]
    if gone:  # fused-only modules (a `qkv_proj`) may be added; none may go
        raise _Failed(f"{len(gone)} modules are gone from named_modules() ({gone[:3]})")
    for attr in ("_tp_plan", "_ep_plan"):
        # a plan applied later must meet the names it was written for (fusion.placement)
        want_plan = getattr(ctx.unfused, attr, None) or {}
        got_plan = getattr(ctx.fused, attr, None) or {}
        if got_plan != want_plan:
            lost = sorted(set(want_plan) - set(got_plan))
            raise _Failed(f"{attr.strip('_')} differs: {len(lost)} entries lost ({lost[:3]})")
    return (
        f"{len(identities)} Parameters kept; names, order, buffers, keys and parallel plans "
        "identical; every module name kept"
    )


class Doubled(nn.Module):
    """A user's replacement of a child (a LoRA wrapper stands in): the child, output x2."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(*args, **kwargs)
        return out * 2.0 if isinstance(out, torch.Tensor) else out


def guarded_children(model: nn.Module) -> list[tuple[str, str]]:
    """(qualified name of a module with a rewritten forward, the name of a child its guards
    watch as plainly called), merged projections' shards first."""
    found = [
        (not isinstance(child, nn.Linear), f.qualname, name)
        for f in inspection.fused_forwards(model)
        for name, child in f.watched
    ]
    return [site[1:] for site in sorted(found)]


def double_child(models: tuple[nn.Module, ...], qualname: str, name: str) -> list[nn.Module] | None:
    """Replace `<qualname>.<name>` in each of `models` by `Doubled` around it (a user's
    replacement after fusing); the replaced children, or None (nothing replaced) where the
    first model has no such child."""
    parents = [model.get_submodule(qualname) for model in models]
    if name not in parents[0]._modules:
        return None
    children = [parent._modules[name] for parent in parents]
    for parent, child in zip(parents, children):
        setattr(parent, name, Doubled(child))
    return children


def _guard_round_trip(ctx: Context) -> str:
    """The first guarded child whose module the forward runs (a cross-attention without
    encoder states is never called): replaced, the logits agree and the rewrite fell back;
    put back, the fused forward runs again."""
    sites = guarded_children(ctx.fused)
    if not sites:
        raise _NotApplicable("no rewritten forward guards a child in this model")
    unfused = fused = None
    for qualname, name in sites[:8]:
        unfused = fused = None  # the last site's twins go before the next pair is made
        unfused, fused = _twins(ctx)
        children = double_child((unfused, fused), qualname, name)
        if children is None:
            continue
        parents = [m.get_submodule(qualname) for m in (unfused, fused)]
        where = f"{qualname + '.' if qualname else ''}{name}"
        want = _unfused(f"a forward with {where} replaced", lambda u=unfused: _logits(u, ctx))
        got = _logits(fused, ctx)
        _compare(f"logits with {where} replaced", got, want, ctx.allowance)
        failures = inspection.guard_failures(parents[1])
        if failures == 0:
            continue  # this forward did not run on these inputs: the next site
        for parent, child in zip(parents, children):
            setattr(parent, name, child)
        _compare(f"logits with {where} put back", _logits(fused, ctx), ctx.fused_logits, 0.0)
        if inspection.guard_failures(parents[1]) != failures:
            raise _Failed(f"with {where} put back, {qualname} still runs its original forward")
        return f"{where} replaced: original forward ran, logits agree; put back: fused again"
    raise _NotApplicable("no guarded rewritten forward runs on these inputs")


def _references_measured(model: nn.Module) -> Table:
    """A calibration table in which every merged projection of `model` was measured, at
    every row bucket and this thread count, in every floating dtype, to run its reference
    (no kernel won): what `fusion.calibrate` writes on a machine where fusion only costs."""
    table = Table("lifecycle: every merged product measured to lose")
    buckets = sorted({row_bucket(rows) for rows in range(1, MAX_BUCKET + 1)})
    for merged in inspection.merged_projections(model):
        for dtype in ("float32", "bfloat16", "float16", "float64"):
            for bucket in buckets:
                table.add(
                    Entry(
                        op="stacked",
                        shape=merged.kernel_shape,
                        dtype=dtype,
                        rows=bucket,
                        threads=torch.get_num_threads(),
                        median_us={"reference": 1.0},
                        ratios={},
                        rounds=0,
                    )
                )
    return table


def _route(ctx: Context) -> str:
    """Where a calibration measured every merged product to lose, the rewritten forwards
    run their classes' originals on the fused state (`FusedForward.routed`): the logits agree with
    the unfused model's, and at least one forward took the route."""
    if POLICY.mode != "measured":
        raise _NotApplicable(f"kernel policy mode {POLICY.mode!r}: routes are measured-mode only")
    fused = copy.deepcopy(ctx.fused)
    forwards = [f for f in inspection.fused_forwards(fused) if f.routed]
    if not forwards:
        raise _NotApplicable("no rewritten forward has a route (no merged projection it calls)")
    previous = POLICY.table
    POLICY.set_table(_references_measured(fused))
    try:
        got = _logits(fused, ctx)
    finally:
        POLICY.set_table(previous)
    taken = sum(inspection.original_calls(f.module) for f in forwards)
    if not taken:
        raise _NotApplicable("no route taken on these inputs (hooks, or another input width)")
    _compare("logits on the route", got, ctx.unfused_logits, ctx.allowance)
    return f"{taken} of the rewritten forwards' calls ran the original; logits agree"


_QUANTIZATION_SHARE = 0.25
"""The share of the unfused model's own quantisation error (its quantized logits against its
float ones) that `quantize-dynamic` adds to the allowance where the float models differ:
there a rounding difference may move a dynamically quantized activation across a step."""


def quantized_modules(model: nn.Module) -> dict[str, str]:
    """{qualified name: class name} of every quantized module of `model` (a class of
    `torch.ao.nn`, what `quantize_dynamic` installs in place of the types it maps)."""
    return {
        name: type(module).__qualname__
        for name, module in model.named_modules()
        if type(module).__module__.startswith("torch.ao.nn.")
    }


def _quantized(model: nn.Module) -> nn.Module:
    """`model` (a twin: a copy of the context's model) quantized in place: a third copy of a
    large corpus model (musicgen on 4.57: 420M parameters) ran two workers out of memory."""
    with warnings.catch_warnings():
        # torch.ao.quantization's deprecation notices, once per call
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(
            model, {nn.Linear}, dtype=torch.qint8, inplace=True
        )


def _quantized_logits(model: nn.Module, ctx: Context) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _logits(model, ctx)


def _quantize_dynamic(ctx: Context) -> str:
    """A type-keyed transform after fusing: the fused model's quantized modules must be the
    unfused model's (same names, same classes), and its quantized logits the unfused one's
    (the rewritten forwards whose children were replaced run their originals)."""
    unfused, fused = _twins(ctx)
    unfused = _unfused("quantize_dynamic", lambda: _quantized(unfused))
    want = _unfused("a forward of the quantized model", lambda: _quantized_logits(unfused, ctx))
    fused = _quantized(fused)
    want_kinds, got_kinds = quantized_modules(unfused), quantized_modules(fused)
    if got_kinds != want_kinds:
        missing = sorted(set(want_kinds) - set(got_kinds))
        extra = sorted(set(got_kinds) - set(want_kinds))
        changed = sorted(
            n for n in set(want_kinds) & set(got_kinds) if want_kinds[n] != got_kinds[n]
        )
        shown = missing[:1] or extra[:1] or changed[:1]
        still = {n: type(m).__name__ for n, m in ctx.fused.named_modules()}
        raise _Failed(
            f"quantize_dynamic quantized {len(got_kinds)} modules of the fused model, "
            f"{len(want_kinds)} of the unfused ({len(missing)} not quantized, {len(extra)} "
            f"only fused, {len(changed)} of another class; first: {shown[0]}, a "
            f"{still.get(shown[0], '?')} in the fused model)"
        )
    if not want_kinds:
        raise _NotApplicable("quantize_dynamic quantizes no module of the unfused model")
    got = _quantized_logits(fused, ctx)
    moved = float((want.double() - ctx.unfused_logits.double()).abs().max())
    identical = torch.equal(ctx.fused_logits, ctx.unfused_logits)
    allowance = ctx.allowance + (0.0 if identical else _QUANTIZATION_SHARE * moved)
    diff = _compare("quantized logits", got, want, allowance)
    return (
        f"{len(want_kinds)} modules quantized as unfused; logits within {diff:.3g} "
        f"(quantisation moved the unfused logits by {moved:.3g})"
    )


def _lora_targets(model: nn.Module) -> list[str]:
    """Two shard names (or one) of the model's first merged projection (attention comes
    before the MLP): what a user names in `LoraConfig(target_modules=...)` (`q_proj` and
    `k_proj`). Not a GLU's gate without its up projection: PEFT refuses that split."""
    first = next(iter(inspection.merged_projections(model)), None)
    return [] if first is None else list(first.shard_names[:2])


def _lora_after_fuse(ctx: Context) -> str:
    try:
        import peft
    except ImportError as exc:
        raise _NotApplicable(not_installed("peft")) from exc
    targets = _lora_targets(ctx.fused)
    if not targets:
        raise _NotApplicable("no merged projection for a LoRA adapter to target")
    # init_lora_weights=False: B is random too, so the adapters change the outputs at once
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    unfused, fused = _twins(ctx)
    _unfused(f"LoRA on {targets}", lambda: peft.inject_adapter_in_model(config, unfused))
    peft.inject_adapter_in_model(config, fused)
    adapters = _unfused(
        "PEFT's adapter state dict", lambda: peft.get_peft_model_state_dict(unfused)
    )
    # Loading them back into the unfused model first (a no-op there): where PEFT cannot load
    # adapters into this model at all (PEFT 0.21 over Transformers 5.0's weight conversions
    # raises TypeError), that is the unfused model's own limit, not a fusion failure.
    _unfused(
        "PEFT's set_peft_model_state_dict",
        lambda: peft.set_peft_model_state_dict(unfused, adapters),
    )
    missing = peft.set_peft_model_state_dict(fused, adapters).unexpected_keys
    if missing or set(peft.get_peft_model_state_dict(fused)) != set(adapters):
        raise _Failed("the fused model's LoRA adapters have other names than the unfused one's")
    want = _logits(unfused, ctx)
    if torch.equal(want, ctx.unfused_logits):
        raise _NotApplicable(f"LoRA on {targets} does not change the unfused logits here")
    diff = _compare(f"logits with LoRA on {targets}", _logits(fused, ctx), want, ctx.allowance)
    _train_twins(ctx, unfused, fused, lambda model, grads: grads)
    return f"LoRA on {targets} after fusing: logits within {diff:.3g}, a training step agrees"


def _double_norm_gradients(module: nn.Module, grad_input: Any, grad_output: Any) -> Any:
    if "Norm" not in type(module).__name__:
        return None
    return tuple(g * 2.0 if g is not None and g.is_floating_point() else g for g in grad_input)


def _train_global_hook(ctx: Context) -> str:
    handle = nn.modules.module.register_module_full_backward_hook(_double_norm_gradients)
    try:
        with warnings.catch_warnings():
            # "Full backward hook is firing when gradients are computed with respect to
            # module outputs since no inputs require gradients": the embedding's output.
            warnings.simplefilter("ignore", UserWarning)
            return _train(ctx)
    finally:
        handle.remove()


def _compile(ctx: Context) -> str:
    """Where the unfused model compiles fullgraph, the fused one must too (a graph break
    the fusion introduced is a defect); otherwise both compile with graph breaks."""
    import torch._dynamo

    unfused, fused = _twins(ctx)
    torch._dynamo.reset()
    try:
        want = _logits(torch.compile(unfused, fullgraph=True, backend="eager"), ctx)
        fullgraph = True
    except Exception:
        torch._dynamo.reset()
        unfused = copy.deepcopy(ctx.unfused)
        want = _unfused(
            "torch.compile", lambda: _logits(torch.compile(unfused, backend="eager"), ctx)
        )
        fullgraph = False
    torch._dynamo.reset()
    try:
        got = _logits(torch.compile(fused, fullgraph=fullgraph, backend="eager"), ctx)
    finally:
        torch._dynamo.reset()
    _compare("compiled logits", got, ctx.fused_logits, ctx.allowance)
    _compare("compiled logits vs compiled unfused", got, want, ctx.allowance)
    how = "fullgraph, as the unfused model" if fullgraph else "with graph breaks, as unfused"
    return f"compiled (Dynamo, eager backend; {how}) logits agree"


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
