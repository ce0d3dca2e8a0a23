"""Imported once by the worker forkserver, so every worker forked from it starts warm.

Only imports and config enumeration: nothing here runs a tensor op, so no thread pool exists
before the fork (forking a process whose OpenMP pool is running can hang the child).
Any failure is swallowed: the forkserver must stay up, and each worker repeats these imports
in its setup, where an error is reported with its traceback.

The forkserver shares the terminal's process group, so a Ctrl-C in the first seconds reaches
it while these imports run: SIGINT is ignored first (the forkserver ignores it anyway once its
loop starts; Ctrl-C is the parent's to handle), so no KeyboardInterrupt traceback is printed.
The forkserver also asks to be killed with its parent (harness.runner.pool.die_with_parent), and its
workers with it, however the parent ends.
"""

import contextlib
import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)

with contextlib.suppress(Exception):
    from harness.runner.pool import die_with_parent

    die_with_parent()

with contextlib.suppress(Exception):
    import torch.fx  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    import corpus
    import fusion  # noqa: F401

    corpus.architectures()  # imports every configuration module once, for all workers
