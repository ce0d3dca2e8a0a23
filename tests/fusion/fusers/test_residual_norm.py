"""The residual add + RMSNorm fuser: spellings it fuses (bit for bit), hazards it refuses.

Synthetic layers below share one constructor and differ in `forward` only (each class is
matched on its own source); real Transformers decoder layers come from the corpus.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import corpus
import fusion
from fusion.analysis.source import recover_forward
from fusion.engine import apply
from fusion.fusers.residual_norm import HELPER, Refused, ResidualNormFuser, Site, find_sites
from fusion.fusers.residual_norm.fuser import is_fused_norm
from fusion.fusers.rmsnorm import RMSNormFuser
from fusion.kernels import ops
from tests.fusion.fusers.helpers import fuse_copy, reasons

WIDTH = 16


class MeanNorm(nn.Module):
    """A LayerNorm without bias: a norm, not an RMSNorm."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centred = x - x.mean(-1, keepdim=True)
        return (
            self.weight
            * centred
            * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        )


class DoubledNorm(LlamaRMSNorm):
    """A subclassed RMSNorm whose own forward computes something else."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_states) * 2


class Base(nn.Module):
    norm_class: type[nn.Module] = LlamaRMSNorm

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm = self.norm_class(WIDTH)
        self.mlp = nn.Linear(WIDTH, WIDTH)
        self.flag = True
        self.saved: list[torch.Tensor] = []
        with torch.no_grad():
            self.norm.weight.copy_(
                1 + 0.1 * torch.randn(WIDTH, generator=torch.Generator().manual_seed(1))
            )


class Llama(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x
        h = self.proj(x)
        h = residual + h
        residual = h
        h = self.norm(h)
        h = self.mlp(h)
        return residual + h


class Gemma(Llama):
    norm_class = GemmaRMSNorm


class NoCopy(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x) + x
        h = self.norm(h)
        return self.mlp(h)


class Returned(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.proj(x) * 0.5
        return self.norm(h)


class Nested(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.proj(x)
        residual = h
        out = self.mlp(self.norm(h))
        return residual + out


class Chained(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.proj(x)
        skip = h
        h = self.norm(h).to(x.dtype)
        return self.mlp(h) + skip


class InlineBranch(Base):
    """Lfm2's spelling: the norm inside the next residual add's right operand."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x) + x
        return h + self.mlp(self.norm(h))


FUSED_SPELLINGS = [Llama, Gemma, NoCopy, Returned, Nested, Chained, InlineBranch]


class WritesResidual(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.proj(x)
        residual = h
        residual.mul_(2)
        h = self.norm(h)
        return residual + h


class StoresItem(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.proj(x)
        residual = h
        residual[..., 0] = 0.0
        return residual + self.norm(h)


class TorchInplace(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.proj(x)
        torch.relu_(h)
        h = self.norm(h)
        return h


class DropoutInplace(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.proj(x)
        F.dropout(h, 0.0, self.training, True)
        h = self.norm(h)
        return h


class Escapes(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.proj(x)
        self.saved.append(h)
        h = self.norm(h)
        return h


class Conditional(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.proj(x)
        residual = h
        if self.flag:
            h = self.norm(h)
        return residual + h


class NotFirst(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.proj(x)
        h = self.mlp(x) + self.norm(h)
        return h


class MeanNormLayer(Llama):
    norm_class = MeanNorm


class DoubledNormLayer(Llama):
    norm_class = DoubledNorm


REFUSED = [
    (WritesResidual, "not a plain copy"),
    (StoresItem, "not a plain copy"),
    (TorchInplace, "not a plain copy"),
    (DropoutInplace, "not a plain copy"),
    (Escapes, "not a plain copy"),
    (Conditional, "compound statement"),
    (NotFirst, "not the first thing"),
    (MeanNormLayer, "norm is not an RMSNorm"),
    (DoubledNormLayer, "norm is not an RMSNorm"),
]


class AugmentedSum(Base):
    """`h += 1` writes the sum in place (and rebinds `h`): the norm reads another value, so
    this is not a site at all."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.proj(x)
        residual = h
        h += 1
        return residual + self.norm(h)


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = ops.add_rms_norm

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "add_rms_norm", spy)
    return calls


def _applied(report: fusion.FusionReport, fuser: str = "residual_norm") -> list[str]:
    return [record.qualname for record in report.applied if record.fuser == fuser]


def _same(original: nn.Module, fused: nn.Module, dtype: torch.dtype) -> bool:
    x = torch.randn(2, 3, WIDTH, generator=torch.Generator().manual_seed(0)).to(dtype)
    a_in, b_in = x.clone(), x.clone()
    with torch.no_grad():
        a, b = original(a_in), fused(b_in)
    return torch.equal(a, b) and torch.equal(a_in, b_in)


@pytest.mark.parametrize("cls", FUSED_SPELLINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spellings_fuse_bit_for_bit(cls, dtype, kernel_calls) -> None:
    layer = cls().to(dtype)
    fused, report = fuse_copy(layer)
    assert _applied(report) == [""], reasons(report)
    assert is_fused_norm(fused.norm)
    assert _same(layer, fused, dtype)
    assert kernel_calls == [1], "the fused kernel did not run"


@pytest.mark.parametrize(("cls", "reason"), REFUSED)
def test_hazards_are_refused_with_the_reason(cls, reason, kernel_calls) -> None:
    layer = cls()
    fused, report = fuse_copy(layer)
    assert _applied(report) == []
    refusals = [r.reason for r in report.skipped if r.fuser == "residual_norm"]
    assert refusals and reason in refusals[0], reasons(report)
    layer.saved, fused.saved = [], []
    assert _same(layer, fused, torch.float32)
    assert kernel_calls == []


def test_a_sum_written_in_place_is_not_a_site() -> None:
    layer = AugmentedSum()
    fused, report = fuse_copy(layer)
    assert _applied(report) == []
    assert _same(layer, fused, torch.float32)


def test_hooks_on_the_norm_refuse_the_instance() -> None:
    layer = Llama()
    layer.norm.register_forward_hook(lambda module, inputs, output: None)
    _fused, report = fuse_copy(layer)
    assert _applied(report) == []
    assert "norm would not be fused" in reasons(report)


def test_norm_with_an_instance_forward_is_refused() -> None:
    layer = Llama()
    layer.norm.forward = lambda x: x
    fused, report = fuse_copy(layer)
    assert _applied(report) == []
    assert "instance-level forward" in reasons(report)
    assert _same(layer, fused, torch.float32)


def test_sites_found_in_source() -> None:
    """`find_sites` reads the add, the copy and the norm call of a Llama-style forward."""
    funcdef, _ = recover_forward(Llama)
    found = find_sites(funcdef, lambda name: name == "norm", lambda name: True)
    assert len(found) == 1 and isinstance(found[0], Site)
    assert found[0].norm == "norm" and found[0].total == "h" and len(found[0].gap) == 1
    funcdef, _ = recover_forward(WritesResidual)
    refused = find_sites(funcdef, lambda name: name == "norm", lambda name: True)
    assert isinstance(refused[0], Refused) and "residual.mul_(2)" in refused[0].reason


def test_hook_added_after_fusing_runs_and_the_result_is_unchanged(kernel_calls) -> None:
    layer = Llama()
    fused, report = fuse_copy(layer)
    assert _applied(report) == [""]
    seen: list[torch.Tensor] = []
    fused.norm.register_forward_hook(lambda module, inputs, output: seen.append(output))
    assert _same(layer, fused, torch.float32)
    assert len(seen) == 1 and kernel_calls == []  # the original two ops ran


def test_a_norm_swapped_in_after_fusing_is_called() -> None:
    layer = Llama()
    fused, _ = fuse_copy(layer)
    fused.norm = copy.deepcopy(layer.norm)  # the Transformers norm again
    assert _same(layer, fused, torch.float32)


def test_norm_already_fused_when_the_layer_is() -> None:
    layer = Llama()
    fused = copy.deepcopy(layer)
    apply.run(fused, fusers=(RMSNormFuser,))
    assert is_fused_norm(fused.norm)
    report = fusion.fuse(fused)
    assert _applied(report) == [""]
    assert _same(layer, fused, torch.float32)


def test_plan_matches_fuse_and_changes_nothing() -> None:
    layer = Llama()
    before = copy.deepcopy(layer)
    planned = fusion.plan(layer)
    assert "forward" not in layer.__dict__ and not hasattr(layer, HELPER)
    assert type(layer.norm) is LlamaRMSNorm and _same(before, layer, torch.float32)
    _, report = fuse_copy(layer)
    assert [(r.qualname, r.fuser) for r in planned.applied] == [
        (r.qualname, r.fuser) for r in report.applied
    ]


def test_state_dict_pickle_and_compile() -> None:
    layer = Llama()
    fused, _ = fuse_copy(layer)
    unfused_state, fused_state = layer.state_dict(), fused.state_dict()
    assert list(unfused_state) == list(fused_state)
    assert all(torch.equal(unfused_state[k], fused_state[k]) for k in unfused_state)
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    buffer.seek(0)
    reloaded = torch.load(buffer, weights_only=False)
    assert _same(layer, reloaded, torch.float32)
    assert _same(layer, copy.deepcopy(fused), torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(fused, fullgraph=True, backend="eager")
    assert _same(layer, compiled, torch.float32)


DECODER_ARCHS = ["llama", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "granite", "lfm2"]


@pytest.mark.parametrize("arch", DECODER_ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformers_decoder_layers_fuse_bit_for_bit(arch, dtype) -> None:
    model = corpus.build(arch, seed=0, dtype=dtype, device="cpu")
    fused, report = fuse_copy(model)
    layers = [name for name, m in model.named_modules() if name.endswith("layers.0")]
    assert layers and layers[0] in _applied(report), reasons(report)
    inputs = corpus.make_inputs(model, seed=0)
    with torch.no_grad():
        assert torch.equal(fused(**inputs).logits, model(**inputs).logits)
    assert set(fused.state_dict()) == set(model.state_dict())


def test_olmo2_post_norms_read_the_branch_not_the_sum() -> None:
    """OLMo2 normalises each branch before adding it: no add is followed by a norm of the sum."""
    model = corpus.build("olmo2", seed=0, dtype=torch.float32, device="cpu")
    assert _applied(fusion.plan(model)) == []


def test_fused_decoder_layers_keep_the_state_dict() -> None:
    """Only this fuser and the norm fuser: the state dict is the unfused one, key for key in
    order, tensor for tensor."""
    model = corpus.build("llama", seed=0, dtype=torch.float32, device="cpu")
    fused = copy.deepcopy(model)
    report = apply.run(fused, fusers=(ResidualNormFuser, RMSNormFuser))
    assert "model.layers.0" in _applied(report)
    before, after = model.state_dict(), fused.state_dict()
    assert list(before) == list(after)
    assert all(torch.equal(before[k], after[k]) for k in before)


def _norm_grad_scaler(module: nn.Module, grad_input, grad_output):
    """A global full backward hook that rescales every norm's input gradient (by class
    name, so the fused norm is matched as the Transformers one is)."""
    if "Norm" in type(module).__name__:
        return tuple(None if g is None else g * 3.0 for g in grad_input)
    return None


def _embedding_grad(model: nn.Module, inputs: dict) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    model(**inputs).logits.float().pow(2).mean().backward()
    return model.get_input_embeddings().weight.grad.clone()


def test_global_backward_hook_added_after_fusing_fires_on_the_added_norm() -> None:
    """Issue 24, defect 5: the post-attention norm ran inside `add_rms_norm` without
    `__call__`, so a global backward hook added after fusing never fired for it (embedding
    gradient off by 6-27). The helper now sees global hooks per call and calls the norm."""
    model = corpus.build("llama", seed=0, dtype=torch.float32, device="cpu")
    fused = copy.deepcopy(model)
    report = fusion.fuse(fused)
    assert any(a.fuser == "residual_norm" for a in report.applied)
    inputs = corpus.make_inputs(model, seed=0)
    handle = nn.modules.module.register_module_full_backward_hook(_norm_grad_scaler)
    try:
        expected = _embedding_grad(model, inputs)
        got = _embedding_grad(fused, inputs)
    finally:
        handle.remove()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    # the hook changes the gradient, so the comparison above could fail
    assert not torch.allclose(_embedding_grad(model, inputs), expected, rtol=1e-3, atol=1e-6)


def test_global_backward_hook_at_fuse_time_refuses_residual_norm() -> None:
    model = corpus.build("llama", seed=0, dtype=torch.float32, device="cpu")
    handle = nn.modules.module.register_module_full_backward_hook(_norm_grad_scaler)
    try:
        report = fusion.plan(model)
    finally:
        handle.remove()
    assert not any(a.fuser == "residual_norm" for a in report.applied)
    assert any("global backward hooks" in (s.reason or "") for s in report.skipped)
