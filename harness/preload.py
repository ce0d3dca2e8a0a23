"""Imported once by the worker forkserver, so every worker forked from it starts warm.

Only imports and config enumeration: nothing here runs a tensor op, so no thread pool exists
before the fork (forking a process whose OpenMP pool is running can hang the child).
Any failure is swallowed: the forkserver must stay up, and each worker repeats these imports
in its setup, where an error is reported with its traceback.
"""

import contextlib

with contextlib.suppress(Exception):
    import torch.fx  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    import corpus
    import fusion  # noqa: F401

    corpus.architectures()  # imports every configuration module once, for all workers
