"""The gated-MLP shape: act(gate(x)) * up(x) in its spellings, with the activations drawn."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from tests.fuzz.grammar import (
    Draw,
    Part,
    Slot,
    draw_statements,
    ints,
    linear_kind,
    method,
    projection_hooks,
    weighted,
)

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


@dataclass(frozen=True)
class Mlp:
    """What `glu_part` drew for one gated MLP, in the order drawn."""

    hidden: int
    inter: int
    busy: int
    x: str
    form: str
    act: str
    swapped: bool
    down: bool
    dropout: bool
    biases: dict[str, bool]

    def product(self, gate: str, up: str, act_call: str = "self.act_fn") -> str:
        """`act(gate) * up`, its operands in the drawn order."""
        left, right = f"{act_call}({gate})", up
        return f"{right} * {left}" if self.swapped else f"{left} * {right}"


def _draw_mlp(draw: Draw, part: Part, hidden: int | None) -> Mlp:
    """The widths, the spelling, the activation, operand order, down projection and biases."""
    hidden_given = hidden is not None
    hidden = hidden if hidden is not None else draw(ints([16, 8, 12]))
    inter = draw(ints([24, 8, 16]))
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
    return Mlp(hidden, inter, busy, x, form, act, swapped, down, dropout, biases)


def _mlp_init(draw: Draw, m: Mlp, part: Part, safe: bool) -> tuple[list[str], list[str]]:
    """The body of `__init__` (drawing the projections' classes) and the projections' names."""
    init = [
        "super().__init__()",
        f"self.hidden_size = {m.hidden}",
        f"self.intermediate_size = {m.inter}",
    ]
    if m.form == "already_fused":
        init.append(
            f"self.gate_up_proj = nn.Linear({m.hidden}, {2 * m.inter}, bias={m.biases['gate']})"
        )
        projections = ["gate_up_proj"]
    else:
        for p in ("gate", "up"):
            kind = linear_kind(draw, part, f"{p}_proj", safe)
            init.append(f"self.{p}_proj = {kind}({m.hidden}, {m.inter}, bias={m.biases[p]})")
        projections = ["gate_proj", "up_proj"]
    if m.down:
        init.append(f"self.down_proj = nn.Linear({m.inter}, {m.hidden}, bias={m.biases['down']})")
    init.append(f"self.act_fn = {m.act}")
    if m.dropout:
        init.append("self.dropout = nn.Dropout(0.0)")
        part.features.append("dropout")
    return init, projections


def _mlp_body(draw: Draw, m: Mlp, part: Part, safe: bool, projections: list[str]) -> list[str]:
    """The forward's body: the gated product in the drawn spelling, statements around it."""
    x, busy = m.x, m.busy
    slot = Slot()
    body = part.add(draw_statements(draw, x, slot, projections, safe, busy))
    if m.form == "expr":
        body.append(f"h = {m.product(f'self.gate_proj({x})', f'self.up_proj({x})')}")
    elif m.form == "functional":
        fn = draw(st.sampled_from(["F.silu", "F.gelu"]))
        body.append(f"h = {m.product(f'self.gate_proj({x})', f'self.up_proj({x})', fn)}")
    elif m.form == "already_fused":
        body += [
            f"gate, up = self.gate_up_proj({x}).chunk(2, dim=-1)",
            f"h = {m.product('gate', 'up')}",
        ]
    else:
        first, second = draw(st.permutations(["gate", "up"]))
        body.append(f"{first} = self.{first}_proj({x})")
        slot.outputs.append((first, True))
        body += part.add(draw_statements(draw, x, slot, projections, safe, busy))
        body.append(f"{second} = self.{second}_proj({x})")
        slot.outputs.append((second, True))
        body += part.add(draw_statements(draw, x, slot, projections, safe, busy))
        body.append(f"h = {m.product('gate', 'up')}")
    body += part.add(draw_statements(draw, x, Slot(), projections, safe, min(busy, 1)))
    if m.down:
        body.append("h = self.down_proj(h)")
    if m.dropout:
        body.append("h = self.dropout(h)")
    body.append("return h")
    return body


def _mlp_inputs(draw: Draw, hidden: int) -> list[str]:
    """make_inputs()'s statement: hidden states of rank 3 or 2."""
    rank = draw(st.sampled_from([3, 2]))
    shape = (
        f"{draw(ints([2, 1]))}, {draw(ints([3, 1]))}, {hidden}"
        if rank == 3
        else f"{draw(ints([5, 1]))}, {hidden}"
    )
    return [f"args.append(torch.randn({shape}, generator=generator))"]


def glu_part(draw: Draw, safe: bool, name: str = "GeneratedMLP", hidden: int | None = None) -> Part:
    """A gated MLP: act(gate(x)) * up(x), optionally through a down projection, in one of
    several spellings (one expression, separate statements, a functional activation)."""
    part = Part(name, [])
    m = _draw_mlp(draw, part, hidden)
    init, projections = _mlp_init(draw, m, part, safe)
    body = _mlp_body(draw, m, part, safe, projections)
    part.lines = [
        f"class {name}(nn.Module):",
        *method("__init__", "self", init),
        "",
        *method("forward", f"self, {m.x}", body),
    ]
    if m.form != "already_fused":
        projection_hooks(draw, part, projections, safe)
        if not safe and draw(st.integers(0, 6)) == 0:
            part.snippets.append("hooks")
            part.hooks.append("{m}.act_fn.register_forward_hook(halve_output_hook)")
            part.hazards.append("hook:act_fn")
    part.inputs = _mlp_inputs(draw, m.hidden)
    return part
