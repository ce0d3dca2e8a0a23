"""Kernel backends behind one interface.

A backend is an object with the `Kernels` methods. `torch` (reference, every device) is always
available; others register themselves when their import succeeds on this machine. Fused
modules store a backend *name* and resolve it per call with `get(name, device)`, so a model
fused on CPU and moved to GPU picks the right implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from fusion.kernels.norm_variant import DEFAULT_VARIANT, NormVariant
from fusion.kernels.reference import TorchKernels


class Kernels(Protocol):
    """What a backend provides. Each method computes exactly the function documented on the
    torch reference (`fusion.kernels.reference`); backends differ only in speed and rounding."""

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
        variant: NormVariant = DEFAULT_VARIANT,
    ) -> torch.Tensor:
        """RMSNorm over the last dim in one `variant` (`fusion.kernels.norm_variant`;
        `reference.rms_norm` defines each field: statistics in float32 or not; weight
        applied after the cast back, to `x`'s or the weight's dtype, or before it; `offset`
        added to the weight). Returns a new tensor."""
        ...

    def add_rms_norm(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        *,
        variant: NormVariant = DEFAULT_VARIANT,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add and RMSNorm of the sum in one call: `(s, rms_norm(s, variant))` with
        `s = a + b` exactly as PyTorch adds (`reference.add_rms_norm`). The norm reads the
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
        `reference.ACTIVATIONS`. Returns a new `[T, H]` tensor of `hidden`'s dtype computing
        `reference.moe_experts` (each routed product rounded to that dtype, then summed)."""
        ...


def _triton() -> Kernels | None:
    from fusion.kernels.triton import create  # imports triton only when first asked for

    return create()


def _onednn() -> Kernels | None:
    from fusion.kernels import onednn as onednn_backend  # probes oneDNN only when first asked for

    return onednn_backend.create()


def _native() -> Kernels | None:
    # builds the native kernel when first asked for
    from fusion.kernels.native import backend as native_backend

    return native_backend.create()


def _vllm() -> Kernels | None:
    from fusion.kernels import vllm as vllm_backend  # imports vllm only when first asked for

    return vllm_backend.create()


BUILT_IN: dict[str, Callable[[], Kernels | None]] = {
    "torch": TorchKernels,
    "onednn": _onednn,
    "native": _native,
    "triton": _triton,
    "vllm": _vllm,
}
"""Backend name -> constructor of the backends shipped here; a constructor returns None when
its dependency is missing."""

PREFERENCE = ("vllm", "triton", "torch")
"""Order `auto` tries backends in for a GPU: fastest first, the reference last. A backend
whose `auto_pick` is False or that runs `interpreted` (Triton's CPU interpreter) is skipped
by `auto`, never by its explicit name. On a CPU `auto` is the reference: the CPU kernels
(`native`, `onednn`) are chosen per op, shape and machine by measurement
(`fusion.kernels.policy`, asked by `fusion.kernels.ops`), never for a whole backend."""

Factory = Callable[[], Kernels | None]
"""A backend's constructor: the backend, or None where its dependency is missing here."""


class BackendRegistry:
    """The process's kernel backends: each name's constructor, the backends constructed
    from them (each at its first use, once: constructing one imports its dependency or
    probes the machine) and what `auto` resolved to per device.

    One object for the three because they change together: a new constructor makes that
    name's backend and every `auto` choice stale, and `register`/`install` drop both.
    `reset()` forgets every constructed backend, `auto` choice and `install`ed backend; the
    `register`ed constructors stay (the process's configuration, nothing it computed).
    Forgetting is cheap (the next use constructs again); a test that changes what a backend
    would be constructed as uses `fresh()`, so the backends it made do not outlive it."""

    def __init__(self, factories: dict[str, Factory]) -> None:
        self.factories: dict[str, Factory] = dict(factories)
        """Backend name -> constructor, in `auto`'s listing order. Read it; change it with
        `register` or `install` (which drop what the change made stale)."""
        self.auto: dict[str, Kernels] = {}
        """What `auto` resolved to, keyed by `str(device)`: after the first call per device,
        `get("auto", device)` is one dict lookup, which Dynamo traces without a graph break."""
        self._instances: dict[str, Kernels | None] = {}
        self._shadowed: dict[str, Factory | None] = {}
        """Per `install`ed name, the constructor it replaced (None: the name was new)."""

    def instance(self, name: str) -> Kernels | None:
        """The backend `name`, constructed at the first call and kept: None where it is
        unavailable here (its constructor returned None or raised, or `name` has none)."""
        if name not in self._instances:
            try:
                self._instances[name] = self.factories[name]()
            except Exception:  # an optional backend that fails to initialise is unavailable
                self._instances[name] = None
        return self._instances[name]

    def reference(self) -> Kernels:
        """The torch reference backend: always available (it has no optional dependency)."""
        backend = self.instance("torch")
        assert backend is not None
        return backend

    def choose_auto(self, device: torch.device) -> Kernels:
        """What `auto` means on `device`, constructing the candidates it tries, and kept for
        `get`: the first of `PREFERENCE` (on a CPU, the reference) that is available, not
        `interpreted`, `auto_pick` and supports `device`. Raises ValueError where none does."""
        for candidate in PREFERENCE if device.type != "cpu" else ("torch",):
            if candidate in self.factories:
                backend = self.instance(candidate)
                if (
                    backend is not None
                    and not backend.interpreted
                    and backend.auto_pick
                    and backend.supports(device)
                ):
                    self.auto[str(device)] = backend
                    return backend
        raise ValueError(f"no kernel backend supports device {device}")

    def register(self, name: str, factory: Factory) -> None:
        """Construct the backend `name` with `factory` from now on (for good, even over an
        `install`); its old backend and every `auto` choice are dropped, as now stale."""
        self.factories[name] = factory
        self._instances.pop(name, None)
        self._shadowed.pop(name, None)
        self.auto.clear()

    def install(self, name: str, backend: Kernels) -> None:
        """Serve the constructed `backend` under `name` until `uninstall` or `reset`: a
        test's backend, or a stand-in for the one of that name, whose constructor comes back
        afterwards. `get` and `available_backends` know it; every `auto` choice is dropped."""
        if name not in self._shadowed:
            self._shadowed[name] = self.factories.get(name)
        self.factories[name] = lambda: backend
        self._instances[name] = backend
        self.auto.clear()

    def uninstall(self) -> None:
        """Undo every `install`: each name's former constructor back (its backend built anew
        at next use) or the name gone. Without installs it changes nothing (other backends
        and `auto` choices stay constructed), so running it after every test costs nothing."""
        if not self._shadowed:
            return
        for name, factory in self._shadowed.items():
            self._instances.pop(name, None)
            if factory is None:
                del self.factories[name]
            else:
                self.factories[name] = factory
        self._shadowed.clear()
        self.auto.clear()

    def reset(self) -> None:
        """`uninstall`, then forget every constructed backend and `auto` choice: each is
        constructed again at its next use."""
        self.uninstall()
        self._instances.clear()
        self.auto.clear()

    @contextmanager
    def fresh(self) -> Iterator[None]:
        """A block in which every backend is constructed and `auto` chosen again at first
        use (under whatever settings the block changed); afterwards the backends and choices
        from before it, so none made under a test's settings outlives the block."""
        instances, auto = dict(self._instances), dict(self.auto)
        self._instances.clear()
        self.auto.clear()
        try:
            yield
        finally:
            self._instances.clear()
            self._instances.update(instances)
            self.auto.clear()
            self.auto.update(auto)


REGISTRY = BackendRegistry(BUILT_IN)
"""The process's one backend registry (`REGISTRY.reset()` forgets what it constructed)."""


def register(name: str, factory: Factory) -> None:
    """Make a backend available under `name` (used by optional GPU backends)."""
    REGISTRY.register(name, factory)


def resolve_ahead(devices: Iterable[torch.device | str]) -> None:
    """Resolve `auto` (and construct the backends it probes) for `devices` now, outside any
    `torch.compile` trace, so compiled fused modules dispatch with a dict lookup."""
    for device in devices:
        get("auto", device)


def known_backends() -> list[str]:
    """Every backend name `get` knows (nothing is built or imported to answer), `auto` first."""
    return ["auto", *REGISTRY.factories]


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Names of the backends that import here (and support `device`, when given)."""
    names = []
    for name in REGISTRY.factories:
        backend = REGISTRY.instance(name)
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
        chosen = REGISTRY.auto.get(str(device))
        if chosen is not None:
            return chosen
        if torch.compiler.is_compiling():
            # Probing a backend (imports, probe GEMMs) cannot run while Dynamo traces: the
            # reference computes every kernel's function and is what Inductor optimises.
            # `fusion.fuse` resolves `auto` for the model's devices ahead, so this is only
            # met by a model moved to a new device and compiled before any eager call.
            return REGISTRY.reference()
        return REGISTRY.choose_auto(device)
    if name not in REGISTRY.factories:
        raise ValueError(f"unknown kernel backend {name!r}; known: {sorted(REGISTRY.factories)}")
    backend = REGISTRY.instance(name)
    if backend is None:
        raise ValueError(f"kernel backend {name!r} is not available on this machine")
    if not backend.supports(device):
        raise ValueError(f"kernel backend {name!r} does not support device {device}")
    return backend
