"""harness.suites.hf_tests.exceptions: every listed test has a reason; lookups by node id."""

from __future__ import annotations

from harness.suites.hf_tests import exceptions


def test_every_exception_says_why():
    assert exceptions.EXCEPTIONS
    for name, why in exceptions.EXCEPTIONS.items():
        assert name.startswith("test_") and len(why) > 80, name


def test_reason_by_node_id_and_parameterized_name():
    why = exceptions.EXCEPTIONS["test_eager_matches_batched_and_grouped_inference"]
    assert (
        exceptions.reason(
            "tests/hf_suite/hf_mixins.py::HFLlamaMixinTest::test_eager_matches_batched_and_grouped_inference"
        )
        == why
    )
    assert (
        exceptions.reason("x.py::C::test_eager_matches_batched_and_grouped_inference_0_fp32") == why
    )
    assert exceptions.reason("x.py::C::test_tied_weights_are_sharded_together") is None
    assert exceptions.reason("x.py::C::test_save_load") is None
