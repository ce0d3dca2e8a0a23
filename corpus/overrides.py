"""Load ``overrides.toml``: per-architecture fixes, kept as data rather than code.

Each table is keyed by architecture (the ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` key) and may hold:

``defaults``  constructor kwargs used to build the *default* config the shrinker reads (for
              architectures whose own defaults do not construct);
``config``    constructor kwargs merged over the shrinker's output (nested tables merge into
              sub-config dicts);
``inputs``    extra keyword arguments for the forward (merged into ``make_inputs``);
``inputs_rows_per_sample``  a config attribute naming how many ``input_ids`` rows one sample
              takes (multi-codebook audio decoders);
``noncausal`` why the model attends to later positions although it is a causal-LM class
              (the corpus's causality check skips it);
``broken``    a known reason the architecture cannot be built or run; it is still attempted, and
              the reason is quoted in the ``BuildError``.

Entries naming architectures the installed Transformers does not have are ignored, so one file
serves several Transformers versions.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from importlib import resources
from typing import Any

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10 only
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["deep_merge", "override"]


@functools.cache
def _all() -> dict[str, dict[str, Any]]:
    text = resources.files(__package__).joinpath("overrides.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)


def override(arch: str) -> dict[str, Any]:
    """Return the override table for ``arch`` (empty when there is none). Never mutate it."""
    return _all().get(arch, {})


def deep_merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``base`` updated with ``extra``; nested mappings merge instead of being replaced."""
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out
