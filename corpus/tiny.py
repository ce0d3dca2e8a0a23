"""Generic tiny-config shrinker: a default config in, constructor kwargs for a tiny one out.

The shrinker never hand-lists architectures. It reads the attributes of a config class (its
dataclass fields, or its ``__init__`` parameters on Transformers versions whose configs are not
dataclasses), shrinks size-like attributes by name family (the rules in ``corpus.rules``: hidden
size, layers, heads, kv heads, head dims, intermediate sizes, vocab, positions, experts and top-k,
MLA ranks, SSM dims, windows) and returns *constructor keyword arguments*. The caller rebuilds
the config through its constructor with them, so every size the config derives itself (rotary
dims, MLA head dims, mamba inner sizes, default ``layer_types``) is recomputed from the tiny
values instead of going stale.

Invariants kept (tested in ``tests/corpus/test_tiny.py`` and, on every architecture, in
``tests/corpus/test_all_architectures.py``):

* values only ever shrink (``min(default, tiny)``); ``None`` defaults the config derives are left
  to it, except the "fill" families (head_dim, kv heads, experts, top-k) so GQA / MoE paths stay on;
* heads divide the hidden size, kv heads divide the heads (MQA stays MQA, MHA and MLA stay MHA),
  expert groups divide the experts with >= 2 experts per group; relations found in the defaults
  are re-established on the tiny values (``ssm_heads * ssm_head_dim == expand * hidden``, equal
  head dims stay equal, MLA ``head_dim == nope + rope`` per layer, adapter widths equal to a
  hidden size follow it, value heads stay a multiple of key heads);
* per-layer lists (``layer_types``, ``mlp_layer_types``, hybrid pattern strings, layer-index
  lists, heterogeneous ``per_layer_config``) are resized to the new layer count keeping every
  distinct value, in original order, so hybrid stacks keep one layer of each kind; there are
  always at least two layers;
* numerics are untouched: no eps, scale, softcap, theta or initializer attribute is changed;
* special token ids that fall outside the tiny vocabulary are remapped, consistently across the
  config and its sub-configs, to distinct ids at the top of the tiny vocabulary.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from corpus.layer_lists import (
    HEADS_NAMES,
    PerLayer,
    first,
    implicit_layer_list,
    keep_layers,
    layer_count,
    per_layer_attrs,
    rescale_sections,
    resize,
)
from corpus.rules import KEEP, KV_PATTERN, SIZES, Sizes, is_int, rule_for

__all__ = [
    "SIZES",
    "Sizes",
    "config_fields",
    "config_values",
    "is_config",
    "shrink_kwargs",
    "special_token_ids",
]


def is_config(value: Any) -> bool:
    """True for a Transformers config instance (duck-typed, so it works across versions)."""
    return (
        hasattr(value, "to_dict") and hasattr(value, "model_type") and not isinstance(value, type)
    )


def config_fields(config_cls: type) -> list[str]:
    """Return the names the config constructor accepts.

    Dataclass configs (Transformers >= 5) expose their fields; older configs expose ``__init__``
    parameters. Either way only names the constructor takes are returned, so the kwargs the
    shrinker produces are always accepted.
    """
    if dataclasses.is_dataclass(config_cls):
        return [f.name for f in dataclasses.fields(config_cls) if f.init]
    params = inspect.signature(config_cls.__init__).parameters
    return [
        n
        for n, p in params.items()
        if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]


def _shrink_original_positions(original: int, factor: Any, tiny_max: int) -> int:
    """A tiny ``original_max_position_embeddings`` below ``tiny_max`` with the same ratio.

    YaRN / longrope compare ``max_position_embeddings / original`` with the scaling ``factor``;
    keeping that ratio keeps the rope (and Transformers' consistency check) as in the default.
    """
    if isinstance(factor, (int, float)) and factor > 1:
        return max(1, int(tiny_max / factor))
    return max(1, min(original, tiny_max // 2))


def _shrink_rope(rope: Any, half: int, tiny_max: int | None = None) -> Any:
    """Return rope parameters with per-frequency lists sized for ``half`` rotary frequencies and
    an ``original_max_position_embeddings`` that fits under the tiny ``tiny_max``."""
    if not isinstance(rope, dict):
        return rope
    out = {}
    for k, v in rope.items():
        if isinstance(v, dict):
            out[k] = _shrink_rope(v, half, tiny_max)
        elif k == "original_max_position_embeddings" and is_int(v) and tiny_max and v >= tiny_max:
            out[k] = _shrink_original_positions(v, rope.get("factor"), tiny_max)
        elif k in ("mrope_section", "mrope_sections") and isinstance(v, list) and half > 0:
            out[k] = rescale_sections(v, half)
        elif k in ("long_factor", "short_factor") and isinstance(v, list):
            out[k] = list(v[:half])
        else:
            out[k] = v
    return out


# ---------------------------------------------------------------------------------------------
# Token ids


_TOKEN_NAME = re.compile(r".*token_(id|ids|index|idx)|.*_token")


def special_token_ids(config: Any) -> set[int]:
    """Every special token id named in ``config`` and its sub-configs (recursively).

    Used by input generation to keep special tokens (image/audio placeholders, pad, bos...)
    out of random ``input_ids``: a stray image token without pixels breaks multimodal models.
    """
    found: set[int] = set()
    values = config.to_dict() if is_config(config) else dict(config)

    def walk(d: Any) -> None:
        if isinstance(d, dict):
            for k, v in d.items():
                if isinstance(k, str) and _TOKEN_NAME.fullmatch(k):
                    for x in v if isinstance(v, (list, tuple)) else [v]:
                        if is_int(x):
                            found.add(x)
                elif isinstance(v, dict):
                    walk(v)

    walk(values)
    return found


class _TokenMap:
    """Consistent remapping of out-of-range special ids into the top of the tiny vocabulary."""

    def __init__(self, vocab: int, reserved: int) -> None:
        self.vocab = vocab
        self.low = vocab - reserved
        self.map: dict[int, int] = {}

    def __call__(self, x: int) -> int:
        if x < self.low or x < 0:
            return x
        if x not in self.map:
            self.map[x] = self.vocab - 1 - len(self.map)
        return self.map[x]

    def remap(self, v: Any) -> Any:
        if is_int(v):
            return self(v)
        if isinstance(v, (list, tuple)) and all(is_int(x) for x in v):
            return type(v)(self(x) for x in v)
        return v


# ---------------------------------------------------------------------------------------------
# The shrinker


def _kv_heads(default: Any, default_heads: Any, tiny_heads: int, s: Sizes) -> Any:
    """Tiny kv heads: MQA stays MQA, MHA stays MHA, GQA (or unset) becomes ``s.kv_heads``."""
    if default is None:
        return min(s.kv_heads, tiny_heads)
    if not is_int(default):
        return default
    if default == 1:
        return 1
    if is_int(default_heads) and default == default_heads:
        return tiny_heads
    return min(s.kv_heads, tiny_heads)


_MISSING = object()


def class_defaults(config_cls: type) -> dict[str, Any]:
    """Constructor defaults of a config class (``_MISSING`` where there is none)."""
    out: dict[str, Any] = {}
    if dataclasses.is_dataclass(config_cls):
        for f in dataclasses.fields(config_cls):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = _MISSING  # a mutable default: never a derived size
        return out
    for n, p in inspect.signature(config_cls.__init__).parameters.items():
        out[n] = _MISSING if p.default is inspect.Parameter.empty else p.default
    return out


def config_values(config: Any) -> dict[str, Any]:
    """Attribute values of a config instance (post-init, i.e. including derived values)."""
    # Heterogeneous configs (per-layer overrides) refuse plain global reads of per-layer
    # attributes; their raw global value is what the constructor takes, so read that.
    raw = getattr(config, "_getattr_without_heterogeneous_validation", None)
    out = {}
    for name in config_fields(type(config)):
        try:
            out[name] = raw(name) if raw is not None else getattr(config, name)
        except Exception:  # an attribute some configs only define lazily
            continue
    return out


_WIDTH_NAMES = ("hidden_size", "d_model", "n_embd")
_WIDTH_LIKE = re.compile(
    r"(?!.*(vocab|position|window|chunk|patch|image|sampling|hop|feature|bucket|length|token)).*"
    r"(_dim|_size|_dims|_width|dim_.*|size_.*)"
)


def _default_widths(config: Any) -> frozenset[int]:
    """Every hidden width (>= 64) in the default config tree, for :data:`_WIDTH_LIKE` ties."""
    found: set[int] = set()

    def walk(c: Any) -> None:
        values = config_values(c)
        for n in _WIDTH_NAMES:
            if is_int(values.get(n)) and values[n] >= 64:
                found.add(values[n])
        for v in values.values():
            if is_config(v):
                walk(v)

    walk(config)
    return frozenset(found)


def _per_layer_overrides(config: Any) -> dict[int, dict[str, Any]]:
    """Explicit per-layer overrides of a heterogeneous config (``per_layer_config``), by layer."""
    try:
        d = config.to_dict().get("per_layer_config")
    except Exception:
        return {}
    if not isinstance(d, dict):
        return {}
    return {int(k): dict(v) for k, v in d.items() if isinstance(v, dict)}


def _shrink_layer_override(
    layer: dict[str, Any], values: Mapping[str, Any], kw: Mapping[str, Any], sizes: Sizes
) -> dict[str, Any]:
    """Apply the same rules to one layer's overrides (its heads/kv heads/ranks/head dims)."""
    out: dict[str, Any] = {}
    for name, v in layer.items():
        rule = rule_for(name)
        new = rule(v, sizes) if rule is not None else KEEP
        out[name] = v if new is KEEP else new
    # MLA layers whose head_dim is nope + rope (a per-layer nope with the global head_dim) keep
    # that sum: the layer's nope dim absorbs the difference.
    nope = layer.get("qk_nope_head_dim")
    hd, rope = values.get("head_dim"), values.get("qk_rope_head_dim")
    if (
        is_int(nope)
        and is_int(hd)
        and is_int(rope)
        and nope + layer.get("qk_rope_head_dim", rope) == hd
    ):
        t_hd = kw.get("head_dim", hd)
        t_rope = out.get("qk_rope_head_dim", kw.get("qk_rope_head_dim", rope))
        if t_hd - t_rope > 0:
            out["qk_nope_head_dim"] = t_hd - t_rope
    heads_name = next((h for h in HEADS_NAMES if h in layer), None)
    for name, v in layer.items():
        if re.fullmatch(KV_PATTERN, name) and is_int(v):
            d_heads = layer[heads_name] if heads_name else values.get("num_attention_heads")
            t_heads = out[heads_name] if heads_name else kw.get("num_attention_heads", sizes.heads)
            if is_int(t_heads):
                out[name] = _kv_heads(v, d_heads, t_heads, sizes)
    return out


def shrink_kwargs(
    config: Any,
    sizes: Sizes = SIZES,
    *,
    fill: bool = True,
    tokens: _TokenMap | None = None,
    widths: frozenset[int] | None = None,
    explicit: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Return constructor kwargs that rebuild ``type(config)`` as a tiny config.

    ``config`` is a default instance of the class: its values decide which rules fire and which
    relations to keep. Only size-like attributes, per-layer lists, rope per-frequency lists,
    out-of-range token ids and sub-configs appear in the result; everything else is left to the
    constructor, so derived sizes are recomputed from the tiny ones. Attributes whose class
    default is ``None`` are derived by the config, so they are left out too, except the "fill"
    families (head_dim, kv heads, experts, top-k) when ``fill`` is true: those are set so the
    tiny model keeps GQA / MoE paths and models that read an unset ``head_dim`` still build.
    ``explicit`` is the kwargs ``config`` was constructed with (if any): those attributes were
    given, not derived, so their values are shrunk like any other.
    Sub-configs come back as dicts with their ``model_type`` (how composite configs accept
    them). Pure: ``config`` is never mutated.
    """
    tokens = tokens or _TokenMap(sizes.vocab, sizes.reserved_ids)
    if widths is None:
        widths = _default_widths(config)
    fields = config_fields(type(config))
    values = config_values(config)
    explicit = explicit or {}
    derived = _Derived(explicit, class_defaults(type(config)))
    kw = _shrink_fields(config, fields, values, derived, sizes, fill, tokens, widths, explicit)

    # Key/value heads follow the (tiny) query heads they divide.
    heads_name, default_heads = first(values, HEADS_NAMES)
    tiny_heads = _tiny(kw, values, heads_name) if heads_name else sizes.heads
    _shrink_kv_heads(fields, values, kw, derived, sizes, fill, tiny_heads, default_heads)
    _shrink_linear_attention_heads(values, kw)

    _auxiliary_vocabs(values, kw, fields)
    _equal_head_dims(values, kw)
    _restore_products(values, kw)

    _shrink_per_layer_lists(config, fields, values, kw, sizes)
    _shrink_rope_lists(values, kw, sizes, tiny_heads)
    _shrink_top_level_original_positions(values, kw)
    return kw


@dataclass(frozen=True)
class _Derived:
    """Whether an attribute is derived by the config: not given explicitly and ``None`` by
    default (the constructor computes it from the others, so it is left out of the kwargs)."""

    explicit: Mapping[str, Any]
    defaults: Mapping[str, Any]

    def __call__(self, name: str) -> bool:
        return name not in self.explicit and name in self.defaults and self.defaults[name] is None


def _tiny(kw: Mapping[str, Any], values: Mapping[str, Any], name: str | None) -> Any:
    """The tiny value of ``name``: the shrunk one where set, else the config's own (None for none)."""
    return kw.get(name, values.get(name)) if name else None


def _shrink_fields(
    config: Any,
    fields: Iterable[str],
    values: Mapping[str, Any],
    derived: _Derived,
    sizes: Sizes,
    fill: bool,
    tokens: _TokenMap,
    widths: frozenset[int],
    explicit: Mapping[str, Any],
) -> dict[str, Any]:
    """The kwargs of every field taken one by one: sub-configs shrunk recursively (as dicts with
    their ``model_type``), token ids remapped, the rules of size-like names applied, and
    unrecognised widths equal to a model width following the tiny hidden size."""
    kw: dict[str, Any] = {}
    for name in fields:
        d = values.get(name)
        if is_config(d):
            sub_explicit = explicit.get(name) if isinstance(explicit.get(name), Mapping) else None
            sub = shrink_kwargs(
                d, sizes, fill=fill, tokens=tokens, widths=widths, explicit=sub_explicit
            )
            sub["model_type"] = d.model_type
            kw[name] = sub
            continue
        if _TOKEN_NAME.fullmatch(name):
            new = tokens.remap(d)
            if new != d:
                kw[name] = new
            continue
        rule = rule_for(name)
        if rule is None:
            # An unrecognised width that equals a model width somewhere in the config tree
            # (adapter/projection dims that must match a hidden size) follows the tiny width.
            if is_int(d) and d in widths and _WIDTH_LIKE.fullmatch(name) and not derived(name):
                kw[name] = sizes.hidden
            continue
        if derived(name):
            if not (fill and getattr(rule, "fills", False)):
                continue
            d = None
        new = rule(d, sizes)
        if new is not KEEP and new != values.get(name):
            kw[name] = new
    return kw


def _shrink_kv_heads(
    fields: Iterable[str],
    values: Mapping[str, Any],
    kw: dict[str, Any],
    derived: _Derived,
    sizes: Sizes,
    fill: bool,
    tiny_heads: Any,
    default_heads: Any,
) -> None:
    """Set every key/value-heads attribute in ``kw`` to divide the tiny query heads it pairs
    with (filled where derived, for the main one only; MLA's kv heads stay == heads)."""
    # MLA projects K/V per query head from a shared latent: its kv heads must stay == heads.
    mla = is_int(values.get("kv_lora_rank"))
    for name in fields:
        if not re.fullmatch(KV_PATTERN, name):
            continue
        other = _paired_heads(name, values)
        # Only the main kv-heads attribute is filled: an unset auxiliary one (an indexer's kv
        # heads) usually means "feature off", and setting it alone switches a feature half on.
        primary = other is None and not name.startswith(("index", "indexer"))
        if derived(name) and (not fill or mla or not primary):
            continue
        d_heads = values.get(other) if other else default_heads
        tiny_other = _tiny(kw, values, other)
        t_heads = tiny_other if other and is_int(tiny_other) else tiny_heads
        if not is_int(t_heads):
            continue
        new = _kv_heads(None if derived(name) else values.get(name), d_heads, t_heads, sizes)
        if new != values.get(name):
            kw[name] = new


def _shrink_linear_attention_heads(values: Mapping[str, Any], kw: dict[str, Any]) -> None:
    """Linear-attention value heads: keep the value/key ratio over at most 2 key heads."""
    k, v = values.get("linear_num_key_heads"), values.get("linear_num_value_heads")
    if is_int(k) and is_int(v) and k > 0:
        tk = min(k, 2)
        kw["linear_num_key_heads"] = tk
        kw["linear_num_value_heads"] = tk * (v // k) if v % k == 0 else min(v, tk)


def _shrink_per_layer_lists(
    config: Any,
    fields: Iterable[str],
    values: Mapping[str, Any],
    kw: dict[str, Any],
    sizes: Sizes,
) -> None:
    """Per-layer lists: decide the layer count so every distinct layer kind survives, then
    resize every per-layer attribute (and per-layer config overrides) to the kept layers."""
    count_name, n = layer_count(values)
    implicit = count_name is None
    if implicit:
        count_name, n = implicit_layer_list(values)
    if not (count_name and is_int(n)):
        return
    attrs = per_layer_attrs(values, fields, n)
    overrides = _per_layer_overrides(config)
    if overrides:  # heterogeneous layers are a layer kind of their own
        sig = [repr(sorted(overrides.get(i, {}).items())) for i in range(n)]
        attrs.append(PerLayer("per_layer_config", "list", sig))
    minimum = min(n, sizes.layers)
    kept = keep_layers(attrs, n, minimum) if attrs else list(range(minimum))
    if not implicit:
        kw[count_name] = len(kept)
    for a in attrs:
        if a.name != "per_layer_config":
            kw[a.name] = resize(a, kept, sizes)
    if overrides:
        kw["per_layer_config"] = {
            new: _shrink_layer_override(overrides[old], values, kw, sizes)
            for new, old in enumerate(kept)
            if old in overrides
        }


def _shrink_rope_lists(
    values: Mapping[str, Any], kw: dict[str, Any], sizes: Sizes, tiny_heads: Any
) -> None:
    """Rope per-frequency lists follow the tiny rotary dimension."""
    rope_name = next((r for r in ("rope_parameters", "rope_scaling") if r in values), None)
    if not (rope_name and isinstance(values.get(rope_name), dict)):
        return
    hd = _tiny(kw, values, "head_dim") if is_int(_tiny(kw, values, "head_dim")) else None
    if hd is None:
        h = _tiny(kw, values, "hidden_size")
        ok = is_int(h) and is_int(tiny_heads) and tiny_heads > 0
        hd = h // tiny_heads if ok else sizes.head_dim
    half = int(hd * _partial_factor(values[rope_name], values)) // 2
    tiny_max = _tiny(kw, values, "max_position_embeddings")
    new_rope = _shrink_rope(values[rope_name], half, tiny_max if is_int(tiny_max) else None)
    if new_rope != values[rope_name]:
        kw[rope_name] = new_rope


def _shrink_top_level_original_positions(values: Mapping[str, Any], kw: dict[str, Any]) -> None:
    """A top-level original context length (Phi-3 style) keeps its ratio to the context length."""
    orig, max_d = (
        values.get("original_max_position_embeddings"),
        values.get("max_position_embeddings"),
    )
    tiny_max = _tiny(kw, values, "max_position_embeddings")
    if is_int(orig) and is_int(max_d) and is_int(tiny_max) and orig >= tiny_max and max_d > 0:
        kw["original_max_position_embeddings"] = _shrink_original_positions(
            orig, max_d / orig, tiny_max
        )


def _paired_heads(kv_name: str, values: Mapping[str, Any]) -> str | None:
    """The query-heads attribute a kv-heads attribute belongs to (``swa_num_key_value_heads`` ->
    ``swa_num_attention_heads``), or None for the main one."""
    for a, b in (("key_value_heads", "attention_heads"), ("kv_heads", "n_heads")):
        if a in kv_name:
            cand = kv_name.replace(a, b)
            if cand != kv_name and cand in values and not cand.startswith("num_attention"):
                return cand
    return None


def _partial_factor(rope: dict, values: Mapping[str, Any]) -> float:
    f = values.get("partial_rotary_factor")
    for d in [rope, *[v for v in rope.values() if isinstance(v, dict)]]:
        if isinstance(d.get("partial_rotary_factor"), (int, float)):
            f = d["partial_rotary_factor"]
            break
    return float(f) if isinstance(f, (int, float)) and f else 1.0


def _auxiliary_vocabs(values: Mapping[str, Any], kw: dict[str, Any], fields: list[str]) -> None:
    """Auxiliary vocabularies (``unpadded_vocab_size``, per-layer-input vocabs) shrink in
    proportion to the main one, so "smaller than the vocab" relations keep holding."""
    main = values.get("vocab_size")
    tiny_main = kw.get("vocab_size", main)
    if not (is_int(main) and is_int(tiny_main)) or main <= 0:
        return
    for name in fields:
        d = values.get(name)
        if name == "vocab_size" or name not in kw or not is_int(d) or not re.search("vocab", name):
            continue
        if d <= main:
            kw[name] = max(1, min(tiny_main, round(tiny_main * d / main)))


_HEAD_DIM_FAMILY = re.compile(r"head_dim|.*_head_dim|dim_head|mamba_d_head|kv_channels")


def _equal_head_dims(values: Mapping[str, Any], kw: dict[str, Any]) -> None:
    """Head dims equal in the defaults stay equal (``head_dim == qk_rope_head_dim`` in models that
    size their rotary embedding by ``head_dim``): each group takes its smallest tiny value."""
    groups: dict[int, list[str]] = {}
    for n, v in values.items():
        if is_int(v) and v > 0 and _HEAD_DIM_FAMILY.fullmatch(n):
            groups.setdefault(v, []).append(n)
    for names in groups.values():
        tiny = [kw.get(n, values[n]) for n in names]
        if len(names) > 1 and len(set(tiny)) > 1:
            low = min(tiny)
            for n in names:
                kw[n] = low


def _restore_products(values: Mapping[str, Any], kw: dict[str, Any]) -> None:
    """Re-establish ``heads * head_dim == expand * hidden`` (or ``== d_ssm``) relations.

    SSM configs tie their head count to an inner width (``mamba_n_heads * mamba_d_head ==
    mamba_expand * hidden_size``). Shrinking each factor independently breaks that; here the
    heads factor is recomputed from the tiny width. Plain attention (``heads * head_dim ==
    hidden``) is left alone: the tiny sizes already satisfy it when it matters, and MLA models
    satisfy it only by coincidence.
    """

    def tiny(n: str) -> Any:
        return kw.get(n, values.get(n))

    ints = {n: v for n, v in values.items() if is_int(v) and v > 0}
    heads = [n for n in ints if "heads" in n and "key_value" not in n and "kv" not in n]
    dims = [n for n in ints if re.search(r"head_dim|d_head|head_size", n)]
    hidden = next((h for h in ("hidden_size", "d_model", "n_embd") if h in ints), None)
    targets: list[tuple[int, Any]] = []
    if hidden:
        for e in (n for n in ints if n.endswith("expand")):
            targets.append((ints[e] * ints[hidden], tiny(e) * tiny(hidden)))
    for n in ints:
        if n.endswith(("d_ssm", "d_inner")):
            targets.append((ints[n], tiny(n)))
    for h in heads:
        for d in dims:
            td = tiny(d)
            for default_t, tiny_t in targets:
                if ints[h] * ints[d] != default_t or not (is_int(tiny_t) and is_int(td) and td > 0):
                    continue
                if tiny_t % td == 0:
                    kw[h] = tiny_t // td
                break
