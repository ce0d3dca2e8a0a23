"""Per-layer attributes of a config, found and resized to a new layer count (the tiny shrinker's
layer half, `corpus.tiny`).

A per-layer value is a list (or pattern string) whose length is the config's layer count, or a
list of layer indices (names ending `_layers`, `_idxs`, ...). Resizing keeps every distinct
value in original order (`keep_layers`), so a hybrid stack keeps one layer of each kind, and
shrinks size-like entries by the same rules as scalar fields (`corpus.rules`)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from corpus.rules import KEEP, Sizes, is_int, rule_for

LAYER_COUNT_NAMES = (
    "num_hidden_layers",
    "n_layer",
    "n_layers",
    "num_layers",
    "decoder_layers",
    "num_decoder_layers",
)
INDEX_LIST_SUFFIX = re.compile(r".*(_layers|_idxs|_indices|_ids|_layer_ids)")
HEADS_NAMES = ("num_attention_heads", "n_head", "n_heads", "num_heads")


def first(values: Mapping[str, Any], names: Iterable[str]) -> tuple[str | None, Any]:
    for n in names:
        if is_int(values.get(n)):
            return n, values[n]
    return None, None


def layer_count(values: Mapping[str, Any]) -> tuple[str | None, int | None]:
    return first(values, LAYER_COUNT_NAMES)


def implicit_layer_list(values: Mapping[str, Any]) -> tuple[str | None, int | None]:
    """A config with no layer-count attribute whose depth is the length of a list of layer
    kinds (Reformer's ``attn_layers``): return that list's name and length."""
    for name, v in values.items():
        is_list = isinstance(v, (list, tuple)) and len(v) > 1
        if "layers" in name and is_list and all(isinstance(x, str) for x in v):
            return name, len(v)
    return None, None


# ---------------------------------------------------------------------------------------------
# Per-layer lists


@dataclass
class PerLayer:
    """A per-layer attribute: ``kind`` is 'list' (aligned values), 'str' (pattern) or 'index'."""

    name: str
    kind: str
    value: Any


def per_layer_attrs(values: Mapping[str, Any], fields: Iterable[str], n: int) -> list[PerLayer]:
    out: list[PerLayer] = []
    for name in fields:
        v = values.get(name)
        if isinstance(v, (list, tuple)) and v:
            ints = all(is_int(x) for x in v)
            increasing = ints and all(a < b for a, b in itertools.pairwise(v))
            is_index_name = bool(INDEX_LIST_SUFFIX.fullmatch(name))
            if (
                is_index_name
                and increasing
                and all(0 <= x < n for x in v)
                and (len(v) < n or list(v) == list(range(n)))
            ):
                out.append(PerLayer(name, "index", list(v)))
            elif len(v) == n:
                out.append(PerLayer(name, "list", list(v)))
        elif isinstance(v, str) and len(v) == n and n > 1 and len(set(v)) <= 4:
            out.append(PerLayer(name, "str", v))
    return out


def keep_layers(attrs: list[PerLayer], n: int, minimum: int) -> list[int]:
    """Pick layer indices so every distinct value of every per-layer attribute survives.

    Greedy in layer order: a layer is kept when it shows a (attribute, value) pair not yet
    covered. Order is preserved, so "the first k layers are dense" style prefixes keep holding.
    Always at least ``minimum`` layers (while the original has that many).
    """

    def sig(i: int) -> list[tuple[str, Any]]:
        pairs = []
        for a in attrs:
            if a.kind == "index":
                pairs.append((a.name, i in a.value))
            else:
                v = a.value[i]
                pairs.append((a.name, repr(v)))
        return pairs

    seen: set[tuple[str, Any]] = set()
    kept: list[int] = []
    for i in range(n):
        new = [p for p in sig(i) if p not in seen]
        if new:
            kept.append(i)
            seen.update(new)
    for i in range(n):
        if len(kept) >= minimum:
            break
        if i not in kept:
            kept.append(i)
    return sorted(kept)


def resize(attr: PerLayer, kept: list[int], sizes: Sizes) -> Any:
    """Resize a per-layer attribute to the kept layers; per-layer *sizes* (a list-valued
    ``intermediate_size``) also go through the attribute's shrink rule, element by element."""
    if attr.kind == "index":
        return [new for new, old in enumerate(kept) if old in attr.value]
    if attr.kind == "str":
        return "".join(attr.value[i] for i in kept)
    out = [attr.value[i] for i in kept]
    rule = rule_for(attr.name)
    if rule is not None:
        shrunk = [rule(v, sizes) if is_int(v) else KEEP for v in out]
        out = [v if new is KEEP else new for v, new in zip(out, shrunk)]
    return out


# ---------------------------------------------------------------------------------------------
# Rope parameters


def rescale_sections(sections: list[int], total: int) -> list[int]:
    """Rescale mrope sections to sum exactly to ``total`` (the tiny rotary half-dim), in
    proportion, keeping each non-zero section >= 1 while ``total`` allows it."""
    old = sum(sections) or 1
    out = [max(1, int(x * total / old)) if x else 0 for x in sections]
    while sum(out) > total:
        # Take from the largest section; once all are 1, drop the smallest-by-default ones.
        if any(x > 1 for x in out):
            j = max(range(len(out)), key=lambda k: out[k])
        else:
            j = min((k for k in range(len(out)) if out[k]), key=lambda k: sections[k])
        out[j] -= 1
    while sum(out) < total:
        j = max(range(len(out)), key=lambda k: sections[k])
        out[j] += 1
    return out
