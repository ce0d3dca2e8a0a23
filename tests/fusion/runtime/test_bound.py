"""`fusion.runtime.bound`: a fused model's rewritten forwards survive pickling, deepcopy and compile."""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import io
import pickle

import pytest
import torch

import fusion
from fusion.errors import RewriteRefused
from fusion.kernels.policy import POLICY
from fusion.runtime.bound import BoundForward, _rebuild, rebind_installed, rewrap
from tests.fusion.merged_paths import measured_references
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
    assert attn.forward.failure() is None  # the copy's guards watch the copy's children
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


def test_gradient_checkpointing_survives_the_layer_rewrite() -> None:
    # Transformers wraps every decoder layer's forward in a checkpointing wrapper; the
    # residual-norm rewrite of the layer must run inside it, not instead of it.
    unfused, fused = _fused()
    assert any(isinstance(m.forward, BoundForward) for m in fused.model.layers)
    ids = token_ids(seed=1)
    grads = []
    for model in (unfused, fused):
        model.gradient_checkpointing_enable()
        model.train()
        calls = []
        for layer in model.model.layers:
            inner = layer._gradient_checkpointing_func

            def spy(*args, _inner=inner, _calls=calls, **kwargs):
                _calls.append(1)
                return _inner(*args, **kwargs)

            layer._gradient_checkpointing_func = spy
        model(ids).logits.float().pow(2).mean().backward()
        assert len(calls) == len(model.model.layers)
        grads.append(model.model.embed_tokens.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)


def _renames(old: str, new: str):
    def decorator(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            if old in kwargs:
                kwargs[new] = kwargs.pop(old)
            return fn(self, *args, **kwargs)

        return wrapper

    return decorator


def test_rewrap_runs_each_wrapper_around_the_replacement() -> None:
    def original(self, x, scale=1.0):
        return ("original", x, scale)

    wrapped = _renames("s", "factor")(_renames("factor", "scale")(original))

    def replacement(self, x, scale=1.0):
        return ("replacement", x, scale)

    rebuilt = rewrap(wrapped, replacement)
    assert rebuilt(None, 2, s=3.0) == ("replacement", 2, 3.0)
    assert wrapped(None, 2, s=3.0) == ("original", 2, 3.0)  # the class's own is untouched
    assert inspect.unwrap(rebuilt) is replacement
    assert rewrap(original, replacement) is replacement


def test_rewrap_refuses_a_wrapper_it_cannot_rebuild() -> None:
    class Wrapper:
        def __init__(self, fn):
            self.__wrapped__ = fn

        def __call__(self, *args, **kwargs):
            return self.__wrapped__(*args, **kwargs)

    def original(self, x):
        return x

    with pytest.raises(RewriteRefused, match="not a plain function"):
        rewrap(Wrapper(original), original)

    def by_default(self, x, _fn=original):
        return _fn(self, x)

    by_default.__wrapped__ = original  # reaches the wrapped function through a default
    with pytest.raises(RewriteRefused, match="exactly one closure cell"):
        rewrap(by_default, original)


# -- issue 43: the class forward the proof was made for --------------------------------------


def _attention_logits(unfused, fused, ids):
    """Both models' logits and layer 0's fused attention forward."""
    return _logits(unfused, ids), _logits(fused, ids), fused.model.layers[0].self_attn.forward


def test_a_patched_class_forward_runs_instead_of_the_rewrite(monkeypatch) -> None:
    """The proof was made for the class's forward at fuse time: a patched class forward is
    what the unfused module runs, so the fused one falls back to it (not to the old one),
    and fuses again once it is restored."""
    unfused, fused = _fused()
    attn_class = type(fused.model.layers[0].self_attn)
    plain = attn_class.forward

    def patched(self, *args, **kwargs):
        out, weights = plain(self, *args, **kwargs)
        return out * 0.5, weights

    ids = token_ids()
    before = _logits(unfused, ids)
    monkeypatch.setattr(attn_class, "forward", patched)
    want, got, forward = _attention_logits(unfused, fused, ids)
    assert not torch.allclose(want, before)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert forward.guard_failures >= 1 and "forward was replaced" in forward.last_failure
    monkeypatch.undo()
    failures = forward.guard_failures
    torch.testing.assert_close(_logits(fused, ids), before, rtol=1e-5, atol=1e-6)
    assert forward.guard_failures == failures


@pytest.mark.parametrize("own_forward", [True, False])
def test_a_class_swap_runs_the_new_class_forward(own_forward: bool) -> None:
    """A class swap of the fused module (what `torch.nn.utils.parametrize` does; here a
    user's subclass): the fused forward falls back to the forward Python resolves on the
    new class, with or without one of its own."""
    unfused, fused = _fused()
    attn_class = type(fused.model.layers[0].self_attn)

    def halved(self, *args, **kwargs):
        out, weights = attn_class.forward(self, *args, **kwargs)
        return out * 0.5, weights

    body = {"forward": halved} if own_forward else {}
    swapped = type("Swapped", (attn_class,), body)
    for model in (unfused, fused):
        model.model.layers[0].self_attn.__class__ = swapped
    ids = token_ids()
    want, got, forward = _attention_logits(unfused, fused, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert "became a" in forward.last_failure


def test_the_route_runs_the_current_class_forward() -> None:
    """Where the route takes the original (every kernel measured slower), the original is
    the forward of the module's class now (here swapped to a subclass with its own), as
    the unfused module would run it."""
    unfused, fused = _fused()
    attn_class = type(fused.model.layers[0].self_attn)

    def halved(self, *args, **kwargs):
        out, weights = attn_class.forward(self, *args, **kwargs)
        return out * 0.5, weights

    swapped = type("Swapped", (attn_class,), {"forward": halved})
    for model in (unfused, fused):
        model.model.layers[0].self_attn.__class__ = swapped
    ids = token_ids()
    with measured_references(), POLICY.counting_routes():
        want, got, forward = _attention_logits(unfused, fused, ids)
    assert forward.original_calls >= 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_deepcopy_keeps_the_class_forward_of_fuse_time(monkeypatch) -> None:
    """A copy made while the class forward is patched still knows the rewrite is of the
    old one: it falls back while the patch lasts, then runs fused."""
    _, fused = _fused()
    attn_class = type(fused.model.layers[0].self_attn)
    plain = attn_class.forward
    monkeypatch.setattr(attn_class, "forward", lambda self, *a, **k: plain(self, *a, **k))
    copied = copy.deepcopy(fused)
    forward = copied.model.layers[0].self_attn.forward
    assert forward.class_forward is plain and forward.failure() is not None
    monkeypatch.undo()
    assert forward.failure() is None


# -- issue 43: a shallow copy's forward reads the copy ---------------------------------------


def test_a_shallow_copy_reads_itself() -> None:
    """`copy.copy(fused_attention)`: its forward is bound to the copy (an attribute set on
    the copy is read, as by the unfused copy's class forward), fused (no fallback), and
    the original is untouched; a copy of the copy too."""
    unfused, fused = _fused()
    ids = token_ids()
    for model in (unfused, fused):
        attn = model.model.layers[0].self_attn
        copied = copy.copy(copy.copy(attn))
        copied.scaling = attn.scaling * 3.0
        model.model.layers[0].self_attn = copied
    torch.testing.assert_close(_logits(fused, ids), _logits(unfused, ids), rtol=1e-5, atol=1e-6)
    copied = fused.model.layers[0].self_attn
    assert isinstance(copied.forward, BoundForward) and copied.forward.module is copied
    assert copied.forward.guard_failures == 0 and copied.forward.failure() is None
    assert copied.__reduce_ex__.module is copied  # and its copies rebind in turn


def test_a_shallow_copy_drops_an_installed_forward_it_cannot_rebind() -> None:
    """A fusion-installed forward without `rebound` is removed from the copy: the class
    forward (the unfused function) runs there, never the original's state."""

    class Installed:
        fusion_installed = True

        def __init__(self, module):
            self.__self__ = module

    original, copied = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    copied.forward = Installed(original)
    rebind_installed(copied)
    assert "forward" not in copied.__dict__
    copied.forward = Installed(copied)  # bound to itself: kept
    rebind_installed(copied)
    assert isinstance(copied.__dict__["forward"], Installed)
