"""The attention shape: q/k/v/o projections with the variations a fuser must get right.

`attention_part` draws in a fixed order (the fuzz-ci profile is derandomized: the same examples
must be drawn run after run), through helpers that each draw one part of it in turn: the sizes
and per-projection choices, the forward's choices, the projection calls with the statements
between them, and the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import strategies as st

from tests.fuzz.grammar import (
    HAS_GET_INTERFACE,
    REGIONS,
    SHADOW_METHOD,
    Draw,
    Part,
    Slot,
    draw_region,
    draw_statements,
    in_region,
    ints,
    linear_kind,
    method,
    projection_hooks,
    weighted,
)

# -- attention ------------------------------------------------------------------------------------

NAMES = {"q": "query_states", "k": "key_states", "v": "value_states"}
"""The local each projection's output is bound to."""

CALL_ARGS = (
    "self, query_states, key_states, value_states, attention_mask, scaling=self.scaling, "
    "dropout=0.0, **kwargs"
)
"""The arguments of an attention-interface call."""


@dataclass
class Attention:
    """What `attention_part` drew for one attention block, in the order drawn."""

    head_dim: int
    kv_heads: int
    groups: int
    hidden: int
    batch: int
    seq: int
    busy: int
    x: str
    biases: dict[str, bool]
    kinds: dict[str, str]
    norm: str | None
    norm_flat: bool
    clip: str | None
    prescale: str | None
    rotary: str | None
    order: list[str] = field(default_factory=list)
    styles: dict[str, str] = field(default_factory=dict)
    guards: dict[str, str] = field(default_factory=dict)
    interface: str = ""
    cache: str | None = None
    cache_kind: str | None = None
    dropout: bool = False
    returns_tuple: bool = False
    regions: dict[str, str | None] = field(default_factory=dict)
    shadow: bool = False

    @property
    def heads(self) -> int:
        return self.kv_heads * self.groups

    @property
    def widths(self) -> dict[str, int]:
        return {
            "q": self.heads * self.head_dim,
            "k": self.kv_heads * self.head_dim,
            "v": self.kv_heads * self.head_dim,
        }

    def shaped(self, p: str, value: str) -> str:
        """`value` (projection `p`'s output) viewed per head, through its q/k norm if any."""
        if self.norm and p in ("q", "k") and self.norm_flat:
            return f"self.{p}_norm({value}).view(hidden_shape).transpose(1, 2)"
        if self.norm and p in ("q", "k"):
            return f"self.{p}_norm({value}.view(hidden_shape)).transpose(1, 2)"
        return f"{value}.view(hidden_shape).transpose(1, 2)"


def _draw_attention(draw: Draw, part: Part, safe: bool, hidden: int | None) -> Attention:
    """The sizes, the projections' classes and biases, the q/k norm and the in-place forms."""
    head_dim = draw(ints([4, 2, 8]))
    kv_heads = draw(ints([1, 2]))
    groups = draw(ints([1, 2, 3]))
    hidden = hidden if hidden is not None else draw(ints([16, 8, 12]))
    batch, seq = draw(ints([2, 1])), draw(ints([3, 1, 4]))
    busy = draw(weighted([(0, 2), (1, 2), (2, 1)]))  # statements a slot may take
    x = draw(st.sampled_from(["hidden_states", "hidden_states", "x"]))
    biases = {p: draw(st.booleans()) for p in ("q", "k", "v", "o")}
    kinds = {p: linear_kind(draw, part, f"{p}_proj", safe) for p in ("q", "k", "v")}
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
    rotary = draw(
        weighted(
            [(None, 5), ("functional", 2), ("in_place", 1), ("inline_setitem", 1), ("module", 1)]
        )
    )
    if rotary:
        part.snippets.append("rotary")
        part.features.append(f"rotary:{rotary}")
    a = Attention(
        head_dim, kv_heads, groups, hidden, batch, seq, busy, x, biases, kinds, norm, norm_flat,
        clip, prescale, rotary,
    )  # fmt: skip
    _draw_forward_choices(draw, a, part, safe)
    return a


def _draw_forward_choices(draw: Draw, a: Attention, part: Part, safe: bool) -> None:
    """The projections' order, styles, guards and regions, the attention call, the cache,
    dropout, the return value and method shadowing, into `a`."""
    a.order = order = draw(st.permutations(["q", "k", "v"]))
    if order != ["q", "k", "v"]:
        part.features.append("order:" + "".join(order))
    a.styles = {p: draw(st.sampled_from(["chained", "separate"])) for p in order}
    guard_weights = [
        ("none", 14),
        ("ternary", 1),
        ("if_none", 1),
        ("truthy", 1),
        ("flag_on", 1),
        ("flag_off", 1),
    ]
    a.guards = {p: draw(weighted(guard_weights)) for p in order}
    interfaces = [("interface_v4", 4), ("direct", 5), ("local", 4), ("inline_sdpa", 3)]
    if HAS_GET_INTERFACE:
        interfaces.append(("interface", 8))
    a.interface = draw(weighted(interfaces))
    part.features.append(f"attention:{a.interface}")
    a.cache = draw(weighted([(None, 5), ("past_key_values", 2), ("cache", 2), ("layer_past", 1)]))
    a.cache_kind = draw(st.sampled_from(["SimpleCache", "StaticCache"])) if a.cache else None
    a.dropout = draw(st.booleans())
    a.returns_tuple = draw(st.booleans())
    a.regions = regions = {
        p: (draw_region(draw, safe) if a.guards[p] == "none" else None) for p in order
    }
    if len(set(regions.values())) > 1:
        for p, region in regions.items():
            if region is not None:
                changes = REGIONS[region][0]
                (part.hazards if changes else part.features).append(f"region:{p}:{region}")
    elif regions[order[0]] is not None:
        part.features.append(f"region:all:{regions[order[0]]}")
    a.shadow = not safe and draw(st.integers(0, 9)) == 0


def _attention_init(a: Attention, part: Part) -> list[str]:
    """The body of `__init__` (what the forward's branches and tweaks need included)."""
    init = [
        "super().__init__()",
        f"self.head_dim = {a.head_dim}",
        f"self.num_heads = {a.heads}",
        f"self.num_key_value_heads = {a.kv_heads}",
        f"self.num_key_value_groups = {a.groups}",
        f"self.scaling = {a.head_dim} ** -0.5",
        "self.layer_idx = 0",
        "self.config = types.SimpleNamespace(_attn_implementation='eager')",
    ]
    widths = a.widths
    for p in ("q", "k", "v"):
        init.append(f"self.{p}_proj = {a.kinds[p]}({a.hidden}, {widths[p]}, bias={a.biases[p]})")
    init.append(
        f"self.o_proj = nn.Linear({a.heads * a.head_dim}, {a.hidden}, bias={a.biases['o']})"
    )
    if a.norm:
        q_dim, k_dim = (widths["q"], widths["k"]) if a.norm_flat else (a.head_dim, a.head_dim)
        init += [
            f"self.q_norm = {a.norm}({q_dim}, eps=1e-6)",
            f"self.k_norm = {a.norm}({k_dim}, eps=1e-6)",
        ]
    if a.clip == "config":
        init.append("self.clip_qkv = None")
        part.tweaks.append("{m}.clip_qkv = 0.5")
    if a.dropout:
        init.append("self.resid_dropout = nn.Dropout(0.0)")
        part.features.append("dropout")
    for p in a.order:
        if a.guards[p].startswith("flag"):
            init.append(f"self.use_{p} = {a.guards[p] == 'flag_on'}")
            part.tweaks.append(f"{{m}}.use_{p} = {a.guards[p] != 'flag_on'}")
    return init


def _projection_call(a: Attention, part: Part, p: str) -> list[str]:
    """The lines binding projection `p`'s output under its guard (and region)."""
    x, n, widths = a.x, NAMES[p], a.widths
    call = f"self.{p}_proj({x})"
    expr = a.shaped(p, call) if a.styles[p] == "chained" else call
    alt = f"{x}.new_zeros((*input_shape, {widths[p]}))"
    alt = a.shaped(p, alt) if a.styles[p] == "chained" else alt
    guard = a.guards[p]
    if guard != "none":
        part.features.append(f"guard:{p}:{guard}")
    if guard == "none":
        return in_region(a.regions[p], [f"{n} = {expr}"], n)
    if guard == "ternary":
        return [f"{n} = {expr} if self.{p}_proj is not None else None"]
    if guard in ("if_none", "truthy"):
        test = f"self.{p}_proj is not None" if guard == "if_none" else f"self.{p}_proj"
        return [f"if {test}:", f"    {n} = {expr}", "else:", f"    {n} = None"]
    return [f"if self.use_{p}:", f"    {n} = {expr}", "else:", f"    {n} = {alt}"]


def _attention_projections(
    draw: Draw, a: Attention, part: Part, safe: bool, init: list[str]
) -> list[str]:
    """The forward up to the per-head states: the projection calls in their order with the
    statements drawn between them, an optional flattening branch, the per-head views."""
    x, busy = a.x, a.busy
    body = [
        "input_shape = " + x + ".shape[:-1]",
        "hidden_shape = (*input_shape, -1, self.head_dim)",
    ]
    projections = [f"{p}_proj" for p in ("q", "k", "v")]
    slot = Slot()
    body += part.add(draw_statements(draw, x, slot, projections, safe, busy))
    for p in a.order:
        body += _projection_call(a, part, p)
        slot.outputs.append((NAMES[p], a.styles[p] == "separate"))
        if a.shadow and p == a.order[0]:
            body.append(f"_z_shadow = self.shadowed({x})")
        body += part.add(draw_statements(draw, x, slot, projections, safe, busy))
    # A layout-sensitive use of the raw value output on a branch the trace need not take
    # (issue 43): a flag the second instance sets, or no mask where the trace passed one.
    # On v, which little else writes (a written piece is a copy of its own anyway).
    flat = draw(weighted([(None, 6), ("flag", 1), ("mask", 1)]))
    if flat and a.styles["v"] == "separate":
        test = "self.flatten_v" if flat == "flag" else "attention_mask is None"
        if flat == "flag":
            init.append("self.flatten_v = False")
            part.tweaks.append("{m}.flatten_v = True")
        body += [f"if {test}:", "    value_states = value_states.view(-1).view(value_states.shape)"]
        part.features.append(f"flat_branch:{flat}")
    for p in a.order:
        if a.styles[p] == "separate":
            body.append(f"{NAMES[p]} = {a.shaped(p, NAMES[p])}")
    slot.outputs = [(n, False) for n, _ in slot.outputs]
    body += part.add(draw_statements(draw, x, slot, projections, safe, min(busy, 1)))
    return body


def _attention_in_place_forms(a: Attention, part: Part) -> list[str]:
    """The clip, rotary, prescale and KV-cache lines on the per-head states."""
    body: list[str] = []
    clip_lines = [f"{NAMES[p]}.clamp_(min=-0.5, max=0.5)" for p in ("q", "k", "v")]
    if a.clip == "always":
        body += clip_lines
    elif a.clip == "config":
        clip_lines = [f"{n}.clamp_(min=-self.clip_qkv, max=self.clip_qkv)" for n in NAMES.values()]
        body += ["if self.clip_qkv is not None:", *(f"    {line}" for line in clip_lines)]
    if a.rotary:
        body.append("cos, sin = rotary_tables(query_states)")
    if a.rotary == "functional":
        body.append(
            "query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)"
        )
    elif a.rotary == "module":
        body.append(
            "query_states, key_states = apply_rotary_kernel(query_states, key_states, cos, sin)"
        )
    elif a.rotary == "in_place":
        body.append("apply_rotary_in_place(query_states, key_states, cos, sin)")
    elif a.rotary == "inline_setitem":
        body += [
            "_z_rot = query_states.shape[-1] // 2",
            "query_states[..., :_z_rot] = query_states[..., :_z_rot] * cos[..., :_z_rot]",
            "key_states[..., :_z_rot].copy_(key_states[..., :_z_rot] * sin[..., :_z_rot])",
        ]
    if a.prescale == "augassign":
        body.append("query_states *= self.scaling")
    elif a.prescale == "mul_":
        body.append("query_states.mul_(self.scaling)")
    elif a.prescale == "rebind":
        body.append("query_states = query_states * self.scaling")
    if a.cache:
        part.snippets.append(a.cache_kind)
        part.features.append(f"cache:{a.cache}:{a.cache_kind}")
        body += [
            f"if {a.cache} is not None:",
            f"    key_states, value_states = {a.cache}.update(key_states, value_states, self.layer_idx)",
        ]
    return body


def _attention_call(a: Attention, part: Part) -> list[str]:
    """The attention itself: inline SDPA or one of the attention-interface spellings."""
    if a.interface == "inline_sdpa":
        part.snippets.append("repeat_kv")
        return [
            "key_states = repeat_kv(key_states, self.num_key_value_groups)",
            "value_states = repeat_kv(value_states, self.num_key_value_groups)",
            "attn_output = F.scaled_dot_product_attention(query_states, key_states, value_states, attn_mask=attention_mask, scale=self.scaling)",
            "attn_output = attn_output.transpose(1, 2).contiguous()",
            "attn_weights = None",
        ]
    part.snippets.append("eager_attention_forward")
    if a.interface == "interface":
        return [
            "attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface("
            "self.config._attn_implementation, eager_attention_forward)",
            f"attn_output, attn_weights = attention_interface({CALL_ARGS})",
        ]
    if a.interface == "interface_v4":  # the Transformers 4 spelling
        return [
            "attention_interface = eager_attention_forward",
            "if self.config._attn_implementation != 'eager':",
            "    attention_interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]",
            f"attn_output, attn_weights = attention_interface({CALL_ARGS})",
        ]
    if a.interface == "local":
        return [
            "attention_interface = eager_attention_forward",
            f"attn_output, attn_weights = attention_interface({CALL_ARGS})",
        ]
    return [f"attn_output, attn_weights = eager_attention_forward({CALL_ARGS})"]


def _attention_inputs(draw: Draw, a: Attention, part: Part) -> list[str]:
    """make_inputs()'s statements: the hidden states, and a KV cache or a causal mask."""
    b, s = a.batch, a.seq
    inputs = [f"args.append(torch.randn({b}, {s}, {a.hidden}, generator=generator))"]
    if a.cache:
        past = draw(ints([2, 0]))
        shape = f"{b}, {a.kv_heads}, {{}}, {a.head_dim}"
        if a.cache_kind == "SimpleCache":
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
        inputs.append(f"kwargs[{a.cache!r}] = {make}")
    elif draw(st.booleans()):
        part.features.append("causal_mask")
        inputs.append(
            f"kwargs['attention_mask'] = torch.triu(torch.full(({s}, {s}), -1e9), 1)[None, None]"
            f".expand({b}, 1, {s}, {s})"
        )
    return inputs


def attention_part(
    draw: Draw, safe: bool, name: str = "GeneratedAttention", hidden: int | None = None
) -> Part:
    """An attention block: q/k/v/o projections, optional q/k norms, guards and branches, an
    optional KV-cache update, and an attention-interface call."""
    part = Part(name, [])
    a = _draw_attention(draw, part, safe, hidden)
    init = _attention_init(a, part)
    body = _attention_projections(draw, a, part, safe, init)
    body += _attention_in_place_forms(a, part)
    body += _attention_call(a, part)
    body += [
        "attn_output = attn_output.reshape(*input_shape, -1).contiguous()",
        "attn_output = self.o_proj(attn_output)",
    ]
    if a.dropout:
        body.append("attn_output = self.resid_dropout(attn_output)")
    body.append("return attn_output, attn_weights" if a.returns_tuple else "return attn_output")
    params = (
        f"self, {a.x}, attention_mask=None"
        + (f", {a.cache}=None" if a.cache else "")
        + ", **kwargs"
    )
    if a.shadow:
        init.append('self._modules["shadowed"] = nn.Identity()')
        part.hazards.append("shadowed_method")
    part.lines = [
        f"class {name}(nn.Module):",
        *method("__init__", "self", init),
        "",
        *method("forward", params, body),
        *(["", *SHADOW_METHOD] if a.shadow else []),
    ]
    projection_hooks(draw, part, [f"{p}_proj" for p in ("q", "k", "v")], safe)
    part.cache_argument = a.cache
    part.returns_tuple = a.returns_tuple
    part.inputs = _attention_inputs(draw, a, part)
    return part
