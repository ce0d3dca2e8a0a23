"""A Hypothesis strategy for experts gating functions (`_apply_gate`), safe and hazardous.

Each draw is the source of one `_apply_gate(self, gate_up)`: a split (halves or
interleaved), optionally an upcast, a few elementwise steps on the gate and on the up part
(clamps, scaling, offsets, activations: the shapes of Transformers' SwiGLU variants), a
product, optionally a cast back; and, sometimes, a hazard the program reader must refuse
or reproduce exactly: an in-place op, a random op, a parameter read, a write to the
module's state, a branch on a tensor's value, an op outside the allowed set, a branch on
the row count or on `self.training`, a read of an attribute a user may change after fusing
(`self.limit`, as GPT-OSS's gate reads it).
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

GATE_STEPS = (
    "g = g.clamp(max={c})",
    "g = g.clamp(min=None, max={c})",
    "g = g * {c}",
    "g = g + {c}",
    "g = F.silu(g)",
    "g = F.gelu(g)",
    "g = F.gelu(g, approximate='tanh')",
    "g = torch.tanh(g / {c}) * {c}",
    "g = g * torch.sigmoid(g * {c})",
    "g = g * torch.sigmoid(g)",
)
UP_STEPS = ("u = u.clamp(min=-{c}, max={c})", "u = u + {c}", "u = u * {c}", "u = torch.tanh(u)")
HAZARDS = {
    "in-place": "g = g.mul_(2.0)",
    "random": "g = g * torch.rand_like(g)",
    "dropout": "g = F.dropout(g, 0.1, True)",
    "parameter": "g = g * self.down_proj[0, 0, 0]",
    "state write": "self.seen = g.shape[0]",
    "value branch": "g = g if bool((g > 1e9).any()) else g * 2",
    "other op": "g = F.softplus(g)",
    "constant tensor": "g = g * torch.ones_like(g)",
    # Issue 24, defect 6: a program traced once must not freeze what it branches on or reads.
    "shape branch": "g = g * 2 if g.shape[0] == 1 else g",
    "training branch": "g = g * 2 if self.training else g",
    "attribute read": "g = g.clamp(max=self.limit)",
}
"""Hazard name -> a statement inserted among the gate steps."""


@dataclass(frozen=True)
class GeneratedGate:
    source: str
    hazards: tuple[str, ...]

    def describe(self) -> str:
        return f"hazards={list(self.hazards) or 'none'}"


@st.composite
def generated_gates(draw: st.DrawFn) -> GeneratedGate:
    constants = st.sampled_from((0.5, 1, 1.702, 4.0, 7.0, 10.0))
    lines = ["def _apply_gate(self, gate_up):"]
    if draw(st.booleans()):
        lines.append("    g, u = gate_up.chunk(2, dim=-1)")
    else:
        lines.append("    g, u = gate_up[..., ::2], gate_up[..., 1::2]")
    upcast = draw(st.booleans())
    if upcast:
        lines.append("    dtype = g.dtype")
        lines.append("    g, u = g.float(), u.float()")
    steps = draw(st.lists(st.sampled_from(GATE_STEPS), min_size=1, max_size=4))
    lines += [f"    {s.format(c=draw(constants))}" for s in steps]
    lines += [
        f"    {s.format(c=draw(constants))}"
        for s in draw(st.lists(st.sampled_from(UP_STEPS), max_size=2))
    ]
    hazards = tuple(draw(st.lists(st.sampled_from(sorted(HAZARDS)), max_size=1)))
    for hazard in hazards:
        at = draw(st.integers(2, len(lines)))
        lines.insert(at, f"    {HAZARDS[hazard]}")
    product = "g * u" if draw(st.booleans()) else "u * g"
    lines.append(f"    out = {product}")
    if upcast and draw(st.booleans()):
        lines.append("    out = out.to(dtype)")
    lines.append("    return out")
    return GeneratedGate("\n".join(lines) + "\n", hazards)
