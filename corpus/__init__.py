"""corpus: every causal-LM architecture of the installed Transformers, as tiny random models."""
