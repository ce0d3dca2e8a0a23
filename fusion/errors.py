"""The one exception type every fail-closed refusal raises."""

from __future__ import annotations


class RewriteRefused(Exception):
    """A fuser declined to rewrite a module; `str(exc)` is the reason shown in reports.

    Raised by source recovery, alias analysis and fusers alike, so `fusion.engine.apply` can tell a
    deliberate refusal (recorded as skipped, with its reason) from a bug (also recorded, but
    as an error with its type).
    """
