"""Tests of harness.oracles."""
