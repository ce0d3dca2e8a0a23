"""fusion.trace.signature: the instance signature both the MoE and the RMSNorm fusers key matches by."""

from __future__ import annotations

import torch
from torch import nn

from fusion.trace.signature import plain_attributes


def test_plain_values_by_value_objects_by_identity_internals_and_private_left_out() -> None:
    module = nn.Linear(2, 2)
    module.top_k, module.scale, module.dtype_flag = 2, 0.5, torch.float16
    module.helper = object()
    module._private, module._kept = 1, True
    items = dict((key, rest) for key, *rest in plain_attributes(module, keep_private={"_kept"}))
    assert (
        items["top_k"] == [2] and items["scale"] == [0.5] and items["dtype_flag"] == [torch.float16]
    )
    assert items["helper"] == ["object", id(module.helper)]
    assert items["_kept"] == [True] and "_private" not in items
    assert not {"_parameters", "_modules", "training"} & set(items)
    assert "top_k" not in dict(
        (key, rest) for key, *rest in plain_attributes(module, skip={"top_k"})
    )


def test_instances_differing_in_a_flag_differ_in_signature() -> None:
    a, b = nn.Identity(), nn.Identity()
    a.with_scale, b.with_scale = True, False
    assert plain_attributes(a) != plain_attributes(b)
    b.with_scale = True
    assert plain_attributes(a) == plain_attributes(b)
