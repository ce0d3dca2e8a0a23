"""The one exception class every layer raises for input the user got wrong.

`InputError` marks an exception as the user's input, not a bug: an unknown architecture, a
malformed results or golden file, shards that do not merge, a refused model path, options
that cannot work together. The command line answers each with one line on stderr and exit
status 2, never a traceback; anything else propagates. Subclasses keep their builtin base
(`ValueError`, `ImportError`) for callers that catch those.
"""

from __future__ import annotations


class InputError(Exception):
    """A mixin: this exception is the user's input (exit 2 with its message), not a bug."""
