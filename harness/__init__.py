"""harness: differential testing of fused vs unfused Transformers models."""
