"""Residual add + RMSNorm: `h = a + b; r = h; h = self.norm(h)` -> one `add_rms_norm` call.

In a decoder layer the residual add and the norm that reads the sum are two memory-bound
passes over the hidden states; `NormForward.add_forward` (a fused norm's forward) makes them one kernel that returns
both the sum and the normalised value. The pattern is read from the forward's source (the
sum's name is what ties the two together, which a traced graph also shows but cannot
rewrite), never from class names:

- `sites` finds each `H = L + R` whose next statements are only plain copies of `H`
  (`residual = H`) followed by a statement whose first evaluated call is a norm child called
  on `H` (`H = self.norm(H)`, `x = self.mlp(self.norm(H))`, `return self.norm(H)`), and
  says why any other add followed by a norm call is refused;
- `fuser` proves each site's norm is an RMSNorm by the RMSNorm fuser's own proof (the
  registry's `rmsnorm` verdict on the child, per instance its `validate`), proves the sum
  stable between the add and the norm with `fusion.analysis.alias`, and rewrites the forward;
- `runtime` is what the rewritten forward calls: the fused kernel when the norm child is a
  norm whose call runs only its fused forward at call time, and that forward's premises
  hold; else the original two operations.

Out of place on purpose: the sum goes to a new tensor as `a + b` did, because the residual
buffer is the layer's input, which the caller may still hold (`output_hidden_states`).
"""

from __future__ import annotations

from fusion.fusers.residual_norm.fuser import ResidualNormFuser
from fusion.fusers.residual_norm.runtime import HELPER, add_rms_norm
from fusion.fusers.residual_norm.sites import Refused, Site, find_sites

__all__ = ["HELPER", "Refused", "ResidualNormFuser", "Site", "add_rms_norm", "find_sites"]
