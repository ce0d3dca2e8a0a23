"""Tests of harness.base."""
