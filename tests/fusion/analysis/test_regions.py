"""`fusion.analysis.regions`: merged projections never leave the grad, autocast or global-state
region their calls ran in.

Each hazard module below computes something different when one of its projections is moved
to the merge point (its input gradient, its output dtype, whether it carries gradient, or
the grad mode it leaves behind), so the numeric check next to each refusal could fail.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusion
from fusion.analysis.regions import (
    callable_keeps_state,
    function_keeps_state,
    module_keeps_state,
    op_keeps_state,
    self_call_keeps_state,
)
from fusion.trace.tracer import preserved_globals
from tests.fusion.fusers.helpers import fuse_copy, reasons

WIDTH = 16


def eager_attention_forward(module, mixed):
    """Stand-in attention (the tracer makes any `*attention_forward` a leaf). The forwards
    mix q, k and v themselves (sums: nothing is saved for backward, so an inference-mode
    key is a legal operand), so the split pieces are used as they are, not copied."""
    return mixed


def freeze():
    torch.set_grad_enabled(False)


def thaw():
    torch.set_grad_enabled(True)


def centre(x):
    with torch.no_grad():
        mean = x.mean(-1, keepdim=True)
    return x - mean


class GradOff:
    """A context manager this package does not know: disables grad mode, restores it."""

    def __enter__(self) -> None:
        self.previous = torch.is_grad_enabled()
        torch.set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        torch.set_grad_enabled(self.previous)


class LeakyAutocast:
    """An unknown context manager whose exit does not restore what its entry changed: it
    leaves CPU autocast on."""

    def __enter__(self) -> None:
        torch.set_autocast_enabled("cpu", True)

    def __exit__(self, *exc: object) -> None:
        pass


class Toggle(nn.Module):
    """A child that writes no tensor (so a write-purity proof passes it) but switches CPU
    autocast on for everything after it."""

    def forward(self, x):
        torch.set_autocast_enabled("cpu", True)
        return x


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(WIDTH, WIDTH)
        self.k_proj = nn.Linear(WIDTH, WIDTH)
        self.v_proj = nn.Linear(WIDTH, WIDTH)
        self.o_proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, h):
        q = self.q_proj(h)
        k = self.k_proj(h)
        v = self.v_proj(h)
        return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v))

    def _no_grad(self):
        torch._C._set_grad_enabled(False)

    def _grad(self):
        torch._C._set_grad_enabled(True)


class NoGradAroundOne(Attention):
    def forward(self, h):
        q = self.q_proj(h)
        with torch.no_grad():
            k = self.k_proj(h)
        v = self.v_proj(h)
        return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v))


class InferenceModeAroundOne(Attention):
    def forward(self, h):
        q = self.q_proj(h)
        with torch.inference_mode():
            k = self.k_proj(h)
        v = self.v_proj(h)
        return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v))


class EnableGradAroundOne(Attention):
    def forward(self, h):
        with torch.no_grad():
            q = self.q_proj(h)
            with torch.enable_grad():
                k = self.k_proj(h)
                mixed = q + 2.0 * k  # carries gradient through k only
            v = self.v_proj(h)
        return self.o_proj(eager_attention_forward(self, mixed + 3.0 * v))


class SetGradManagerAroundOne(Attention):
    def forward(self, h):
        q = self.q_proj(h)
        with torch.set_grad_enabled(False):
            k = self.k_proj(h)
        v = self.v_proj(h)
        return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v))


class AutocastAroundOne(Attention):
    def forward(self, h):
        q = self.q_proj(h)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            k = self.k_proj(h)
        v = self.v_proj(h)
        return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v))


class UnknownManagerAroundOne(Attention):
    def forward(self, h):
        q = self.q_proj(h)
        with GradOff():
            k = self.k_proj(h)
        v = self.v_proj(h)
        return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v))


class TwoNoGradBlocks(Attention):
    def forward(self, h):
        with torch.no_grad():
            q = self.q_proj(h)
            k = self.k_proj(h)
        with torch.no_grad():
            v = self.v_proj(h)
        return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v))


class UnknownManagerBetween(Attention):
    def forward(self, h):
        q = self.q_proj(h)
        with LeakyAutocast():
            pass
        k = self.k_proj(h)
        v = self.v_proj(h)
        torch.set_autocast_enabled("cpu", False)
        return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v))


class SetGradStatements(Attention):
    def forward(self, h):
        q = self.q_proj(h)
        torch.set_grad_enabled(False)
        k = self.k_proj(h)
        torch.set_grad_enabled(True)
        v = self.v_proj(h)
        return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v))


class PrivateSetGrad(Attention):
    def forward(self, h):
        q = self.q_proj(h)
        torch._C._set_grad_enabled(False)
        k = self.k_proj(h)
        torch._C._set_grad_enabled(True)
        v = self.v_proj(h)
        return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v))


class SetAutocastEnabled(Attention):
    def forward(self, h):
        q = self.q_proj(h)
        torch.set_autocast_enabled("cpu", True)
        k = self.k_proj(h)
        v = self.v_proj(h)
        torch.set_autocast_enabled("cpu", False)
        return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v))


class SetDefaultDtype(Attention):
    def forward(self, h):
        q = self.q_proj(h)
        torch.set_default_dtype(torch.float64)
        k = self.k_proj(h)
        torch.set_default_dtype(torch.float32)
        v = self.v_proj(h)
        return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v))


class ManualSeed(Attention):
    def forward(self, h):
        q = self.q_proj(h)
        torch.manual_seed(0)
        k = self.k_proj(h)
        v = self.v_proj(h)
        return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v))


class BackendsAssignment(Attention):
    def forward(self, h):
        q = self.q_proj(h)
        # (a flag with no legacy/per-backend API pair: reading the TF32 flags raises once
        # another test mixed those APIs)
        previous = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = True
        k = self.k_proj(h)
        torch.backends.cudnn.benchmark = previous
        v = self.v_proj(h)
        return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v))


class MatmulPrecision(Attention):
    def forward(self, h):
        q = self.q_proj(h)
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("medium")
        k = self.k_proj(h)
        torch.set_float32_matmul_precision(previous)
        v = self.v_proj(h)
        return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v))


class HelperToggles(Attention):
    def forward(self, h):
        q = self.q_proj(h)
        freeze()
        k = self.k_proj(h)
        v = self.v_proj(h)
        thaw()
        return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v))


class MethodToggles(Attention):
    def forward(self, h):
        q = self.q_proj(h)
        self._no_grad()
        k = self.k_proj(h)
        self._grad()
        v = self.v_proj(h)
        return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v))


class ChildToggles(Attention):
    def __init__(self) -> None:
        super().__init__()
        self.q_norm = Toggle()

    def forward(self, h):
        q = self.q_norm(self.q_proj(h))
        k = self.k_proj(h)
        v = self.v_proj(h)
        torch.set_autocast_enabled("cpu", False)
        return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v))


class AllInsideNoGrad(Attention):
    def forward(self, h):
        with torch.no_grad():
            q = self.q_proj(h)
            k = self.k_proj(h)
            v = self.v_proj(h)
        return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v))


class AllInsideAutocast(Attention):
    def forward(self, h):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            q = self.q_proj(h)
            k = self.k_proj(h)
            v = self.v_proj(h)
        return self.o_proj(
            eager_attention_forward(self, q.float() + 2.0 * k.float() + 3.0 * v.float())
        )


class BalancedBetween(Attention):
    def forward(self, h):
        q = self.q_proj(h)
        with torch.no_grad():
            scale = q.abs().amax()
        q = centre(q) / (1.0 + scale)
        k = self.k_proj(h)
        v = self.v_proj(h)
        return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v))


@torch.autocast("cpu", dtype=torch.bfloat16)
def autocast_scale(x):
    return x * 0.5


class AutocastHelperBetween(Attention):
    def forward(self, h):
        q = autocast_scale(self.q_proj(h))
        k = self.k_proj(h)
        v = self.v_proj(h)
        return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v))


class AutocastDecoratedForward(Attention):
    @torch.autocast("cpu", dtype=torch.bfloat16)
    def forward(self, h):
        q = self.q_proj(h)
        k = self.k_proj(h)
        v = self.v_proj(h)
        return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v)).float()


class DecoratedForward(Attention):
    @torch.no_grad()
    def forward(self, h):
        q = self.q_proj(h)
        k = self.k_proj(h)
        v = self.v_proj(h)
        return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v))


@dataclass
class Run:
    """One forward's observable behaviour: output, input gradient, grad mode afterwards."""

    out: torch.Tensor
    grad: torch.Tensor | None
    grad_mode_after: bool


def run(module: nn.Module, grad_mode: bool, seed: int = 0) -> Run:
    x = torch.randn(2, 3, WIDTH, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    x.requires_grad_(True)
    # Explicit ambient state: tracing a hazard forward while fusing may have run (part of)
    # it, leaving grad mode or autocast changed.
    with torch.set_grad_enabled(grad_mode), torch.autocast("cpu", enabled=False):
        out = module(x)
        after = torch.is_grad_enabled()
    grad = None
    if out.requires_grad:
        with torch.enable_grad():  # whatever grad mode the forward left behind
            out.float().square().sum().backward()
        grad = x.grad
    return Run(out.detach(), grad, after)


def close(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> bool:
    """Relative (norm-wise) error within `tolerance`: a merged GEMM rounds differently."""
    return bool((a - b).norm() <= tolerance * a.norm())


def same_behaviour(
    original: nn.Module, fused: nn.Module, grad_mode: bool = True, tolerance: float = 1e-5
) -> bool:
    """Equal outputs (dtype included), equal input gradients (or none on both sides), and
    the same grad mode left behind."""
    a, b = run(original, grad_mode), run(fused, grad_mode)
    if a.out.dtype != b.out.dtype or not close(a.out, b.out, tolerance):
        return False
    if (a.grad is None) != (b.grad is None) or a.grad_mode_after != b.grad_mode_after:
        return False
    return a.grad is None or close(a.grad, b.grad, tolerance)


@pytest.fixture(autouse=True)
def _restore_global_state():
    """Every hazard forward restores what it sets; this guards the other tests if one does
    not (a failing assertion midway)."""
    with preserved_globals():
        yield


REGION = "merging would move it out of its region"
STATE = "out of the state it ran in"


@pytest.mark.parametrize(
    ("cls", "reason"),
    [
        (NoGradAroundOne, "k_proj is called inside `with torch.no_grad()` and q_proj outside"),
        (InferenceModeAroundOne, "inside `with torch.inference_mode()`"),
        (EnableGradAroundOne, "inside `with torch.enable_grad()`"),
        (SetGradManagerAroundOne, "inside `with torch.set_grad_enabled(False)`"),
        (AutocastAroundOne, "inside `with torch.autocast('cpu', dtype=torch.bfloat16)`"),
        (UnknownManagerAroundOne, "k_proj is called inside `with GradOff()`"),
        (TwoNoGradBlocks, "q_proj is called inside `with torch.no_grad()` and v_proj"),
    ],
)
def test_a_with_around_some_calls_refuses(cls: type[nn.Module], reason: str) -> None:
    module = cls()
    fused, report = fuse_copy(module)
    assert not report.applied, str(report)
    assert reason in reasons(report) and REGION in reasons(report), str(report)
    assert same_behaviour(module, fused)


@pytest.mark.parametrize(
    ("cls", "statement"),
    [
        (SetGradStatements, "`torch.set_grad_enabled(False)` is a call not proven"),
        (PrivateSetGrad, "`torch._C._set_grad_enabled(False)`"),
        (SetAutocastEnabled, "`torch.set_autocast_enabled('cpu', True)`"),
        (SetDefaultDtype, "`torch.set_default_dtype(torch.float64)`"),
        (ManualSeed, "`torch.manual_seed(0)`"),
        (BackendsAssignment, "`torch.backends.cudnn.benchmark` stores into state"),
        (MatmulPrecision, "`torch.set_float32_matmul_precision('medium')`"),
        (UnknownManagerBetween, "`with LeakyAutocast()` is a context manager not known"),
        (HelperToggles, "`freeze()`"),
        (MethodToggles, "`self._no_grad()`"),
        (ChildToggles, "`self.q_norm(self.q_proj(h))`"),
        # Balanced, but a wrapper runs code its source does not show: refused, fail-closed.
        (AutocastHelperBetween, "`autocast_scale(self.q_proj(h))`"),
    ],
)
def test_state_changes_between_calls_refuse(cls: type[nn.Module], statement: str) -> None:
    module = cls()
    fused, report = fuse_copy(module)
    assert not report.applied, str(report)
    assert statement in reasons(report) and STATE in reasons(report), str(report)
    assert same_behaviour(module, fused)


@pytest.mark.parametrize(
    "cls",
    [
        Attention,
        AllInsideNoGrad,
        AllInsideAutocast,
        BalancedBetween,
        DecoratedForward,
        AutocastDecoratedForward,
    ],
)
@pytest.mark.parametrize("grad_mode", [True, False])
def test_calls_in_one_region_still_fuse(cls: type[nn.Module], grad_mode: bool) -> None:
    module = cls()
    fused, report = fuse_copy(module)
    assert report.counts() == {"qkv": 1}, str(report)
    # bfloat16 rounding (autocast) differs between one GEMM and three.
    autocast = cls in (AllInsideAutocast, AutocastDecoratedForward)
    assert same_behaviour(module, fused, grad_mode, 1e-2 if autocast else 1e-5)


@pytest.mark.parametrize(
    ("target", "keeps"),
    [
        (torch.cat, True),
        (torch.split, True),
        (F.silu, True),
        (F.gelu, True),
        (torch.finfo, True),
        (torch.is_grad_enabled, True),
        (torch.get_default_dtype, True),
        (torch.set_grad_enabled, False),
        (torch._C._set_grad_enabled, False),
        (torch.set_autocast_enabled, False),
        (torch.set_default_dtype, False),
        (torch.manual_seed, False),
        (torch.use_deterministic_algorithms, False),
        (torch.set_float32_matmul_precision, False),
        (torch.no_grad, False),
        (print, False),
    ],
)
def test_op_keeps_state(target: object, keeps: bool) -> None:
    assert op_keeps_state(target) is keeps


def test_callees_are_read_for_state_changes() -> None:
    assert function_keeps_state(centre, None)  # a balanced `with torch.no_grad()` inside
    assert not function_keeps_state(freeze, None)
    assert not function_keeps_state(GradOff.__enter__, None)
    assert not module_keeps_state(Toggle())
    assert module_keeps_state(nn.Linear(2, 2))
    hooked = nn.Linear(2, 2)
    hooked.register_forward_hook(lambda *args: None)
    assert not module_keeps_state(hooked)
    assert callable_keeps_state(F.gelu, 0)
    assert not callable_keeps_state(freeze, 0)
    module = MethodToggles()
    assert not self_call_keeps_state(module, "_no_grad")
    assert self_call_keeps_state(module, "k_proj")
    assert self_call_keeps_state(module, "missing")  # calling it raises before anything runs
    module.helper = freeze  # an instance-held callable is read like any other
    assert not self_call_keeps_state(module, "helper")


def sparsify(x):
    normal = torch.distributions.normal.Normal(0, 1)
    cutoff = normal.icdf(torch.tensor(0.95))
    return torch.relu(x - cutoff)


def no_validation(x):
    torch.distributions.Distribution.set_default_validate_args(False)
    return x


def test_torch_distributions_are_stateless_but_not_their_setters() -> None:
    assert function_keeps_state(sparsify, None)  # Gemma 3n's activation sparsity
    assert not function_keeps_state(no_validation, None)


def test_instances_are_proven_again() -> None:
    # The class's proof read `self.q_norm` on the first instance; another instance whose
    # child toggles grad mode is refused when fused, not merged on the class's word.
    class Normed(Attention):
        def __init__(self, norm: nn.Module) -> None:
            super().__init__()
            self.q_norm = norm

        def forward(self, h):
            q = self.q_norm(self.q_proj(h))
            k = self.k_proj(h)
            v = self.v_proj(h)
            torch.set_grad_enabled(True)
            return self.o_proj(eager_attention_forward(self, q + 2.0 * k + 3.0 * v))

    calm, toggling = Normed(nn.Identity()), Normed(nn.Identity())
    toggling.q_norm.register_forward_pre_hook(lambda module, args: freeze())
    model = nn.ModuleList([calm, toggling])
    reference = copy.deepcopy(model)
    report = fusion.fuse(model)
    assert [r.qualname for r in report.applied] == ["0"], str(report)
    for original, fused in zip(reference, model):
        assert same_behaviour(original, fused)


class ShadowedQuiet(Attention):
    """`quiet` is both a class method that switches grad mode off and a child registered
    under that name (an Identity that keeps state): Python runs the method."""

    def __init__(self) -> None:
        super().__init__()
        self._modules["quiet"] = nn.Identity()

    def quiet(self, x):
        torch._C._set_grad_enabled(False)
        return x


class _HoldsAToggle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = Toggle()


class ReboundSelf(Attention):
    def __init__(self) -> None:
        super().__init__()
        self.other = _HoldsAToggle()

    def helper(self, x):
        self = self.other
        return self.q_proj(x)


def test_a_method_beside_a_same_named_child_is_not_read_as_the_child() -> None:
    """Before: `self_call_keeps_state` looked in `_modules` first and proved the Identity,
    while Python runs the method that switches grad mode off."""
    assert not self_call_keeps_state(ShadowedQuiet(), "quiet")
    assert self_call_keeps_state(Attention(), "q_proj")


def test_a_method_that_rebinds_self_proves_nothing() -> None:
    """Before: `self` stayed the owner after `self = self.other`, so `self.q_proj(x)` was
    read as the owner's linear (keeps state) while it calls the other module's Toggle."""
    module = ReboundSelf()
    assert not function_keeps_state(type(module).helper, module)
