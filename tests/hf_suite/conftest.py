"""Markers Transformers' test code applies (its own conftest registers them; --strict-markers
would reject them here)."""

from __future__ import annotations

import pytest

TRANSFORMERS_MARKERS = (
    "accelerate_tests",
    "flash_attn_test",
    "flash_attn_3_test",
    "flash_attn_4_test",
    "is_agent_test",
    "is_expert_parallel_test",
    "is_fsdp_test",
    "is_pipeline_test",
    "is_staging_test",
    "is_tensor_parallel_test",
    "is_training_test",
    "order",
    "torch_compile_test",
)


def pytest_configure(config: pytest.Config) -> None:
    for name in TRANSFORMERS_MARKERS:
        config.addinivalue_line("markers", f"{name}: applied by Transformers' test code")
