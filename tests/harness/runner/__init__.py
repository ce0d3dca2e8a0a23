"""Tests of harness.runner."""
