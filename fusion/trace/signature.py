"""Instance signatures: what tells two instances of one module class apart for a fuser.

A fuser derives its match once per kind of instance and caches it under the instance's
signature (`fusion.fusers.base.per_signature`). The signature is built from the instance's own
plain attributes (numbers, strings, flags, dtypes: they can change what a trace shows, such
as a top-k or an eps) and the identity of any other object it holds, so two instances share a
match only when nothing a trace could read differs.
"""

from __future__ import annotations

from collections.abc import Container

import torch
from torch import nn

MODULE_INTERNALS = frozenset(
    {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training"}
)
"""`nn.Module` bookkeeping in an instance's `__dict__`: never part of a signature."""


def _is_plain(value: object) -> bool:
    return isinstance(value, (bool, int, float, str, type(None), torch.dtype)) or (
        isinstance(value, tuple) and all(isinstance(v, (int, float, str)) for v in value)
    )


def plain_attributes(
    owner: nn.Module, *, skip: Container[str] = (), keep_private: Container[str] = ()
) -> tuple:
    """`owner`'s instance attributes as a hashable tuple, sorted by name: plain values
    (numbers, strings, None, dtypes, tuples of those) by value, anything else by type name and
    identity. Module internals, the names in `skip` and private (`_`) names not in
    `keep_private` are left out."""
    items = []
    for key, value in sorted(owner.__dict__.items()):
        if key in MODULE_INTERNALS or key in skip:
            continue
        if key.startswith("_") and key not in keep_private:
            continue
        items.append((key, value) if _is_plain(value) else (key, type(value).__name__, id(value)))
    return tuple(items)
