"""The vocabulary every layer of the harness shares: which architectures exist and the records of
their results.

    architectures   corpus names, --arch globs, test-plugin architectures (builds the models)
    results         result records and the locked, validated JSONL results file

May import: fusion's public API, the corpus; nothing of the harness.
"""
