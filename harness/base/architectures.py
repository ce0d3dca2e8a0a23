"""Which architectures a command may name, and how one of them is built.

The corpus is the only source of real architectures. Tests need architectures that abort, hang
or build slowly on purpose; they come from *test plugins*: modules named (comma-separated) in the
FUSION_HARNESS_TEST_PLUGINS environment variable, each defining

    HARNESS_ARCHITECTURES: dict[str, Callable[..., nn.Module]]   # name -> build(seed=, dtype=, device=)

Plugin architectures never enter the corpus and are invisible unless the variable is set. The CLI
reads the variable once and hands the module names to worker processes explicitly (as
`CheckOptions.plugins`): a forkserver's children would not see a later change of the environment.
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib
import os
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from harness.base.errors import InputError

PLUGINS_ENV = "FUSION_HARNESS_TEST_PLUGINS"

Builder = Callable[..., nn.Module]


class UnknownArchitecture(ValueError, InputError):
    """A requested name or glob matches no architecture."""


class BuilderExit(RuntimeError):
    """A model builder raised SystemExit (see `build`)."""


class PluginError(ImportError, InputError):
    """A test plugin module is missing or does not define HARNESS_ARCHITECTURES."""


def plugins_from_env(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The test plugin module names the environment asks for (usually none)."""
    return tuple(m.strip() for m in environ.get(PLUGINS_ENV, "").split(",") if m.strip())


def plugin_architectures(plugins: Sequence[str]) -> dict[str, Builder]:
    """{name: build callable} of every plugin architecture (imports the plugin modules)."""
    found: dict[str, Builder] = {}
    for module_name in plugins:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise PluginError(f"test plugin {module_name!r} cannot be imported: {exc}") from exc
        table = getattr(module, "HARNESS_ARCHITECTURES", None)
        if not isinstance(table, dict):
            raise PluginError(f"test plugin {module_name!r} defines no HARNESS_ARCHITECTURES dict")
        found.update(table)
    return found


def available(plugins: Sequence[str] = ()) -> list[str]:
    """Corpus architectures (corpus order) followed by plugin architectures (sorted)."""
    import corpus

    names = list(corpus.architectures())
    extra = plugin_architectures(plugins)
    clash = sorted(set(names) & set(extra))
    if clash:
        raise PluginError(f"test plugin architectures shadow corpus ones: {clash}")
    return names + sorted(extra)


def select(patterns: Iterable[str], names: Sequence[str]) -> list[str]:
    """The names matching any of `patterns` (exact names or fnmatch globs), in `names` order.

    No patterns selects everything. A pattern matching nothing raises UnknownArchitecture with
    the closest names, since a typo would otherwise silently shrink a sweep.
    """
    patterns = list(patterns)
    if not patterns:
        return list(names)
    chosen: set[str] = set()
    for pattern in patterns:
        matched = fnmatch.filter(names, pattern)
        if not matched:
            close = difflib.get_close_matches(pattern, names, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise UnknownArchitecture(f"--arch {pattern!r} matches no architecture{hint}")
        chosen.update(matched)
    return [n for n in names if n in chosen]


def build(
    name: str, *, seed: int, dtype: torch.dtype, device: str, plugins: Sequence[str] = ()
) -> nn.Module:
    """The tiny random model for `name`: a plugin's builder if one defines it, else the corpus.

    Raises whatever the builder raises (corpus.BuildError for a corpus architecture that does
    not build); the caller records it. A builder that raises SystemExit (a library calling
    sys.exit on a bad config) raises BuilderExit instead: an Exception, so it is recorded as a
    build error like any other, not taken for the end of the worker.
    """
    builders = plugin_architectures(plugins) if plugins else {}
    if name in builders:
        try:
            return builders[name](seed=seed, dtype=dtype, device=device)
        except SystemExit as exc:
            raise BuilderExit(f"the builder called sys.exit({exc.code!r})") from None
    import corpus

    try:
        return corpus.build(name, seed=seed, dtype=dtype, device=device)
    except SystemExit as exc:
        raise BuilderExit(f"the builder called sys.exit({exc.code!r})") from None


def unbuildable() -> dict[str, str]:
    """{name: reason} of every causal-LM architecture the corpus knows it cannot build."""
    import corpus

    return {
        name: corpus.entry(name).reason or "(no reason recorded)"
        for name in corpus.all_types()
        if corpus.entry(name).status != "ok"
    }
