"""fusion's public entry points: what users import from `fusion` itself, never an internal
layer's path."""

from __future__ import annotations

import fusion
from fusion.runtime import checkpoint


def test_every_public_name_is_importable_from_fusion() -> None:
    for name in fusion.__all__:
        assert hasattr(fusion, name), name
    for name in ("fuse", "plan", "calibrate", "available_backends", "kernel_choices"):
        assert callable(getattr(fusion, name)), name


def test_unfused_state_dict_is_the_checkpoint_one() -> None:
    """The README's quick start exports an unfused checkpoint with `fusion.unfused_state_dict`."""
    assert "unfused_state_dict" in fusion.__all__
    assert fusion.unfused_state_dict is checkpoint.unfused_state_dict
