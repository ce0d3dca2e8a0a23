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

The grammar the shapes share (the generated module, helpers, interleaved statements, program
assembly) is `tests.fuzz.grammar`; each shape is a module of its own (`tests.fuzz.shape_attention`,
`shape_mlp`, `shape_norm`, `shape_moe`); this module nests them in a decoder layer, wraps each in a
model, and holds the strategies the tests import.
"""

from __future__ import annotations

from hypothesis import strategies as st

from tests.fuzz.grammar import SHAPES, Draw, GeneratedModule, Part, assemble, ints, method
from tests.fuzz.shape_attention import attention_part
from tests.fuzz.shape_mlp import glu_part
from tests.fuzz.shape_moe import moe_part
from tests.fuzz.shape_norm import rmsnorm_part

__all__ = [
    "SHAPES",
    "GeneratedModule",
    "any_generated_module",
    "attention_part",
    "decoder_layer_part",
    "generated_modules",
    "glu_part",
    "moe_part",
    "rmsnorm_part",
    "wrap",
]


# -- decoder layer ----------------------------------------------------------------------------------


def decoder_layer_part(draw: Draw, safe: bool) -> Part:
    """A pre-norm decoder layer nesting a generated attention block, two RMSNorms and a
    gated MLP: fusion must find and replace the children inside a parent."""
    hidden = draw(ints([16, 8]))
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
