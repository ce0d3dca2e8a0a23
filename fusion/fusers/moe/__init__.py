"""MoE: a mixture-of-experts block -> `FusedMoE` (matched routing, grouped experts).

Matched by dataflow in the block's traced forward, never by name:

- Transformers 5 (packed experts): the block returns `experts(x, ids, weights) [+ shared]`
  where `_, weights, ids = router(x)` and `x` is the block's input up to reshapes. The
  experts child must be a Transformers experts class in the standard layout, proven by the
  identity of its functions (`provenance`: Transformers' dispatcher over a Transformers
  model's own eager forward, the configured implementation a known one), never by the
  numeric check alone: `gate_up_proj [E, 2I, H]` (gate rows, then up), `down_proj [E, H, I]`,
  no bias, not transposed, the default `act(gate) * up` gating with an activation
  `ActAndMul` reproduces. Its semantics are then fixed by Transformers' experts interface,
  whichever implementation (eager loop, `grouped_mm`) the config selects.
- Transformers 4 (`ModuleList` of expert MLPs, routing in the block's own forward): refused
  (`fuser.MODULELIST_REFUSAL`). Packing the list would replace the experts' Parameters (an
  optimizer or adapter made before fusing would train tensors the fused block never reads),
  and its data-dependent expert loop does not trace, so only a numeric sample would have
  vouched for it. Each expert MLP is merged by `glu` instead, keeping its Parameters.

The router is read from its graph as a small program (`fusion.runtime.moe.RouteSpec`): a
bias-free linear (with the casts it computes in), then softmax or sigmoid before or after a
single top-k, renormalisation (a division by the sum of the selection, read from the graph,
never from a config flag), a constant scaling and casts, in their order. Anything else in
the router refuses with its reason: a biased linear, grouped top-k (several top-k ops), an
`e_score_correction_bias` added for the choice.

A shared expert is found by dataflow as the other addend of the output: `shared(x)`, or
`sigmoid(gate(x)) * shared(x)` with `gate` a linear to one logit (Qwen2-MoE).

Refused: a block returning a tuple (directly or through a name), any stateful child the
fused block would not run, hooks on the block or its experts (they would stop firing).

Because the experts interface (Transformers 5) is taken on its contract (proven by
`provenance`) rather than traced, every match is also checked numerically once per
kind of instance, on the module's own weights: the fused block must reproduce the router's
indices and weights bit for bit and the block's output to rounding, or it refuses.

Layout: `router` reads the routing program, `experts` checks the experts child,
`provenance` proves what an experts class computes, `block` matches the block, `build`
builds the `FusedMoE`, `selfcheck` runs the numeric check, `experts_only` matches experts
fused alone, `gate` reads and proves their gating program (`fusion.analysis.reads` records what it
reads, for `FusedExperts`'s guards, and what the router match reads, for `FusedMoE`'s), and
`fuser` holds `MoEFuser`.
"""

from __future__ import annotations

from fusion.fusers.moe.block import MoEMatch
from fusion.fusers.moe.fuser import MoEFuser, match_block

__all__ = ["MoEFuser", "MoEMatch", "match_block"]
