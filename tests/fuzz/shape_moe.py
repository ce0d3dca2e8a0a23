"""The mixture-of-experts shape: a router and top-k experts, a ModuleList or packed experts."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from tests.fuzz.grammar import (
    INPUT_HAZARDS,
    Draw,
    Part,
    Slot,
    Stmt,
    draw_statements,
    ints,
    method,
    weighted,
)

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


@dataclass(frozen=True)
class Moe:
    """What `moe_part` drew for one MoE block, in the order drawn."""

    name: str
    hidden: int
    experts: int
    top_k: int
    inter: int
    act: str
    norm_topk: bool
    layout: str
    returns_logits: bool


def _draw_moe(draw: Draw, name: str, hidden: int | None) -> Moe:
    """The widths, expert count and top-k, the activation, the layout and the return value."""
    hidden = hidden if hidden is not None else draw(ints([8, 12]))
    experts = draw(ints([3, 2, 4]))
    top_k = draw(ints([2, 1]))
    inter = draw(ints([8, 16]))
    act = draw(st.sampled_from(["silu", "gelu"]))
    norm_topk = draw(st.booleans())
    layout = draw(st.sampled_from(["module_list", "packed"]))
    returns_logits = draw(weighted([(False, 3), (True, 1)]))
    return Moe(name, hidden, experts, top_k, inter, act, norm_topk, layout, returns_logits)


def _moe_prelude(draw: Draw, m: Moe, part: Part, safe: bool, x: str) -> tuple[list[str], str]:
    """The statements before the block's own code (an input hazard among them sometimes),
    and the hazard kinds drawn for the block ("input", "hook", "both"; "" when safe)."""
    busy = draw(weighted([(0, 2), (1, 2), (2, 1)]))  # statements a slot may take
    part.features += [f"layout:{m.layout}", f"experts:{m.experts}", f"top_k:{m.top_k}"]
    pre = part.add(draw_statements(draw, x, Slot(), [], safe, min(busy, 1)))
    hazard_kinds = draw(st.sampled_from(["input", "hook", "both"])) if not safe else ""
    if hazard_kinds in ("input", "both"):
        label, _, lines, snippets = draw(st.sampled_from(INPUT_HAZARDS))
        pre += part.add([Stmt(label, True, tuple(line.format(x=x) for line in lines), snippets)])
    return pre, hazard_kinds


def _routing(m: Moe) -> list[str]:
    """Softmax, top-k, optional renormalisation and the cast back (Mixtral's routing)."""
    routing = [
        "routing_weights = F.softmax(router_logits, dim=-1, dtype=torch.float)",
        "routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)",
    ]
    if m.norm_topk:
        routing.append("routing_weights /= routing_weights.sum(dim=-1, keepdim=True)")
    routing.append("routing_weights = routing_weights.to(hidden_states.dtype)")
    return routing


def _expert_part(m: Moe) -> Part:
    """One expert of a ModuleList block: a gated MLP."""
    init = [
        "super().__init__()",
        f"self.gate_proj = nn.Linear({m.hidden}, {m.inter}, bias=False)",
        f"self.up_proj = nn.Linear({m.hidden}, {m.inter}, bias=False)",
        f"self.down_proj = nn.Linear({m.inter}, {m.hidden}, bias=False)",
        f"self.act_fn = ACT2FN[{m.act!r}]",
    ]
    forward = ["return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"]
    return Part(
        f"{m.name}Expert",
        [
            f"class {m.name}Expert(nn.Module):",
            *method("__init__", "self", init),
            "",
            *method("forward", "self, x", forward),
        ],
    )


def _module_list_block(
    draw: Draw, m: Moe, part: Part, safe: bool, pre: list[str]
) -> tuple[list[str], list[str]]:
    """`__init__` and forward bodies of a ModuleList block (Mixtral / Qwen2-MoE), with an
    optional shared expert added in one of `SHARED_FORMS` (or, hazardous, `SHARED_FORMS_ALL`)."""
    part.children.append(_expert_part(m))
    shared = draw(st.booleans())
    init = [
        "super().__init__()",
        f"self.num_experts = {m.experts}",
        f"self.top_k = {m.top_k}",
        f"self.gate = nn.Linear({m.hidden}, {m.experts}, bias=False)",
        f"self.experts = nn.ModuleList([{m.name}Expert() for _ in range({m.experts})])",
    ]
    form = ""
    if shared:
        form = draw(st.sampled_from(sorted(SHARED_FORMS if safe else SHARED_FORMS_ALL)))
        part.features += ["shared_expert", f"shared:{form}"]
        init.append(f"self.shared_expert = {m.name}Expert()")
        # An unused gate would be refused as unaccounted state: create it where it is read
        # (and, in hazardous modules, sometimes where it is not).
        if any("shared_expert_gate" in line for line in SHARED_FORMS_ALL[form]) or (
            not safe and draw(st.booleans())
        ):
            init.append(f"self.shared_expert_gate = nn.Linear({m.hidden}, 1, bias=False)")
    body = [
        *pre,
        "batch_size, sequence_length, hidden_dim = hidden_states.shape",
        "hidden_states = hidden_states.view(-1, hidden_dim)",
        "router_logits = self.gate(hidden_states)",
        *_routing(m),
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
    return init, body


def _router_part(m: Moe) -> Part:
    """The Transformers 5 router child: logits, softmax, top-k, optional renormalisation."""
    router_body = [
        f"hidden_states = hidden_states.reshape(-1, {m.hidden})",
        "router_logits = F.linear(hidden_states, self.weight)",
        "router_probs = F.softmax(router_logits, dtype=torch.float, dim=-1)",
        "top_value, top_index = torch.topk(router_probs, self.top_k, dim=-1)",
    ]
    if m.norm_topk:
        router_body.append("top_value /= top_value.sum(dim=-1, keepdim=True)")
    router_body += [
        "top_value = top_value.to(router_logits.dtype)",
        "return router_logits, top_value, top_index",
    ]
    init = [
        "super().__init__()",
        f"self.top_k = {m.top_k}",
        f"self.weight = nn.Parameter(torch.randn({m.experts}, {m.hidden}))",
    ]
    return Part(
        f"{m.name}Router",
        [
            f"class {m.name}Router(nn.Module):",
            *method("__init__", "self", init),
            "",
            *method("forward", "self, hidden_states", router_body),
        ],
    )


def _packed_experts_part(m: Moe) -> Part:
    """The Transformers 5 experts-interface child: 3-D expert weights, gated per expert."""
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
    init = [
        "super().__init__()",
        f"self.num_experts = {m.experts}",
        f"self.gate_up_proj = nn.Parameter(torch.randn({m.experts}, {2 * m.inter}, {m.hidden}) * 0.2)",
        f"self.down_proj = nn.Parameter(torch.randn({m.experts}, {m.hidden}, {m.inter}) * 0.2)",
        f"self.act_fn = ACT2FN[{m.act!r}]",
    ]
    return Part(
        f"{m.name}Experts",
        [
            "@use_experts_implementation",
            f"class {m.name}Experts(nn.Module):",
            *method("__init__", "self, config", init),
            "",
            *method("forward", "self, hidden_states, top_k_index, top_k_weights", experts_body),
        ],
    )


def _packed_block(m: Moe, part: Part, pre: list[str]) -> tuple[list[str], list[str]]:
    """`__init__` and forward bodies of the Transformers 5 layout: a router child and a
    packed experts-interface child."""
    part.children += [_router_part(m), _packed_experts_part(m)]
    init = [
        "super().__init__()",
        f"self.gate = {m.name}Router()",
        f"self.experts = {m.name}Experts(types.SimpleNamespace(_experts_implementation='eager'))",
    ]
    body = [
        *pre,
        "batch_size, sequence_length, hidden_dim = hidden_states.shape",
        "hidden_states_reshaped = hidden_states.view(-1, hidden_dim)",
        "router_logits, routing_weights, selected_experts = self.gate(hidden_states_reshaped)",
        "final_hidden_states = self.experts(hidden_states_reshaped, selected_experts, routing_weights)",
        "final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)",
    ]
    return init, body


def _moe_hook(draw: Draw, m: Moe, part: Part) -> None:
    """A forward hook on the router or an expert (a hazard: a fused block stops firing it)."""
    target = draw(
        st.sampled_from(
            ["gate", "experts[0]", "experts[0].gate_proj"]
            if m.layout == "module_list"
            else ["experts"]  # the packed router returns a tuple
        )
    )
    part.snippets.append("hooks")
    part.hooks.append(f"{{m}}.{target}.register_forward_hook(halve_output_hook)")
    part.hazards.append(f"hook:{target}")


def moe_part(draw: Draw, safe: bool, name: str = "GeneratedMoE", hidden: int | None = None) -> Part:
    """A sparse MoE block: a router and top-k experts, either a ModuleList of gated MLPs
    (Mixtral / Qwen2-MoE) with an optional shared expert, or 3-D expert weights (the
    Transformers 5 `*Experts` layout)."""
    m = _draw_moe(draw, name, hidden)
    part = Part(name, [])
    x = "hidden_states"
    pre, hazard_kinds = _moe_prelude(draw, m, part, safe, x)
    if m.layout == "module_list":
        init, body = _module_list_block(draw, m, part, safe, pre)
    else:
        init, body = _packed_block(m, part, pre)
    if m.returns_logits:
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
        _moe_hook(draw, m, part)
    part.returns_tuple = m.returns_logits
    part.inputs = [
        f"args.append(torch.randn({draw(ints([2, 1]))}, {draw(ints([3, 1]))}, {m.hidden}, generator=generator))"
    ]
    return part
