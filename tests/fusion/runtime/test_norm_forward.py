"""fusion.runtime.norm_forward: a fused norm stays in its slot and reads everything live (issue 43).

Each test makes one ordinary edit after fusing, the same edit on an unfused copy made before
fusing, and requires the two to compute the same values, bit for bit."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize, prune
from torch.overrides import TorchFunctionMode

import fusion
from fusion.kernels.policy import POLICY
from fusion.runtime import norm_forward
from fusion.runtime.norm_forward import NormForward
from tests.fusion.tiny_models import tiny_model, token_ids

WIDTH = 48


def _llama_norm() -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(WIDTH, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(WIDTH, generator=torch.Generator().manual_seed(0)))
    return norm


def _pair(norm: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(unfused, fused) holders of two copies of `norm`; the fused one's forward checked."""
    unfused, fused = nn.Sequential(copy.deepcopy(norm)), nn.Sequential(copy.deepcopy(norm))
    assert fusion.fuse(fused).counts() == {"rmsnorm": 1}
    assert type(fused[0]) is type(norm)
    assert type(fused[0].__dict__["forward"]) is NormForward
    return unfused, fused


def _x(scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(3, 5, WIDTH, generator=torch.Generator().manual_seed(1))


def _same(unfused: nn.Module, fused: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        expected, actual = unfused(x), fused(x)
    assert actual.dtype == expected.dtype
    assert torch.equal(actual, expected)


def test_fused_norm_is_the_module_in_its_slot() -> None:
    unfused, fused = _pair(_llama_norm())
    forward = fused[0].forward
    _same(unfused, fused, _x())
    assert forward.guard_failures == 0, forward.last_failure
    assert isinstance(fused[0], type(unfused[0])) and fused[0].weight.shape == (WIDTH,)


def test_eps_written_after_fusing_is_read() -> None:
    unfused, fused = _pair(_llama_norm())
    x = _x(1e-3)  # small inputs: eps dominates, so a frozen eps shows
    _same(unfused, fused, x)
    for holder in (unfused, fused):
        holder[0].variance_epsilon = 0.5
    _same(unfused, fused, x)
    assert fused[0].forward.guard_failures == 0  # read live: the fused path still ran


def test_a_patched_class_forward_is_what_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    unfused, fused = _pair(_llama_norm())
    cls = type(fused[0])
    original = cls.forward
    monkeypatch.setattr(cls, "forward", lambda self, x: 2 * original(self, x))
    _same(unfused, fused, _x())
    assert fused[0].forward.last_failure == f"{cls.__name__}.forward was replaced"


class _Doubled(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w


def test_a_parametrized_weight_is_what_is_normalised_with() -> None:
    unfused, fused = _pair(_llama_norm())
    for holder in (unfused, fused):
        parametrize.register_parametrization(holder[0], "weight", _Doubled())
    _same(unfused, fused, _x())  # was KeyError: the fused norm read `_parameters["weight"]`


def test_a_pruned_weight_is_what_is_normalised_with() -> None:
    unfused, fused = _pair(_llama_norm())
    for holder in (unfused, fused):
        prune.random_unstructured(holder[0], "weight", amount=0.5)
    torch.manual_seed(0)
    mask = unfused[0].weight_mask.clone()
    fused[0].weight_mask.copy_(mask)
    fused[0](_x())  # the pre-hook recomputes the masked weight
    unfused[0](_x())
    _same(unfused, fused, _x())
    assert fused[0].forward.guard_failures == 0  # the masked weight is a live read


class _FlaggedNorm(nn.Module):
    """An RMSNorm whose flag, read by a helper method, is off at fuse time."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(WIDTH))
        self.eps = 1e-6
        self.shifted = False

    def _shift(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1 if self.shifted else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self._shift(self.weight * h.to(x.dtype))


def test_a_flag_read_by_a_helper_is_recorded_and_guarded() -> None:
    unfused, fused = _pair(_FlaggedNorm())
    forward = fused[0].forward
    assert {name for _, name in forward.reads.reads} == {"_shift", "shifted"}
    for holder in (unfused, fused):
        holder[0].shifted = True
    _same(unfused, fused, _x())
    assert forward.last_failure == "_FlaggedNorm.shifted, which the norm's forward read, changed"


def test_a_helper_patched_on_the_class_is_what_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    unfused, fused = _pair(_FlaggedNorm())
    monkeypatch.setattr(_FlaggedNorm, "_shift", lambda self, x: x - 1)
    _same(unfused, fused, _x())


class _Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_a_torch_function_mode_sees_the_original_ops() -> None:
    unfused, fused = _pair(_llama_norm())
    x = _x()
    with torch.no_grad():
        with _Recorder() as seen_unfused:
            expected = unfused(x)
        with _Recorder() as seen_fused:
            actual = fused(x)
    assert torch.equal(actual, expected)
    assert seen_fused.names == seen_unfused.names
    assert "rms_norm" not in seen_fused.names


def test_copies_read_their_own_state() -> None:
    unfused, fused = _pair(_llama_norm())
    copied = copy.deepcopy(fused)
    assert copied[0].forward.module is copied[0]
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded[0].forward.module is loaded[0] and loaded[0].forward.disabled is None
    for holder in (unfused, copied, loaded):
        holder[0].variance_epsilon = 0.25
    x = _x(1e-3)
    _same(unfused, copied, x)
    _same(unfused, loaded, x)
    with torch.no_grad():  # the original fused model kept its own eps
        assert not torch.equal(fused(x), unfused(x))


def test_a_shallow_copy_reads_itself() -> None:
    """`copy.copy` of the fused norm: the copy's forward reads the copy (its own eps, its own
    flag read by a helper), not the module it was copied from."""
    for norm, attribute in ((_llama_norm(), "variance_epsilon"), (_FlaggedNorm(), "shifted")):
        unfused, fused = _pair(norm)
        copies = [copy.copy(holder[0]) for holder in (unfused, fused)]
        assert copies[1].forward.module is copies[1]
        value = 0.5 if attribute == "variance_epsilon" else True
        for module in copies:
            setattr(module, attribute, value)
        _same(copies[0], copies[1], _x(1e-3))
        _same(unfused, fused, _x(1e-3))  # the originals are untouched


def test_a_saved_forward_whose_class_source_changed_runs_the_original() -> None:
    _, fused = _pair(_llama_norm())
    forward = fused[0].forward
    rebuild, (module, cls, _original, reads, fields) = forward.__reduce__()
    stale = rebuild(module, cls, "def forward(self, x):\n    return x", reads, fields)
    assert stale.disabled is not None
    x = _x()
    with torch.no_grad():
        assert torch.equal(stale(x), type(module).forward(module, x))


def test_model_eps_edit_after_fusing() -> None:
    """The issue's reproduction: a tiny Llama, `variance_epsilon = 0.5` on one norm."""
    model = tiny_model("llama")
    fused = copy.deepcopy(model)
    fusion.fuse(fused)
    for m in (model, fused):
        m.model.layers[0].input_layernorm.variance_epsilon = 0.5
    ids = token_ids()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fused(ids).logits)


def _norm_forwards(model: nn.Module) -> list[NormForward]:
    found = (m.__dict__.get("forward") for m in model.modules())
    return [f for f in found if isinstance(f, NormForward)]


def test_on_the_route_every_norm_runs_its_original_and_the_residual_adds_stay_apart(
    monkeypatch,
):
    """Routes open (the default; tests/conftest.py closes them): on a CPU under `auto`
    every norm call, the residual-norm sites' included, runs the class's original (no norm
    kernel), so the logits are the unfused model's bit for bit; closed, the kernels run."""
    unfused = tiny_model("llama").eval()
    fused = copy.deepcopy(unfused)
    report = fusion.fuse(fused)
    assert {a.fuser for a in report.applied} >= {"rmsnorm", "residual_norm"}
    kernels = []
    for name in ("norm_kernel", "norm_pair_kernel"):
        real = getattr(norm_forward, name)
        monkeypatch.setattr(
            norm_forward,
            name,
            lambda *a, _real=real, _name=name: kernels.append(_name) or _real(*a),
        )
    ids = token_ids(batch=1, seq=5)
    with torch.no_grad(), POLICY.routing(True), POLICY.counting_routes():
        assert torch.equal(fused(ids).logits, unfused(ids).logits)
    forwards = _norm_forwards(fused)
    assert forwards and all(f.original_calls > 0 for f in forwards)
    assert not kernels and all(f.guard_failures == 0 for f in forwards)
    taken = sum(f.original_calls for f in forwards)
    with torch.no_grad(), POLICY.routing(False), POLICY.counting_routes():
        fused(ids)
    assert sum(f.original_calls for f in forwards) == taken
    assert set(kernels) == {"norm_kernel", "norm_pair_kernel"}
