"""Hypothesis strategies that write Hugging Face-shaped modules as Python source.

Each example is the complete text of a small Python module: helper functions, one or more
`nn.Module` classes whose forwards look like Transformers code (attention blocks, gated
MLPs, RMSNorms, mixture-of-experts blocks, decoder layers nesting those), and two entry
points the oracle and repro bundles call:

    build() -> nn.Module                        # construct (weights from the global seed)
    make_inputs(generator) -> (args, kwargs)    # fresh random inputs for one forward

The text is written to a file and imported (`tests.fuzz.oracle.load`), so fusion reads it
with `inspect.getsource` exactly as it reads Transformers: rewriting sees real source.

Forwards are drawn from a grammar of variations a fuser must get right (widths, GQA ratios,
biases, q/k norms, existence guards, flag branches, layout-sensitive views on branches the
trace need not take, KV-cache updates, attention-interface calls, activation choices,
operand order) and of statements interleaved between the
projection calls. Every statement carries a label; statements and module features that can
change what a fused forward computes (writes to the projection input, rebinding it, hooks,
`nn.Linear` subclasses with their own call path) are *hazards*. A module without hazards is
*safe*: the engine should usually fuse it, which the coverage test checks.

The generator aims for programs that run: shapes are tracked by construction, not inferred.
Whether a hazard actually changes anything is never decided here: the oracle runs both
forwards and compares.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from tests.write_spellings import spellings

SHAPES = ("attention", "glu_mlp", "rmsnorm", "moe", "decoder_layer")
"""Kinds of generated module, one tally row each."""

try:
    from transformers.modeling_utils import AttentionInterface

    HAS_GET_INTERFACE = hasattr(AttentionInterface, "get_interface")
except ImportError:
    HAS_GET_INTERFACE = False
"""Transformers 5 resolves attention with `ALL_ATTENTION_FUNCTIONS.get_interface(...)`."""

Draw = Callable[[st.SearchStrategy[Any]], Any]


@dataclass(frozen=True)
class GeneratedModule:
    """One generated module: its source text and what the generator put into it."""

    shape: str
    class_name: str
    source: str
    hazards: tuple[str, ...]
    """Labels of constructs that may change what a fused forward computes."""
    features: tuple[str, ...]
    """Labels of the benign variations drawn (for notes and repro bundles)."""

    @property
    def safe(self) -> bool:
        """No hazards: fusing may not change anything, and the engine should usually fuse."""
        return not self.hazards

    def describe(self) -> str:
        hazards = ", ".join(self.hazards) or "none"
        return f"{self.shape} {self.class_name}; hazards: {hazards}; features: {', '.join(self.features)}"


# -- module-level helpers the generated classes may use ----------------------------------------

SNIPPETS: dict[str, str] = {
    "repeat_kv": '''
        def repeat_kv(hidden_states, n_rep):
            """Expand key/value heads for grouped-query attention (as Transformers does)."""
            if n_rep == 1:
                return hidden_states
            batch, num_key_value_heads, slen, head_dim = hidden_states.shape
            hidden_states = hidden_states[:, :, None, :, :].expand(
                batch, num_key_value_heads, n_rep, slen, head_dim
            )
            return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)
        ''',
    "eager_attention_forward": '''
        def eager_attention_forward(
            module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs
        ):
            """Transformers' eager attention (the tracer makes `*attention_forward` a leaf)."""
            key_states = repeat_kv(key, module.num_key_value_groups)
            value_states = repeat_kv(value, module.num_key_value_groups)
            attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
            if attention_mask is not None:
                attn_weights = attn_weights + attention_mask
            attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(
                query.dtype
            )
            attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
            attn_output = torch.matmul(attn_weights, value_states)
            attn_output = attn_output.transpose(1, 2).contiguous()
            return attn_output, attn_weights
        ''',
    "SimpleCache": '''
        class SimpleCache:
            """A dynamic KV cache: appends the new keys and values to the past ones."""

            def __init__(self, keys, values):
                self.keys = keys
                self.values = values

            def update(self, key_states, value_states, layer_idx, **kwargs):
                self.keys = torch.cat([self.keys, key_states], dim=-2)
                self.values = torch.cat([self.values, value_states], dim=-2)
                return self.keys, self.values
        ''',
    "StaticCache": '''
        class StaticCache:
            """A static KV cache: copies the new keys and values into preallocated tensors."""

            def __init__(self, keys, values, position):
                self.keys = keys
                self.values = values
                self.position = position

            def update(self, key_states, value_states, layer_idx, **kwargs):
                end = self.position + key_states.shape[-2]
                self.keys[:, :, self.position : end].copy_(key_states)
                self.values[:, :, self.position : end].copy_(value_states)
                self.position = end
                return self.keys[:, :, :end], self.values[:, :, :end]
        ''',
    "bump": '''
        def bump(t):
            """Writes its argument (a name without an in-place spelling)."""
            t.mul_(0.5)
            return t
        ''',
    "hooks": """
        def halve_output_hook(module, args, output):
            return output * 0.5


        def halve_input_pre_hook(module, args):
            return (args[0] * 0.5, *args[1:])


        def counting_hook(module, args, output):
            module.calls = getattr(module, "calls", 0) + 1
        """,
    "SubLinear": '''
        class SubLinear(nn.Linear):
            """An nn.Linear subclass that changes nothing about the call."""

            def extra_repr(self):
                return "sub, " + super().extra_repr()
        ''',
    "ScaledLinear": '''
        class ScaledLinear(nn.Linear):
            """An nn.Linear subclass with its own forward."""

            def forward(self, input):
                return super().forward(input) * 0.5
        ''',
    "CallLinear": '''
        class CallLinear(nn.Linear):
            """An nn.Linear subclass that overrides __call__ rather than forward."""

            def __call__(self, input):
                return super().__call__(input) * 0.5
        ''',
    "FlagCallLinear": '''
        class FlagCallLinear(nn.Linear):
            """An nn.Linear subclass whose __call__ depends on an instance attribute: one
            instance may look plain to a trace while another scales its output."""

            scale = 1.0

            def __call__(self, input):
                output = super().__call__(input)
                return output * self.scale if self.scale != 1.0 else output
        ''',
    "InplaceHeadRMSNorm": '''
        class InplaceHeadRMSNorm(nn.Module):
            """A q/k RMSNorm that normalises its input in place (`.float()` of a float32
            tensor is the tensor itself), as some remote-code models do."""

            def __init__(self, hidden_size, eps=1e-6):
                super().__init__()
                self.weight = nn.Parameter(torch.randn(hidden_size) * 0.1 + 1.0)
                self.variance_epsilon = eps

            def forward(self, hidden_states):
                hidden_states = hidden_states.float()
                variance = hidden_states.pow(2).mean(-1, keepdim=True)
                hidden_states.mul_(torch.rsqrt(variance + self.variance_epsilon))
                return self.weight * hidden_states
        ''',
    "rotary": '''
        def rotate_half(x):
            """Rotates half the hidden dims of the input (as Transformers does)."""
            x1 = x[..., : x.shape[-1] // 2]
            x2 = x[..., x.shape[-1] // 2 :]
            return torch.cat((-x2, x1), dim=-1)


        def rotary_tables(x):
            """cos/sin tables for `x`'s sequence length and head size."""
            seq, dim = x.shape[-2], x.shape[-1]
            angles = torch.arange(seq, dtype=x.dtype)[:, None] * torch.arange(1, dim + 1, dtype=x.dtype)
            return torch.cos(angles * 0.1), torch.sin(angles * 0.1)


        def apply_rotary_pos_emb(q, k, cos, sin):
            """Out of place, as Transformers does."""
            return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


        def apply_rotary_in_place(q, k, cos, sin):
            """In place: the rotated values are copied back into q and k."""
            q.copy_(q * cos + rotate_half(q) * sin)
            half = k.shape[-1] // 2
            k[..., :half] = k[..., :half] * cos[..., :half] - k[..., half : 2 * half] * sin[..., :half]
            return q, k
        ''',
    "CustomAct": '''
        class CustomAct(nn.Module):
            """An activation no fused kernel reproduces (quick GELU spelled by hand)."""

            def forward(self, x):
                return x * torch.sigmoid(1.702 * x)
        ''',
    "HeadRMSNorm": '''
        class HeadRMSNorm(nn.Module):
            """Llama-style RMSNorm used as a q/k norm."""

            def __init__(self, hidden_size, eps=1e-6):
                super().__init__()
                self.weight = nn.Parameter(torch.randn(hidden_size) * 0.1 + 1.0)
                self.variance_epsilon = eps

            def forward(self, hidden_states):
                input_dtype = hidden_states.dtype
                hidden_states = hidden_states.to(torch.float32)
                variance = hidden_states.pow(2).mean(-1, keepdim=True)
                hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
                return self.weight * hidden_states.to(input_dtype)
        ''',
}

SNIPPET_DEPENDENCIES = {"eager_attention_forward": ("repeat_kv",)}

HEADER = """\
# Generated by tests/fuzz/strategies.py (Hypothesis): a Hugging Face-shaped module for the
# fusion fuzzer. build() constructs it; make_inputs(generator) draws one forward's inputs.
import contextlib
import operator
import types

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

try:
    from transformers.integrations import use_experts_implementation
except ImportError:  # Transformers 4 has no experts interface: a plain class

    def use_experts_implementation(experts_class):
        return experts_class
"""


# -- interleaved statements ---------------------------------------------------------------------


@dataclass(frozen=True)
class Stmt:
    """One interleaved statement: its label, whether it is a hazard, its lines, and the
    helpers it needs."""

    label: str
    hazard: bool
    lines: tuple[str, ...]
    snippets: tuple[str, ...] = ()


def _stmts(
    table: Sequence[tuple[str, Sequence[str]] | tuple[str, Sequence[str], Sequence[str]]],
    hazard: bool,
) -> list[tuple[str, bool, tuple[str, ...], tuple[str, ...]]]:
    return [
        (entry[0], hazard, tuple(entry[1]), tuple(entry[2]) if len(entry) > 2 else ())
        for entry in table
    ]


INPUT_BENIGN = _stmts(
    [
        ("shape_read", ["_z_n = {x}.shape[-1]"]),
        ("size_read", ["_z_b = {x}.size(0)"]),
        ("fresh_value", ["_z_tmp = {x} * 0.5"]),
        ("residual", ["_z_residual = {x}"]),
        ("view_read", ["_z_flat = {x}.reshape(-1, {x}.shape[-1])"]),
        ("slice_read", ["_z_head = {x}[..., :1]"]),
        ("detach_read", ["_z_det = {x}.detach()"]),
        ("contiguous_read", ["_z_c = {x}.contiguous()"]),
        ("metadata_branch", ["if {x}.dim() == 0:", "    _z_never = True"]),
        ("dtype_branch", ["if {x}.dtype == torch.float64:", "    {x} = {x}.float()"]),
    ],
    hazard=False,
)
"""Statements that read the projection input without changing it."""

INPUT_PROVIDES = frozenset({"operator", "bump", "wide", "contiguous", "no_grad"})
"""What a generated module offers a write to the projection input (`Spelling.needs`): the
`operator` import, the `bump` snippet, an input at least 8 wide and even, contiguous, that
does not require grad. No `self.flag` and no `rotate_in_place` snippet."""

OUTPUT_PROVIDES = frozenset({"operator", "bump"})
"""A projection output may be a reshaped, transposed view as narrow as 2 that requires
grad: only the spellings that need nothing of its shape."""

INPUT_HAZARDS = _stmts(
    [
        (spelling.label, spelling.template("x"), tuple(spelling.needs & {"bump"}))
        for spelling in spellings(INPUT_PROVIDES)
    ]
    + [
        ("rebind", ["{x} = {x} * 0.5"]),
        ("rebind_flip", ["{x} = {x}.flip(-1)"]),
        ("rebind_tuple", ["{x}, _z_u = {x} + 0.25, None"]),
        ("walrus_rebind", ["_z_w = ({x} := {x} * 0.5)"]),
        ("loop_rebind", ["for _ in range(1):", "    {x} = {x} + 0.25"]),
    ],
    hazard=True,
)
"""Statements that change the projection input's value: every write spelling of the shared
table (tests/write_spellings.py) this module can host, and the rebinding forms."""

OUTPUT_ANY = _stmts(
    [
        (f"out_{spelling.label}", spelling.template("p"), tuple(spelling.needs & {"bump"}))
        for spelling in spellings(OUTPUT_PROVIDES)
    ]
    + [
        ("out_contiguity_probe", ["if not {p}.is_contiguous():", "    {p} = {p} * 0.5"]),
        ("out_rebind", ["{p} = {p} * 0.5"]),
        ("out_inplace_view_op", ["{p}.unsqueeze_(0)", "{p}.squeeze_(0)"]),
    ],
    hazard=False,
)
"""Statements on a projection's output (reshaped or not): every write spelling of the shared
table it can host, and probes. Harmless to the function, but a split piece of a merged GEMM
must behave like the projection's own output."""

OUTPUT_RAW = _stmts(
    [
        ("out_flat_view", ["_z_pf = {p}.view(-1)"]),
        ("out_merge_view", ["{p} = {p}.view(-1, {p}.shape[-1]).view({p}.shape)"]),
        ("out_functional_view", ["_z_pv = torch.Tensor.view({p}, -1)"]),
        (
            "out_storage_probe",
            [
                "_z_exact = {p}.untyped_storage().nbytes() == {p}.numel() * {p}.element_size()",
                "{p} = {p} * (1.0 if _z_exact else 0.5)",
            ],
        ),
        ("out_stride_probe", ["{p} = {p} * (1.0 if {p}.stride(-2) == {p}.shape[-1] else 0.5)"]),
    ],
    hazard=False,
)
"""Statements only valid on a projection's raw (contiguous, unreshaped) output."""

PROJECTION_REFERENCES = _stmts(
    [
        ("proj_weight_dtype", ["_z_dt = self.{proj}.weight.dtype"]),
        ("proj_out_features", ["_z_of = self.{proj}.out_features"]),
        ("proj_alias", ["_z_pm = self.{proj}"]),
        ("proj_bias_branch", ["if self.{proj}.bias is not None:", "    _z_hb = True"]),
    ],
    hazard=False,
)
"""Other references to a projection module: harmless, but the projection must survive."""


@dataclass
class Slot:
    """What an interleaved statement at one point of a forward may refer to."""

    outputs: list[tuple[str, bool]] = field(default_factory=list)
    """Bound projection outputs: (name, still the raw contiguous output)."""


def draw_statements(
    draw: Draw,
    x: str,
    slot: Slot,
    projections: Sequence[str],
    safe: bool,
    max_count: int = 2,
) -> list[Stmt]:
    """Up to `max_count` statements for one slot; hazards only when not `safe`."""
    count = draw(st.integers(0, max_count)) if max_count > 0 else 0
    result: list[Stmt] = []
    for _ in range(count):
        kinds = ["input_benign", "input_benign"]
        if projections and draw(st.integers(0, 3)) == 0:
            kinds.append("projection_reference")
        if slot.outputs:
            kinds += ["output", "output"]
        if not safe:
            kinds += ["input_hazard", "input_hazard"]
        kind = draw(st.sampled_from(kinds))
        if kind == "input_benign":
            table, fill = INPUT_BENIGN, {"x": x}
        elif kind == "input_hazard":
            table, fill = INPUT_HAZARDS, {"x": x}
        elif kind == "projection_reference":
            table, fill = PROJECTION_REFERENCES, {"proj": draw(st.sampled_from(list(projections)))}
        else:
            name, raw = draw(st.sampled_from(slot.outputs))
            table, fill = (OUTPUT_ANY + OUTPUT_RAW if raw else OUTPUT_ANY), {"p": name}
        label, hazard, lines, snippets = draw(st.sampled_from(table))
        result.append(Stmt(label, hazard, tuple(line.format(**fill) for line in lines), snippets))
    return result


# -- program assembly ---------------------------------------------------------------------------


@dataclass
class Part:
    """One generated class and everything the module around it must provide."""

    class_name: str
    lines: list[str]
    """The class definition, unindented."""
    snippets: list[str] = field(default_factory=list)
    hooks: list[str] = field(default_factory=list)
    """Statements for build(), `{m}` standing for the instance's expression."""
    tweaks: list[str] = field(default_factory=list)
    """Per-instance changes for build() (`{m}` as in `hooks`), applied to a second instance
    of the class when the model has one: what one instance's trace cannot show."""
    inputs: list[str] = field(default_factory=list)
    """Statements for make_inputs() that bind `args` (a list) and `kwargs` (a dict)."""
    hazards: list[str] = field(default_factory=list)
    features: list[str] = field(default_factory=list)
    children: list[Part] = field(default_factory=list)
    cache_argument: str | None = None
    returns_tuple: bool = False

    def add(self, stmts: Sequence[Stmt]) -> list[str]:
        """Record `stmts`' hazards and helpers; return their lines."""
        lines: list[str] = []
        for stmt in stmts:
            (self.hazards if stmt.hazard else self.features).append(stmt.label)
            self.snippets.extend(stmt.snippets)
            lines.extend(stmt.lines)
        return lines


def method(name: str, params: str, body: Sequence[str]) -> list[str]:
    """A method definition indented for a class body."""
    return [f"    def {name}({params}):", *(f"        {line}" for line in body)]


def _ordered_snippets(parts: Sequence[Part]) -> list[str]:
    names: list[str] = []

    def want(name: str) -> None:
        for dep in SNIPPET_DEPENDENCIES.get(name, ()):
            want(dep)
        if name not in names:
            names.append(name)

    def visit(part: Part) -> None:
        for child in part.children:
            visit(child)
        for name in part.snippets:
            want(name)

    for part in parts:
        visit(part)
    return names


def _classes(part: Part, seen: set[str]) -> list[str]:
    out: list[str] = []
    for child in part.children:
        out += _classes(child, seen)
    if part.class_name not in seen:
        seen.add(part.class_name)
        out += ["", "", *part.lines]
    return out


def _collect(part: Part, attr: str) -> list[str]:
    values = [item for child in part.children for item in _collect(child, attr)]
    return values + list(getattr(part, attr))


def assemble(shape: str, top: Part, construct: str, input_lines: Sequence[str]) -> GeneratedModule:
    """The whole module source for `top` (built by `construct`), with build/make_inputs."""
    text = [HEADER.rstrip("\n")]
    for name in _ordered_snippets([top]):
        text += ["", "", textwrap.dedent(SNIPPETS[name]).strip("\n")]
    text += _classes(top, set())
    build_body = [f"module = {construct}", *top.hooks, "return module"]
    text += ["", "", "def build():", *(f"    {line}" for line in build_body)]
    inputs_body = ["args = []", "kwargs = {}", *input_lines, "return tuple(args), kwargs"]
    text += ["", "", "def make_inputs(generator):", *(f"    {line}" for line in inputs_body)]
    return GeneratedModule(
        shape=shape,
        class_name=top.class_name,
        source="\n".join(text) + "\n",
        hazards=tuple(_collect(top, "hazards")),
        features=tuple(_collect(top, "features")),
    )


def _linear_kind(draw: Draw, part: Part, attr: str, safe: bool) -> str:
    """The class used for projection `attr`: nn.Linear mostly, a subclass sometimes."""
    options = ["nn.Linear"] * 7 + ["SubLinear"]
    if not safe:
        options += ["ScaledLinear", "CallLinear", "FlagCallLinear"]
    kind = draw(st.sampled_from(options))
    if kind != "nn.Linear":
        part.snippets.append(kind)
        (part.features if kind == "SubLinear" else part.hazards).append(f"{attr}:{kind}")
    if kind == "FlagCallLinear":
        part.tweaks.append(f"{{m}}.{attr}.scale = 0.5")
    return kind


def _projection_hooks(draw: Draw, part: Part, attrs: Sequence[str], safe: bool) -> None:
    """Hooks on projections (hazards: a merged projection stops firing them)."""
    if safe or draw(st.integers(0, 4)) != 0:
        return
    attr = draw(st.sampled_from(list(attrs)))
    hook = draw(
        st.sampled_from(
            [
                ("register_forward_hook", "halve_output_hook"),
                ("register_forward_pre_hook", "halve_input_pre_hook"),
                ("register_forward_hook", "counting_hook"),
            ]
        )
    )
    part.snippets.append("hooks")
    part.hooks.append(f"{{m}}.{attr}.{hook[0]}({hook[1]})")
    part.hazards.append(f"hook:{attr}:{hook[1]}")


REGIONS: dict[str, tuple[bool, tuple[str, ...], tuple[str, ...]]] = {
    "no_grad": (True, ("with torch.no_grad():",), ()),
    "autocast": (
        True,
        ("with torch.autocast('cpu', dtype=torch.bfloat16):",),
        ("{n} = {n}.float()",),
    ),
    "grad_toggle": (
        True,
        ("_z_grad = torch.is_grad_enabled()", "torch.set_grad_enabled(False)", "if True:"),
        ("torch.set_grad_enabled(_z_grad)",),
    ),
    "enable_grad": (False, ("with torch.enable_grad():",), ()),
    "null_context": (False, ("with contextlib.nullcontext():",), ()),
}
"""Regions a projection call may sit in (issue 24, defect 4): {name: (changes what the call
computes or records, lines opening the region (the call is indented under the last),
lines after it (`{n}`: the bound output))}. A region around some projections and not
others is a hazard: merging would move a call out of (or into) its grad or autocast
state. `enable_grad` (grad is on wherever the oracle records gradients) and
`nullcontext` change nothing, but an engine that cannot tell may refuse them."""


def _region(draw: Draw, safe: bool) -> str | None:
    options: list[tuple[str | None, int]] = [(None, 14), ("enable_grad", 1), ("null_context", 1)]
    if not safe:
        options += [("no_grad", 2), ("autocast", 1), ("grad_toggle", 1)]
    return draw(weighted(options))


def _in_region(region: str | None, lines: Sequence[str], bound: str) -> list[str]:
    """`lines` (binding `bound`) inside `region` (`REGIONS`), unchanged for None."""
    if region is None:
        return list(lines)
    _, opening, closing = REGIONS[region]
    return [*opening, *(f"    {line}" for line in lines), *(c.format(n=bound) for c in closing)]


SHADOW_METHOD = [
    "    def shadowed(self, t):",
    '        """A method beside a child of the same name: Python runs this, not the child."""',
    "        t.mul_(0.5)",
    "        return t",
]
"""Name shadowing (issue 24, defect 9): the class defines `shadowed`, which writes its
argument in place, and `__init__` also puts a pure child under that name into `_modules`.
Attribute lookup finds the method first; an analysis that reads the child proves a pure
call where Python runs a write."""


def _ints(values: Sequence[int]) -> st.SearchStrategy[int]:
    return st.sampled_from(list(values))


def weighted(choices: Sequence[tuple[Any, int]]) -> st.SearchStrategy[Any]:
    """One of the values, with the given integer weights (the first shrinks best)."""
    return st.sampled_from([value for value, weight in choices for _ in range(weight)])


# -- attention ------------------------------------------------------------------------------------


def attention_part(
    draw: Draw, safe: bool, name: str = "GeneratedAttention", hidden: int | None = None
) -> Part:
    """An attention block: q/k/v/o projections, optional q/k norms, guards and branches, an
    optional KV-cache update, and an attention-interface call."""
    head_dim = draw(_ints([4, 2, 8]))
    kv_heads = draw(_ints([1, 2]))
    groups = draw(_ints([1, 2, 3]))
    heads = kv_heads * groups
    hidden = hidden if hidden is not None else draw(_ints([16, 8, 12]))
    batch, seq = draw(_ints([2, 1])), draw(_ints([3, 1, 4]))
    part = Part(name, [])
    busy = draw(weighted([(0, 2), (1, 2), (2, 1)]))  # statements a slot may take
    x = draw(st.sampled_from(["hidden_states", "hidden_states", "x"]))
    widths = {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim}
    biases = {p: draw(st.booleans()) for p in ("q", "k", "v", "o")}
    kinds = {p: _linear_kind(draw, part, f"{p}_proj", safe) for p in ("q", "k", "v")}
    norm = draw(st.sampled_from([None, None, "nn.RMSNorm", "HeadRMSNorm", "InplaceHeadRMSNorm"]))
    if norm in ("HeadRMSNorm", "InplaceHeadRMSNorm"):
        part.snippets.append(norm)
    # Per head, through a view (Qwen3), or over the flat projection before the view (OLMo 2).
    norm_flat = bool(norm) and draw(st.booleans())
    if norm:
        part.features.append(f"qk_norm:{norm}:{'flat' if norm_flat else 'head'}")
    # In-place forms real modules use on projected states: OLMo's clip_qkv clamp (behind a
    # config test, which a second instance may take where the traced one did not), queries
    # scaled in place, rotary embeddings written back in place.
    clip = draw(weighted([(None, 4), ("always", 1), ("config", 1)]))
    if clip:
        part.features.append(f"clip_qkv:{clip}")
    prescale = draw(weighted([(None, 5), ("augassign", 1), ("mul_", 1), ("rebind", 1)]))
    if prescale:
        part.features.append(f"prescale:{prescale}")
    rotary = draw(weighted([(None, 5), ("functional", 2), ("in_place", 1), ("inline_setitem", 1)]))
    if rotary:
        part.snippets.append("rotary")
        part.features.append(f"rotary:{rotary}")
    order = draw(st.permutations(["q", "k", "v"]))
    if order != ["q", "k", "v"]:
        part.features.append("order:" + "".join(order))
    styles = {p: draw(st.sampled_from(["chained", "separate"])) for p in order}
    guards = {
        p: draw(
            weighted(
                [
                    ("none", 14),
                    ("ternary", 1),
                    ("if_none", 1),
                    ("truthy", 1),
                    ("flag_on", 1),
                    ("flag_off", 1),
                ]
            )
        )
        for p in order
    }
    interfaces = [("interface_v4", 4), ("direct", 5), ("local", 4), ("inline_sdpa", 3)]
    if HAS_GET_INTERFACE:
        interfaces.append(("interface", 8))
    interface = draw(weighted(interfaces))
    part.features.append(f"attention:{interface}")
    cache = draw(weighted([(None, 5), ("past_key_values", 2), ("cache", 2), ("layer_past", 1)]))
    cache_kind = draw(st.sampled_from(["SimpleCache", "StaticCache"])) if cache else None
    dropout = draw(st.booleans())
    returns_tuple = draw(st.booleans())
    names = {"q": "query_states", "k": "key_states", "v": "value_states"}
    regions = {p: (_region(draw, safe) if guards[p] == "none" else None) for p in order}
    if len(set(regions.values())) > 1:
        for p, region in regions.items():
            if region is not None:
                changes = REGIONS[region][0]
                (part.hazards if changes else part.features).append(f"region:{p}:{region}")
    elif regions[order[0]] is not None:
        part.features.append(f"region:all:{regions[order[0]]}")
    shadow = not safe and draw(st.integers(0, 9)) == 0

    init = [
        "super().__init__()",
        f"self.head_dim = {head_dim}",
        f"self.num_heads = {heads}",
        f"self.num_key_value_heads = {kv_heads}",
        f"self.num_key_value_groups = {groups}",
        f"self.scaling = {head_dim} ** -0.5",
        "self.layer_idx = 0",
        "self.config = types.SimpleNamespace(_attn_implementation='eager')",
    ]
    for p in ("q", "k", "v"):
        init.append(f"self.{p}_proj = {kinds[p]}({hidden}, {widths[p]}, bias={biases[p]})")
    init.append(f"self.o_proj = nn.Linear({heads * head_dim}, {hidden}, bias={biases['o']})")
    if norm:
        q_dim, k_dim = (widths["q"], widths["k"]) if norm_flat else (head_dim, head_dim)
        init += [
            f"self.q_norm = {norm}({q_dim}, eps=1e-6)",
            f"self.k_norm = {norm}({k_dim}, eps=1e-6)",
        ]
    if clip == "config":
        init.append("self.clip_qkv = None")
        part.tweaks.append("{m}.clip_qkv = 0.5")
    if dropout:
        init.append("self.resid_dropout = nn.Dropout(0.0)")
        part.features.append("dropout")
    for p in order:
        if guards[p].startswith("flag"):
            init.append(f"self.use_{p} = {guards[p] == 'flag_on'}")
            part.tweaks.append(f"{{m}}.use_{p} = {guards[p] != 'flag_on'}")

    def shaped(p: str, value: str) -> str:
        if norm and p in ("q", "k") and norm_flat:
            return f"self.{p}_norm({value}).view(hidden_shape).transpose(1, 2)"
        if norm and p in ("q", "k"):
            return f"self.{p}_norm({value}.view(hidden_shape)).transpose(1, 2)"
        return f"{value}.view(hidden_shape).transpose(1, 2)"

    body = [
        "input_shape = " + x + ".shape[:-1]",
        "hidden_shape = (*input_shape, -1, self.head_dim)",
    ]
    projections = [f"{p}_proj" for p in ("q", "k", "v")]
    slot = Slot()
    body += part.add(draw_statements(draw, x, slot, projections, safe, busy))
    for p in order:
        n = names[p]
        call = f"self.{p}_proj({x})"
        expr = shaped(p, call) if styles[p] == "chained" else call
        alt = f"{x}.new_zeros((*input_shape, {widths[p]}))"
        alt = shaped(p, alt) if styles[p] == "chained" else alt
        guard = guards[p]
        if guard != "none":
            part.features.append(f"guard:{p}:{guard}")
        if guard == "none":
            body += _in_region(regions[p], [f"{n} = {expr}"], n)
        elif guard == "ternary":
            body.append(f"{n} = {expr} if self.{p}_proj is not None else None")
        elif guard in ("if_none", "truthy"):
            test = f"self.{p}_proj is not None" if guard == "if_none" else f"self.{p}_proj"
            body += [f"if {test}:", f"    {n} = {expr}", "else:", f"    {n} = None"]
        else:
            body += [f"if self.use_{p}:", f"    {n} = {expr}", "else:", f"    {n} = {alt}"]
        slot.outputs.append((n, styles[p] == "separate"))
        if shadow and p == order[0]:
            body.append(f"_z_shadow = self.shadowed({x})")
        body += part.add(draw_statements(draw, x, slot, projections, safe, busy))
    # A layout-sensitive use of the raw value output on a branch the trace need not take
    # (issue 43): a flag the second instance sets, or no mask where the trace passed one.
    # On v, which little else writes (a written piece is a copy of its own anyway).
    flat = draw(weighted([(None, 6), ("flag", 1), ("mask", 1)]))
    if flat and styles["v"] == "separate":
        test = "self.flatten_v" if flat == "flag" else "attention_mask is None"
        if flat == "flag":
            init.append("self.flatten_v = False")
            part.tweaks.append("{m}.flatten_v = True")
        body += [f"if {test}:", "    value_states = value_states.view(-1).view(value_states.shape)"]
        part.features.append(f"flat_branch:{flat}")
    for p in order:
        if styles[p] == "separate":
            body.append(f"{names[p]} = {shaped(p, names[p])}")
    slot.outputs = [(n, False) for n, _ in slot.outputs]
    body += part.add(draw_statements(draw, x, slot, projections, safe, min(busy, 1)))
    clip_lines = [f"{names[p]}.clamp_(min=-0.5, max=0.5)" for p in ("q", "k", "v")]
    if clip == "always":
        body += clip_lines
    elif clip == "config":
        clip_lines = [f"{n}.clamp_(min=-self.clip_qkv, max=self.clip_qkv)" for n in names.values()]
        body += ["if self.clip_qkv is not None:", *(f"    {line}" for line in clip_lines)]
    if rotary:
        body.append("cos, sin = rotary_tables(query_states)")
    if rotary == "functional":
        body.append(
            "query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)"
        )
    elif rotary == "in_place":
        body.append("apply_rotary_in_place(query_states, key_states, cos, sin)")
    elif rotary == "inline_setitem":
        body += [
            "_z_rot = query_states.shape[-1] // 2",
            "query_states[..., :_z_rot] = query_states[..., :_z_rot] * cos[..., :_z_rot]",
            "key_states[..., :_z_rot].copy_(key_states[..., :_z_rot] * sin[..., :_z_rot])",
        ]
    if prescale == "augassign":
        body.append("query_states *= self.scaling")
    elif prescale == "mul_":
        body.append("query_states.mul_(self.scaling)")
    elif prescale == "rebind":
        body.append("query_states = query_states * self.scaling")
    if cache:
        part.snippets.append(cache_kind)
        part.features.append(f"cache:{cache}:{cache_kind}")
        body += [
            f"if {cache} is not None:",
            f"    key_states, value_states = {cache}.update(key_states, value_states, self.layer_idx)",
        ]
    call_args = "self, query_states, key_states, value_states, attention_mask, scaling=self.scaling, dropout=0.0, **kwargs"
    if interface == "inline_sdpa":
        part.snippets.append("repeat_kv")
        body += [
            "key_states = repeat_kv(key_states, self.num_key_value_groups)",
            "value_states = repeat_kv(value_states, self.num_key_value_groups)",
            "attn_output = F.scaled_dot_product_attention(query_states, key_states, value_states, attn_mask=attention_mask, scale=self.scaling)",
            "attn_output = attn_output.transpose(1, 2).contiguous()",
            "attn_weights = None",
        ]
    else:
        part.snippets.append("eager_attention_forward")
        if interface == "interface":
            body.append(
                "attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface("
                "self.config._attn_implementation, eager_attention_forward)"
            )
            body.append(f"attn_output, attn_weights = attention_interface({call_args})")
        elif interface == "interface_v4":  # the Transformers 4 spelling
            body += [
                "attention_interface = eager_attention_forward",
                "if self.config._attn_implementation != 'eager':",
                "    attention_interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]",
                f"attn_output, attn_weights = attention_interface({call_args})",
            ]
        elif interface == "local":
            body.append("attention_interface = eager_attention_forward")
            body.append(f"attn_output, attn_weights = attention_interface({call_args})")
        else:
            body.append(f"attn_output, attn_weights = eager_attention_forward({call_args})")
    body += [
        "attn_output = attn_output.reshape(*input_shape, -1).contiguous()",
        "attn_output = self.o_proj(attn_output)",
    ]
    if dropout:
        body.append("attn_output = self.resid_dropout(attn_output)")
    body.append("return attn_output, attn_weights" if returns_tuple else "return attn_output")
    params = f"self, {x}, attention_mask=None" + (f", {cache}=None" if cache else "") + ", **kwargs"
    if shadow:
        init.append('self._modules["shadowed"] = nn.Identity()')
        part.hazards.append("shadowed_method")
    part.lines = [
        f"class {name}(nn.Module):",
        *method("__init__", "self", init),
        "",
        *method("forward", params, body),
        *(["", *SHADOW_METHOD] if shadow else []),
    ]
    _projection_hooks(draw, part, projections, safe)
    part.cache_argument = cache
    part.returns_tuple = returns_tuple

    b, s = batch, seq
    part.inputs = [f"args.append(torch.randn({b}, {s}, {hidden}, generator=generator))"]
    if cache:
        past = draw(_ints([2, 0]))
        shape = f"{b}, {kv_heads}, {{}}, {head_dim}"
        if cache_kind == "SimpleCache":
            make = (
                f"SimpleCache(torch.randn({shape.format(past)}, generator=generator), "
                f"torch.randn({shape.format(past)}, generator=generator))"
            )
        else:
            total = past + s
            make = (
                f"StaticCache(torch.randn({shape.format(total)}, generator=generator), "
                f"torch.randn({shape.format(total)}, generator=generator), {past})"
            )
        part.inputs.append(f"kwargs[{cache!r}] = {make}")
    elif draw(st.booleans()):
        part.features.append("causal_mask")
        part.inputs.append(
            f"kwargs['attention_mask'] = torch.triu(torch.full(({s}, {s}), -1e9), 1)[None, None]"
            f".expand({b}, 1, {s}, {s})"
        )
    return part


# -- gated MLP ------------------------------------------------------------------------------------

ACTIVATIONS = (
    "nn.SiLU()",
    "ACT2FN['silu']",
    "nn.GELU()",
    "nn.GELU(approximate='tanh')",
    "ACT2FN['gelu']",
    "ACT2FN['gelu_pytorch_tanh']",
    "ACT2FN['gelu_new']",
    "ACT2FN['quick_gelu']",
    "nn.ReLU()",
    "nn.Tanh()",
    "CustomAct()",
    "nn.SiLU(inplace=True)",
)

FUSABLE_ACTIVATIONS = frozenset(ACTIVATIONS[:7])
"""Activations an `ActAndMul` reproduces (drawn more often, so safe MLPs usually fuse)."""


def glu_part(draw: Draw, safe: bool, name: str = "GeneratedMLP", hidden: int | None = None) -> Part:
    """A gated MLP: act(gate(x)) * up(x), optionally through a down projection, in one of
    several spellings (one expression, separate statements, a functional activation)."""
    hidden_given = hidden is not None
    hidden = hidden if hidden is not None else draw(_ints([16, 8, 12]))
    inter = draw(_ints([24, 8, 16]))
    part = Part(name, [])
    busy = draw(weighted([(0, 2), (1, 2), (2, 1)]))  # statements a slot may take
    x = draw(st.sampled_from(["x", "hidden_states", "hidden_state"]))
    form = draw(weighted([("expr", 5), ("split", 2), ("functional", 1), ("already_fused", 1)]))
    part.features.append(f"form:{form}")
    # An in-place activation on a chunk of one GEMM fails under autograd in the original too.
    act = draw(
        weighted(
            [
                (a, 3 if a in FUSABLE_ACTIVATIONS else 1)
                for a in ACTIVATIONS
                if form != "already_fused" or "inplace" not in a
            ]
        )
    )
    if act == "CustomAct()":
        part.snippets.append("CustomAct")
    part.features.append(f"act:{act}")
    swapped = draw(st.booleans())
    if swapped:
        part.features.append("operands_swapped")
    # Nested in a layer (`hidden` given) the MLP must map back to the hidden width.
    down = hidden_given or draw(st.sampled_from([True, True, False]))
    dropout = draw(st.booleans())
    biases = {p: draw(st.booleans()) for p in ("gate", "up", "down")}
    init = [
        "super().__init__()",
        f"self.hidden_size = {hidden}",
        f"self.intermediate_size = {inter}",
    ]
    if form == "already_fused":
        init.append(f"self.gate_up_proj = nn.Linear({hidden}, {2 * inter}, bias={biases['gate']})")
        projections = ["gate_up_proj"]
    else:
        for p in ("gate", "up"):
            kind = _linear_kind(draw, part, f"{p}_proj", safe)
            init.append(f"self.{p}_proj = {kind}({hidden}, {inter}, bias={biases[p]})")
        projections = ["gate_proj", "up_proj"]
    if down:
        init.append(f"self.down_proj = nn.Linear({inter}, {hidden}, bias={biases['down']})")
    init.append(f"self.act_fn = {act}")
    if dropout:
        init.append("self.dropout = nn.Dropout(0.0)")
        part.features.append("dropout")

    slot = Slot()
    body = part.add(draw_statements(draw, x, slot, projections, safe, busy))

    def product(gate: str, up: str, act_call: str = "self.act_fn") -> str:
        left, right = f"{act_call}({gate})", up
        return f"{right} * {left}" if swapped else f"{left} * {right}"

    if form == "expr":
        body.append(f"h = {product(f'self.gate_proj({x})', f'self.up_proj({x})')}")
    elif form == "functional":
        fn = draw(st.sampled_from(["F.silu", "F.gelu"]))
        body.append(f"h = {product(f'self.gate_proj({x})', f'self.up_proj({x})', fn)}")
    elif form == "already_fused":
        body += [
            f"gate, up = self.gate_up_proj({x}).chunk(2, dim=-1)",
            f"h = {product('gate', 'up')}",
        ]
    else:
        first, second = draw(st.permutations(["gate", "up"]))
        body.append(f"{first} = self.{first}_proj({x})")
        slot.outputs.append((first, True))
        body += part.add(draw_statements(draw, x, slot, projections, safe, busy))
        body.append(f"{second} = self.{second}_proj({x})")
        slot.outputs.append((second, True))
        body += part.add(draw_statements(draw, x, slot, projections, safe, busy))
        body.append(f"h = {product('gate', 'up')}")
    body += part.add(draw_statements(draw, x, Slot(), projections, safe, min(busy, 1)))
    if down:
        body.append("h = self.down_proj(h)")
    if dropout:
        body.append("h = self.dropout(h)")
    body.append("return h")
    part.lines = [
        f"class {name}(nn.Module):",
        *method("__init__", "self", init),
        "",
        *method("forward", f"self, {x}", body),
    ]
    if form != "already_fused":
        _projection_hooks(draw, part, projections, safe)
        if not safe and draw(st.integers(0, 6)) == 0:
            part.snippets.append("hooks")
            part.hooks.append("{m}.act_fn.register_forward_hook(halve_output_hook)")
            part.hazards.append("hook:act_fn")
    rank = draw(st.sampled_from([3, 2]))
    shape = (
        f"{draw(_ints([2, 1]))}, {draw(_ints([3, 1]))}, {hidden}"
        if rank == 3
        else f"{draw(_ints([5, 1]))}, {hidden}"
    )
    part.inputs = [f"args.append(torch.randn({shape}, generator=generator))"]
    return part


# -- RMSNorm --------------------------------------------------------------------------------------


def rmsnorm_part(
    draw: Draw, safe: bool, name: str = "GeneratedRMSNorm", hidden: int | None = None
) -> Part:
    """An RMSNorm in one of Transformers' spellings (Llama, Gemma, no weight), or a near
    miss that is not an RMSNorm at all (mean-subtracting, eps outside the root, ...)."""
    hidden = hidden if hidden is not None else draw(_ints([16, 8, 12]))
    eps = draw(st.sampled_from([1e-6, 1e-5, 0.1]))
    part = Part(name, [])
    busy = draw(weighted([(0, 2), (1, 2), (2, 1)]))  # statements a slot may take
    x = "hidden_states"
    eps_attr = draw(st.sampled_from(["variance_epsilon", "eps"]))
    upcast = draw(st.sampled_from(["to", "float", "none"]))
    variance = draw(
        st.sampled_from(
            [
                "{h}.pow(2).mean(-1, keepdim=True)",
                "torch.mean({h} * {h}, dim=-1, keepdim=True)",
                "{h}.square().mean(-1, keepdim=True)",
                "{h}.pow(exponent=2).mean(-1, keepdim=True)",
            ]
        )
    )
    scale = draw(st.sampled_from(["rsqrt", "rsqrt", "div_sqrt", "pow_kw", "pow_all_kw"]))
    output = draw(st.sampled_from(["llama", "llama", "gemma", "cast_after", "no_weight"]))
    near_miss = draw(
        weighted(
            [
                (None, 14),
                *((miss, 1) for miss in ("mean_subtracted", "abs_mean", "var", "sum")),
                *((miss, 1) for miss in ("eps_outside", "dim0", "bias")),
            ]
        )
    )
    part.features += [f"upcast:{upcast}", f"scale:{scale}", f"output:{output}"]
    if near_miss:
        part.features.append(f"near_miss:{near_miss}")
    init = ["super().__init__()"]
    if output == "gemma":
        init.append(f"self.weight = nn.Parameter(torch.randn({hidden}) * 0.1)")
    elif output != "no_weight":
        init.append(f"self.weight = nn.Parameter(torch.randn({hidden}) * 0.1 + 1.0)")
    if near_miss == "bias":
        init.append(f"self.bias = nn.Parameter(torch.randn({hidden}) * 0.1)")
    init.append(f"self.{eps_attr} = {eps}")
    part.tweaks.append(f"{{m}}.{eps_attr} = {0.1 if eps != 0.1 else 1e-6}")

    body = part.add(draw_statements(draw, x, Slot(), [], safe, busy))
    body.append(f"input_dtype = {x}.dtype")
    if upcast == "to":
        body.append(f"{x} = {x}.to(torch.float32)")
    elif upcast == "float":
        body.append(f"{x} = {x}.float()")
    if near_miss == "mean_subtracted":
        body.append(f"{x} = {x} - {x}.mean(-1, keepdim=True)")
    var = variance.format(h=x)
    if near_miss == "abs_mean":
        var = f"{x}.abs().mean(-1, keepdim=True)"
    elif near_miss == "var":
        var = f"{x}.var(-1, keepdim=True)"
    elif near_miss == "sum":
        var = f"{x}.pow(2).sum(-1, keepdim=True)"
    elif near_miss == "dim0":
        var = f"{x}.pow(2).mean(0, keepdim=True)"
    body.append(f"variance = {var}")
    eps_ref = f"self.{eps_attr}"
    if near_miss == "eps_outside":
        factor = f"(torch.rsqrt(variance) + {eps_ref})"
    elif scale == "rsqrt":
        factor = f"torch.rsqrt(variance + {eps_ref})"
    elif scale == "pow_kw":  # vLLM's test spellings (issue 27): keywords, the same call
        factor = f"torch.pow(variance + {eps_ref}, exponent=-0.5)"
    elif scale == "pow_all_kw":
        factor = f"torch.pow(input=variance + {eps_ref}, exponent=-0.5)"
    else:
        factor = f"(1.0 / torch.sqrt(variance + {eps_ref}))"
    inplace = not safe and draw(st.integers(0, 3)) == 0
    if inplace:
        # For a float32 input `.to(torch.float32)` / `.float()` return the input itself, so
        # this writes the caller's tensor: a fused norm must do the same.
        part.hazards.append("inplace_normalise")
        body.append(f"{x} *= {factor}")
    else:
        body.append(f"{x} = {x} * {factor}")
    body += part.add(draw_statements(draw, x, Slot(), [], safe, min(busy, 1)))
    if output == "llama":
        result = f"self.weight * {x}.to(input_dtype)"
    elif output == "cast_after":
        result = f"(self.weight * {x}).to(input_dtype)"
    elif output == "gemma":
        result = f"({x} * (1.0 + self.weight.float())).to(input_dtype)"
    else:
        result = f"{x}.to(input_dtype)"
    if near_miss == "bias":
        result = f"{result} + self.bias"
    body.append(f"return {result}")
    part.lines = [
        f"class {name}(nn.Module):",
        *method("__init__", "self", init),
        "",
        *method("forward", f"self, {x}", body),
    ]
    if not safe and draw(st.integers(0, 5)) == 0:
        part.snippets.append("hooks")
        part.hooks.append("{m}.register_forward_hook(halve_output_hook)")
        part.hazards.append("hook:norm")
    part.inputs = [
        f"args.append(torch.randn({draw(_ints([2, 1]))}, {draw(_ints([3, 1]))}, {hidden}, generator=generator) * 2.0)"
    ]
    return part


# -- mixture of experts ---------------------------------------------------------------------------


SHARED_FORMS: dict[str, tuple[str, ...]] = {
    "gated": (
        "shared = self.shared_expert({h})",
        "{f} = {f} + torch.sigmoid(self.shared_expert_gate({h})) * shared",
    ),
    "gated_swapped": (
        "shared = self.shared_expert({h})",
        "{f} = {f} + shared * F.sigmoid(self.shared_expert_gate({h}))",
    ),
    "plain_first": ("{f} = self.shared_expert({h}) + {f}",),
    "in_place": (
        "shared = self.shared_expert({h})",
        "{f} += torch.sigmoid(self.shared_expert_gate({h})) * shared",
    ),
}
"""How a Transformers 4 block may add its shared expert: all compute `routed + shared term`,
which the MoE fuser keeps (`{h}` the flattened input, `{f}` the routed buffer)."""

SHARED_FORMS_ALL: dict[str, tuple[str, ...]] = {
    **SHARED_FORMS,
    "scaled": ("{f} = {f} + 0.5 * self.shared_expert({h})",),
    "subtracted": ("{f} = {f} - self.shared_expert({h})",),
    "tanh_gate": (
        "{f} = {f} + torch.tanh(self.shared_expert_gate({h})) * self.shared_expert({h})",
    ),
    "other_input": ("{f} = {f} + self.shared_expert({h} * 2)",),
    "of_routed": ("{f} = {f} + self.shared_expert({f})",),
    "gate_of_routed": (
        "{f} = {f} + torch.sigmoid(self.shared_expert_gate({f})) * self.shared_expert({h})",
    ),
}
"""`SHARED_FORMS` plus hazards: terms that are not `[sigmoid(gate(x)) *] shared(x)` of the
block input. A fuser that kept them as a shared expert would change the function."""


def moe_part(draw: Draw, safe: bool, name: str = "GeneratedMoE", hidden: int | None = None) -> Part:
    """A sparse MoE block: a router and top-k experts, either a ModuleList of gated MLPs
    (Mixtral / Qwen2-MoE) with an optional shared expert, or 3-D expert weights (the
    Transformers 5 `*Experts` layout)."""
    hidden = hidden if hidden is not None else draw(_ints([8, 12]))
    experts = draw(_ints([3, 2, 4]))
    top_k = draw(_ints([2, 1]))
    inter = draw(_ints([8, 16]))
    act = draw(st.sampled_from(["silu", "gelu"]))
    norm_topk = draw(st.booleans())
    layout = draw(st.sampled_from(["module_list", "packed"]))
    returns_logits = draw(weighted([(False, 3), (True, 1)]))
    part = Part(name, [])
    busy = draw(weighted([(0, 2), (1, 2), (2, 1)]))  # statements a slot may take
    part.features += [f"layout:{layout}", f"experts:{experts}", f"top_k:{top_k}"]
    x = "hidden_states"
    pre = part.add(draw_statements(draw, x, Slot(), [], safe, min(busy, 1)))
    hazard_kinds = draw(st.sampled_from(["input", "hook", "both"])) if not safe else ""
    if hazard_kinds in ("input", "both"):
        label, _, lines, snippets = draw(st.sampled_from(INPUT_HAZARDS))
        pre += part.add([Stmt(label, True, tuple(line.format(x=x) for line in lines), snippets)])
    routing = [
        "routing_weights = F.softmax(router_logits, dim=-1, dtype=torch.float)",
        "routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)",
    ]
    if norm_topk:
        routing.append("routing_weights /= routing_weights.sum(dim=-1, keepdim=True)")
    routing.append("routing_weights = routing_weights.to(hidden_states.dtype)")
    if layout == "module_list":
        expert = Part(
            f"{name}Expert",
            [
                f"class {name}Expert(nn.Module):",
                *method(
                    "__init__",
                    "self",
                    [
                        "super().__init__()",
                        f"self.gate_proj = nn.Linear({hidden}, {inter}, bias=False)",
                        f"self.up_proj = nn.Linear({hidden}, {inter}, bias=False)",
                        f"self.down_proj = nn.Linear({inter}, {hidden}, bias=False)",
                        f"self.act_fn = ACT2FN[{act!r}]",
                    ],
                ),
                "",
                *method(
                    "forward",
                    "self, x",
                    ["return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"],
                ),
            ],
        )
        part.children.append(expert)
        shared = draw(st.booleans())
        init = [
            "super().__init__()",
            f"self.num_experts = {experts}",
            f"self.top_k = {top_k}",
            f"self.gate = nn.Linear({hidden}, {experts}, bias=False)",
            f"self.experts = nn.ModuleList([{name}Expert() for _ in range({experts})])",
        ]
        form = ""
        if shared:
            form = draw(st.sampled_from(sorted(SHARED_FORMS if safe else SHARED_FORMS_ALL)))
            part.features += ["shared_expert", f"shared:{form}"]
            init.append(f"self.shared_expert = {name}Expert()")
            # An unused gate would be refused as unaccounted state: create it where it is read
            # (and, in hazardous modules, sometimes where it is not).
            if any("shared_expert_gate" in line for line in SHARED_FORMS_ALL[form]) or (
                not safe and draw(st.booleans())
            ):
                init.append(f"self.shared_expert_gate = nn.Linear({hidden}, 1, bias=False)")
        body = [
            *pre,
            "batch_size, sequence_length, hidden_dim = hidden_states.shape",
            "hidden_states = hidden_states.view(-1, hidden_dim)",
            "router_logits = self.gate(hidden_states)",
            *routing,
            "final_hidden_states = torch.zeros_like(hidden_states)",
            "for expert_idx in range(self.num_experts):",
            "    top_x, idx = torch.where(selected_experts == expert_idx)",
            "    current_state = hidden_states[top_x]",
            "    current = self.experts[expert_idx](current_state) * routing_weights[top_x, idx, None]",
            "    final_hidden_states.index_add_(0, top_x, current.to(hidden_states.dtype))",
        ]
        if shared:
            body += [
                line.format(h="hidden_states", f="final_hidden_states")
                for line in SHARED_FORMS_ALL[form]
            ]
        body.append(
            "final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)"
        )
    else:
        # The Transformers 5 layout: a router child and a packed experts-interface child.
        router_body = [
            f"hidden_states = hidden_states.reshape(-1, {hidden})",
            "router_logits = F.linear(hidden_states, self.weight)",
            "router_probs = F.softmax(router_logits, dtype=torch.float, dim=-1)",
            "top_value, top_index = torch.topk(router_probs, self.top_k, dim=-1)",
        ]
        if norm_topk:
            router_body.append("top_value /= top_value.sum(dim=-1, keepdim=True)")
        router_body += [
            "top_value = top_value.to(router_logits.dtype)",
            "return router_logits, top_value, top_index",
        ]
        router = Part(
            f"{name}Router",
            [
                f"class {name}Router(nn.Module):",
                *method(
                    "__init__",
                    "self",
                    [
                        "super().__init__()",
                        f"self.top_k = {top_k}",
                        f"self.weight = nn.Parameter(torch.randn({experts}, {hidden}))",
                    ],
                ),
                "",
                *method("forward", "self, hidden_states", router_body),
            ],
        )
        experts_body = [
            "final_hidden_states = torch.zeros_like(hidden_states)",
            "expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)",
            "for expert_idx in range(self.num_experts):",
            "    top_k_pos, token_idx = torch.where(expert_mask[expert_idx])",
            "    current_state = hidden_states[token_idx]",
            "    gate, up = F.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)",
            "    current = F.linear(self.act_fn(gate) * up, self.down_proj[expert_idx])",
            "    current = current * top_k_weights[token_idx, top_k_pos, None]",
            "    final_hidden_states.index_add_(0, token_idx, current.to(final_hidden_states.dtype))",
            "return final_hidden_states",
        ]
        packed = Part(
            f"{name}Experts",
            [
                "@use_experts_implementation",
                f"class {name}Experts(nn.Module):",
                *method(
                    "__init__",
                    "self, config",
                    [
                        "super().__init__()",
                        f"self.num_experts = {experts}",
                        f"self.gate_up_proj = nn.Parameter(torch.randn({experts}, {2 * inter}, {hidden}) * 0.2)",
                        f"self.down_proj = nn.Parameter(torch.randn({experts}, {hidden}, {inter}) * 0.2)",
                        f"self.act_fn = ACT2FN[{act!r}]",
                    ],
                ),
                "",
                *method("forward", "self, hidden_states, top_k_index, top_k_weights", experts_body),
            ],
        )
        part.children += [router, packed]
        init = [
            "super().__init__()",
            f"self.gate = {name}Router()",
            f"self.experts = {name}Experts(types.SimpleNamespace(_experts_implementation='eager'))",
        ]
        body = [
            *pre,
            "batch_size, sequence_length, hidden_dim = hidden_states.shape",
            "hidden_states_reshaped = hidden_states.view(-1, hidden_dim)",
            "router_logits, routing_weights, selected_experts = self.gate(hidden_states_reshaped)",
            "final_hidden_states = self.experts(hidden_states_reshaped, selected_experts, routing_weights)",
            "final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)",
        ]
    if returns_logits:
        part.features.append("returns_router_logits")
        body.append("return final_hidden_states, router_logits")
    else:
        body.append("return final_hidden_states")
    part.lines = [
        f"class {name}(nn.Module):",
        *method("__init__", "self", init),
        "",
        *method("forward", f"self, {x}", body),
    ]
    if hazard_kinds in ("hook", "both"):
        target = draw(
            st.sampled_from(
                ["gate", "experts[0]", "experts[0].gate_proj"]
                if layout == "module_list"
                else ["experts"]  # the packed router returns a tuple
            )
        )
        part.snippets.append("hooks")
        part.hooks.append(f"{{m}}.{target}.register_forward_hook(halve_output_hook)")
        part.hazards.append(f"hook:{target}")
    part.returns_tuple = returns_logits
    part.inputs = [
        f"args.append(torch.randn({draw(_ints([2, 1]))}, {draw(_ints([3, 1]))}, {hidden}, generator=generator))"
    ]
    return part


# -- decoder layer ----------------------------------------------------------------------------------


def decoder_layer_part(draw: Draw, safe: bool) -> Part:
    """A pre-norm decoder layer nesting a generated attention block, two RMSNorms and a
    gated MLP: fusion must find and replace the children inside a parent."""
    hidden = draw(_ints([16, 8]))
    attention = attention_part(draw, safe, "LayerAttention", hidden=hidden)
    mlp = glu_part(draw, safe, "LayerMLP", hidden=hidden)
    norm = rmsnorm_part(draw, safe, "LayerRMSNorm", hidden=hidden)
    cache = attention.cache_argument
    first = "attn_out[0]" if attention.returns_tuple else "attn_out"
    cache_kw = f", {cache}={cache}" if cache else ""
    body = [
        "residual = hidden_states",
        "hidden_states = self.input_layernorm(hidden_states)",
        f"attn_out = self.self_attn(hidden_states, attention_mask=attention_mask{cache_kw})",
        f"hidden_states = residual + {first}",
        "residual = hidden_states",
        "hidden_states = self.post_attention_layernorm(hidden_states)",
        "hidden_states = self.mlp(hidden_states)",
        "return residual + hidden_states",
    ]
    init = [
        "super().__init__()",
        "self.self_attn = LayerAttention()",
        "self.mlp = LayerMLP()",
        "self.input_layernorm = LayerRMSNorm()",
        "self.post_attention_layernorm = LayerRMSNorm()",
    ]
    params = "self, hidden_states, attention_mask=None" + (f", {cache}=None" if cache else "")
    layer = Part(
        "GeneratedDecoderLayer",
        [
            "class GeneratedDecoderLayer(nn.Module):",
            *method("__init__", "self", init),
            "",
            *method("forward", params, body),
        ],
        children=[attention, mlp, norm],
    )
    # Hooks of children address them through the layer; inputs are the attention's.
    layer.hooks = [
        *(hook.replace("{m}", "{m}.self_attn") for hook in attention.hooks),
        *(hook.replace("{m}", "{m}.mlp") for hook in mlp.hooks),
        *(hook.replace("{m}", "{m}.input_layernorm") for hook in norm.hooks),
    ]
    layer.tweaks = [
        *(tweak.replace("{m}", "{m}.self_attn") for tweak in attention.tweaks),
        *(tweak.replace("{m}", "{m}.mlp") for tweak in mlp.tweaks),
        *(tweak.replace("{m}", "{m}.post_attention_layernorm") for tweak in norm.tweaks),
    ]
    attention.hooks, mlp.hooks, norm.hooks = [], [], []
    attention.tweaks, mlp.tweaks, norm.tweaks = [], [], []
    layer.inputs = attention.inputs
    return layer


# -- public strategies ----------------------------------------------------------------------------


def wrap(draw: Draw, part: Part) -> Part:
    """`part` as the `block` child of a `GeneratedModel`, as every Transformers module is a
    child of a model: fusers that replace a whole module (RMSNorm, MoE) cannot replace the
    root, and hooks address the child through its parent.

    Sometimes the model holds a second instance, `block2` (run on the positional inputs
    only), which takes the per-instance tweaks and some of the hooks: fusion matches once
    per class, so what one instance's trace shows must not be taken for the other's.
    """
    twin = draw(st.booleans())
    init = ["super().__init__()", f"self.block = {part.class_name}()"]
    body = ["return self.block(*args, **kwargs)"]
    if twin:
        init.append(f"self.block2 = {part.class_name}()")
        body = ["return self.block(*args, **kwargs), self.block2(*args)"]
    model = Part(
        "GeneratedModel",
        [
            "class GeneratedModel(nn.Module):",
            *method("__init__", "self", init),
            "",
            *method("forward", "self, *args, **kwargs", body),
        ],
        children=[part],
        features=["twin_instances"] if twin else [],
    )
    targets = ["module.block", "module.block2"] if twin else ["module.block"]
    model.hooks = [hook.replace("{m}", draw(st.sampled_from(targets))) for hook in part.hooks]
    model.hooks += [tweak.replace("{m}", targets[-1]) for tweak in part.tweaks]
    part.hooks, part.tweaks = [], []
    return model


@st.composite
def generated_modules(draw: Draw, shape: str, safe: bool | None = None) -> GeneratedModule:
    """A generated module of `shape` (one of SHAPES). `safe=None` draws safe and hazardous
    modules about half and half; True/False forces one kind."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")
    is_safe = draw(st.booleans()) if safe is None else safe
    if shape == "attention":
        part = attention_part(draw, is_safe)
    elif shape == "glu_mlp":
        part = glu_part(draw, is_safe)
    elif shape == "rmsnorm":
        part = rmsnorm_part(draw, is_safe)
    elif shape == "moe":
        part = moe_part(draw, is_safe)
    else:
        part = decoder_layer_part(draw, is_safe)
    model = wrap(draw, part)
    return assemble(shape, model, "GeneratedModel()", part.inputs)


def any_generated_module() -> st.SearchStrategy[GeneratedModule]:
    """A generated module of any shape."""
    return st.sampled_from(SHAPES).flatmap(generated_modules)
