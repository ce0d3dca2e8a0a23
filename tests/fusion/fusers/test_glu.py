"""GLU fuser: activation identification, operand order, refusals, parity."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from fusion.errors import RewriteRefused
from fusion.fusers.glu import activation_kind
from fusion.runtime.merged import ActAndMul, MergedLinear
from tests.fusion.fusers import hazards
from tests.fusion.fusers.helpers import fuse_copy, outputs_match, reasons


@pytest.mark.parametrize(
    ("act", "kind"),
    [
        (nn.SiLU(), "silu"),
        (nn.GELU(), "gelu"),
        (nn.GELU(approximate="tanh"), "gelu_tanh"),
        (ACT2FN["silu"], "silu"),
        (ACT2FN["swish"], "silu"),
        (ACT2FN["gelu"], "gelu"),
        (ACT2FN["gelu_pytorch_tanh"], "gelu_tanh"),
        (ACT2FN["gelu_new"], "gelu_tanh"),
    ],
)
def test_activation_identified(act: nn.Module, kind: str) -> None:
    assert activation_kind(act) == kind
    module = hazards.MLP(act=act)
    fused, report = fuse_copy(module)
    assert report.counts() == {"glu": 1}, str(report)
    assert isinstance(fused.gate_up_proj, MergedLinear)
    assert fused.gate_up_proj.shard_names == ("gate_proj", "up_proj")  # gate is shard 0
    assert isinstance(fused.act_and_mul, ActAndMul) and fused.act_and_mul.activation == kind
    assert outputs_match(module, fused, 2, 5, 32)


@pytest.mark.parametrize("name", ["relu", "gelu_python", "gelu_fast", "quick_gelu", "tanh"])
def test_unknown_activation_refused(name: str) -> None:
    with pytest.raises(RewriteRefused, match="not one ActAndMul reproduces exactly"):
        activation_kind(ACT2FN[name])
    module = hazards.MLP(act=ACT2FN[name])
    fused, report = fuse_copy(module)
    assert "glu" not in report.counts()
    assert "reproduces exactly" in reasons(report)
    assert outputs_match(module, fused, 2, 5, 32)


@pytest.mark.parametrize("cls", [hazards.MLPSwapped, hazards.MLPNoDown])
def test_operand_order_and_no_down_projection(cls: type[nn.Module]) -> None:
    module = cls()
    fused, report = fuse_copy(module)
    assert report.counts() == {"glu": 1}, str(report)
    assert outputs_match(module, fused, 2, 5, 32)


def test_split_statements_fall_back_to_sibling_merge() -> None:
    module = hazards.MLPSplitStatements()
    fused, report = fuse_copy(module)
    assert report.counts() == {"sibling": 1}, str(report)
    assert "not one expression" in reasons(report)
    assert outputs_match(module, fused, 2, 5, 32)


def test_inplace_write_between_gate_and_up_refused() -> None:
    module = hazards.MLPInplaceBetween()
    fused, report = fuse_copy(module)
    assert not report.applied, str(report)
    assert outputs_match(module, fused, 2, 5, 32)


def test_per_instance_activation() -> None:
    silu, gelu = hazards.MLP(act=nn.SiLU()), hazards.MLP(act=nn.GELU(approximate="tanh"))
    model = nn.ModuleList([silu, gelu])
    original = [hazards.MLP(act=nn.SiLU()), hazards.MLP(act=nn.GELU(approximate="tanh"))]
    for o, m in zip(original, model):
        o.load_state_dict(m.state_dict())
    fused, report = fuse_copy(model)
    assert report.counts() == {"glu": 2}
    assert [m.act_and_mul.activation for m in fused] == ["silu", "gelu_tanh"]
    for o, f in zip(original, fused):
        assert outputs_match(o, f, 2, 5, 32)


def test_broadcast_gate_refused() -> None:
    # A width-1 gate broadcasts over up: a valid function that ActAndMul cannot compute.
    module = hazards.MLP()
    module.gate_proj = nn.Linear(32, 1, bias=False)
    fused, report = fuse_copy(module)
    assert "glu" not in report.counts()
    assert "gate width 1 != up width 48" in reasons(report)
    assert outputs_match(module, fused, 2, 5, 32)


def test_act_and_mul_matches_reference() -> None:
    x = torch.randn(3, 10)
    for kind, fn in [("silu", torch.nn.functional.silu), ("gelu", torch.nn.functional.gelu)]:
        expected = fn(x[:, :5]) * x[:, 5:]
        assert torch.equal(ActAndMul(kind)(x), expected)


# -- activations called as functions, and activation classes read by tracing ------------------


class FunctionalSiLU(hazards.MLP):
    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FunctionalGeluTanh(hazards.MLP):
    def forward(self, x):
        return self.down_proj(self.up_proj(x) * F.gelu(self.gate_proj(x), approximate="tanh"))


class FunctionalInplace(hazards.MLP):
    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x), inplace=True) * self.up_proj(x))


class FunctionalShadowed(hazards.MLP):
    def forward(self, x):
        F = torch.nn.functional  # a local `F`: the global is not what is called
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FunctionalApproximateFromAttribute(hazards.MLP):
    approximate = "tanh"

    def forward(self, x):
        gate = F.gelu(self.gate_proj(x), approximate=self.approximate)
        return self.down_proj(gate * self.up_proj(x))


class GeluTanhCallingFunctional(nn.Module):
    """Older Transformers' `PytorchGELUTanh`: calls `F.gelu(..., approximate="tanh")`."""

    def forward(self, input):
        return F.gelu(input, approximate="tanh")


class SiluTimesOne(nn.Module):
    def forward(self, input):
        return F.silu(input) * 1.0


class CalledSilu(nn.Module):
    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **kwargs) * 2.0

    def forward(self, input):
        return F.silu(input)


@pytest.mark.parametrize(
    ("cls", "kind"), [(FunctionalSiLU, "silu"), (FunctionalGeluTanh, "gelu_tanh")]
)
def test_functional_activation_fused(cls: type[nn.Module], kind: str) -> None:
    module = cls()
    fused, report = fuse_copy(module)
    assert report.counts() == {"glu": 1}, str(report)
    assert fused.act_and_mul.activation == kind
    assert outputs_match(module, fused, 2, 5, 32)


@pytest.mark.parametrize(
    "cls", [FunctionalInplace, FunctionalShadowed, FunctionalApproximateFromAttribute]
)
def test_functional_activation_hazards_not_glu_fused(cls: type[nn.Module]) -> None:
    module = cls()
    fused, report = fuse_copy(module)
    assert "glu" not in report.counts(), str(report)
    assert outputs_match(module, fused, 2, 5, 32)


def test_activation_class_read_by_tracing() -> None:
    assert activation_kind(GeluTanhCallingFunctional()) == "gelu_tanh"
    module = hazards.MLP(act=GeluTanhCallingFunctional())
    fused, report = fuse_copy(module)
    assert report.counts() == {"glu": 1}, str(report)
    assert outputs_match(module, fused, 2, 5, 32)


@pytest.mark.parametrize("act", [SiluTimesOne(), CalledSilu()])
def test_activation_class_that_is_not_one_call_refused(act: nn.Module) -> None:
    with pytest.raises(RewriteRefused, match="not one ActAndMul reproduces exactly"):
        activation_kind(act)
    module = hazards.MLP(act=act)
    fused, report = fuse_copy(module)
    assert "glu" not in report.counts()
    assert outputs_match(module, fused, 2, 5, 32)


def test_functional_glu_of_a_corpus_model_with_parity() -> None:
    import copy

    import corpus
    import fusion

    model = corpus.build("lfm2", seed=0, dtype=torch.float32, device="cpu").eval()
    fused = copy.deepcopy(model)
    report = fusion.fuse(fused)
    applied = [r for r in report.applied if r.source_class == "Lfm2MLP"]
    assert applied and all(r.fuser == "glu" for r in applied), str(report)
    assert "silu(*)" in applied[0].description
    inputs = corpus.make_inputs(model, seed=0)
    with torch.no_grad():
        torch.testing.assert_close(fused(**inputs).logits, model(**inputs).logits)


class AutocastLeakingSiLU(nn.Module):
    """A SiLU of its own class (read by tracing: one `F.silu` call) that also switches CPU
    autocast on and leaves it on: `up` runs under autocast after it."""

    def forward(self, x):
        torch.set_autocast_enabled("cpu", True)
        return F.silu(x)


class GradFreeSiLU(nn.Module):
    """A SiLU of its own class whose output carries no gradient (grad mode restored after)."""

    def forward(self, x):
        previous = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        out = F.silu(x)
        torch.set_grad_enabled(previous)
        return out


class MLPAutocastOff(hazards.MLP):
    def forward(self, x):
        out = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        torch.set_autocast_enabled("cpu", False)
        return out


def _behaviour(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Output and input gradient under explicit ambient state (grad on, autocast off)."""
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0)).requires_grad_()
    with torch.enable_grad(), torch.autocast("cpu", enabled=False):
        out = module(x)
    if out.requires_grad:
        out.float().square().sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("act", [AutocastLeakingSiLU, GradFreeSiLU])
def test_activation_changing_global_state_refused(act: type[nn.Module]) -> None:
    # The trace shows one `F.silu`, but the activation also changes global state: merging
    # gate and up (and replacing the activation by `ActAndMul`) would drop the change, and
    # move `up` out of the state it ran in.
    try:
        module = MLPAutocastOff(act=act())
        fused, report = fuse_copy(module)
        assert not report.applied, str(report)
        assert "may change global state" in reasons(report), str(report)
        (out, grad), (fused_out, fused_grad) = _behaviour(module), _behaviour(fused)
        assert out.dtype == fused_out.dtype and torch.allclose(out, fused_out)
        assert (grad is None) == (fused_grad is None)
        assert grad is None or torch.allclose(grad, fused_grad)
    finally:
        torch.set_autocast_enabled("cpu", False)
        torch.set_grad_enabled(True)


# -- the activation's kind, guarded: an edit after fusing runs the original forward ---------


def _set(name: str, value: object):
    def edit(acts: list[nn.Module], monkeypatch: pytest.MonkeyPatch) -> None:
        for act in acts:
            setattr(act, name, value)

    return edit


def _python_gelu(acts: list[nn.Module], monkeypatch: pytest.MonkeyPatch) -> None:
    for act in acts:
        act.act = act._gelu_python  # a bound method stored on the instance


def _partial_keyword(acts: list[nn.Module], monkeypatch: pytest.MonkeyPatch) -> None:
    for act in acts:
        act.act.keywords["approximate"] = "none"  # a functools.partial's contents, in place


def _class_forward(acts: list[nn.Module], monkeypatch: pytest.MonkeyPatch) -> None:
    cls = type(acts[0])
    base = cls.forward
    monkeypatch.setattr(cls, "forward", lambda self, x: base(self, x) * 0.5)


ACTIVATION_EDITS = [
    ("gelu", lambda: nn.GELU(), _set("approximate", "tanh")),
    ("gelu-tanh", lambda: nn.GELU(approximate="tanh"), _set("approximate", "none")),
    ("hf-gelu", lambda: ACT2FN["gelu"], _python_gelu),
    ("hf-gelu-tanh", lambda: ACT2FN["gelu_pytorch_tanh"], _set("act", F.gelu)),
    ("hf-gelu-tanh-keywords", lambda: ACT2FN["gelu_pytorch_tanh"], _partial_keyword),
    ("silu-class", lambda: nn.SiLU(), _class_forward),
    ("hf-silu-class", lambda: ACT2FN["silu"], _class_forward),
    ("gelu-class", lambda: nn.GELU(), _class_forward),
]


@pytest.mark.parametrize(
    ("act", "edit"), [(a, e) for _, a, e in ACTIVATION_EDITS], ids=[n for n, *_ in ACTIVATION_EDITS]
)
def test_activation_edited_after_fusing_runs_the_original_forward(act, edit, monkeypatch) -> None:
    """What identifying the activation read (`approximate`, the function a Transformers
    wrapper calls, its class's forward) is guarded: after an edit the rewritten forward falls
    back to the original, which computes what the unfused MLP now does, bit for bit. (On main:
    the kind frozen into `act_and_mul` at fuse time was used.)"""
    module = hazards.MLP(act=act())
    fused, report = fuse_copy(module)
    assert report.counts() == {"glu": 1}, str(report)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = module(x)
        edit([module.act_fn, fused.act_fn], monkeypatch)
        expected, actual = module(x), fused(x)
    assert not torch.equal(before, expected)  # the edit changes the function
    assert torch.equal(expected, actual)
    assert fused.forward.guard_failures == 1
    # a patched class forward is caught first by the child guard on `act_fn` (which
    # records the child class's forward), anything else by the activation's own guard
    reason = fused.forward.last_failure
    assert reason.startswith("activation: ") or reason.endswith(".forward was replaced"), reason


def test_activation_guard_follows_a_copy() -> None:
    """A deep copy's guard watches the copy's activation: editing the copy falls back there
    and leaves the original fused."""
    module = hazards.MLP(act=nn.GELU())
    fused, _ = fuse_copy(module)
    copied = copy.deepcopy(fused)
    copied.act_fn.approximate = "tanh"
    x = torch.randn(3, 32)
    with torch.no_grad():
        copied(x)
        fused(x)
    assert copied.forward.guard_failures == 1
    assert fused.forward.guard_failures == 0


def test_activation_with_an_instance_forward_is_refused() -> None:
    act = nn.SiLU()
    act.forward = lambda x: F.silu(x) * 2
    module = hazards.MLP(act=act)
    fused, report = fuse_copy(module)
    assert "glu" not in report.counts()
    assert "instance-level forward" in reasons(report)
    assert outputs_match(module, fused, 2, 5, 32)
