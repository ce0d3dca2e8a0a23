"""Calls between sibling projections whose callees provably write nothing
(fusion.fusers.pure_calls): read from source, shown to the alias analysis as pure calls, and
every way a callee could still write refused."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fusion
from fusion.fusers import pure_calls, registry
from tests.fusion.fusers.hazards import eager_attention_forward
from tests.fusion.fusers.helpers import fuse_copy, outputs_match, reasons
from tests.write_spellings import Spelling, by_label

STASH: list[torch.Tensor] = []
F = copy  # not torch.nn.functional: `F.relu` here proves nothing


def foreign(x):
    return F.relu(x)


def rotate(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def stack_halves(x):
    return torch.stack((x, x), dim=0).sum(0) / 2


def scale_in_place(x):
    x.mul_(1.0)
    return x


def stash(x):
    STASH.append(x)
    return x


class Norm(nn.Module):
    """An RMSNorm of the model's own class: reads its input, writes nothing."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width) + 0.1)
        self.eps = 1e-6

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self._scale(x).to(dtype)

    def _scale(self, x):
        return self.weight.float() * stack_halves(x)


class InplaceNorm(Norm):
    def forward(self, x):
        return x.mul_(self.weight)


class StoringNorm(Norm):
    def forward(self, x):
        self.last = x
        return x * self.weight


class AugmentingNorm(Norm):
    def forward(self, x):
        y = x
        y *= self.weight
        return y


class HelperWritingNorm(Norm):
    def forward(self, x):
        return scale_in_place(x) * self.weight


class StashingNorm(Norm):
    def forward(self, x):
        return stash(x) * self.weight


class IdentityNorm(Norm):
    """Writes nothing, but returns its input itself: a write to the result is one to it."""

    def forward(self, x):
        return x


class ForeignManagerNorm(Norm):
    def forward(self, x):
        with open(__file__):
            return x * self.weight


class DistributedNorm(Norm):
    def forward(self, x):
        torch.distributed.all_reduce(x)
        return x


class NestedNorm(Norm):
    def __init__(self, width: int, inner: nn.Module) -> None:
        super().__init__(width)
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * self.weight


class NormedAttention(nn.Module):
    """q/k/v with a norm of its own class between the calls, and a method that receives the
    input (so, read flow-insensitively, `self` may hold it) before them."""

    def __init__(self, norm: type[nn.Module] = Norm) -> None:
        super().__init__()
        self.q_proj = nn.Linear(32, 32, bias=False)
        self.k_proj = nn.Linear(32, 16, bias=False)
        self.v_proj = nn.Linear(32, 16, bias=False)
        self.o_proj = nn.Linear(16, 32, bias=False)
        self.q_norm = norm(32)

    def describe(self, hidden_states):
        return hidden_states.shape[-1] + 0

    def forward(self, hidden_states):
        width = self.describe(hidden_states=hidden_states)
        q = self.q_norm(self.q_proj(hidden_states)) * (width / width)
        q = rotate(q)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class NormOfInput(NormedAttention):
    """The norm reads the input itself between the calls and its result is written."""

    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        normed = self.q_norm(hidden_states)
        normed.add_(1.0)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q + normed, k, v)
        return self.o_proj(out)


class NormedInputWritten(NormedAttention):
    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        self.q_norm(hidden_states)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


def test_a_norm_and_a_method_that_write_nothing_do_not_block_the_merge() -> None:
    module = NormedAttention()
    fused, report = fuse_copy(module)
    assert report.counts() == {"qkv": 1}, str(report)
    assert outputs_match(module, fused, 2, 5, 32)


@pytest.mark.parametrize(
    "norm",
    [
        InplaceNorm,
        StoringNorm,
        AugmentingNorm,
        HelperWritingNorm,
        StashingNorm,
        ForeignManagerNorm,
        DistributedNorm,
    ],
)
def test_a_child_that_may_write_is_presumed_to(norm: type[nn.Module]) -> None:
    assert not pure_calls.module_writes_nothing(norm(32))
    module = NormedInputWritten(norm)
    report = fusion.plan(module)
    assert not report.applied, str(report)
    assert "may change between the projection calls" in reasons(report)


@pytest.mark.parametrize("norm", [Norm, IdentityNorm])
def test_what_a_proven_call_returns_still_aliases_its_arguments(norm: type[nn.Module]) -> None:
    assert pure_calls.module_writes_nothing(norm(32))
    module = NormOfInput(norm)
    fused, report = fuse_copy(module)
    assert not report.applied, str(report)
    assert "may change between the projection calls" in reasons(report)
    assert outputs_match(module, fused, 2, 5, 32)


def test_hooks_and_call_paths_make_a_child_unreadable() -> None:
    hooked = Norm(32)
    hooked.register_forward_pre_hook(lambda *args: None)
    own_forward = Norm(32)
    own_forward.forward = lambda x: x  # type: ignore[method-assign]

    class Called(Norm):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs)

    for child in (hooked, own_forward, Called(32)):
        assert not pure_calls.module_writes_nothing(child)


def test_grandchildren_are_read_and_depth_is_bounded() -> None:
    assert pure_calls.module_writes_nothing(NestedNorm(32, Norm(32)))
    assert not pure_calls.module_writes_nothing(NestedNorm(32, InplaceNorm(32)))
    deep: nn.Module = Norm(32)
    for _ in range(pure_calls.MAX_DEPTH + 1):
        deep = NestedNorm(32, deep)
    assert not pure_calls.module_writes_nothing(deep)


def test_a_shadowed_namespace_proves_nothing() -> None:
    def shadowed(x):
        torch = STASH  # a local `torch` is not the torch module
        torch.append(x)  # ...and `append` is no tensor method
        return x

    assert pure_calls.function_writes_nothing(rotate, None)
    assert not pure_calls.function_writes_nothing(shadowed, None)
    assert not pure_calls.function_writes_nothing(foreign, None)
    assert foreign.__code__.co_freevars == ()  # refused for its `F`, not as a closure


def test_every_instance_is_proven_again() -> None:
    # (An Identity grandchild: a Norm there is three callees deep, past what the region
    # proof reads, and would be refused for that on both instances.)
    safe = NormedAttention(lambda w: NestedNorm(w, nn.Identity()))
    unsafe = NormedAttention(lambda w: NestedNorm(w, InplaceNorm(w)))
    model = nn.ModuleList([safe, unsafe])
    reference = copy.deepcopy(model)
    report = fusion.fuse(model)
    # One class, one child type: the cached match was proven on the first instance only;
    # the second's grandchild writes, and `validate` says so.
    assert [r.qualname for r in report.applied] == ["0"], str(report)
    assert any("may write the projection input" in r.reason for r in report.skipped)
    for original, fused in zip(reference, model):
        assert outputs_match(original, fused, 2, 5, 32)


def _writes_first(fn):
    import functools

    @functools.wraps(fn)
    def wrapper(x, *args, **kwargs):
        x.mul_(1.0)
        return fn(x, *args, **kwargs)

    return wrapper


@_writes_first
def wrapped_rotate(x):
    return rotate(x)


def test_a_decorated_callee_is_presumed_to_write() -> None:
    assert pure_calls.function_writes_nothing(rotate, None)
    assert not pure_calls.function_writes_nothing(wrapped_rotate, None)


# -- writes with no in-place spelling, wherever the proof reads them (issue 24) ----------

WITHOUT_SPELLING = (
    "numpy_put",
    "numpy_put_kept",
    "numpy_sort",
    "numpy_item_store",
    "swap_tensors",
    "vector_to_parameters",
    "init_deprecated",
    "embedding_max_norm",
    "batch_norm_training",
)
"""Spellings of the shared table (tests/write_spellings.py) that write with no in-place
spelling: a numpy view's `put`/`sort`, `swap_tensors`, `vector_to_parameters`, the deprecated
`nn.init.constant`, `F.embedding(max_norm=)`, `F.batch_norm(training=True)`."""

CONTEXTS = ("forward", "helper", "method", "staticmethod", "child")
"""Where the write sits: between the projections in the forward itself, or in a module-level
helper, a method, a static method or a child's forward called there (read by the proof)."""

WRITER_HEADER = """\
import torch
import torch.nn.functional as F
from torch import nn


def eager_attention_forward(module, query, key, value):
    scores = query @ key.transpose(-1, -2)
    return torch.softmax(scores, dim=-1) @ value, None
"""


def _writer_source(spelling: Spelling, context: str) -> str:
    """A q/k/v attention whose `x` is written by `spelling` between the q and k projections,
    in `context`; the callee returns nothing (so only its write matters)."""
    callee = [f"    {line}" for line in spelling.on("t")] + ["    return None"]
    helper = child = method = ""
    between = "_z = self.writer(x)"
    if context == "forward":
        between = "\n        ".join(spelling.on("x"))
    elif context == "helper":
        helper = "def writer(t):\n" + "\n".join(callee) + "\n"
        between = "_z = writer(x)"
    elif context == "child":
        child = "class Writer(nn.Module):\n    def forward(self, t):\n"
        child += "\n".join(f"    {line}" for line in callee) + "\n"
    else:
        head = "    @staticmethod\n    def writer(t):\n"
        if context == "method":
            head = "    def writer(self, t):\n"
        method = head + "\n".join(f"    {line}" for line in callee) + "\n"
    return (
        f"{WRITER_HEADER}\n\n{helper}\n\n{child}\n\n"
        "class Block(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.q_proj = nn.Linear(8, 8, bias=False)\n"
        "        self.k_proj = nn.Linear(8, 8, bias=False)\n"
        "        self.v_proj = nn.Linear(8, 8, bias=False)\n"
        f"        {'self.writer = Writer()' if context == 'child' else 'pass'}\n\n"
        f"{method}\n"
        "    def forward(self, x):\n"
        "        q = self.q_proj(x)\n"
        f"        {between}\n"
        "        k = self.k_proj(x)\n"
        "        v = self.v_proj(x)\n"
        "        out, _ = eager_attention_forward(self, q, k, v)\n"
        "        return out\n"
    )


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the deprecated `nn.init.constant`
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("label", WITHOUT_SPELLING)
def test_a_write_without_an_in_place_spelling_is_a_write_wherever_it_is_read(
    load, label: str, context: str
) -> None:
    """Fused or refused, the fused block computes what the original does (the write really
    changes `x`: a merged GEMM that read `x` once would see the old value)."""
    module = load(_writer_source(by_label()[label], context)).Block()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    written = x.clone()
    with torch.no_grad():
        module(written)
    assert not torch.equal(written, x), "the case must really write the input"
    fused, report = fuse_copy(module)
    assert outputs_match(module, fused, 2, 5, 8), str(report)
    assert not report.applied, str(report)


class Codebook(nn.Module):
    """Projections of an embedding's own weight, with the embedding called between them: an
    `nn.Embedding(max_norm=...)` renormalises the rows it looks up in place."""

    def __init__(self, max_norm: float | None = 1.0) -> None:
        super().__init__()
        self.codebook = nn.Embedding(16, 8, max_norm=max_norm)
        with torch.no_grad():
            self.codebook.weight.mul_(10.0)  # rows well over the norm
        self.q_proj = nn.Linear(8, 8)
        self.k_proj = nn.Linear(8, 8)
        self.v_proj = nn.Linear(8, 8)

    def forward(self, ids):
        weight = self.codebook.weight
        q = self.q_proj(weight)
        looked_up = self.codebook(ids)
        k = self.k_proj(weight)
        v = self.v_proj(weight)
        return q + k + v + looked_up.sum()


def _same_on_ids(module: nn.Module, fused: nn.Module) -> bool:
    ids = torch.tensor([0, 3, 5])
    with torch.no_grad():
        return torch.allclose(module(ids), fused(ids), rtol=1e-5, atol=1e-6)


def test_an_embedding_with_max_norm_writes_its_own_weight() -> None:
    registry.clear_cache()
    module = Codebook()
    fused, report = fuse_copy(module)
    assert not report.applied, str(report)
    assert "may change between the projection calls" in reasons(report)
    assert _same_on_ids(module, fused)
    assert not pure_calls.module_writes_nothing(nn.Embedding(4, 4, max_norm=1.0))
    assert pure_calls.module_writes_nothing(nn.Embedding(4, 4))


def test_an_embedding_without_max_norm_still_merges() -> None:
    registry.clear_cache()
    module = Codebook(max_norm=None)
    fused, report = fuse_copy(module)
    assert report.applied, str(report)
    assert _same_on_ids(module, fused)


def test_each_instance_proves_its_embedding_again() -> None:
    """The class is proven on an instance whose embedding has no `max_norm`; the second
    instance's has one (same child type: the per-class match is shared), and is refused."""
    registry.clear_cache()
    model = nn.ModuleList([Codebook(max_norm=None), Codebook(max_norm=1.0)])
    fused, report = fuse_copy(model)
    assert [record.qualname for record in report.applied] == ["0"], str(report)
    # refused by the write proof of the call, or earlier by the input-stability proof that
    # sees the call may write `self` (what the embedding holds)
    assert "self.codebook may write" in reasons(report) or (
        "projection input may change between the projection calls" in reasons(report)
    )
    for original, merged in zip(model, fused):
        assert _same_on_ids(original, merged)


class RunningStats(nn.Module):
    """Projections of a batch norm's running mean, the norm called (in training mode, so it
    updates the mean in place) between them."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(8)
        self.q_proj = nn.Linear(8, 8)
        self.k_proj = nn.Linear(8, 8)
        self.v_proj = nn.Linear(8, 8)

    def forward(self, x):
        mean = self.norm.running_mean
        q = self.q_proj(mean)
        normed = self.norm(x)
        k = self.k_proj(mean)
        v = self.v_proj(mean)
        return q + k + v + normed.sum()


def test_a_batch_norm_in_training_writes_its_running_stats() -> None:
    module = RunningStats().train()
    fused, report = fuse_copy(module)
    assert not report.applied, str(report)
    assert not pure_calls.module_writes_nothing(nn.BatchNorm1d(8))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(module(x), fused(x), rtol=1e-5, atol=1e-6)


# -- `self` rebound inside a proven method (issue 24) ------------------------------------


class Scaler(nn.Module):
    def scale(self, t):
        return t.mul_(1.5)


class SelfRebinding(nn.Module):
    """`describe` rebinds `self`: its `self.scale` is the Scaler's (which writes), not this
    module's own (which does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(8, 8, bias=False)
        self.k_proj = nn.Linear(8, 8, bias=False)
        self.v_proj = nn.Linear(8, 8, bias=False)
        self.other = Scaler()

    def scale(self, t):
        return t * 1.5

    def describe(self, t):
        self = self.other
        return self.scale(t)

    def forward(self, x):
        q = self.q_proj(x)
        _unused = self.describe(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        out, _ = eager_attention_forward(self, q, k, v)
        return out


def test_a_method_that_rebinds_self_proves_nothing_of_self() -> None:
    module = SelfRebinding()
    assert not pure_calls.self_call_writes_nothing(module, "describe")
    assert pure_calls.self_call_writes_nothing(module, "scale")
    fused, report = fuse_copy(module)
    assert not report.applied, str(report)
    assert outputs_match(module, fused, 2, 5, 8)
