"""Tests of harness.suites."""
