"""RMSNorm: any module computing a root-mean-square norm -> one `FusedRMSNorm` kernel call.

The computation is matched, never the class name. A norm's forward is traced with fx and its
dataflow is read as an expression over the input `x`, the weight `w` and constants, with every
dtype explicit: implicit type promotion becomes a cast node, a cast to the dtype a value
already has disappears, and two casts collapse when the first one is exact (bf16 -> fp32 ->
D equals bf16 -> D). Spellings become one node only where ATen runs the same op for them:
`rsqrt(v)` and `pow(v, -0.5)` in float32/float64 give `rsqrt`; `pow(x, 2)`, `square(x)` and
`x * x` give `sq`. `x / sqrt(v)` and `x * (1 / sqrt(v))` round differently from
`x * rsqrt(v)`, so they stay themselves and are matched by the kernel variant that spells them
the same way (`NormVariant.root`, computed by the reference's plain ops). Products and sums of
one dtype are flattened and sorted (they differ only in rounding order). `F.rms_norm` (and so `nn.RMSNorm`) is expanded into the ops PyTorch runs.

The reference kernel (`fusion.kernels.reference.rms_norm`) is traced and read the same way
for each candidate variant, and a variant is accepted only if both expressions are equal at
every (input dtype, weight dtype) pair of float32, bfloat16 and float16. That grid is what
tells Llama's cast-then-weight from Gemma's weight-then-cast (equal in float32, different in
bfloat16) and T5's cast to the weight's dtype from Llama's cast to the input's. A forward
that branches on a dtype (`if self.weight.dtype in [...]`) is traced once per grid point, the
branch answered from the meta values, so each point is judged on its own path.

eps is found per class: each float attribute of an instance is set to a marker value in a
shallow copy and the forward retraced; the attribute whose marker appears is the eps, read per
instance at fuse time. Anything else an instance carries (flags such as Gemma 3n's
`with_scale`) goes into an instance signature; an instance whose signature differs from the
matched one is matched on its own, so a per-class cache can never hand one instance another
instance's variant.

Layout: `expr` holds the expression algebra, `interpret` evaluates a traced graph to an
expression, `tracing` traces a norm at chosen dtypes, `variants` gives the kernel's expression
per variant, `match` proves which variant an instance computes (`diagnose` says why not;
`fusion.analysis.alias.check_write_free` checks the source for tensor writes), and `fuser` holds
`RMSNormFuser`.
"""

from __future__ import annotations

from fusion.analysis.alias import check_write_free
from fusion.fusers.rmsnorm.fuser import RMSNormFuser
from fusion.fusers.rmsnorm.match import NormMatch, prove_variant
from fusion.fusers.rmsnorm.variants import EXTRA, GRID, Variant

__all__ = [
    "EXTRA",
    "GRID",
    "NormMatch",
    "RMSNormFuser",
    "Variant",
    "check_write_free",
    "prove_variant",
]
