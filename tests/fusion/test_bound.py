"""`fusion.bound`: a fused model's rewritten forwards survive pickling, deepcopy and compile."""

from __future__ import annotations

import ast
import copy
import inspect
import io
import pickle

import pytest
import torch

import fusion
from fusion.bound import BoundForward, _rebuild
from tests.fusion.tiny_models import tiny_model, token_ids


def _fused(model_type: str = "llama"):
    unfused = tiny_model(model_type, seed=5)
    fused = copy.deepcopy(unfused)
    report = fusion.fuse(fused)
    assert report.counts().get("qkv") or report.counts().get("mla"), str(report)
    return unfused, fused


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _assert_fused_copy(copied, unfused) -> None:
    attn = copied.model.layers[0].self_attn
    assert isinstance(attn.forward, BoundForward) and attn.forward.module is attn
    assert not hasattr(attn, "q_proj") or not isinstance(attn.q_proj, torch.nn.Linear)
    ids = token_ids()
    torch.testing.assert_close(_logits(copied, ids), _logits(unfused, ids), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "deepseek_v3"])
def test_torch_save_and_load_whole_model(model_type: str) -> None:
    """Regression (`torch.save(fused)` failed on a local hook, and the reloaded model lost
    its rewritten forward): the reloaded model is fused, bound to itself, and equal."""
    unfused, fused = _fused(model_type)
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    _assert_fused_copy(loaded, unfused)
    # Its checkpoint hooks came along: state dict in the unfused layout, loads unfused keys.
    assert set(loaded.state_dict()) == set(unfused.state_dict())
    loaded.load_state_dict(unfused.state_dict())


def test_pickle_every_protocol() -> None:
    unfused, fused = _fused()
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        _assert_fused_copy(pickle.loads(pickle.dumps(fused, protocol=protocol)), unfused)


def test_deepcopy_binds_the_copy_not_the_original() -> None:
    unfused, fused = _fused()
    copied = copy.deepcopy(fused)
    _assert_fused_copy(copied, unfused)
    with torch.no_grad():
        for p in copied.parameters():
            p.mul_(0.5)
    ids = token_ids()
    torch.testing.assert_close(_logits(fused, ids), _logits(unfused, ids), rtol=1e-5, atol=1e-6)


def test_bound_forward_looks_like_a_bound_method() -> None:
    _, fused = _fused()
    attn = fused.model.layers[0].self_attn
    want = inspect.signature(type(attn).forward.__get__(attn))
    assert inspect.signature(attn.forward) == want
    assert attn.forward.__self__ is attn and attn.forward.__name__ == "forward"


def test_changed_class_source_refuses_to_rebuild() -> None:
    """Unpickling against a class whose forward changed raises instead of grafting."""
    _, fused = _fused()
    bound = fused.model.layers[0].self_attn.forward
    with pytest.raises(RuntimeError, match="source changed since the model was fused"):
        _rebuild(bound.module, bound.cls, bound.original + "# edited\n", bound.rewritten)
    assert isinstance(bound.rewritten, ast.FunctionDef)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_torch_compile_fused_model(model_type: str) -> None:
    """Regression (compiling a fused MoE model crashed in Dynamo on the oneDNN pack cache's
    weakref.finalize; dense ones when compiled before their first eager call): the fused
    model compiles fullgraph on the default kernel backend and gives the eager outputs (the
    kernels are operators while Dynamo traces, `fusion.kernels.ops`)."""
    unfused, fused = _fused(model_type)
    torch._dynamo.reset()
    compiled = torch.compile(fused, fullgraph=True, backend="eager")
    ids = token_ids()
    torch.testing.assert_close(_logits(compiled, ids), _logits(unfused, ids), rtol=1e-5, atol=1e-6)
