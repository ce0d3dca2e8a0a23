"""Apply Liger Kernel's own entry point to a built HF model, scoped to that model, for the oracles.

The `liger` system (`harness.runner.systems`) judges Liger Kernel (`liger-kernel`, pinned
`LIGER_VERSION`) with the same oracles as any system: what `apply(model)` does is what a
Liger user does, `apply_liger_kernel_to_<type>(model=model)` from Liger's own per-type table
(`liger_kernel.transformers.monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN`), with its defaults
(RoPE, RMSNorm, SwiGLU / GeGLU, MoE experts, fused linear cross-entropy where the type has
them). Importing this module never imports liger_kernel.

Liger patches more than the model it is given: module functions and classes of the modeling
module, class attributes, torch's cross-entropy (`harness.peers.liger_globals`). So `apply`
snapshots those namespaces, calls Liger, records what changed, and restores them at once: an
unfused model, the float64 reference and the next architecture of the same worker run
Transformers' own code. The patched model gets forward pre- and post-hooks (on every module,
`always_call`) that install Liger's global changes only while it runs (reentrant), and count
the Liger Triton kernels it launches (`harness.peers.triton_launches`).

On a machine without a GPU the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`,
required: `unavailable()` says so), with its gaps handled by `harness.peers.triton_interpreter`,
installed by `apply` for the worker's lifetime (it changes only Triton's interpreter, and a
patched model's backward pass launches kernels outside any forward).

Fail closed: a model type Liger does not register is `NotRegistered` (the system's apply
error, never a judged unpatched model); a patch that changed no module and no global, or whose
model launched no Liger kernel of a family it replaced, is reported by
`Application.unapplied()` (the `not-applied` finding), never a pass.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fusion.report import Applied, FusionReport
from harness.peers import triton_interpreter, triton_launches
from harness.peers.liger_globals import Changes, Snapshot

LIGER_VERSION = "0.8.5"
"""The liger-kernel release this module and its data (`IN_CORPUS`, `NOT_IN_CORPUS`) follow."""

IN_CORPUS: tuple[str, ...] = (
    "deepseek_v2", "deepseek_v3", "deepseek_v4", "exaone4", "falcon_h1", "gemma", "gemma2",
    "gemma3", "gemma3_text", "gemma4", "gemma4_text", "glm4", "gpt_oss", "granite",
    "hunyuan_v1_dense", "hunyuan_v1_moe", "llama", "llama4", "llama4_text", "ministral",
    "mistral", "mixtral", "mllama", "nemotron", "olmo2", "olmo3", "phi3", "qwen2", "qwen3",
    "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next",
    "smollm3",
)  # fmt: skip
"""Liger's model types that are corpus architectures (the same name): what `--system liger`
sweeps (tox -e liger-system). A test keeps this, `NOT_IN_CORPUS` and the installed Liger's
table in step."""

_VISION = "a vision-language model (image-text-to-text); the corpus builds causal LMs only"
_SUBCONFIG = "the text sub-config type of a vision-language model, no causal-LM class of its own"

NOT_IN_CORPUS: dict[str, str] = {
    "glm4v": _VISION,
    "glm4v_moe": _VISION,
    "internvl": _VISION,
    "llava": _VISION,
    "muse_glimmer": _VISION,
    "paligemma": _VISION,
    "qwen2_vl": _VISION,
    "qwen2_5_vl": _VISION,
    "qwen3_vl": _VISION,
    "qwen3_vl_moe": _VISION,
    "smolvlm": _VISION,
    "mllama_text_model": _SUBCONFIG,
    "qwen2_vl_text": _SUBCONFIG,
    "qwen2_5_vl_text": _SUBCONFIG,
    "qwen3_vl_text": _SUBCONFIG,
    "qwen3_vl_moe_text": _SUBCONFIG,
    "pixtral": "a vision encoder (no language-model head); the corpus builds causal LMs only",
}
"""Liger's model types the corpus does not build, with the reason (Transformers 5.24)."""

KERNEL_PREFIX = "liger_kernel."

FAMILIES: tuple[tuple[str, str], ...] = (
    ("RMSNorm", "rms_norm"),
    ("LayerNorm", "layer_norm"),
    ("SwiGLU", "swiglu"),
    ("BlockSparseTop2MLP", "swiglu"),
    ("GEGLU", "geglu"),
    ("Experts", "fused_moe"),
)
"""(marker, family): a module forward replaced by a method of a Liger class whose name holds
the marker (LigerRMSNorm, LigerFalconH1SwiGLUMLP, ...) is of that family. A model forward
from `liger_kernel.transformers.model.*` (lce_forward, causal_forward, multimodal_forward) is
`fused_linear_cross_entropy`; anything else is named after its class."""

MODEL_FORWARDS = "liger_kernel.transformers.model."

KERNEL_MODULES: dict[str, tuple[str, ...]] = {
    "rms_norm": ("liger_kernel.ops.rms_norm", "liger_kernel.ops.fused_add_rms_norm"),
    "layer_norm": ("liger_kernel.ops.layer_norm",),
    "swiglu": ("liger_kernel.ops.swiglu",),
    "geglu": ("liger_kernel.ops.geglu",),
    "fused_moe": ("liger_kernel.ops.fused_moe", "liger_kernel.ops.fused_moe_kernels"),
    "rope": ("liger_kernel.ops.rope", "liger_kernel.ops.llama4_rope"),
}
"""Family -> the modules of its Triton kernels: a family applied whose kernels never launched
in the forward is `not-applied`. Fused linear cross-entropy launches only with labels (not in
an inference forward), so it is not required there."""

GLOBAL_FAMILIES = {"apply_rotary_pos_emb": "rope", "apply_multimodal_rotary_pos_emb": "rope"}
"""Module-level names whose replacement promises a family's launches."""


class LigerUnavailable(RuntimeError):
    """liger-kernel cannot run here (not installed, or no GPU and no interpreter)."""


class NotRegistered(RuntimeError):
    """Liger registers no apply function for this model type."""


def registry() -> dict[str, Callable[..., None]]:
    """Liger's {model type: apply_liger_kernel_to_<type>}; LigerUnavailable when it does not
    import. Imported here, not at module import: importing it builds Liger's Triton kernels,
    interpreted or compiled per TRITON_INTERPRET at that moment."""
    try:
        patch = importlib.import_module("liger_kernel.transformers.monkey_patch")
    except ImportError as exc:
        raise LigerUnavailable(
            f"liger-kernel does not import ({exc}); pip install liger-kernel=={LIGER_VERSION}"
        ) from exc
    return dict(patch.MODEL_TYPE_TO_APPLY_LIGER_FN)


def unavailable() -> str | None:
    """Why the liger system cannot run here, or None: liger-kernel must be importable, and
    without a CUDA device Triton must interpret (`TRITON_INTERPRET=1`, set before Liger's
    kernels are imported; its compiled kernels need a GPU driver)."""
    if not torch.cuda.is_available() and not triton_interpreter.interpreter_on():
        return "no GPU here: set TRITON_INTERPRET=1 to run Liger's Triton kernels interpreted"
    try:
        registry()
    except LigerUnavailable as exc:
        return str(exc)
    return None


def family_of(method: Any) -> str:
    """The kernel family of a replaced forward (`FAMILIES`), from its function's qualname."""
    func = getattr(method, "__func__", method)
    qualname = getattr(func, "__qualname__", "") or ""
    for marker, family in FAMILIES:
        if marker in qualname:
            return family
    if (getattr(func, "__module__", "") or "").startswith(MODEL_FORWARDS):
        return "fused_linear_cross_entropy"
    parts = qualname.split(".")
    return parts[-2] if len(parts) > 1 and parts[-1] == "forward" else parts[-1]


@dataclass
class Application:
    """What `apply` did to one model and what its kernels did since: replaced forwards,
    global changes, launches per kernel (counted while the model runs)."""

    model_type: str
    report: FusionReport = field(default_factory=FusionReport)
    changes: Changes = field(default_factory=Changes)
    dropped: list[str] = field(default_factory=list)
    launches: Counter[str] = field(default_factory=Counter)

    def counts(self) -> dict[str, int]:
        """Replaced module forwards per family, and replaced globals per family."""
        out: Counter[str] = Counter(record.fuser for record in self.report.applied)
        for change in self.changes.changes:
            kind = "class" if isinstance(change.new, type) else "global"
            out[f"liger:{GLOBAL_FAMILIES.get(change.name, kind)}"] += 1
        return dict(sorted(out.items()))

    def families(self) -> set[str]:
        """Families whose kernels an inference forward must launch."""
        found = {r.fuser.split(":", 1)[1] for r in self.report.applied}
        found |= {
            GLOBAL_FAMILIES[c.name] for c in self.changes.changes if c.name in GLOBAL_FAMILIES
        }
        return {f for f in found if f in KERNEL_MODULES}

    def unapplied(self) -> str:
        """Why the patch does not count as applied ("" when it does): nothing changed, no
        Liger kernel launched, or a family applied whose kernels never launched."""
        if not self.report.applied and not self.changes.changes:
            return f"apply_liger_kernel_to_{self.model_type} changed no module and no global"
        if not self.launches:
            return "no Liger Triton kernel launched in the patched model's forward"
        launched = {name.rsplit(".", 1)[0] for name in self.launches}
        silent = sorted(
            family for family in self.families() if not launched & set(KERNEL_MODULES[family])
        )
        if silent:
            return f"Liger applied {', '.join(silent)} but launched none of its kernels"
        return ""

    def summary(self) -> str:
        """One line: what Liger replaced and launched."""
        applied = ", ".join(f"{k} x{n}" for k, n in self.counts().items()) or "nothing"
        total = sum(self.launches.values())
        kernels = ", ".join(
            f"{name.rsplit('.', 1)[-1]} x{n}" for name, n in sorted(self.launches.items())
        )
        text = f"liger applied: {applied}; {total} kernel launch(es)"
        return f"{text} ({kernels})" if kernels else text


def apply(model: nn.Module) -> Application:
    """Apply Liger's entry point for `model`'s type to `model` (in place), scoped to it (see
    the module docstring). Raises NotRegistered for a type Liger does not register,
    LigerUnavailable where it cannot run; the process's globals are restored either way."""
    table = registry()
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None) or ""
    if model_type not in table:
        raise NotRegistered(
            f"liger-kernel {LIGER_VERSION} registers no apply function for model type "
            f"{model_type!r}"
        )
    triton_interpreter.SHIMS.install()  # stays for the worker: backward passes launch too
    before = {name: module.__dict__.get("forward") for name, module in model.named_modules()}
    snapshot = Snapshot.take()
    try:
        table[model_type](model=model)
        changes = snapshot.changes()
    finally:
        dropped = snapshot.restore()
    app = Application(model_type, changes=Changes(changes), dropped=dropped)
    app.report.applied.extend(_replaced(model, before))
    _hook(model, app)
    return app


def _replaced(model: nn.Module, before: dict[str, Any]) -> list[Applied]:
    """An Applied record per module whose instance forward Liger replaced."""
    records = []
    for qualname, module in model.named_modules():
        forward = module.__dict__.get("forward")
        if forward is None or forward is before.get(qualname):
            continue
        family = family_of(forward)
        func = getattr(forward, "__func__", forward)
        records.append(
            Applied(
                qualname=qualname,
                fuser=f"liger:{family}",
                source_class=type(module).__name__,
                description=f"forward -> {func.__module__}.{func.__qualname__}",
            )
        )
    return records


def _hook(model: nn.Module, app: Application) -> None:
    """Pre- and always-called post-hooks on every module of `model`: the outermost call
    installs Liger's global changes and counts Liger launches until it returns or raises."""
    scope = _Scope(app)
    for module in model.modules():
        module.register_forward_pre_hook(scope.pre)
        module.register_forward_hook(scope.post, always_call=True)


@dataclass
class _Scope:
    """The hooks' shared state (deep copies of the model share it: `__deepcopy__`)."""

    app: Application
    counting: Any = None
    live: Counter[str] | None = None

    def pre(self, module: nn.Module, args: Any) -> None:
        """Forward pre-hook: the outermost call installs Liger's globals and starts counting."""
        if self.app.changes.enter():
            self.counting = triton_launches.counting(KERNEL_PREFIX)
            self.live = self.counting.__enter__()

    def post(self, module: nn.Module, args: Any, output: Any) -> None:
        """Forward hook, also called when the forward raised: the outermost call adds its
        launches to the Application, stops counting and puts Transformers' globals back."""
        if self.app.changes.depth == 1 and self.counting is not None:
            counting, live = self.counting, self.live
            self.counting = self.live = None
            self.app.launches.update(live or {})
            counting.__exit__(None, None, None)
        self.app.changes.exit()

    def __deepcopy__(self, memo: dict) -> _Scope:
        return self
