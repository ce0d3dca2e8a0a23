"""RMSNorm fuser: real Transformers norms, every spelling and variant, and every refusal.

Weights are random (not ones, not zeros) so a wrong variant shows: an offset, a weight
applied in the wrong dtype, or another instance's eps all change the output.
"""

from __future__ import annotations

import copy
import linecache

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusion
from fusion.errors import RewriteRefused
from fusion.fusers import rmsnorm
from fusion.fusers.rmsnorm import RMSNormFuser
from fusion.kernels.norm_variant import DEFAULT_VARIANT, NormVariant
from fusion.runtime.checkpoint import unfused_state_dict
from fusion.runtime.norm_forward import NormForward
from tests.fusion.fusers.helpers import reasons
from tests.fusion.tiny_models import relative_error, tiny_model, token_ids

HIDDEN = 48


def randomized(norm: nn.Module, seed: int = 0) -> nn.Module:
    """`norm` with weights 1 + N(0, 0.3) (or N(0, 0.3) for zero-centred Gemma weights)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in norm.parameters():
            noise = 0.3 * torch.randn(param.shape, generator=generator)
            param.copy_(noise if (param == 0).all() else 1.0 + noise)
    return norm


def fused_norm(norm: nn.Module) -> tuple[nn.Module, fusion.FusionReport]:
    """Fuse a deep copy of `norm` inside a container (the root itself cannot be replaced)."""
    holder = nn.Sequential(copy.deepcopy(norm))
    report = fusion.fuse(holder)
    return holder[0], report


def norm_forward(norm: nn.Module) -> NormForward:
    """The fused forward fusion installed on `norm` (which stays in its slot)."""
    forward = norm.__dict__.get("forward")
    assert type(forward) is NormForward and forward.module is norm, forward
    return forward


def real_norms() -> dict[str, nn.Module]:
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    return {
        "llama": LlamaRMSNorm(HIDDEN, eps=1e-5),
        "qwen3": Qwen3RMSNorm(HIDDEN, eps=1e-6),
        "gemma": GemmaRMSNorm(HIDDEN, eps=1e-6),
        "gemma2": Gemma2RMSNorm(HIDDEN, eps=1e-6),
        "gemma3": Gemma3RMSNorm(HIDDEN, eps=1e-6),
        "olmo2": Olmo2RMSNorm(HIDDEN, eps=1e-6),
        "t5": T5LayerNorm(HIDDEN, eps=1e-6),
        "nn.RMSNorm": nn.RMSNorm(HIDDEN),
        "nn.RMSNorm-eps": nn.RMSNorm(HIDDEN, eps=1e-4),
        "nn.RMSNorm-weightless": nn.RMSNorm(HIDDEN, elementwise_affine=False),
        "cohere": CohereLayerNorm(HIDDEN),
    }


_GEMMA = NormVariant(offset=1.0, weight_after_cast=False)
_WEIGHT_BEFORE_CAST = NormVariant(weight_after_cast=False)

EXPECTED = {
    # name: (variant, has_weight)
    "llama": (DEFAULT_VARIANT, True),
    "qwen3": (DEFAULT_VARIANT, True),
    "gemma": (_GEMMA, True),
    "gemma2": (_GEMMA, True),
    "gemma3": (_GEMMA, True),
    "olmo2": (_WEIGHT_BEFORE_CAST, True),
    "t5": (NormVariant(cast_to_weight=True), True),
    "nn.RMSNorm": (_WEIGHT_BEFORE_CAST, True),
    "nn.RMSNorm-eps": (_WEIGHT_BEFORE_CAST, True),
    "nn.RMSNorm-weightless": (DEFAULT_VARIANT, False),  # the weight-order fields unused
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_norm_variant_and_bit_exact_parity(name: str) -> None:
    norm = randomized(real_norms()[name])
    fused, report = fused_norm(norm)
    assert report.counts() == {"rmsnorm": 1}, str(report)
    assert type(fused) is type(norm)  # kept in its slot, of its own class
    forward = norm_forward(fused)
    variant, has_weight = EXPECTED[name]
    assert (forward.variant, forward.weight_name is not None) == (variant, has_weight)
    if has_weight:
        assert set(fused.state_dict()) == set(norm.state_dict()) == {"weight"}
    # Canonical spellings run the same ops in the same order: bit-identical in every
    # verified dtype pair, including the bfloat16 ones where cast orders differ.
    generator = torch.Generator().manual_seed(1)
    for dtype, wdtype in sorted(forward.verified, key=str):
        a, b = copy.deepcopy(norm), copy.deepcopy(fused)
        if wdtype is not None:
            a.to(wdtype)
            b.to(wdtype)
        x = (3 * torch.randn(2, 5, HIDDEN, generator=generator)).to(dtype)
        with torch.no_grad():
            expected, actual = a(x), b(x)
        assert actual.dtype == expected.dtype, (dtype, wdtype)
        assert torch.equal(actual, expected), (dtype, wdtype)
        assert norm_forward(b).guard_failures == 0, norm_forward(b).last_failure


def test_fused_norm_holds_the_original_parameter() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    holder = nn.Sequential(randomized(LlamaRMSNorm(HIDDEN)))
    weight = holder[0].weight
    fusion.fuse(holder)
    assert type(holder[0]) is LlamaRMSNorm and holder[0].weight is weight
    assert norm_forward(holder[0]).weight_name == "weight"


def test_cohere_layernorm_is_refused_with_reason() -> None:
    norm = real_norms()["cohere"]
    with pytest.raises(RewriteRefused, match="subtracts the mean"):
        rmsnorm.prove_variant(norm)
    fused, report = fused_norm(norm)
    assert report.counts() == {}
    assert type(fused).__name__ == "CohereLayerNorm"


def test_eps_read_per_instance_and_found_per_class() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    model = nn.ModuleDict(
        {
            "a": randomized(LlamaRMSNorm(HIDDEN, eps=1e-6)),
            "b": randomized(LlamaRMSNorm(HIDDEN, eps=0.5)),
        }
    )
    fused = copy.deepcopy(model)
    report = fusion.fuse(fused)
    assert report.counts() == {"rmsnorm": 2}
    assert {norm_forward(fused[key]).eps_attr for key in "ab"} == {"variance_epsilon"}
    assert "eps from variance_epsilon" in report.applied[0].description
    x = 1e-3 * torch.randn(3, HIDDEN)  # small inputs: eps dominates, so a wrong eps shows
    with torch.no_grad():
        for key in ("a", "b"):
            assert torch.equal(model[key](x), fused[key](x))


def _synthetic(body: str, *, weight: bool = True, init: str = "ones") -> nn.Module:
    """A norm class whose forward is `body` (an expression of x, self.weight, self.my_eps)."""
    source = f"""
class SyntheticRMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        {"self.weight = nn.Parameter(torch." + init + "(d))" if weight else "pass"}
        self.my_eps = eps

    def forward(self, x):
        return {body}
"""
    namespace = {"nn": nn, "torch": torch, "F": F}
    filename = f"<synthetic-rmsnorm-{len(linecache.cache)}>"
    # Registered like a file, so `inspect.getsource` (which the write check reads) finds it.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)
    return randomized(namespace["SyntheticRMSNorm"](HIDDEN))


_H = "x.float()"
_MS = f"{_H}.pow(2).mean(-1, keepdim=True)"
SPELLINGS = {
    "rsqrt": f"self.weight * ({_H} * torch.rsqrt({_MS} + self.my_eps)).to(x.dtype)",
    "pow-0.5": f"self.weight * ({_H} * torch.pow({_MS} + self.my_eps, -0.5)).to(x.dtype)",
    "**-0.5": f"self.weight * ({_H} * ({_MS} + self.my_eps) ** -0.5).to(x.dtype)",
    "pow-exponent=": f"self.weight * ({_H} * torch.pow({_MS} + self.my_eps, exponent=-0.5)).to(x.dtype)",
    "pow-input=exponent=": f"self.weight * ({_H} * torch.pow(input={_MS} + self.my_eps, exponent=-0.5)).to(x.dtype)",
    ".pow(exponent=2)": f"self.weight * ({_H} * torch.rsqrt({_H}.pow(exponent=2).mean(-1, keepdim=True) + self.my_eps)).to(x.dtype)",
    "square": f"self.weight * ({_H} * torch.rsqrt(torch.square({_H}).mean(dim=-1, keepdim=True) + self.my_eps)).to(x.dtype)",
    "x*x": f"self.weight * ({_H} * torch.rsqrt(({_H} * {_H}).mean(-1, keepdim=True) + self.my_eps)).to(x.dtype)",
    "weight-right": f"({_H} * torch.rsqrt({_MS} + self.my_eps)).to(x.dtype) * self.weight",
}


ROOT_SPELLINGS = {
    # name: (body, the NormVariant.root that keeps its ops, upcast)
    "1/sqrt": (
        f"self.weight * ({_H} * (1 / torch.sqrt({_MS} + self.my_eps))).to(x.dtype)",
        "recip_sqrt",
        True,
    ),
    "reciprocal": (
        f"self.weight * ({_H} * torch.reciprocal(torch.sqrt({_MS} + self.my_eps))).to(x.dtype)",
        "recip_sqrt",
        True,
    ),
    "sqrt**-1": (
        f"self.weight * ({_H} * torch.sqrt({_MS} + self.my_eps) ** -1).to(x.dtype)",
        "recip_sqrt",
        True,
    ),
    "x/sqrt": (
        f"self.weight * ({_H} / torch.sqrt({_MS} + self.my_eps)).to(x.dtype)",
        "div_sqrt",
        True,
    ),
    "x/sqrt-no-upcast": (
        "self.weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.my_eps))",
        "div_sqrt",
        False,
    ),
    "x/sqrt-weightless": (f"({_H} / torch.sqrt({_MS} + self.my_eps)).type_as(x)", "div_sqrt", True),
    "rsqrt": (SPELLINGS["rsqrt"], "rsqrt", True),
    "**-0.5": (SPELLINGS["**-0.5"], "rsqrt", True),
}


@pytest.mark.parametrize(
    ("name", "dtype"),
    [(name, dtype) for name in sorted(ROOT_SPELLINGS) for dtype in (torch.float32, torch.bfloat16)],
)
def test_each_root_spelling_keeps_its_ops_bit_for_bit(name: str, dtype: torch.dtype) -> None:
    """`x / sqrt(v)`, `x * (1 / sqrt(v))` and `x * rsqrt(v)` round differently (1-2 ulp on
    a third of the elements): each is fused as its own `NormVariant.root` and computes the
    unfused module's bits, through the fused module and through `ops.rms_norm`."""
    body, root, upcast = ROOT_SPELLINGS[name]
    weightless = "weightless" in name
    norm = _synthetic(body, weight=not weightless).to(dtype)
    fused, report = fused_norm(norm)
    assert report.counts() == {"rmsnorm": 1}, reasons(report)
    variant = norm_forward(fused).variant
    assert variant.root == root and variant.upcast == upcast
    x = torch.randn(64, 4, HIDDEN, generator=torch.Generator().manual_seed(5)).to(dtype)
    weight = None if weightless else norm.weight
    with torch.no_grad():
        expected = norm(x)
        for backend in ("auto", "torch"):
            out = fusion.kernels.ops.rms_norm(backend, x, weight, 1e-6, variant=variant)
            assert torch.equal(out, expected), backend
        assert torch.equal(fused(x), expected)
    assert norm_forward(fused).guard_failures == 0  # the fused path computed it


def test_root_spellings_are_told_apart() -> None:
    """The three spellings really round differently here (else the test above shows
    nothing), and a kernel of one spelling does not match a module of another."""
    x = torch.randn(256, HIDDEN, generator=torch.Generator().manual_seed(5))
    outs = {}
    for name in ("rsqrt", "x/sqrt", "1/sqrt"):
        norm = _synthetic(ROOT_SPELLINGS[name][0])
        with torch.no_grad():
            outs[name] = norm(x)
    assert not torch.equal(outs["rsqrt"], outs["x/sqrt"])
    assert not torch.equal(outs["x/sqrt"], outs["1/sqrt"])
    v = x.pow(2).mean(-1, keepdim=True) + 1e-6
    if torch.equal(torch.rsqrt(v), 1 / torch.sqrt(v)):
        pytest.skip(
            "this CPU flavour computes rsqrt as 1/sqrt (ATen's AVX2 kernels): x * rsqrt(v) and "
            "x * (1 / sqrt(v)) are the same function here; the other pairs were told apart"
        )
    assert not torch.equal(outs["rsqrt"], outs["1/sqrt"])


def test_pow_minus_half_in_a_reduced_dtype_is_proven_only_where_it_is_rsqrt() -> None:
    """Without the float32 upcast, `pow(v, -0.5)` runs in bfloat16/float16, where ATen's
    `pow` rounds otherwise than `rsqrt` on some values: the norm fuses, proven at the
    float32 and float64 inputs only, and a reduced-dtype call runs the original, bit for bit."""
    norm = _synthetic(
        "self.weight * (x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.my_eps, -0.5))"
    )
    fused, report = fused_norm(norm)
    assert report.counts() == {"rmsnorm": 1}, reasons(report)
    verified = norm_forward(fused).verified
    assert {x for x, _ in verified} == {torch.float32, torch.float64}
    reference = copy.deepcopy(norm)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(3)).to(dtype)
        with torch.no_grad():
            assert torch.equal(fused(x), reference(x)), dtype


def test_pow_minus_half_in_every_dtype_is_refused_with_reason() -> None:
    """A norm whose input is cast to bfloat16 before the root computes `pow` in a reduced
    dtype at every point: nothing is left to prove, so it refuses and says why."""
    norm = _synthetic(
        "self.weight * (x * torch.pow((x.to(torch.bfloat16) ** 2).mean(-1, keepdim=True)"
        " + self.my_eps, -0.5))"
    )
    _, report = fused_norm(norm)
    assert report.counts() == {}
    assert "pow(v, -0.5) in bfloat16 rounds otherwise than rsqrt" in reasons(report)


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_every_spelling_is_the_llama_variant(name: str) -> None:
    norm = _synthetic(SPELLINGS[name])
    fused, report = fused_norm(norm)
    assert report.counts() == {"rmsnorm": 1}, reasons(report)
    assert norm_forward(fused).variant == DEFAULT_VARIANT
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(norm(x), fused(x), rtol=1e-6, atol=1e-6)


VARIANTS = {
    # name: (body, expected variant)
    "no-upcast": (
        "self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.my_eps))",
        NormVariant(upcast=False),
    ),
    "weight-before-cast": (
        f"(self.weight * ({_H} * torch.rsqrt({_MS} + self.my_eps))).to(x.dtype)",
        _WEIGHT_BEFORE_CAST,
    ),
    "gemma-offset": (
        f"(({_H} * torch.rsqrt({_MS} + self.my_eps)) * (1.0 + self.weight.float())).type_as(x)",
        _GEMMA,
    ),
    "cast-to-weight": (
        f"self.weight * (x * torch.rsqrt({_MS} + self.my_eps)).to(self.weight.dtype)",
        NormVariant(cast_to_weight=True),
    ),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_variants_match_and_hold_parity_against_float64(name: str, dtype: torch.dtype) -> None:
    body, expected = VARIANTS[name]
    norm = _synthetic(body, init="zeros" if "offset" in name else "ones")
    fused, report = fused_norm(norm)
    assert report.counts() == {"rmsnorm": 1}, reasons(report)
    assert norm_forward(fused).variant == expected
    x64 = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    reference = copy.deepcopy(norm).double()
    with torch.no_grad():
        truth = reference(x64)
        unfused = copy.deepcopy(norm).to(dtype)(x64.to(dtype))
        out = copy.deepcopy(fused).to(dtype)(x64.to(dtype))
    assert out.dtype == unfused.dtype
    unfused_error = relative_error(truth, unfused.double())
    fused_error = relative_error(truth, out.double())
    assert fused_error <= 2 * unfused_error + 1e-3, (fused_error, unfused_error)
    assert torch.equal(out, unfused)  # canonical spelling: the same ops, the same bits


def test_llama_and_gemma_cast_orders_are_told_apart_in_bfloat16() -> None:
    """The two orders agree in float32 but round differently in bfloat16: a fuser that gave
    both the same variant would fail one of these bit-exact comparisons."""
    llama = _synthetic(f"self.weight * ({_H} * torch.rsqrt({_MS} + self.my_eps)).to(x.dtype)")
    olmo = _synthetic(VARIANTS["weight-before-cast"][0])
    assert torch.equal(llama.weight, olmo.weight)
    x = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.no_grad():
        a, b = llama.bfloat16()(x), olmo.bfloat16()(x)
        assert not torch.equal(a, b)
        for norm, out in ((llama, a), (olmo, b)):
            fused, _ = fused_norm(norm)
            assert torch.equal(fused(x), out)


REFUSALS = {
    "layernorm": (
        f"self.weight * (({_H} - {_H}.mean(-1, keepdim=True)) * torch.rsqrt({_MS} + self.my_eps)).to(x.dtype)",
        "subtracts the mean",
    ),
    "sum": (
        f"self.weight * ({_H} * torch.rsqrt({_H}.pow(2).sum(-1, keepdim=True) + self.my_eps)).to(x.dtype)",
        "sums the squares",
    ),
    "eps-outside-rsqrt": (
        f"self.weight * ({_H} * (torch.rsqrt({_MS}) + self.my_eps)).to(x.dtype)",
        "eps is added outside the root",
    ),
    "eps-outside-sqrt": (
        f"self.weight * ({_H} / (torch.sqrt({_MS}) + self.my_eps)).to(x.dtype)",
        "eps is added outside the root",
    ),
    "after-output": (
        f"torch.tanh(self.weight * ({_H} * torch.rsqrt({_MS} + self.my_eps)).to(x.dtype))",
        "computation after the normalised output",
    ),
    "after-output-add": (
        f"self.weight * ({_H} * torch.rsqrt({_MS} + self.my_eps)).to(x.dtype) + 1.0",
        "computation after the normalised output",
    ),
    "scaled-output": (
        f"2.0 * self.weight * ({_H} * torch.rsqrt({_MS} + self.my_eps)).to(x.dtype)",
        "scaled by a constant",
    ),
    "other-dim": (
        f"self.weight * ({_H} * torch.rsqrt({_H}.pow(2).mean(1, keepdim=True) + self.my_eps)).to(x.dtype)",
        "not the last dimension",
    ),
    "two-dims": (
        f"self.weight * ({_H} * torch.rsqrt({_H}.pow(2).mean((-2, -1), keepdim=True) + self.my_eps)).to(x.dtype)",
        "not the last dimension",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refusals_are_reported_for_rmsnorm_classes(name: str) -> None:
    body, reason = REFUSALS[name]
    norm = _synthetic(body)
    fused, report = fused_norm(norm)
    assert report.counts() == {}
    assert type(fused).__name__ == "SyntheticRMSNorm"
    [skipped] = [r for r in report.skipped if r.fuser == "rmsnorm"]
    assert reason in skipped.reason, skipped.reason


def test_gated_norm_is_refused() -> None:
    class GatedRMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(HIDDEN))
            self.variance_epsilon = 1e-6

        def forward(self, hidden_states, gate=None):
            h = hidden_states.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            if gate is not None:
                h = h * F.silu(gate.float())
            return self.weight * h.to(hidden_states.dtype)

    _, report = fused_norm(GatedRMSNorm())
    assert report.counts() == {}
    assert "gated norm" in reasons(report)


def test_weightless_norm_is_sized_by_its_input() -> None:
    norm = _synthetic(f"({_H} * torch.rsqrt({_MS} + self.my_eps)).type_as(x)", weight=False)
    fused, report = fused_norm(norm)
    assert report.counts() == {"rmsnorm": 1} and norm_forward(fused).weight_name is None
    for width in (8, 200):  # any width, not the model's
        x = torch.randn(3, width, generator=torch.Generator().manual_seed(width))
        with torch.no_grad():
            assert torch.equal(fused(x), norm(x))


def test_instances_with_different_flags_each_get_their_own_variant() -> None:
    """Gemma 3n's `with_scale` decides, per instance, whether there is a weight at all; the
    per-class cache must not hand one instance the other's variant."""
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nRMSNorm

    model = nn.ModuleDict(
        {
            "scaled": randomized(Gemma3nRMSNorm(HIDDEN)),
            "plain": Gemma3nRMSNorm(HIDDEN, with_scale=False),
        }
    )
    fused = copy.deepcopy(model)
    report = fusion.fuse(fused)
    assert report.counts() == {"rmsnorm": 2}, reasons(report)
    assert (
        norm_forward(fused["scaled"]).weight_name and not norm_forward(fused["plain"]).weight_name
    )
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for key in model:
            assert torch.equal(model[key](x), fused[key](x))


def test_unverified_dtype_pair_runs_the_original() -> None:
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    norm = randomized(GemmaRMSNorm(HIDDEN))
    fused, _ = fused_norm(norm)
    # Gemma casts its weight with `.float()`: float64 weights would be downcast, while the
    # kernel promotes, so that pair was not proven and must not run: the original does.
    assert (torch.float32, torch.float64) not in norm_forward(fused).verified
    x = torch.randn(2, HIDDEN, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(fused.double()(x), copy.deepcopy(norm).double()(x))
    assert "were not proven" in norm_forward(fused).last_failure


def test_hooked_norm_is_refused() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    holder = nn.Sequential(LlamaRMSNorm(HIDDEN))
    holder[0].register_forward_hook(lambda *args: None)
    report = fusion.fuse(holder)
    assert report.counts() == {} and "hooks" in reasons(report)


def test_qwen3_qk_norms_inside_a_rewritten_attention() -> None:
    """q_norm/k_norm are children of an attention whose forward the QKV fuser rewrote; the
    norms are replaced through the parent slot and the rewritten forward finds them."""
    model = tiny_model("qwen3")
    fused = copy.deepcopy(model)
    report = fusion.fuse(fused)
    assert report.counts() == {"qkv": 2, "glu": 2, "rmsnorm": 9, "residual_norm": 2}, str(report)
    attn = fused.model.layers[0].self_attn
    assert norm_forward(attn.q_norm) and norm_forward(attn.k_norm)
    assert "forward" in attn.__dict__  # the QKV rewrite
    ids = token_ids()
    with torch.no_grad():
        assert relative_error(model(ids).logits, fused(ids).logits) <= 1e-6


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "gemma3_text", "olmo2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_model_parity(model_type: str, dtype: torch.dtype) -> None:
    model = tiny_model(model_type)
    fused = copy.deepcopy(model)
    report = fusion.fuse(fused)
    assert report.counts().get("rmsnorm", 0) >= 5
    assert not [r for r in report.skipped if r.fuser == "rmsnorm"], reasons(report)
    ids = token_ids()
    with torch.no_grad():
        truth = copy.deepcopy(model).double()(ids).logits
        unfused = copy.deepcopy(model).to(dtype)(ids).logits.double()
        out = fused.to(dtype)(ids).logits.double()
    unfused_error = relative_error(truth, unfused)
    assert relative_error(truth, out) <= 2 * unfused_error + 1e-3


def test_checkpoint_keys_map_one_to_one() -> None:
    model = tiny_model("gemma3_text", seed=1)
    fused = tiny_model("gemma3_text", seed=2)
    fusion.fuse(fused)
    fused.load_state_dict(model.state_dict())
    exported, original = unfused_state_dict(fused), model.state_dict()
    assert set(exported) == set(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)


def test_candidate_skips_modules_with_children_or_matrices() -> None:
    assert not RMSNormFuser.candidate(nn.Linear(4, 4))
    assert not RMSNormFuser.candidate(nn.Sequential(nn.RMSNorm(4)))
    assert RMSNormFuser.candidate(nn.RMSNorm(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16, None])
def test_torch_backend_fast_path_is_the_reference_bit_for_bit(dtype, wdtype) -> None:
    """`TorchKernels.rms_norm` hands some variants to `torch.rms_norm`; that must compute
    `torch_ref.rms_norm` exactly (same dtype, same bits) for every variant flag."""
    import itertools

    from fusion.kernels import reference as torch_ref

    backend = torch_ref.TorchKernels()
    generator = torch.Generator().manual_seed(0)
    # widths and row counts where ATen's norm may block or vectorise its reduction
    # differently: odd, per-head, model widths, one row and many
    shapes = ((4, 3, 96), (1, 7), (16, 128), (1, 1024), (33, 2048), (2, 4096))
    for (offset, upcast, after, to_weight), shape in itertools.product(
        itertools.product((0.0, 1.0), (True, False), (True, False), (False, True)), shapes
    ):
        width = shape[-1]
        x = (3 * torch.randn(*shape, generator=generator)).to(dtype)
        w = (
            None
            if wdtype is None
            else (0.3 * torch.randn(width, generator=generator) + 1).to(wdtype)
        )
        variant = NormVariant(offset, upcast, after, to_weight)
        expected = torch_ref.rms_norm(x, w, 1e-5, variant=variant)
        actual = backend.rms_norm(x, w, 1e-5, variant=variant)
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), (variant, shape)


class ShapeBranchRMSNorm(nn.Module):
    """Computes differently for wide inputs: a branch the meta trace sees one side of."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HIDDEN))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        h = x.float()
        if x.shape[-1] > 1024:
            h = h * 2.0
        v = h.pow(2).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(v + self.variance_epsilon)).to(x.dtype)


def test_branch_on_a_shape_is_refused_while_branches_on_dtypes_are_traced_per_point() -> None:
    _, report = fused_norm(ShapeBranchRMSNorm())
    assert report.counts() == {} and "does not trace" in reasons(report)
    # T5 branches on the weight's dtype: traced once per dtype point, and fused.
    _, report = fused_norm(real_norms()["t5"])
    assert report.counts() == {"rmsnorm": 1}
