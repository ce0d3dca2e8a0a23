"""Repro bundles for the rewrites vLLM makes that compute otherwise than the unfused model.

    python -m harness.peers.hazards DIR

The peer comparison (`harness.peers.vllm`) classified 11 disagreements as "unsafe by our
analysis", of two kinds. Each kind is written here as a bundle a vLLM developer can replay
with nothing but torch (and vLLM, when installed, for its own kernel): `DIR/<name>/repro.py`
builds the hazard as a tiny module, runs what vLLM's rewrite computes beside what the
unfused module computes, prints both, and exits 1 when they differ (the hazard reproduced),
0 when they agree (the rewrite is safe there, e.g. once the engine is fixed); `README.md`
says which architectures have the shape and why our engine refuses it (or, for the third,
what our engine does instead).

The third kind, `weightless-norm-buffer`, was found by running vLLM's rewrites (the `vllm`
system, `harness.peers.vllm_apply`) over the corpus: FalconMamba's forward fails after vLLM's
RMSNorm fuser takes a dummy buffer for the norm's weight.
"""

from __future__ import annotations

import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Hazard:
    """One unsafe-rewrite kind: where it occurs, why ours refuses, and the replay script."""

    name: str
    title: str
    architectures: str
    refusal: str
    script: str


_TIED = '''
"""vLLM's merged projections copy tied Parameters: after an update the layers stop sharing.

Zamba's shared transformer block is called by several layers with the same Parameters.
vLLM's MergedColumnParallelLinear allocates a fresh stacked weight per layer, filled from the
checkpoint (here: torch.cat of the shards). An in-place update of the tied Parameters (an
optimizer step, load_state_dict, an adapter merge) reaches the unmerged layer and not the
merged copy. Exit 1: the hazard reproduced."""
import sys

import torch
from torch import nn


class Projections(nn.Module):
    def __init__(self, q, k, v):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = q, k, v

    def forward(self, x):
        return self.q_proj(x) * self.k_proj(x) + self.v_proj(x)


torch.manual_seed(0)
first = [nn.Linear(8, 8) for _ in range(3)]
second = [nn.Linear(8, 8) for _ in range(3)]
for mine, theirs in zip(second, first):  # tied, as Zamba's checkpoint ties them
    mine.weight, mine.bias = theirs.weight, theirs.bias
block, other = Projections(*first), Projections(*second)
stacked = torch.cat([p.weight for p in first]).detach().clone()
bias = torch.cat([p.bias for p in first]).detach().clone()


def merged(x):  # what the rewritten forward runs on vLLM's stacked copy
    q, k, v = nn.functional.linear(x, stacked, bias).split(8, -1)
    return q * k + v


x = torch.randn(2, 8)
with torch.no_grad():
    before = (merged(x) - block(x)).abs().max().item()
    first[0].weight.add_(1.0)  # one update of the tied Parameter
    shared = (other(x) - block(x)).abs().max().item()
    after = (merged(x) - block(x)).abs().max().item()
print(f"merged vs unmerged before the update: max diff {before:.3g}")
print(f"the other layer still shares the update: max diff {shared:.3g}")
print(f"merged vs unmerged after the update:  max diff {after:.3g}")
sys.exit(1 if after > 1e-5 else 0)
'''

_CLAMPED = '''
"""vLLM runs experts with their own clamped gating as plain silu(gate) * up.

DeepSeek-V4 and HY-V4 experts gate with a clamped SwiGLU (`swiglu_limit`: the gate clamped
from above, up clamped both ways, in the experts' own `_apply_gate`). vLLM swaps every
`experts` holding 3-D parameters for FusedMoE with activation "silu": the same while
activations stay under the limit, different once they pass it. Exit 1: the hazard
reproduced (vLLM's own SiluAndMul is used when vLLM is importable)."""
import sys

import torch
import torch.nn.functional as F

LIMIT = 7.0  # DeepSeek-V4's swiglu_limit


def clamped_swiglu(gate_up):  # the experts' own gating
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=LIMIT)) * up.clamp(min=-LIMIT, max=LIMIT)


try:
    from vllm.model_executor.layers.activation import SiluAndMul

    silu_and_mul = SiluAndMul().forward_native
    source = "vLLM's SiluAndMul.forward_native"
except Exception:
    def silu_and_mul(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    source = "silu(gate) * up (vLLM not importable: its SiluAndMul's definition)"

small = torch.linspace(-3, 3, 16).reshape(2, 8)
large = small * 10
under = (silu_and_mul(small) - clamped_swiglu(small)).abs().max().item()
over = (silu_and_mul(large) - clamped_swiglu(large)).abs().max().item()
print(f"kernel: {source}")
print(f"activations under the limit: max diff {under:.3g}")
print(f"activations over the limit:  max diff {over:.3g}")
sys.exit(1 if over > 1e-5 else 0)
'''

_WEIGHTLESS = '''
"""vLLM's RMSNorm fuser takes a weightless norm's dummy buffer for its weight.

FalconMamba's FalconMambaWeightlessRMSNorm never reads `self.weight`: it is a non-persistent
buffer of ones kept "for imitating the kernels path", sized `intermediate_size` even where the
norm normalises `time_step_rank` features (dt_layernorm). vLLM's RMSNorm fuser reads
`getattr(module, "weight")`, finds the buffer and builds an RMSNorm of the buffer's size with
a weight: the rewritten norm multiplies the input by it, so the forward raises a shape error
(the sizes differ) or, where they agree, multiplies by ones. Exit 1: the hazard reproduced
(vLLM's own RMSNorm.forward_native is used when vLLM is importable)."""
import os
import sys

import torch
from torch import nn

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


class WeightlessRMSNorm(nn.Module):  # FalconMamba's, as Transformers defines it
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Buffer(torch.ones(hidden_size), persistent=False)  # never read

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


try:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    def fused(module):  # vLLM's RMSNorm of the size the fuser reads from the buffer
        with set_current_vllm_config(VllmConfig()):
            return RMSNorm(hidden_size=module.weight.size(0), eps=module.eps).forward_native

    source = "vLLM's RMSNorm.forward_native"
except Exception:
    def fused(module):
        weight = torch.ones(module.weight.size(0))  # vLLM's RMSNorm starts its weight at ones

        def forward(t):
            t32 = t.float()
            return (t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + module.eps)).type_as(t) * weight

        return forward

    source = "x * rsqrt(mean(x^2) + eps) * weight (vLLM not importable: its RMSNorm's definition)"
print(f"kernel: {source}")
torch.manual_seed(0)
same = WeightlessRMSNorm(16)  # b_layernorm: buffer and input both state_size wide
x = torch.randn(1, 5, 16)
print(f"buffer as wide as the input (b_layernorm): max diff {(fused(same)(x) - same(x)).abs().max().item():.3g}")
dt = WeightlessRMSNorm(128)  # dt_layernorm: the buffer is intermediate_size wide ...
x = torch.randn(1, 5, 8)  # ... the input time_step_rank
try:
    diff = (fused(dt)(x) - dt(x)).abs().max().item()
except RuntimeError as exc:
    print(f"buffer of 128 features, input of 8 (dt_layernorm): the rewritten norm raises: {exc}")
    sys.exit(1)
print(f"buffer of 128 features, input of 8 (dt_layernorm): max diff {diff:.3g}")
sys.exit(1 if diff > 1e-6 else 0)
'''

HAZARDS: tuple[Hazard, ...] = (
    Hazard(
        "tied-shared-block",
        "A merge copies Parameters tied across layers",
        "zamba (its shared transformer block), any model whose layers share one block",
        "our sibling/qkv fusers refuse to merge Parameters another module also holds "
        "('tied'): a merge must make the originals views of one buffer, and a Parameter "
        "tied to a module outside the merge cannot be one",
        _TIED,
    ),
    Hazard(
        "clamped-swiglu-experts",
        "Experts with their own clamped gating run as plain SiluAndMul",
        "deepseek_v4, hy_v4 (experts with swiglu_limit)",
        "our MoE fuser runs such experts' gating op for op (the experts' own `_apply_gate` "
        "program, guarded per call) and refuses the block-level FusedMoE",
        _CLAMPED,
    ),
    Hazard(
        "weightless-norm-buffer",
        "A weightless RMSNorm's dummy buffer taken for its weight",
        "falcon_mamba (FalconMambaWeightlessRMSNorm: dt_layernorm, b_layernorm, c_layernorm; "
        "the forward fails at dt_layernorm, whose buffer has intermediate_size features and "
        "whose input time_step_rank)",
        "our rmsnorm fuser fuses what the forward computes: these norms read no weight, so "
        "they become weightless fused norms and the buffer is left alone (the vllm system of "
        "the harness found this: `fusion-harness run --system vllm --arch falcon_mamba`)",
        _WEIGHTLESS,
    ),
)


def write_bundles(directory: Path) -> list[Path]:
    """One `<directory>/<name>/` per hazard with `repro.py` and `README.md`; their folders."""
    written = []
    for hazard in HAZARDS:
        folder = directory / hazard.name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "repro.py").write_text(textwrap.dedent(hazard.script).lstrip())
        (folder / "README.md").write_text(
            f"# {hazard.title}\n\n"
            f"Architectures with this shape: {hazard.architectures}.\n\n"
            f"Why our engine does not make this rewrite: {hazard.refusal}.\n\n"
            "Replay: `python repro.py` (torch only; vLLM's own kernel when importable). "
            "Exit 1: the rewrite computes otherwise than the unfused model; 0: it agrees.\n"
        )
        written.append(folder)
    return written


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m harness.peers.hazards DIR", file=sys.stderr)
        return 2
    for folder in write_bundles(Path(args[0])):
        print(f"wrote {folder}/repro.py")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
