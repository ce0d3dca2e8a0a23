"""Apply vLLM's own Transformers-backend rewrites to a built HF model, on CPU, for the oracles.

`harness.peers.vllm` asks vLLM what it *would* fuse; this module lets vLLM do it, so that
the harness's parity oracle judges vLLM's rewritten forwards and layers exactly as it judges
ours (the `vllm` system, `harness.runner.systems`). It runs only where vLLM imports (the peer
environment: `scripts/vllm_peer.sh`, `tox -e vllm-peer`); importing this module never
imports vLLM.

What `apply(model)` does, as vLLM's `TransformersForCausalLM` does at load time, at tensor
parallel size 1 on one CPU process:

1. `RUNTIME.config()`: one `VllmConfig` with `custom_ops=["none"]`, so every vLLM CustomOp
   built afterwards (RMSNorm, SiluAndMul, the parallel linears' methods) binds its
   `forward_native` (plain torch), the path vLLM itself takes on a platform without its
   compiled ops; and vLLM's distributed state for world size 1 (gloo), once per process.
2. For every module vLLM's `Fusers` map offers fusers for, each fuser's `fuse` under the
   model's dtype as torch's default (vLLM builds its layers that way): q/k/v become
   `QKVParallelLinear`, gate/up `MergedColumnParallelLinear` (with `SiluAndMul` for the
   activation), output projections `RowParallelLinear`, matched norms `TPAwareRMSNorm`, and
   the module's forward becomes vLLM's rewritten source.
3. The model's own tensors (a copy taken before step 2) loaded into the new layers through
   each Parameter's `weight_loader` with vLLM's shard ids (`orig_to_new_stacked`), every
   fused weight's shards checked as vLLM 0.34's loader checks them (`missing_shards`), then
   `quant_method.process_weights_after_loading` for each vLLM linear (its CPU GEMM
   dispatch; recorded per layer).

Not applied, each recorded with its reason (`Application.not_applied`): the attention
fuser (it routes attention to vLLM's paged-KV backend, which needs its model runner's
forward context and KV cache), the MLA fuser (it also swaps the attention for
`MLAAttention`, the same runtime), and MoE blocks (vLLM's `FusedMoE` reads the forward
context and a model-level config its runner sets up): their modules keep Transformers' code,
so the oracles judge what vLLM's other rewrites do around them.

Fail closed: any fuser that raises, a tensor of the original model that finds no Parameter
or buffer in the rewritten one, a new Parameter no tensor was loaded into, or a fused weight
with a shard no tensor was loaded into (vLLM 0.34's loader rule, `missing_shards`) raises
`ApplyError` naming the module, and the harness records the system's apply failure rather
than judging a half-rewritten model.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from harness.peers.vllm import VLLM_FAMILY, _is_moe_experts, _stub_config, _vllm_detail

NOT_RUN: dict[str, str] = {
    "attention": "vLLM's attention fuser routes attention to its paged-KV backend, which "
    "needs the model runner's forward context and KV cache (not built on CPU here)",
    "mla": "vLLM's MLA fuser swaps the attention for MLAAttention (latent KV cache, the "
    "model runner's forward context), not built on CPU here",
    "moe": "vLLM's FusedMoE reads the forward context and model-level config of its model "
    "runner, not built on CPU here; the block keeps Transformers' code",
}
"""Fuser families this module does not apply, with the reason recorded for each module."""


class ApplyError(RuntimeError):
    """vLLM's rewrite could not be applied completely; the message names the module."""


class PeerUnavailable(RuntimeError):
    """vLLM does not import in this environment (the message says how to get one)."""


@dataclass(frozen=True)
class Rewrite:
    """One fuser vLLM applied: where, which family and vLLM class, what it merged."""

    qualname: str
    module_class: str
    family: str
    fuser: str
    detail: str = ""


@dataclass(frozen=True)
class Skipped:
    """A fuser vLLM offered for a module that was not applied here, and why."""

    qualname: str
    module_class: str
    family: str
    reason: str


@dataclass
class Application:
    """What `apply` did to one model: its rewrites, what it left and why, the GEMM each vLLM
    linear dispatches to on this CPU, and how many tensors were loaded."""

    applied: list[Rewrite] = field(default_factory=list)
    not_applied: list[Skipped] = field(default_factory=list)
    gemms: dict[str, str] = field(default_factory=dict)
    loaded: int = 0

    def counts(self) -> dict[str, int]:
        """Applied rewrites per family."""
        out: dict[str, int] = {}
        for rewrite in self.applied:
            out[rewrite.family] = out.get(rewrite.family, 0) + 1
        return dict(sorted(out.items()))

    def summary(self) -> str:
        """One line for a result's message: applied per family, left per family, the GEMMs."""
        applied = ", ".join(f"{k} x{n}" for k, n in self.counts().items()) or "nothing"
        left: dict[str, int] = {}
        for skipped in self.not_applied:
            left[skipped.family] = left.get(skipped.family, 0) + 1
        text = f"vLLM applied: {applied}"
        if left:
            text += "; not applied: " + ", ".join(f"{k} x{n}" for k, n in sorted(left.items()))
        kinds = sorted(set(self.gemms.values()))
        if kinds:
            text += f"; GEMM: {', '.join(kinds)}"
        return text


class VllmRuntime:
    """vLLM's process-wide state for applying its rewrites: the imported modules, the one
    `VllmConfig` and the world-size-1 distributed group.

    One explicit object (`RUNTIME`) because vLLM's distributed state is itself process-wide
    and can be initialised only once; `reset` tears it down (tests, a fresh start).
    """

    def __init__(self) -> None:
        self._vllm: SimpleNamespace | None = None
        self._config: Any = None

    def modules(self) -> SimpleNamespace:
        """vLLM's modules this file uses, imported on first use.

        PeerUnavailable when vLLM does not import (it is not a dependency of this project:
        only the peer environment has it). Sets VLLM_TARGET_DEVICE=cpu when unset: vLLM
        cannot make a VllmConfig on a machine without an accelerator otherwise.
        """
        if self._vllm is None:
            os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
            try:
                names = {
                    "config": "vllm.config",
                    "distributed": "vllm.distributed",
                    "fuser": "vllm.model_executor.models.transformers.fuser",
                    "fusers": "vllm.model_executor.models.transformers.fusers",
                }
                self._vllm = SimpleNamespace(
                    **{key: importlib.import_module(path) for key, path in names.items()}
                )
            except Exception as exc:
                raise PeerUnavailable(
                    f"vLLM does not import here ({type(exc).__name__}: {exc}); the vllm "
                    "system runs in the peer environment (scripts/vllm_peer.sh, "
                    "tox -e vllm-peer)"
                ) from exc
        return self._vllm

    def config(self) -> Any:
        """The VllmConfig every rewrite is built under (all CustomOps native), with vLLM's
        distributed state initialised for one process on first call."""
        if self._config is None:
            vllm = self.modules()
            config = self.make_config()
            with vllm.config.set_current_vllm_config(config):
                if not vllm.distributed.parallel_state.model_parallel_is_initialized():
                    vllm.distributed.init_distributed_environment(
                        world_size=1,
                        rank=0,
                        local_rank=0,
                        distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                        backend="gloo",
                    )
                    vllm.distributed.initialize_model_parallel(1, 1)
            self._config = config
        return self._config

    def make_config(self) -> Any:
        """A fresh `VllmConfig` with every CustomOp native; PeerUnavailable, with vLLM's own
        reason, where vLLM refuses to make one on this machine (vLLM 0.34 on an x86 CPU
        without triton-cpu, which PyPI does not carry: "vLLM on x86 CPUs requires Triton"),
        so the `vllm` system is refused up front instead of failing every architecture."""
        vllm = self.modules()
        try:
            return vllm.config.VllmConfig(
                compilation_config=vllm.config.CompilationConfig(custom_ops=["none"])
            )
        except Exception as exc:
            hint = (
                "; install the triton-cpu wheel vLLM's requirements/cpu.txt names"
                if "triton" in str(exc).lower()
                else ""
            )
            raise PeerUnavailable(
                f"vLLM cannot make its config on this machine ({type(exc).__name__}: {exc}){hint}"
            ) from exc

    def reset(self) -> None:
        """Tear down vLLM's distributed state and forget the config (imports stay)."""
        if self._config is not None and self._vllm is not None:
            state = self._vllm.distributed.parallel_state
            state.destroy_model_parallel()
            state.destroy_distributed_environment()
        self._config = None


RUNTIME = VllmRuntime()


def _free_port() -> int:
    """A TCP port free on localhost now, for vLLM's one-process gloo group."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set to `dtype` inside, restored after: vLLM's layers allocate
    their Parameters in the default dtype, and vLLM builds a model under the model's."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _family(fuser: Any) -> str:
    name = type(fuser).__name__
    return VLLM_FAMILY.get(name, name)


def _rewrite(model: nn.Module, runtime: VllmRuntime, app: Application) -> dict[str, tuple]:
    """Apply vLLM's fusers module by module (step 2); returns vLLM's weight mapping
    (original module prefix -> (merged module prefix, shard id))."""
    vllm = runtime.modules()
    stub = _stub_config(model)
    fusers = vllm.fuser.Fusers(model, stub)
    base = getattr(model, "base_model", model)
    mapping: dict[str, tuple] = {}
    moe_blocks: list[str] = []
    for qualname, module in list(model.named_modules()):
        if module is model or module is base:
            continue
        if any(qualname.startswith(block + ".") for block in moe_blocks):
            continue  # inside a block left to Transformers: vLLM's MoE layer would own it
        cls = type(module).__name__
        experts = dict(module.named_children()).get("experts")
        if experts is not None and _is_moe_experts(experts):
            app.not_applied.append(Skipped(qualname, cls, "moe", NOT_RUN["moe"]))
            moe_blocks.append(qualname)
            continue
        for fuser in list(fusers[module]):
            family = _family(fuser)
            if family in NOT_RUN:
                app.not_applied.append(Skipped(qualname, cls, family, NOT_RUN[family]))
                continue
            try:
                mapping.update(fuser.orig_to_new_stacked(qualname))
                new = fuser.fuse(module, qualname, stub)
            except Exception as exc:
                raise ApplyError(
                    f"vLLM's {type(fuser).__name__} on {qualname} ({cls}) raised "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            if new is not module:
                parent, _, leaf = qualname.rpartition(".")
                setattr(model.get_submodule(parent), leaf, new)
                module = new
            detail = _vllm_detail(family, fuser)
            app.applied.append(Rewrite(qualname, cls, family, type(fuser).__name__, detail))
    return mapping


def _target(model: nn.Module, key: str) -> torch.Tensor | None:
    """The Parameter or buffer called `key` in `model`, or None."""
    for getter in (model.get_parameter, model.get_buffer):
        try:
            return getter(key)
        except AttributeError:
            continue
    return None


def _load(
    model: nn.Module,
    originals: dict[str, torch.Tensor],
    copies: dict[str, torch.Tensor],
    mapping: dict[str, tuple],
    unsaved: dict[str, torch.Tensor] | None = None,
) -> int:
    """Load `copies` (the model's tensors, copied before the rewrite) into the rewritten
    model (step 3); returns how many tensors went through a vLLM weight loader or a copy.

    A name that still resolves to its original object (`originals`, held here so no id is
    reused) is a tensor vLLM left alone and is not touched. ApplyError when a tensor has no
    place, or when a Parameter the rewrite created received no tensor (vLLM may allocate it
    uninitialised: a forward would read garbage), unless the original model had a
    non-persistent buffer of that name (`unsaved`: no checkpoint carries it, so vLLM serves
    its own initial value) equal to vLLM's initial value (FalconMamba's weightless norms keep
    a buffer of ones as `weight`; vLLM's RMSNorm starts its weight at ones).
    """
    unsaved = unsaved or {}
    before = {id(t) for t in originals.values()}
    filled: set[int] = set()
    count = 0
    for key, tensor in copies.items():
        prefix, _, leaf = key.rpartition(".")
        if prefix in mapping:
            merged, shard = mapping[prefix]
            target = _target(model, f"{merged}.{leaf}")
            if target is None:
                raise ApplyError(f"vLLM's merged {merged} has no {leaf} for {key}")
            target.weight_loader(target, tensor, shard)
        else:
            target = _target(model, key)
            if target is None:
                raise ApplyError(f"{key} has no Parameter or buffer after vLLM's rewrite")
            if target is originals[key]:
                continue  # a module vLLM did not touch
            loader = getattr(target, "weight_loader", None)
            if loader is not None:
                loader(target, tensor)
            else:
                with torch.no_grad():
                    target.copy_(tensor)
        filled.add(id(target))
        count += 1
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in before or id(param) in filled:
            continue
        kept = unsaved.get(name)
        if kept is not None and kept.shape == param.shape and torch.equal(kept, param.detach()):
            continue
        raise ApplyError(f"vLLM's rewrite created {name}, which no tensor was loaded into")
    return count


def missing_shards(model: nn.Module) -> list[str]:
    """`<module>.<parameter>.<shard>` of every shard of a fused vLLM weight that the load
    left unfilled, found as vLLM 0.34's loader finds them: its
    `DefaultModelLoader.track_weights_loading` asks each `StackedColumnParallelLinear`
    (QKVParallelLinear, MergedColumnParallelLinear) for `pop_missing_shards()`, the shards
    of a parameter that received some but not all of its shards (each `weight_loader` call
    records what it filled), and makes any a load error. The call also clears the record, as
    vLLM's does. Layers without the method (vLLM 0.33, which has no such record) report
    none; the parameter-level check of `_load` still holds for them. Why it matters: a
    partly-filled fused weight keeps vLLM's uninitialised rows for the missing shard, so a
    forward reads garbage that a parity check may or may not catch."""
    return [
        f"{name}.{shard}" if name else shard
        for name, module in model.named_modules()
        if callable(getattr(module, "pop_missing_shards", None))
        for shard in module.pop_missing_shards()
    ]


def _after_loading(model: nn.Module, app: Application) -> None:
    """Each vLLM linear's `process_weights_after_loading` (its CPU GEMM dispatch), recording
    which GEMM it chose; ApplyError when one raises (vLLM would not serve that model)."""
    for qualname, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(method, "process_weights_after_loading"):
            continue
        try:
            method.process_weights_after_loading(module)
        except Exception as exc:
            raise ApplyError(
                f"vLLM's process_weights_after_loading on {qualname} raised "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        gemm = getattr(module, "cpu_linear", None)
        app.gemms[qualname] = _gemm_name(gemm)


GEMM_NAMES: tuple[tuple[str, str], ...] = (
    ("zentorch_linear_unary", "zentorch"),
    ("weight_packed_linear_cpu", "sgl weight_packed_linear"),
    ("onednn_mm", "oneDNN onednn_mm"),
    ("linear", "F.linear"),
)
"""vLLM's CPU GEMM dispatch (`dispatch_cpu_unquantized_gemm`) binds a lambda per layer; the
name of the op it calls tells which path it chose (first match wins)."""


def _gemm_name(gemm: Any) -> str:
    """Which CPU GEMM a vLLM linear dispatches to, read from the names its callable uses
    ("unknown" for anything else, "none" when the layer has no CPU dispatch)."""
    if gemm is None:
        return "none"
    if gemm is torch.nn.functional.linear:
        return "F.linear"
    names = getattr(getattr(gemm, "__code__", None), "co_names", ())
    for op, label in GEMM_NAMES:
        if op in names:
            return label
    return "unknown"


def apply(model: nn.Module, runtime: VllmRuntime = RUNTIME) -> Application:
    """Rewrite `model` in place with vLLM's fusers and load its own weights (module
    docstring, steps 1-3); returns what was applied and left.

    Raises PeerUnavailable without vLLM, ApplyError when the rewrite is incomplete.
    """
    config = runtime.config()
    vllm = runtime.modules()
    originals = dict(model.state_dict(keep_vars=True))
    copies = {key: tensor.detach().clone() for key, tensor in originals.items()}
    unsaved = {
        name: buffer.detach().clone()
        for name, buffer in model.named_buffers(remove_duplicate=False)
        if name not in originals
    }
    dtype = next(model.parameters(), torch.empty(0)).dtype
    app = Application()
    with vllm.config.set_current_vllm_config(config), _default_dtype(dtype):
        mapping = _rewrite(model, runtime, app)
        app.loaded = _load(model, originals, copies, mapping, unsaved)
        missing = missing_shards(model)
        if missing:
            raise ApplyError(
                "vLLM's loader refuses fused weights with shards never loaded (a load error "
                f"since vLLM 0.34): {', '.join(missing)}"
            )
        _after_loading(model, app)
    return app
