"""Tensor metadata: the attributes and methods whose answers are plain Python values.

Reading `x.shape` or calling `x.size(0)` shares no storage with `x` and carries none of its
values, so dataflow (`fusion.trace.graph`) and alias analysis (`fusion.analysis.alias`,
`fusion.analysis.value_roots`) may both ignore such reads. One table for both: if they disagreed, a
read one analysis treats as harmless could be one the other must follow.
"""

from __future__ import annotations

METADATA_ATTRS = frozenset(
    {"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad", "is_leaf"}
)
"""Tensor attributes that are plain Python values sharing no storage with the tensor."""

METADATA_METHODS = frozenset(
    {"size", "dim", "numel", "stride", "element_size", "nelement", "is_contiguous", "get_device"}
)
"""Tensor methods returning Python numbers/tuples: reading through them never aliases."""
