"""Enumerate the causal-LM architectures of the installed Transformers and resolve their classes.

Nothing is hand-listed: the list is ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` of whatever Transformers
is installed, and classes are resolved by name through the ``transformers`` package, so a new
release's architectures appear here without code changes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from corpus.overrides import override

__all__ = [
    "Entry",
    "all_types",
    "arch_for_config",
    "arch_for_config_type",
    "architectures",
    "config_class",
    "entry",
    "model_class",
]


@dataclass(frozen=True)
class Entry:
    """One causal-LM architecture.

    ``name`` is the mapping key, ``config_class`` the class registered for it (None when it does
    not import in this install), ``model_class_name`` the causal-LM class name, ``status`` is
    ``"ok"`` or ``"broken"``; ``reason`` says why a broken one is (recorded in
    ``overrides.toml``, or the import error). ``noncausal`` is set (with the reason) for the
    few causal-LM classes whose forward lets a position see later tokens (XLNet, CPM-Ant).
    """

    name: str
    config_class: type | None
    model_class_name: str
    status: str = "ok"
    reason: str | None = None
    noncausal: str | None = None


def _causal_lm_names() -> dict[str, Any]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@functools.cache
def all_types() -> tuple[str, ...]:
    """Every model type in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, in mapping order (the order
    Transformers lists them), buildable or not."""
    return tuple(_causal_lm_names())


def architectures() -> list[str]:
    """Names of every causal-LM architecture of the installed Transformers that the corpus
    builds: all of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` except those ``overrides.toml`` records
    as broken (each with its reason; see ``corpus.entry(name).reason``) and those whose class
    this install does not export. Cheap: imports no modeling or configuration module."""
    names = _causal_lm_names()
    exported = _exported_names()
    return [
        n for n in all_types() if not override(n).get("broken") and _primary(names[n]) in exported
    ]


def config_class(name: str) -> type:
    """The config class Transformers registers for ``name`` (KeyError if it is unknown)."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[name]


def model_class(name: str) -> type:
    """The causal-LM class for ``name``, resolved by its class name in ``transformers``."""
    import transformers

    return getattr(transformers, _primary(_causal_lm_names()[name]))


def _primary(cls_name: Any) -> str:
    """The class name of a mapping value (some versions list alternatives; first is primary)."""
    return cls_name[0] if isinstance(cls_name, (list, tuple)) else cls_name


@functools.cache
def _exported_names() -> frozenset[str]:
    """Names the ``transformers`` package exports (its lazy module lists them without importing
    the modeling modules)."""
    import transformers

    return frozenset(dir(transformers))


@functools.cache
def entry(name: str) -> Entry:
    """Return the :class:`Entry` for architecture ``name`` (KeyError if it is not a causal LM)."""
    names = _causal_lm_names()
    if name not in names:
        raise KeyError(f"{name!r} is not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    cls_name = _primary(names[name])
    broken = override(name).get("broken")
    cfg_cls: type | None = None
    try:
        cfg_cls = config_class(name)
        # The modeling module is imported only when a model is built (importing all of them
        # would make listing the corpus take seconds): here, only check the class is exported.
        if cls_name not in _exported_names():
            raise ImportError(f"transformers does not export {cls_name}")
    except Exception as exc:  # a mapping entry whose modules do not import in this install
        broken = broken or f"does not import: {type(exc).__name__}: {exc}"
    return Entry(
        name=name,
        config_class=cfg_cls,
        model_class_name=cls_name,
        status="broken" if broken else "ok",
        reason=broken,
        noncausal=override(name).get("noncausal"),
    )


def arch_for_config(config: Any) -> str:
    """The corpus architecture a config belongs to: its ``model_type`` when that is a causal-LM
    type, else the architecture whose causal-LM class takes this config class (text sub-configs
    such as ``mllama_text_model``). KeyError when none does."""
    names = all_types()
    if config.model_type in names:
        return config.model_type
    for name in names:
        if _model_config_class(name) is type(config):
            return name
    raise KeyError(f"no causal-LM architecture takes {type(config).__name__}")


def arch_for_config_type(model_type: str) -> str:
    """The architecture whose causal-LM class takes configs of ``model_type``."""
    for name in all_types():
        cc = _model_config_class(name)
        if getattr(cc, "model_type", None) == model_type:
            return name
    raise KeyError(f"unknown config model_type {model_type!r}")


def _model_config_class(name: str) -> type | None:
    """The config class the causal-LM class of ``name`` declares (None if it does not import)."""
    try:
        return getattr(model_class(name), "config_class", None)
    except Exception:
        return None
