"""Kernel backends behind one interface.

A backend is an object with the `Kernels` methods. `torch` (reference, every device) is always
available; others register themselves when their import succeeds on this machine. Fused
modules store a backend *name* and resolve it per call with `get(name, device)`, so a model
fused on CPU and moved to GPU picks the right implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from fusion.kernels.torch_ref import TorchKernels


class Kernels(Protocol):
    """What a backend provides. Each method computes exactly the function documented on the
    torch reference (`fusion.kernels.torch_ref`); backends differ only in speed and rounding."""

    name: str
    interpreted: bool
    """Runs in an interpreter (Triton's CPU interpreter): correct but slow, so `auto` never
    picks it and benchmarks never time it."""
    delegated: frozenset[str]
    """Names of the ops this backend hands to the torch reference unchanged (timing them
    would only time the reference again)."""
    auto_pick: bool
    """Whether `auto` may choose this backend (False where it was measured slower on this
    kind of machine); naming it explicitly always works."""

    def supports(self, device: torch.device) -> bool: ...

    def act_and_mul(self, x: torch.Tensor, activation: str) -> torch.Tensor: ...

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        *,
        offset: float = 0.0,
        upcast: bool = True,
        weight_after_cast: bool = True,
        cast_to_weight: bool = False,
    ) -> torch.Tensor:
        """RMSNorm over the last dim in one variant: `torch_ref.rms_norm` defines each flag
        (statistics in float32 or not; weight applied after the cast back, to `x`'s or the
        weight's dtype, or before it; `offset` added to the weight). Returns a new tensor."""
        ...

    def add_rms_norm(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        *,
        offset: float = 0.0,
        upcast: bool = True,
        weight_after_cast: bool = True,
        cast_to_weight: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add and RMSNorm of the sum in one call: `(s, rms_norm(s, ...))` with
        `s = a + b` exactly as PyTorch adds (`torch_ref.add_rms_norm`). The norm reads the
        rounded sum, so the pair equals the two ops run apart. Returns two new tensors."""
        ...

    def moe_experts(
        self,
        hidden: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        activation: str,
    ) -> torch.Tensor:
        """Routed gated experts: `hidden [T, H]`, `gate_up [E, 2I, H]` (gate rows, then up),
        `down [E, H, I]`, `topk_ids`/`topk_weights [T, K]`, `activation` one of
        `torch_ref.ACTIVATIONS`. Returns a new `[T, H]` tensor of `hidden`'s dtype computing
        `torch_ref.moe_experts` (each routed product rounded to that dtype, then summed)."""
        ...


def _triton() -> Kernels | None:
    from fusion.kernels.triton import create  # imports triton only when first asked for

    return create()


def _onednn() -> Kernels | None:
    from fusion.kernels import onednn_backend  # probes oneDNN only when first asked for

    return onednn_backend.create()


def _native() -> Kernels | None:
    from fusion.kernels import native_backend  # builds the native kernel when first asked for

    return native_backend.create()


def _vllm() -> Kernels | None:
    from fusion.kernels import vllm_backend  # imports vllm only when first asked for

    return vllm_backend.create()


_FACTORIES: dict[str, Callable[[], Kernels | None]] = {
    "torch": TorchKernels,
    "onednn": _onednn,
    "native": _native,
    "triton": _triton,
    "vllm": _vllm,
}
"""Backend name -> constructor; a constructor returns None when its dependency is missing."""

_INSTANCES: dict[str, Kernels | None] = {}
"""Explicit cache of constructed backends, keyed by name."""

PREFERENCE = ("vllm", "triton", "torch")
"""Order `auto` tries backends in for a GPU: fastest first, the reference last. A backend
whose `auto_pick` is False or that runs `interpreted` (Triton's CPU interpreter) is skipped
by `auto`, never by its explicit name. On a CPU `auto` is the reference: the CPU kernels
(`native`, `onednn`) are chosen per op, shape and machine by measurement
(`fusion.kernels.policy`, asked by `fusion.kernels.ops`), never for a whole backend."""


_AUTO: dict[str, Kernels] = {}
"""Explicit cache of what `auto` resolved to, keyed by `str(device)`: after the first call
per device, `get("auto", device)` is one dict lookup, which Dynamo traces without a graph
break. Cleared whenever the set of backends changes (`register`)."""


def _reference() -> Kernels:
    backend = _instance("torch")
    assert backend is not None  # the reference has no optional dependency
    return backend


def register(name: str, factory: Callable[[], Kernels | None]) -> None:
    """Make a backend available under `name` (used by optional GPU backends)."""
    _FACTORIES[name] = factory
    _INSTANCES.pop(name, None)
    _AUTO.clear()


def resolve_ahead(devices: Iterable[torch.device | str]) -> None:
    """Resolve `auto` (and construct the backends it probes) for `devices` now, outside any
    `torch.compile` trace, so compiled fused modules dispatch with a dict lookup."""
    for device in devices:
        get("auto", device)


def _instance(name: str) -> Kernels | None:
    if name not in _INSTANCES:
        try:
            _INSTANCES[name] = _FACTORIES[name]()
        except Exception:  # an optional backend that fails to initialise is unavailable
            _INSTANCES[name] = None
    return _INSTANCES[name]


def known_backends() -> list[str]:
    """Every backend name `get` knows (nothing is built or imported to answer), `auto` first."""
    return ["auto", *_FACTORIES]


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Names of the backends that import here (and support `device`, when given)."""
    names = []
    for name in _FACTORIES:
        backend = _instance(name)
        if backend is None:
            continue
        if device is not None and not backend.supports(torch.device(device)):
            continue
        names.append(name)
    return names


def get(name: str, device: torch.device | str) -> Kernels:
    """The backend `name` for `device`; `auto` is the first of `PREFERENCE` that supports it
    (skipping a backend that runs `interpreted`, e.g. Triton's CPU interpreter: correct but slow,
    or one not measured faster on this machine: `auto_pick` False).

    Raises ValueError naming the backend when it is unknown or cannot run on `device`, so a
    misconfigured fused model fails loudly instead of silently using another kernel.
    """
    device = torch.device(device)
    if name == "auto":
        chosen = _AUTO.get(str(device))
        if chosen is not None:
            return chosen
        if torch.compiler.is_compiling():
            # Probing a backend (imports, probe GEMMs) cannot run while Dynamo traces: the
            # reference computes every kernel's function and is what Inductor optimises.
            # `fusion.fuse` resolves `auto` for the model's devices ahead, so this is only
            # met by a model moved to a new device and compiled before any eager call.
            return _reference()
        for candidate in PREFERENCE if device.type != "cpu" else ("torch",):
            if candidate in _FACTORIES:
                backend = _instance(candidate)
                if (
                    backend is not None
                    and not backend.interpreted
                    and backend.auto_pick
                    and backend.supports(device)
                ):
                    _AUTO[str(device)] = backend
                    return backend
        raise ValueError(f"no kernel backend supports device {device}")
    if name not in _FACTORIES:
        raise ValueError(f"unknown kernel backend {name!r}; known: {sorted(_FACTORIES)}")
    backend = _instance(name)
    if backend is None:
        raise ValueError(f"kernel backend {name!r} is not available on this machine")
    if not backend.supports(device):
        raise ValueError(f"kernel backend {name!r} does not support device {device}")
    return backend
