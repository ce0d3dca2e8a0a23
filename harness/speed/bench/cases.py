"""The case catalogue: each kernel (and model slice) at real model widths, with its unfused
baseline and fused variants computing the same function on the same tensors; the full and
reduced grids."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fusion.inspection import is_moe_block

TOKENS = (1, 16, 512, 4096)
"""Token counts of the full grid: decode, small batch, prefill chunk, long prefill."""


REDUCED_TOKENS = (1, 16, 512)
"""Token counts of the default (CI, CPU) grid."""


DENSE_SHAPES = (
    # (name, hidden, intermediate, q, kv): Llama-3.2-1B and Llama-3-8B widths
    ("llama-1b", 2048, 8192, 2048, 512),
    ("llama-8b", 4096, 14336, 4096, 1024),
)
"""Real model widths for the dense kernels (RMSNorm, act-and-mul, QKV, gate_up)."""


MOE_SHAPES = (
    # (name, hidden, expert intermediate, experts, top-k)
    ("olmoe", 2048, 1024, 64, 8),
    ("mixtral", 4096, 14336, 8, 2),
)
"""Real MoE widths: OLMoE-1B-7B (64 experts, top-8) and Mixtral-8x7B (8 experts, top-2)."""


KERNELS = ("rmsnorm_llama", "rmsnorm_gemma", "act_and_mul", "qkv", "gate_up", "moe")


MODELS = ("model_llama", "model_qwen3", "model_qwen3_moe")


UNFUSED = "unfused"
"""Name of the baseline variant of every case (Hugging Face eager)."""


COPY_SEP = "@"
"""Joins a variant's name and its copy number in `make()`'s keys (`fused@2`): the extra
copies of a model case, each its own allocation of the same weights."""


def copy_key(variant: str, copy_number: int) -> str:
    """`make()`'s key of copy `copy_number` of `variant` (copy 0 is the variant's own name)."""
    return variant if copy_number == 0 else f"{variant}{COPY_SEP}{copy_number}"


def variant_of(key: str) -> str:
    """The variant a `make()` key times (`fused@2` -> `fused`)."""
    return key.split(COPY_SEP, 1)[0]


@dataclass
class Case:
    """One benchmark: a kernel (or model slice) at one shape and dtype, with its variants.

    `make()` allocates the inputs and weights once and returns {variant: zero-argument
    callable}; every variant computes the same function on the same tensors. `variants`
    names them in order, `UNFUSED` first; a variant that cannot run here maps to the reason
    in `unavailable` instead. `bytes_moved`: the minimal memory traffic of one call for
    memory-bound kernels (for achieved bandwidth), else None. `copies`: how many separate
    allocations of each variant `make()` returns (keys `copy_key(variant, k)`): a model's
    speed depends a few per cent on where its weights happen to lie in memory, so a ratio of
    one copy each is placement as much as fusion; timings are pooled over the copies.
    """

    kernel: str
    shape: str
    dtype: torch.dtype
    device: str
    tokens: int
    make: Callable[[], dict[str, Callable[[], Any]]] = field(repr=False)
    variants: tuple[str, ...] = ()
    bytes_moved: int | None = None
    unavailable: dict[str, str] = field(default_factory=dict)
    copies: int = 1
    notes: dict[str, str] = field(default_factory=dict)
    """{variant: what `make()` found worth saying on its row} (a decode case's greedy tokens
    that differ from the unfused ones)."""

    def build(self) -> dict[str, Callable[[], Any]]:
        """`make()`, each variant wrapped to run under `torch.no_grad()` (inference timings:
        no autograd graph is recorded for any variant)."""
        return {name: _no_grad(fn) for name, fn in self.make().items()}

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def id(self) -> str:
        return f"{self.kernel}-{self.shape}-T{self.tokens}-{self.dtype_name}"

    @property
    def group(self) -> str:
        """pytest-benchmark group: all variants of one case side by side."""
        return f"{self.kernel} {self.shape} T={self.tokens} {self.dtype_name} {self.device}"


def _no_grad(fn: Callable[[], Any]) -> Callable[[], Any]:
    if isinstance(fn, Unavailable):
        return fn

    def run() -> Any:
        with torch.no_grad():
            return fn()

    return run


class Unavailable:
    """Stands in for a variant that cannot run here; calling it raises with the reason."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __call__(self) -> Any:
        raise VariantUnavailable(self.reason)


class VariantUnavailable(RuntimeError):
    """A case's variant cannot run on this machine (the message says why)."""


def fused_backends(device: str, op: str | None = None) -> list[str]:
    """Kernel backends fused variants are timed with on `device`: every available one that
    is not an interpreter, leaving out those that hand `op` to the torch reference (their
    `delegated` ops), which would only time the reference twice."""
    from fusion import kernels

    names = []
    for name in kernels.available_backends(device):
        backend = kernels.get(name, device)
        if backend.interpreted or op in backend.delegated:
            continue
        names.append(name)
    return names


def _randn(*shape: int, dtype: torch.dtype, device: str, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)


def _rmsnorm_case(
    variant: str, hidden: int, tokens: int, dtype: torch.dtype, device: str, name: str
) -> Case:
    """RMSNorm of `tokens` rows: HF's eager module vs the backends' kernel."""
    backends = fused_backends(device, "rms_norm")

    def make() -> dict[str, Callable[[], Any]]:
        from fusion import kernels

        # Each norm with the variant the RMSNorm fuser proves for it: Llama's is the
        # default, Gemma's scales by `1 + weight` before the cast back.
        if variant == "llama":
            from transformers.models.llama.modeling_llama import LlamaRMSNorm as Norm

            norm_variant = kernels.DEFAULT_VARIANT
        else:
            from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as Norm

            norm_variant = kernels.NormVariant(offset=1.0, weight_after_cast=False)
        norm = Norm(hidden, eps=1e-6).to(device=device, dtype=dtype)
        with torch.no_grad():
            norm.weight.copy_(_randn(hidden, dtype=dtype, device=device, scale=0.1) + 1)
        x = _randn(tokens, hidden, dtype=dtype, device=device)
        fns: dict[str, Callable[[], Any]] = {UNFUSED: lambda: norm(x)}
        for backend in backends:
            k = kernels.get(backend, device)
            fns[f"fused[{backend}]"] = lambda k=k: k.rms_norm(
                x, norm.weight, norm_eps(norm), variant=norm_variant
            )
        return fns

    size = torch.tensor([], dtype=dtype).element_size()
    return Case(
        kernel=f"rmsnorm_{variant}",
        shape=f"{name}:H{hidden}",
        dtype=dtype,
        device=device,
        tokens=tokens,
        make=make,
        variants=(UNFUSED, *(f"fused[{b}]" for b in backends)),
        bytes_moved=(2 * tokens * hidden + hidden) * size,
    )


def norm_eps(norm: torch.nn.Module) -> float:
    """The epsilon of a Transformers RMSNorm (`variance_epsilon` or `eps`)."""
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _act_case(intermediate: int, tokens: int, dtype: torch.dtype, device: str, name: str) -> Case:
    """SiLU-and-mul: HF eager `silu(gate) * up` on the two projections' separate outputs vs
    the backends' kernel on the merged projection's output."""
    backends = fused_backends(device, "act_and_mul")

    def make() -> dict[str, Callable[[], Any]]:
        import torch.nn.functional as F

        from fusion import kernels

        gate_up = _randn(tokens, 2 * intermediate, dtype=dtype, device=device)
        gate = gate_up[:, :intermediate].contiguous()
        up = gate_up[:, intermediate:].contiguous()
        fns: dict[str, Callable[[], Any]] = {UNFUSED: lambda: F.silu(gate) * up}
        for backend in backends:
            k = kernels.get(backend, device)
            fns[f"fused[{backend}]"] = lambda k=k: k.act_and_mul(gate_up, "silu")
        return fns

    size = torch.tensor([], dtype=dtype).element_size()
    return Case(
        kernel="act_and_mul",
        shape=f"{name}:I{intermediate}",
        dtype=dtype,
        device=device,
        tokens=tokens,
        make=make,
        variants=(UNFUSED, *(f"fused[{b}]" for b in backends)),
        bytes_moved=3 * tokens * intermediate * size,
    )


def _merged_gemm_case(
    kernel: str, hidden: int, sizes: Sequence[int], tokens: int, dtype, device, name
) -> Case:
    """Separate projections (one GEMM each, as HF eager) vs one `MergedLinear` GEMM + split."""

    def make() -> dict[str, Callable[[], Any]]:
        import torch.nn.functional as F

        weights = [_randn(n, hidden, dtype=dtype, device=device, scale=0.02) for n in sizes]
        stacked = torch.cat(weights, dim=0)
        x = _randn(tokens, hidden, dtype=dtype, device=device)
        return {
            UNFUSED: lambda: [F.linear(x, w) for w in weights],
            "fused": lambda: F.linear(x, stacked).split(list(sizes), dim=-1),
        }

    return Case(
        kernel=kernel,
        shape=f"{name}:{hidden}->{'+'.join(str(s) for s in sizes)}",
        dtype=dtype,
        device=device,
        tokens=tokens,
        make=make,
        variants=(UNFUSED, "fused"),
    )


def _with_experts_implementation(block: torch.nn.Module, config: Any, impl: str) -> torch.nn.Module:
    """A shallow copy of a sparse MoE `block` whose experts dispatch to Transformers' `impl`
    ("eager" or "grouped_mm"); it shares every parameter with `block` (no weight copy) and
    leaves `block` unchanged (the copy gets its own child table and its own config)."""
    variant = copy.copy(block)
    variant._modules = dict(block._modules)
    experts = copy.copy(block.experts)
    experts.config = copy.copy(config)
    experts.config._experts_implementation = impl
    variant.experts = experts
    return variant


def moe_case(
    hidden: int, inter: int, experts: int, top_k: int, tokens: int, dtype, device, name
) -> Case:
    """Routed experts at real widths on one routing (computed once by a Qwen3-MoE router,
    outside the timing): Transformers' eager expert loop (the baseline), Transformers'
    `grouped_mm` experts, and each backend's `moe_experts` on the same weights."""
    backends = fused_backends(device)

    def make() -> dict[str, Callable[[], Any]]:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        from fusion import kernels

        config = Qwen3MoeConfig(
            hidden_size=hidden,
            moe_intermediate_size=inter,
            num_experts=experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=True,
        )
        with torch.device(device):
            block = Qwen3MoeSparseMoeBlock(config).to(dtype)
        with torch.no_grad():
            for param in block.parameters():
                param.normal_(0.0, 0.02)
            x = _randn(tokens, hidden, dtype=dtype, device=device)
            _, weights, ids = block.gate(x)
        fns: dict[str, Callable[[], Any]] = {}
        for impl, variant in (("eager", UNFUSED), ("grouped_mm", "hf[grouped_mm]")):
            experts_module = _with_experts_implementation(block, config, impl).experts
            fns[variant] = lambda m=experts_module: m(x, ids, weights)
        gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
        for backend in backends:
            k = kernels.get(backend, device)
            fns[f"fused[{backend}]"] = lambda k=k: k.moe_experts(
                x, gate_up, down, ids, weights, "silu"
            )
        return fns

    return Case(
        kernel="moe",
        shape=f"{name}:H{hidden}-I{inter}-E{experts}-top{top_k}",
        dtype=dtype,
        device=device,
        tokens=tokens,
        make=make,
        variants=(UNFUSED, "hf[grouped_mm]", *(f"fused[{b}]" for b in backends)),
    )


def kernel_cases(
    device: str,
    dtype: torch.dtype,
    *,
    full: bool = False,
    kernels: Sequence[str] = KERNELS,
    tokens: Sequence[int] | None = None,
) -> list[Case]:
    """Per-kernel cases. Full grid: both dense widths and both MoE shapes at every token
    count. Reduced grid (default; CPU-friendly): the Llama-1B width, `REDUCED_TOKENS` (gate_up
    only 1 and 16: larger is a long CPU GEMM), and the OLMoE shape at 16 tokens."""
    token_grid = tuple(tokens) if tokens else (TOKENS if full else REDUCED_TOKENS)
    dense = DENSE_SHAPES if full else DENSE_SHAPES[:1]
    moe = MOE_SHAPES if full else MOE_SHAPES[:1]
    cases: list[Case] = []
    for name, hidden, inter, q, kv in dense:
        for t in token_grid:
            if "rmsnorm_llama" in kernels:
                cases.append(_rmsnorm_case("llama", hidden, t, dtype, device, name))
            if "rmsnorm_gemma" in kernels:
                cases.append(_rmsnorm_case("gemma", hidden, t, dtype, device, name))
            if "act_and_mul" in kernels:
                cases.append(_act_case(inter, t, dtype, device, name))
            if "qkv" in kernels:
                cases.append(_merged_gemm_case("qkv", hidden, (q, kv, kv), t, dtype, device, name))
            if "gate_up" in kernels and (full or tokens or t <= 16):
                cases.append(
                    _merged_gemm_case("gate_up", hidden, (inter, inter), t, dtype, device, name)
                )
    if "moe" in kernels:
        for name, hidden, inter, experts, top_k in moe:
            for t in token_grid if (full or tokens) else (16,):
                cases.append(moe_case(hidden, inter, experts, top_k, t, dtype, device, name))
    return cases


COMPILED = ("compiled", "fused+compiled")
"""Variants of a model case under `torch.compile` (Inductor): the unfused and the fused
decoder stack, each compiled once (and run once) before timing."""


def _model_case(
    arch: str,
    config_kwargs: dict,
    tokens: int,
    dtype: torch.dtype,
    device: str,
    name: str,
    *,
    compiled: bool = False,
    calibrate: bool = False,
    copies: int = 1,
) -> Case:
    """A slice of a real model (real widths, random weights, small vocabulary since only the
    decoder stack is timed): the unfused decoder forward vs the fused one, and with
    `compiled` both under `torch.compile` too (compiled before timing: minutes on a CPU).
    `calibrate`: measure the fused model's kernels at this token count first
    (`fusion.calibrate`, cached per machine), so "fused" times what `fusion.fuse` gives a
    user of this machine; without it, whatever this machine's table already holds.
    `copies`: that many deep copies of the unfused and of the fused model (the compiled
    variants stay one each: compiling is the cost), so placement averages out."""

    def make() -> dict[str, Callable[[], Any]]:
        from transformers import AutoConfig, AutoModelForCausalLM

        import fusion

        config = AutoConfig.for_model(arch, **config_kwargs)
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        case.bytes_moved = streamed_weight_bytes(model.model)
        fused = copy.deepcopy(model)
        report = fusion.fuse(fused)
        if calibrate and report.applied:
            fusion.calibrate(fused, tokens=(tokens,))
        ids = torch.randint(0, config.vocab_size, (1, tokens), device=device)

        def forward(m: torch.nn.Module) -> Callable[[], Any]:
            def run() -> Any:
                with torch.no_grad():
                    return m.model(input_ids=ids, use_cache=False).last_hidden_state

            return run

        fns: dict[str, Callable[[], Any]] = {UNFUSED: forward(model)}
        fns["fused"] = (
            forward(fused)
            if report.applied
            else Unavailable(f"fusion.fuse applied nothing: {report.skipped}")
        )
        for k in range(1, copies):
            fns[copy_key(UNFUSED, k)] = forward(copy.deepcopy(model))
            if report.applied:
                fns[copy_key("fused", k)] = forward(copy.deepcopy(fused))
        if compiled:
            for variant, source in zip(COMPILED, (model, fused)):
                target = copy.deepcopy(source)
                target.model = torch.compile(target.model)
                fns[variant] = forward(target)
                fns[variant]()  # compile now, not inside the timed rounds
        return fns

    case = Case(
        kernel=f"model_{arch}",
        shape=name,
        dtype=dtype,
        device=device,
        tokens=tokens,
        make=make,
        variants=(UNFUSED, "fused", *(COMPILED if compiled else ())),
        copies=copies,
    )
    return case


def streamed_weight_bytes(decoder: torch.nn.Module) -> int | None:
    """The bytes of weight one forward of a dense `decoder` stack must read from memory at
    least once: every parameter but the embedding table (a forward gathers a few of its rows,
    it does not stream it). None where a module holds experts (the MoE fuser's own test,
    `fusion.inspection.is_moe_block`): which experts a forward reads depends on the routing, so no floor holds
    for every input."""
    if any(is_moe_block(module) for module in decoder.modules()):
        return None
    return sum(
        p.numel() * p.element_size()
        for name, p in decoder.named_parameters()
        if not name.startswith("embed_tokens.")
    )


END_TO_END = (
    # (case name, architecture, config): the models the speed issue measures end to end
    (
        "llama-3.2-1b-2L",
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            num_hidden_layers=2,
        ),
    ),
    (
        "qwen3-0.6b-4L",
        "qwen3",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            num_hidden_layers=4,
        ),
    ),
    (
        "qwen3-30b-a3b-E32-2L",
        "qwen3_moe",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=32,
            num_experts_per_tok=8,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_hidden_layers=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
    ),
)
"""Real widths, fewer layers (the per-layer work is what fusion changes)."""

END_TO_END_TOKENS = (1, 16, 128)
"""Decode, small batch, a prefill chunk."""


def end_to_end_cases(
    device: str,
    dtype: torch.dtype,
    *,
    compiled: bool = False,
    tokens: Sequence[int] | None = None,
    calibrate: bool = False,
    copies: int = 1,
) -> list[Case]:
    """One case per `END_TO_END` model and token count: unfused vs fused decoder forward
    (plus both under `torch.compile` with `compiled`; `calibrate`, `copies`: see
    `_model_case`)."""
    common = dict(vocab_size=1024, max_position_embeddings=8192)
    return [
        _model_case(
            arch,
            {**common, **config},
            t,
            dtype,
            device,
            name,
            compiled=compiled,
            calibrate=calibrate,
            copies=copies,
        )
        for name, arch, config in END_TO_END
        for t in (tuple(tokens) if tokens else END_TO_END_TOKENS)
    ]


def model_cases(
    device: str,
    dtype: torch.dtype,
    *,
    full: bool = False,
    models: Sequence[str] = MODELS,
    tokens: Sequence[int] | None = None,
    calibrate: bool = False,
    copies: int = 1,
) -> list[Case]:
    """Per-model cases: a Llama-shaped and a Qwen3-MoE-shaped 2-layer slice, and the Qwen3-0.6B
    slice of `END_TO_END` (4 layers, every grid). Full grid: both
    Llama widths, Qwen3-30B-A3B's 128 experts, every token count; reduced (default): Llama-1B
    widths, 64 experts (half Qwen3-30B-A3B's, to fit a CPU's memory), 16 tokens. `calibrate`,
    `copies`: see `_model_case`."""
    extra = dict(calibrate=calibrate, copies=copies)
    token_grid = tuple(tokens) if tokens else (TOKENS if full else (16,))
    common = dict(num_hidden_layers=2, vocab_size=1024, max_position_embeddings=8192)
    cases = []
    if "model_llama" in models:
        for name, hidden, inter, q, kv in DENSE_SHAPES if full else DENSE_SHAPES[:1]:
            kwargs = dict(
                common,
                hidden_size=hidden,
                intermediate_size=inter,
                num_attention_heads=32,
                num_key_value_heads=32 * kv // q,
                head_dim=q // 32,
            )
            for t in token_grid:
                cases.append(_model_case("llama", kwargs, t, dtype, device, f"{name}-2L", **extra))
    if "model_qwen3" in models:
        name, arch, config = next(entry for entry in END_TO_END if entry[1] == "qwen3")
        kwargs = dict(config, vocab_size=1024, max_position_embeddings=8192)
        for t in token_grid:
            cases.append(_model_case(arch, kwargs, t, dtype, device, name, **extra))
    if "model_qwen3_moe" in models:
        experts = 128 if full else 64
        kwargs = dict(
            common,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=experts,
            num_experts_per_tok=8,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        for t in token_grid:
            name = f"30b-a3b-E{experts}-2L"
            cases.append(_model_case("qwen3_moe", kwargs, t, dtype, device, name, **extra))
    return cases
