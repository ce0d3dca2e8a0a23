"""The grammar the fuzzer's generators share: the generated module and its text, the helpers
generated classes may use, interleaved statements (benign and hazards), program assembly, and
the drawing helpers every shape uses (projection classes, hooks, regions, weights).

The shapes themselves are in `tests.fuzz.shape_*`; `tests.fuzz.strategies` composes them into
the public strategies (see its docstring for what a generated module is).
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


        class RotaryKernel(nn.Module):
            """A module called as a global function (Transformers 5.25's kernels hub makes
            `apply_rotary_pos_emb` one): its forward calls the module-level helper."""

            def forward(self, q, k, cos, sin):
                return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


        apply_rotary_kernel = RotaryKernel()


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


def linear_kind(draw: Draw, part: Part, attr: str, safe: bool) -> str:
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


def projection_hooks(draw: Draw, part: Part, attrs: Sequence[str], safe: bool) -> None:
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


def draw_region(draw: Draw, safe: bool) -> str | None:
    """The region (`REGIONS`) one projection call sits in, None mostly; changing ones only
    when not `safe`."""
    options: list[tuple[str | None, int]] = [(None, 14), ("enable_grad", 1), ("null_context", 1)]
    if not safe:
        options += [("no_grad", 2), ("autocast", 1), ("grad_toggle", 1)]
    return draw(weighted(options))


def in_region(region: str | None, lines: Sequence[str], bound: str) -> list[str]:
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


def ints(values: Sequence[int]) -> st.SearchStrategy[int]:
    """One of `values` (the first shrinks best)."""
    return st.sampled_from(list(values))


def weighted(choices: Sequence[tuple[Any, int]]) -> st.SearchStrategy[Any]:
    """One of the values, with the given integer weights (the first shrinks best)."""
    return st.sampled_from([value for value, weight in choices for _ in range(weight)])
