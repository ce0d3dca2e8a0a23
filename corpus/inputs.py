"""The forward inputs the harness and the corpus share.

Batch of ``batch`` rows of ``seq`` random token ids, with right padding on every odd row (the
last ``min(2, seq - 1)`` positions masked and, when the config has a pad token, holding it). Right padding is the broadly safe choice: every query
still attends to at least one real key, so no attention row is fully masked (a fully masked row
is NaN in several eager attention paths, and the parity oracle never accepts NaN). Token ids avoid
every special id the config names (pad, bos, image/audio placeholders...), so multimodal models
never see a placeholder without its pixels.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from corpus.catalog import arch_for_config, model_class
from corpus.overrides import override
from corpus.tiny import is_config, special_token_ids

__all__ = ["make_inputs"]


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _text_vocab(config: Any) -> int:
    text = _text_config(config)
    for c in (text, config):
        v = getattr(c, "vocab_size", None)
        if isinstance(v, int) and v > 0:
            return v
    raise ValueError(f"config {type(config).__name__} has no vocab_size")


def _accepts(model: Any, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def make_inputs(
    model_or_config: Any,
    *,
    seed: int,
    batch: int = 2,
    seq: int = 6,
    device: str | torch.device = "cpu",
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Return forward kwargs: ``input_ids``, ``attention_mask`` and, when the model's forward
    takes it, ``use_cache=False`` (a single forward needs no cache, and hybrid caches are the
    commonest failure otherwise). The architecture's ``inputs`` override and then ``extra`` are
    merged on top.

    Deterministic in ``seed``; ids are drawn on CPU then moved, so every device sees the same ids.
    """
    model = None if is_config(model_or_config) else model_or_config
    config = model_or_config if model is None else model.config
    try:
        arch: str | None = arch_for_config(config)
    except KeyError:  # a config the corpus does not know: plain inputs
        arch = None
    forward_owner = model if model is not None else (model_class(arch) if arch else None)
    vocab = _text_vocab(config)
    specials = special_token_ids(config)
    allowed = torch.tensor([i for i in range(vocab) if i not in specials], dtype=torch.long)
    if allowed.numel() == 0:
        allowed = torch.arange(vocab)
    ov = override(arch) if arch else {}
    rows = batch
    # Multi-codebook decoders take one input row per codebook per sample.
    per_sample = ov.get("inputs_rows_per_sample")
    if isinstance(per_sample, str) and isinstance(getattr(config, per_sample, None), int):
        rows = batch * getattr(config, per_sample)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, allowed.numel(), (rows, seq), generator=gen)
    input_ids = allowed[idx]
    mask = torch.ones(batch, seq, dtype=torch.long)
    pad = min(2, seq - 1)
    if pad > 0:
        mask[1::2, seq - pad :] = 0
        # Padded positions hold the pad token, as a tokenizer would produce (when there is one).
        pad_id = getattr(_text_config(config), "pad_token_id", None)
        if isinstance(pad_id, int) and 0 <= pad_id < vocab and rows == batch:
            input_ids[mask == 0] = pad_id
    kwargs: dict[str, Any] = {"input_ids": input_ids.to(device), "attention_mask": mask.to(device)}
    if forward_owner is not None and _accepts(forward_owner, "use_cache"):
        kwargs["use_cache"] = False
    for k, v in {**ov.get("inputs", {}), **(extra or {})}.items():
        kwargs[k] = v
    return kwargs
