"""Transformers common tests that a fused model fails on purpose, each with its reason.

A test belongs here only when it inspects what fusion changes by design (the module and
parameter layout of the fused model, the storage its checkpoint tensors share), never
because a fused model computes, trains, saves or loads differently: such a failure is a bug
in `fusion/`, and `python -m harness.suites.hf_tests` reports it as one. Keys are test method
names (parameterized variants share their base name's entry).
"""

from __future__ import annotations

EXCEPTIONS: dict[str, str] = {
    "test_eager_matches_batched_and_grouped_inference": (
        "replaces Transformers' experts kernels by mocks and asserts that the one named by "
        "set_experts_implementation is called. A fused MoE block runs its own fused kernel "
        "for the implementation chosen at fuse time and calls Transformers' experts module "
        "only for another one (README: a fused model over its whole life), so the mock of "
        "the fuse-time implementation is never called: the test inspects which kernel runs"
    ),
}


def reason(test_id: str) -> str | None:
    """The recorded reason for pytest node id (or method name) `test_id`, or None.

    The method name is the id's last `::` part without a parameterization suffix
    (`test_x_0_fp32` matches an entry `test_x` only through an explicit prefix rule: an
    entry applies to its own name and to names that extend it with `_`)."""
    name = test_id.rpartition("::")[2].partition("[")[0]
    for key, text in EXCEPTIONS.items():
        if name == key or name.startswith(f"{key}_"):
            return text
    return None
