"""Tests of harness.reporting."""
