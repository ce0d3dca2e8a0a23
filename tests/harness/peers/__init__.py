"""Tests of harness.peers."""
