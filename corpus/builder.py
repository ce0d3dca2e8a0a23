"""Turn an architecture name (or a stored config) into a deterministic tiny random model.

``tiny_config`` = default config -> generic shrinker (``corpus.tiny``) -> overrides -> rebuilt
through the constructor. ``build_from_config`` = seeded construction + targeted randomisation
(``corpus.weights``), then dtype/device. ``build`` = both, with failures turned into
:class:`~corpus.errors.BuildError` naming the architecture and the stage.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from corpus.catalog import (
    all_types,
    arch_for_config,
    arch_for_config_type,
    config_class,
    entry,
    model_class,
)
from corpus.errors import BuildError
from corpus.inputs import make_inputs
from corpus.overrides import deep_merge, override
from corpus.tiny import is_config, shrink_kwargs
from corpus.weights import deterministic_construction, randomise

__all__ = [
    "build",
    "build_from_config",
    "check",
    "config_from_dict",
    "tiny_config",
    "tiny_kwargs",
]


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence Transformers' logger below errors while inside (restored afterwards)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        yield
        return
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _one_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    first = next((m for m in msg if m.strip()), "")
    # Strict-dataclass validation errors put the useful line second.
    if "validation error" in first.lower() and len(msg) > 1:
        first = f"{first} {msg[1].strip()}"
    return f"{type(exc).__name__}: {first}"[:400]


def _fail(arch: str, stage: str, exc: BaseException) -> BuildError:
    reason = _one_line(exc)
    known = entry(arch).reason if arch in all_types() else None
    if known:
        reason = f"{known} [{reason}]"
    err = BuildError(arch, stage, reason)
    err.__cause__ = exc
    return err


def tiny_kwargs(name: str) -> dict[str, Any]:
    """Constructor kwargs of ``name``'s tiny config: shrinker output with overrides merged.

    Computed once per architecture; each call returns a fresh deep copy, so callers may mutate
    it without affecting later builds.
    """
    return copy.deepcopy(_tiny_kwargs(name))


@functools.cache
def _tiny_kwargs(name: str) -> dict[str, Any]:
    ov = override(name)
    defaults = ov.get("defaults", {})
    try:
        cls = config_class(name)
        with quiet_transformers():  # the default config's own warnings are not the user's
            default = cls(**copy.deepcopy(defaults))
        decoder = _decoder_flag(model_class(name), default)
    except Exception as exc:
        raise _fail(name, "config", exc) from exc
    # First with the "fill" families set (GQA / MoE paths on); a config whose validator insists
    # on its derived values (e.g. kv heads == heads) gets them left to the constructor instead.
    first: Exception | None = None
    for fill in (True, False):
        kw = deep_merge(defaults, shrink_kwargs(default, fill=fill, explicit=defaults))
        kw = deep_merge({**decoder, **kw}, ov.get("config", {}))
        try:
            cls(**copy.deepcopy(kw))
        except Exception as exc:
            first = first or exc
            continue
        return kw
    assert first is not None
    raise _fail(name, "config", first) from first


def _decoder_flag(mcls: type, default: Any) -> dict[str, Any]:
    """``{"is_decoder": True}`` for encoder-family causal LMs (BERT, RoBERTa, ...).

    Their causal-LM class reads ``config.is_decoder`` and, when it is False, runs bidirectional
    attention (Transformers warns "add is_decoder=True"): not a causal LM. Detected from the
    class's own ``__init__`` source, so no architecture is listed by hand.
    """
    if getattr(default, "is_decoder", True):
        return {}
    try:
        src = inspect.getsource(mcls.__init__)
    except (OSError, TypeError):
        return {}
    return {"is_decoder": True} if "is_decoder" in src else {}


def tiny_config(name: str) -> Any:
    """Return the tiny config the model for ``name`` is built from (a new object each call).

    For composite configs whose causal-LM class takes a sub-config (``MllamaForCausalLM`` takes
    ``MllamaTextConfig``), that sub-config is returned, i.e. what ``model.config`` will be.
    Raises :class:`BuildError` (stage ``config``) when the config cannot be constructed.
    """
    if name not in all_types():
        raise BuildError(name, "unknown", "not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    try:
        cls, mcls = config_class(name), model_class(name)
        config = cls(**tiny_kwargs(name))
    except BuildError:
        raise
    except Exception as exc:
        raise _fail(name, "config", exc) from exc
    config = _model_config(config, mcls)
    if not hasattr(config, "pad_token_id"):
        # Transformers 4 gave every config `pad_token_id = None`; some 5.0 configs (Phi,
        # StableLM, EXAONE 4, JetMoE) dropped the attribute while their models still read
        # it (`self.padding_idx = config.pad_token_id`). The old default is what they expect.
        config.pad_token_id = None
    return config


def _model_config(config: Any, mcls: type) -> Any:
    want = getattr(mcls, "config_class", None)
    if want is None or isinstance(config, want):
        return config
    for value in vars(config).values():
        if is_config(value) and isinstance(value, want):
            return value
    return config


def config_from_dict(model_type: str, d: dict[str, Any]) -> Any:
    """Rebuild a config from ``config.to_dict()`` output (for instance a repro bundle's JSON).

    ``model_type`` is the config's ``model_type`` (or a corpus architecture name). Goes through
    ``from_dict``, i.e. the constructor, so the result equals the original config and builds
    bit-identical weights with the same seed.
    """
    from transformers import CONFIG_MAPPING

    d = _special_floats(json.loads(json.dumps(d)))  # detached, JSON types, inf/nan restored
    try:
        cls = CONFIG_MAPPING[model_type]
    except KeyError:
        cls = config_class(arch_for_config_type(model_type))
    return cls.from_dict(d)


_FLOAT_TAGS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _special_floats(value: Any) -> Any:
    """`value` with every `{"__float__": "Infinity"}` (how Transformers' JSON serialisation
    spells inf, -inf and nan, which JSON lacks) turned back into the float it stands for."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in _FLOAT_TAGS:
            return _FLOAT_TAGS[value["__float__"]]
        return {key: _special_floats(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_special_floats(item) for item in value]
    return value


def _construct(mcls: type, config: Any) -> nn.Module:
    """Construct in float32 whatever ``config.dtype`` says, so weights never depend on it.

    Transformers >= 4.56 takes ``dtype``; older releases only ``torch_dtype``.
    """
    try:
        return mcls._from_config(config, dtype=torch.float32)
    except TypeError as exc:
        if "dtype" not in str(exc):
            raise
        return mcls._from_config(config, torch_dtype=torch.float32)


def _cast(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast to ``dtype`` like ``from_pretrained`` would: tensors named by the class's
    ``_keep_in_fp32_modules`` (float16 only) and ``_keep_in_fp32_modules_strict`` (float16 and
    bfloat16) stay float32. Entries are dotted name fragments (``"wo"``, ``"gate.weight"``)."""
    model.to(dtype=dtype)
    keep: set[str] = set()
    if dtype == torch.float16:
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or [])
    if dtype in (torch.float16, torch.bfloat16):
        keep |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if not keep:
        return
    with torch.no_grad():
        for qual, tensor in [*model.named_parameters(), *model.named_buffers()]:
            dotted = f".{qual}."
            if tensor.is_floating_point() and any(f".{k}." in dotted for k in keep):
                tensor.data = tensor.data.to(torch.float32)


def build_from_config(
    config: Any,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    name: str | None = None,
) -> nn.Module:
    """Build the causal-LM model for ``config`` with deterministic random weights.

    Same config + seed -> bit-identical weights on every call and every device: the model is
    constructed in float32 on CPU under a private seeded RNG, norms and zero biases are redrawn
    (``corpus.weights``), then it is cast and moved. Returned in eval mode. ``name`` picks the
    architecture when the config alone is ambiguous. The caller's RNG state is left untouched.
    Raises :class:`BuildError` (stage ``model``).
    """
    arch = name or arch_for_config(config)
    config = copy.deepcopy(config)
    try:
        mcls = model_class(arch)
        with deterministic_construction(seed):
            model = _construct(mcls, config)
        std = getattr(config, "initializer_range", None)
        randomise(model, seed, std=std if isinstance(std, float) and std > 0 else 0.02)
        model.eval()
        _cast(model, dtype)
        model.to(device)
    except Exception as exc:
        raise _fail(arch, "model", exc) from exc
    return model


def build(
    name: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """Build architecture ``name`` as a tiny random model (see :func:`build_from_config`).

    Raises :class:`BuildError` naming ``name`` and the stage when it cannot be built.
    """
    if name not in all_types():
        raise BuildError(name, "unknown", "not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    return build_from_config(tiny_config(name), seed=seed, dtype=dtype, device=device, name=name)


def check(
    name: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Any:
    """Build ``name`` and run one forward on :func:`make_inputs`; return the model output.

    Raises :class:`BuildError` (stage ``forward``) if the forward raises, or if the logits are
    missing, misshapen or not finite.
    """
    model = build(name, seed=seed, dtype=dtype, device=device)
    inputs = make_inputs(model, seed=seed, device=device)
    try:
        with torch.no_grad():
            out = model(**inputs)
        logits = getattr(out, "logits", None)
        if logits is None and isinstance(out, tuple):
            logits = out[0]
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"forward returned no logits ({type(out).__name__})")
        if tuple(logits.shape[:2]) != tuple(inputs["input_ids"].shape):
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match the inputs")
        if not torch.isfinite(logits).all():
            raise ValueError("logits are not finite")
    except Exception as exc:
        raise _fail(name, "forward", exc) from exc
    return out
