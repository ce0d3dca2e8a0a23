"""Hand-written attention and MLP forwards, each with one hazard for the projection fusers.

They live in a real file so `inspect.getsource` works exactly as it does for Transformers
code. `Attention` / `MLP` are the safe baselines; every subclass changes only `forward`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def eager_attention_forward(module, query, key, value):
    """Stand-in attention interface (the tracer makes any `*attention_forward` a leaf)."""
    scores = query[..., : key.shape[-1]] @ key.transpose(-1, -2)
    weights = torch.softmax(scores, dim=-1)
    return weights @ value, weights


def helper(projection, x):
    return projection(x)


def bump(t):
    t.add_(1.0)


class Attention(nn.Module):
    def __init__(self, hidden: int = 32, q: int = 32, kv: int = 16, bias: bool = False):
        super().__init__()
        self.q_proj = nn.Linear(hidden, q, bias=bias)
        self.k_proj = nn.Linear(hidden, kv, bias=bias)
        self.v_proj = nn.Linear(hidden, kv, bias=bias)
        self.o_proj = nn.Linear(kv, hidden, bias=False)
        self.use_k = True

    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class InplaceMethod(Attention):
    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        hidden_states.mul_(2.0)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class OutKeyword(Attention):
    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        torch.mul(hidden_states, 2.0, out=hidden_states)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class InplaceKeyword(Attention):
    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        r = F.relu(hidden_states, inplace=True)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k + 0 * r[..., :16], v)
        return self.o_proj(out)


class TorchUnderscore(Attention):
    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        torch.relu_(hidden_states)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class ItemAssignment(Attention):
    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        hidden_states[..., 0] = 0.0
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class ViewAlias(Attention):
    def forward(self, hidden_states):
        flat = hidden_states.view(-1)
        q = self.q_proj(hidden_states)
        flat.add_(1.0)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class Rebinding(Attention):
    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        hidden_states = hidden_states * 2.0
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class CalledTwice(Attention):
    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states) + self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class InLoop(Attention):
    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        for _ in range(1):
            k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class InGenerator(Attention):
    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        k = sum(self.k_proj(h) for h in [hidden_states])
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class WeightRead(Attention):
    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states) * self.k_proj.weight.mean()
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class PassedOn(Attention):
    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states)
        v = helper(self.v_proj, hidden_states) + 0 * self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class ComparedEqual(Attention):
    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states) if self.v_proj != None else None  # noqa: E711
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class DifferentInputs(Attention):
    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states * 2.0)
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class DiscardedCall(Attention):
    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        bump(hidden_states)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


# -- forwards that are safe to fuse ---------------------------------------------------------


class Guarded(Attention):
    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states) if self.k_proj is not None else None
        v = self.v_proj(hidden_states) if self.v_proj else None
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class Branchy(Attention):
    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        if self.use_k:
            k = self.k_proj(hidden_states)
        else:
            k = torch.zeros_like(q[..., :16])
        v = self.v_proj(hidden_states).view(-1).view((*hidden_states.shape[:-1], -1))
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class ShapeReads(Attention):
    def forward(self, hidden_states):
        shape = hidden_states.shape[:-1]
        q = self.q_proj(hidden_states).view(*shape, -1)
        n = hidden_states.size(-1)
        k = self.k_proj(hidden_states) * (n / n)
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class LatentAttention(nn.Module):
    """MLA-shaped attention with made-up names: low-rank "a" projections found by dataflow."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Linear(32, 12, bias=False)
        self.alpha_norm = nn.LayerNorm(12)
        self.alpha_up = nn.Linear(12, 32, bias=False)
        self.beta = nn.Linear(32, 24, bias=False)
        self.beta_up = nn.Linear(16, 32, bias=False)
        self.out = nn.Linear(32, 32, bias=False)

    def forward(self, hidden_states):
        q = self.alpha_up(self.alpha_norm(self.alpha(hidden_states)))
        latent = self.beta(hidden_states)
        kv, rope = torch.split(latent, [16, 8], dim=-1)
        kv = self.beta_up(kv)
        out, _ = eager_attention_forward(self, q, kv + rope.sum(-1, keepdim=True), kv)
        return self.out(out)


class LinearWithForward(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2.0


class MLP(nn.Module):
    def __init__(self, hidden: int = 32, inter: int = 48, act: nn.Module | None = None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act_fn = act if act is not None else nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MLPSwapped(MLP):
    def forward(self, x):
        return self.down_proj(self.up_proj(x) * self.act_fn(self.gate_proj(x)))


class MLPNoDown(MLP):
    def forward(self, x):
        return self.act_fn(self.gate_proj(x)) * self.up_proj(x)


class MLPSplitStatements(MLP):
    def forward(self, x):
        gate = self.gate_proj(x)
        up = self.up_proj(x)
        return self.down_proj(self.act_fn(gate) * up)


class MLPInplaceBetween(MLP):
    def forward(self, x):
        gate = self.gate_proj(x)
        x.mul_(2.0)
        up = self.up_proj(x)
        return self.down_proj(self.act_fn(gate) * up)


# -- gated attention: four projections of one input, code between the calls ----------------


class GatedAttention(Attention):
    """q/k/v plus an output gate reading the input, with a norm, views and arithmetic between
    the calls: the sibling fuser merges all four (safe baseline)."""

    def __init__(self) -> None:
        super().__init__()
        self.g_proj = nn.Linear(32, 16, bias=False)
        self.q_norm = nn.LayerNorm(32)

    def forward(self, hidden_states):
        shape = hidden_states.shape[:-1]
        q = self.q_norm(self.q_proj(hidden_states)).view(*shape, -1)
        k = self.k_proj(hidden_states)
        gate = torch.sigmoid(self.g_proj(hidden_states).float())
        v = self.v_proj(hidden_states) * 1.5
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out * gate)


class GatedInplaceBetween(GatedAttention):
    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states)
        hidden_states.mul_(2.0)
        gate = torch.sigmoid(self.g_proj(hidden_states))
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out * gate)


class GatedViewWrite(GatedAttention):
    def forward(self, hidden_states):
        rows = hidden_states.view(-1, hidden_states.shape[-1])
        q = self.q_proj(hidden_states)
        rows[0] = 0.0
        k = self.k_proj(hidden_states)
        gate = torch.sigmoid(self.g_proj(hidden_states))
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out * gate)


class GatedHelperWrite(GatedAttention):
    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states)
        gate = torch.sigmoid(self.g_proj(hidden_states))
        bump(hidden_states)
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out * gate)


class GatedAugmented(GatedAttention):
    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        alias = hidden_states
        alias += 1.0
        k = self.k_proj(hidden_states)
        gate = torch.sigmoid(self.g_proj(hidden_states))
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out * gate)


class GatedWeightEscapes(GatedAttention):
    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states)
        gate = torch.sigmoid(self.g_proj(hidden_states)) * self.g_proj.weight.mean()
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out * gate)


class GatedProjectionPassedOn(GatedAttention):
    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states)
        gate = torch.sigmoid(self.g_proj(hidden_states))
        v = self.v_proj(hidden_states) + 0 * helper(self.g_proj, hidden_states).sum()
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out * gate)


class GatedChildWrites(GatedAttention):
    """A child between the calls writes its input in place (`nn.ReLU(inplace=True)`)."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU(inplace=True)

    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states)
        gate = torch.sigmoid(self.g_proj(self.act(hidden_states)))
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out * gate)


class CrossAttentionPair(Attention):
    """Whisper-style: k/v read `key_value_states` when given, else the input; q always the
    input. Only the k/v pair shares one input expression."""

    def forward(self, hidden_states, key_value_states=None):
        q = self.q_proj(hidden_states) * 0.5
        current = key_value_states if key_value_states is not None else hidden_states
        if key_value_states is None or q.shape[0] > 0:
            k = self.k_proj(current).transpose(-1, -2).contiguous().transpose(-1, -2)
            v = self.v_proj(current).view(*current.shape[:-1], -1)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)
