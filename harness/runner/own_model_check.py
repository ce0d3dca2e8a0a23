"""Your own model: a local checkpoint or config.json, checked as a corpus architecture is.

`fusion-harness check PATH` (harness.cli) runs the same oracles on a user's model as the sweep
runs on the corpus: the fusion plan, parity of fused vs unfused against a float64 reference
(`harness.runner.arch_check.check_model`), the lifecycle checks and a repro bundle for each failure. This
module holds the steps, each a function that returns a value or raises `OwnModelError`:

    resolve_source(text)        PATH -> Source (config file, weight files); local paths only
    read_config_dict(file)      config.json -> a plain dict, refused if it loads code
    load_config(data)           dict -> (Transformers config, corpus architecture)
    shrink_config(config, arch) the corpus's tiny rules applied to the user's config (--tiny)
    count_parameters(...)       parameters, counted on the meta device (no memory used)
    estimate_memory(...)        what the check will hold at once, item by item
    check_memory(...)           refuse an estimate over the available memory (unless forced)
                                (the memory steps live in harness.runner.own_model_memory)
    build_model(...)            the unfused model: checkpoint weights, or seeded random ones
    run_check(...)              build + check_model + bundles -> the result record

Nothing is downloaded: PATH must exist on this machine (a Hub id such as
"meta-llama/Llama-3.2-1B" is refused, saying so), weights load with `local_files_only=True`
and never with `trust_remote_code`, and the config passes the same safety check as an
untrusted repro bundle's (`harness.runner.repro.check_config_safety`: no `auto_map`, remote code,
quantization backends, Hub kernels or URLs). Weights are read from safetensors files only
(a `.bin` checkpoint is a pickle).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import io
import json
import re
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers.utils import logging as hf_logging

import corpus
from corpus.builder import quiet_transformers
from corpus.catalog import model_class
from corpus.overrides import deep_merge, override
from corpus.tiny import shrink_kwargs
from fusion.kernels import policy
from harness.base.results import ArchResult
from harness.oracles import localise
from harness.reporting import plans
from harness.runner import arch_check, repro
from harness.runner.own_model_memory import (  # the memory steps, part of this module's API
    OwnModelError,
)

MAX_CONFIG_BYTES = 4 * 1024 * 1024
"""Largest config.json read (real ones are a few kB; the bound keeps a wrong file cheap)."""

MAX_CONFIG_DEPTH = repro.MAX_DEPTH
"""Deepest JSON nesting accepted in a config (the bundle bound: sub-configs, rope dicts)."""

PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt")
"""Weight files that are pickles: never loaded (loading one can run code)."""

NEVER_DOWNLOADS = (
    "fusion-harness check never downloads: give a local directory written by "
    "save_pretrained (config.json + safetensors), a Hub cache folder (models--ORG--NAME), "
    "a .gguf file or a config.json file"
)


@dataclass(frozen=True)
class Source:
    """What PATH names: the config file and, for a checkpoint directory, its weight files."""

    path: Path
    """PATH as resolved (absolute, symlinks followed; a Hub snapshot's folder as chosen)."""
    config_file: Path
    """config.json, or for a GGUF source the .gguf file (whose metadata holds the config)."""
    weights: tuple[Path, ...] = ()
    """The directory's safetensors files (empty: a bare config, or a directory without
    weights), or the one .gguf file."""
    gguf: Path | None = None
    """The GGUF file the weights (and config) come from, loaded through Transformers' own
    GGUF support and dequantized; None for every other source."""

    @property
    def directory(self) -> Path | None:
        """The checkpoint directory, or None when PATH is a config file."""
        return self.path if self.path.is_dir() else None


@dataclass(frozen=True)
class Prepared:
    """A validated model to check: its config (shrunk with --tiny), architecture, size and
    where its weights come from."""

    source: Source
    config: Any
    architecture: str
    tiny: bool
    parameters: int | None
    """Counted on the meta device; None when the model does not construct there."""

    @property
    def checkpoint_weights(self) -> bool:
        """True when the check loads the checkpoint's weights (real size, safetensors present)."""
        return not self.tiny and bool(self.source.weights)

    def loading(self) -> str:
        """The build step in words, for progress ("loading the checkpoint's weights")."""
        if self.checkpoint_weights and self.source.gguf is not None:
            return f"loading and dequantizing {self.source.gguf.name} (GGUF)"
        if self.checkpoint_weights:
            return "loading the checkpoint's weights"
        return "building the model with seeded random weights"

    def describe(self) -> str:
        """One line: architecture, class, size and where the weights come from."""
        size = f"{self.parameters:,} parameters" if self.parameters is not None else "size unknown"
        shrunk = ", shrunk with the corpus rules (--tiny)" if self.tiny else ""
        if self.checkpoint_weights and self.source.gguf is not None:
            weights = f"weights from GGUF ({self.source.gguf.name}), dequantized by Transformers"
        elif self.checkpoint_weights:
            names = ", ".join(p.name for p in self.source.weights[:3])
            more = (
                f" and {len(self.source.weights) - 3} more" if len(self.source.weights) > 3 else ""
            )
            weights = f"checkpoint weights ({names}{more})"
        elif self.tiny and self.source.weights:
            weights = "random weights (--tiny does not load the checkpoint's)"
        else:
            weights = "random weights (no safetensors weights at PATH)"
        cls = model_class(self.architecture).__name__
        return f"{self.architecture} ({cls}{shrunk}), {size}; {weights}"


def resolve_source(text: str, *, tiny: bool = False) -> Source:
    """The Source that PATH names; OwnModelError unless it is an existing local directory with
    a config.json (a checkpoint), a Hub cache folder (`models--ORG--NAME`, its snapshot chosen
    by `refs/main` or as the only one), a directory holding one .gguf file, a .gguf file or a
    JSON config file.

    Safe because nothing but the local file system is consulted: a name that does not exist
    here (a Hub id included) is refused with a message saying that the check never downloads.
    A directory whose only weights are pickles (`.bin`, `.pt`) is refused too unless `tiny`
    (which loads no weights), rather than checked with random weights the user did not ask
    for (the check loads safetensors and GGUF only), and so is a safetensors file that is not
    whole (`safetensors_problem`) or a .gguf file without GGUF's magic, naming the file.
    """
    path = Path(text).expanduser()
    if not path.exists():
        hub = re.fullmatch(r"[\w.-]+/[\w.-]+", text) is not None and not text.startswith(".")
        what = "looks like a Hub model id and is not a local path" if hub else "does not exist"
        raise OwnModelError(f"{text!r} {what}; {NEVER_DOWNLOADS}")
    path = path.resolve()
    if path.is_dir() and not (path / "config.json").is_file():
        snapshot = hub_snapshot(path)
        ggufs = sorted(path.glob("*.gguf"))
        if snapshot is not None:
            path = snapshot
        elif len(ggufs) == 1:
            path = ggufs[0]
        else:
            more = f" but {len(ggufs)} .gguf files (name one)" if ggufs else ""
            raise OwnModelError(f"{path} has no config.json{more}; {NEVER_DOWNLOADS}")
    if path.is_dir():
        return _checkpoint_directory(path, tiny=tiny)
    if path.is_file() and path.suffix == ".gguf":
        problem = gguf_problem(path)
        if problem:
            raise OwnModelError(f"{path}: {problem}")
        return Source(path, path, (path,), gguf=path)
    if path.is_file() and path.suffix == ".json":
        return Source(path, path)
    raise OwnModelError(
        f"{path} is neither a checkpoint directory, a .gguf file nor a .json config file"
    )


def _checkpoint_directory(path: Path, *, tiny: bool) -> Source:
    """The Source of a directory holding config.json (see resolve_source)."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise OwnModelError(f"{path} has no config.json; {NEVER_DOWNLOADS}")
    weights = tuple(sorted(path.glob("*.safetensors")))
    if not tiny:
        for file in weights:
            problem = safetensors_problem(file)
            if problem:
                raise OwnModelError(f"{file}: {problem}; is the checkpoint complete?")
    pickled = any(any(path.glob(pattern)) for pattern in PICKLE_WEIGHTS)
    if pickled and not weights and not tiny:
        raise OwnModelError(
            f"{path} holds weights only as pickles (.bin/.pt), which the check does not "
            "load (unpickling can run code); convert them to safetensors (save_pretrained "
            "does), or use --tiny to check the architecture with random weights"
        )
    return Source(path, config_file, weights)


def hub_snapshot(path: Path) -> Path | None:
    """The snapshot folder of a Hub cache folder (`models--ORG--NAME/snapshots/HASH`): the
    one `refs/main` names, else the only one; None when `path` is no such folder (or holds
    several snapshots and no ref to choose between them: the caller refuses it)."""
    snapshots = path / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = path / "refs" / "main"
    if ref.is_file():
        chosen = snapshots / ref.read_text(encoding="ascii", errors="replace").strip()
        if chosen.is_dir():
            return chosen
    found = [p for p in snapshots.iterdir() if p.is_dir()]
    return found[0] if len(found) == 1 else None


GGUF_MAGIC = b"GGUF"


def gguf_problem(file: Path) -> str | None:
    """Why `file` cannot be a GGUF file (no GGUF magic, unreadable), or None."""
    try:
        with file.open("rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    if magic != GGUF_MAGIC:
        return "not a GGUF file (it does not start with GGUF's magic bytes)"
    return None


SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024
"""Largest safetensors header read (the format's own bound; real ones are kilobytes)."""


def safetensors_problem(file: Path) -> str | None:
    """Why `file` is not a whole safetensors file, or None when it is.

    Reads only the header (an 8-byte little-endian length, then that much JSON mapping each
    tensor to its byte range in the data that follows) and the file's size: a file cut short
    (an interrupted copy or download) holds less data than its header's largest end offset.
    Checked before loading, so the user is told which file is damaged rather than that the
    model "cannot build"."""
    try:
        size = file.stat().st_size
        with file.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                return f"truncated: {size} bytes, not even a safetensors header"
            length = int.from_bytes(prefix, "little")
            if length > min(SAFETENSORS_MAX_HEADER, size - 8):
                return f"not a safetensors file (header of {length} bytes in a {size}-byte file)"
            header = json.loads(handle.read(length).decode("utf-8"))
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return "not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return "not a safetensors file (its header is not a JSON object)"
    ends = [
        entry["data_offsets"][1]
        for name, entry in header.items()
        if name != "__metadata__"
        and isinstance(entry, dict)
        and isinstance(entry.get("data_offsets"), list)
        and len(entry["data_offsets"]) == 2
        and isinstance(entry["data_offsets"][1], int)
    ]
    needed = 8 + length + max(ends, default=0)
    if size < needed:
        return f"truncated: {size:,} bytes where its header describes {needed:,}"
    return None


def read_config_dict(file: Path) -> dict[str, Any]:
    """The JSON object in `file`, refused (OwnModelError) unless it is a regular file of at
    most MAX_CONFIG_BYTES holding strict JSON, nested at most MAX_CONFIG_DEPTH deep, that
    loads no code and reaches no network.

    Returns plain data only: the code-loading checks are repro's for untrusted bundles
    (`check_config_safety`: `auto_map`, `trust_remote_code`, quantization, Hub kernels, URLs),
    so a config that names custom code is refused before Transformers sees it.
    """
    try:
        info = file.stat()
    except OSError as exc:
        raise OwnModelError(f"{file}: cannot be read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise OwnModelError(f"{file}: not a regular file")
    if info.st_size > MAX_CONFIG_BYTES:
        raise OwnModelError(
            f"{file}: {info.st_size} bytes, more than the {MAX_CONFIG_BYTES} a config may have"
        )
    try:
        data = json.loads(file.read_bytes()[: MAX_CONFIG_BYTES + 1].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise OwnModelError(f"{file}: not a JSON config: {type(exc).__name__}: {exc}") from None
    if not isinstance(data, dict):
        raise OwnModelError(f"{file}: expected a JSON object, found {type(data).__name__}")
    if repro.json_depth(data) > MAX_CONFIG_DEPTH:
        raise OwnModelError(f"{file}: JSON nested more than {MAX_CONFIG_DEPTH} levels deep")
    if "auto_map" in data or data.get("trust_remote_code"):
        raise OwnModelError(
            f"{file}: refused: the config names custom code (auto_map / trust_remote_code), "
            "which fusion-harness never runs; check a model whose class Transformers ships"
        )
    try:
        repro.check_config_safety(data, where=str(file))
    except repro.BundleError as exc:
        raise OwnModelError(str(exc)) from None
    return data


def load_config(data: Mapping[str, Any]) -> tuple[Any, str]:
    """(Transformers config, corpus architecture) of a config dict read by read_config_dict.

    Built through the config class's `from_dict` (`corpus.config_from_dict`), which runs no
    code the dict names. OwnModelError when the dict has no `model_type`, the installed
    Transformers does not know it, its constructor rejects the values, or no causal-LM class
    takes the config (the check runs causal LMs, as the corpus does).
    """
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise OwnModelError("the config has no model_type; is it a Transformers config.json?")
    try:
        config = corpus.config_from_dict(model_type, dict(data))
    except KeyError:
        raise OwnModelError(
            f"model_type {printable_name(model_type)} is unknown to the installed Transformers "
            f"{transformers.__version__} (`fusion-harness list` lists its causal-LM types)"
        ) from None
    except Exception as exc:
        raise OwnModelError(f"Transformers rejects this config: {localise.one_line(exc)}") from None
    try:
        architecture = corpus.arch_for_config(config)
    except KeyError:
        raise OwnModelError(
            f"model_type {model_type!r} has no causal-LM class in the installed Transformers; "
            "the check runs causal language models"
        ) from None
    return _with_pad_token(config), architecture


def printable_name(text: str, limit: int = 60) -> str:
    """`text` quoted for a one-line message, cut to `limit` characters (a config's
    model_type is the user's file, not ours: it may be anything)."""
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 4] + "...'"


GGUF_EXTRA = "pip install 'fusion-harness[gguf]' (or pip install gguf accelerate)"


def load_gguf_config(file: Path) -> tuple[Any, str]:
    """(Transformers config, corpus architecture) from a GGUF file's metadata, read by
    Transformers' own GGUF support (`AutoConfig.from_pretrained(dir, gguf_file=...)`, local
    files only). The resulting config passes the same safety and causal-LM checks as a
    config.json's. OwnModelError without the `gguf` package, or where Transformers cannot
    read the file or does not support its architecture."""
    from transformers import AutoConfig

    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise OwnModelError(
            f"{file}: loading GGUF needs the {' and '.join(missing)} package(s): {GGUF_EXTRA}"
        )
    try:
        with quiet_transformers():
            config = AutoConfig.from_pretrained(
                str(file.parent), gguf_file=file.name, local_files_only=True
            )
    except Exception as exc:
        raise OwnModelError(
            f"{file}: Transformers cannot read this GGUF file: {localise.one_line(exc)}"
        ) from None
    data = json.loads(config.to_json_string(use_diff=False))  # plain JSON, as config.json
    try:
        repro.check_config_safety(data, where=str(file))
    except repro.BundleError as exc:
        raise OwnModelError(str(exc)) from None
    return load_config(data)


def _with_pad_token(config: Any) -> Any:
    """`config`, given `pad_token_id = None` where it lacks the attribute: some 5.0 configs
    dropped it while their models still read it (what `corpus.tiny_config` does too)."""
    if not hasattr(config, "pad_token_id"):
        config.pad_token_id = None
    return config


def shrink_config(config: Any, architecture: str) -> Any:
    """A tiny copy of `config` by the corpus's rules, `config` untouched.

    The corpus's shrinker (`corpus.tiny.shrink_kwargs`) reads the user's config, with every
    value the file sets counted as given (so it is shrunk, not re-derived), and the
    architecture's overrides (`corpus/overrides.toml`) are merged on top, as for a corpus
    build; every other value is the user's. As in the corpus, the "fill" families (head_dim,
    kv heads, experts) are set first and left to the constructor if it rejects that.
    OwnModelError when no variant constructs.
    """
    given = config.to_diff_dict()
    overrides = override(architecture).get("config", {})
    first: Exception | None = None
    for fill in (True, False):
        kwargs = deep_merge(given, shrink_kwargs(config, fill=fill, explicit=given))
        kwargs = deep_merge(kwargs, overrides)
        try:
            with quiet_transformers():
                return _with_pad_token(type(config).from_dict(copy.deepcopy(kwargs)))
        except Exception as exc:
            first = first or exc
    raise OwnModelError(
        f"the corpus rules cannot shrink this config: {localise.one_line(first)}"
    ) from first


def count_parameters(config: Any, architecture: str) -> int | None:
    """Parameters of the model `config` builds, constructed on the meta device (no memory, no
    weights read); None when the model does not construct there (the build will say why)."""
    try:
        with torch.device("meta"), quiet_transformers():
            model = model_class(architecture)._from_config(copy.deepcopy(config))
    except Exception:
        return None
    return sum(p.numel() for p in model.parameters())


def prepare(text: str, *, tiny: bool) -> Prepared:
    """PATH validated, its config loaded (and shrunk with `tiny`) and its model counted;
    OwnModelError for anything the check refuses. Reads only local files; builds nothing."""
    source = resolve_source(text, tiny=tiny)
    if source.gguf is not None:
        config, architecture = load_gguf_config(source.gguf)
    else:
        config, architecture = load_config(read_config_dict(source.config_file))
    if tiny:
        config = shrink_config(config, architecture)
    return Prepared(source, config, architecture, tiny, count_parameters(config, architecture))


@contextlib.contextmanager
def _quiet_loading() -> Iterator[None]:
    """Transformers' logger below errors and its progress bars off while inside (both as they
    were afterwards): loading a checkpoint prints a bar per shard on stderr otherwise."""
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with quiet_transformers():
            yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def build_model(
    prepared: Prepared, options: arch_check.CheckOptions
) -> tuple[nn.Module, list[str]]:
    """(the unfused model in eval mode, notes for the user) for `prepared` under `options`.

    With checkpoint weights: the causal-LM class's `from_pretrained` of the directory with the
    validated config object (config.json is not read again), `local_files_only=True`,
    `use_safetensors=True` and no remote code, so nothing is downloaded, unpickled or run; a
    weight the checkpoint lacks is named in the notes (Transformers initialises it). A GGUF
    source loads through Transformers' own GGUF support (`gguf_file=`), which dequantizes every
    tensor to `options.dtype`: the model checked is that dequantized float model. Otherwise
    `corpus.build_from_config`: seeded random weights, bit-identical for the same config and
    seed. Raises whatever the build raises; the caller records it as a build error.
    """
    if not prepared.checkpoint_weights:
        model = corpus.build_from_config(
            prepared.config,
            seed=options.seed,
            dtype=options.torch_dtype,
            device=options.device,
            name=prepared.architecture,
        )
        return model, []
    cls = model_class(prepared.architecture)
    load: dict[str, Any] = dict(
        config=copy.deepcopy(prepared.config),
        local_files_only=True,
        trust_remote_code=False,
        output_loading_info=True,
    )
    directory = prepared.source.path
    quiet: Any = contextlib.nullcontext()
    if prepared.source.gguf is not None:
        directory = prepared.source.gguf.parent
        load.update(gguf_file=prepared.source.gguf.name, **_dequantized())
        # its own tqdm bar ("de-quantizing GGUF tensors"), which the logging switch misses
        quiet = contextlib.redirect_stderr(io.StringIO())
    else:
        load["use_safetensors"] = True
    with _quiet_loading(), quiet:
        try:
            model, info = cls.from_pretrained(str(directory), dtype=options.torch_dtype, **load)
        except TypeError as exc:  # Transformers < 4.56 takes torch_dtype only
            if "dtype" not in str(exc):
                raise
            model, info = cls.from_pretrained(
                str(directory), torch_dtype=options.torch_dtype, **load
            )
    model = model.to(options.device).eval()
    notes = []
    if prepared.source.gguf is not None:
        notes.append(gguf_note(model, prepared.source.gguf, options.dtype))
    for key, what in (
        ("missing_keys", "missing from the checkpoint, initialised by Transformers"),
        ("mismatched_keys", "of another shape in the checkpoint, initialised by Transformers"),
        ("unexpected_keys", "in the checkpoint but not in the model, ignored"),
    ):
        names = sorted(str(k) for k in (info.get(key) or ()))
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            notes.append(f"{len(names)} weight(s) {what}: {shown}")
    return model, notes


def gguf_note(model: nn.Module, file: Path, dtype: str) -> str:
    """The note that says the verdict is about GGUF weights dequantized by Transformers;
    ValueError (the check's build error) when the model did not come out as a plain dense
    one (a quantizer kept, a parameter that is not floating point): that is not a model the
    check can judge as a checkpoint's."""
    packed = [n for n, p in model.named_parameters() if not p.is_floating_point()]
    if getattr(model, "hf_quantizer", None) is not None or packed:
        raise ValueError(
            f"{file.name}: Transformers kept GGUF weights quantized ({', '.join(packed[:3])}); "
            "the check judges dequantized models only"
        )
    return (
        f"weights from GGUF ({file.name}), dequantized to {dtype} by Transformers: the verdict "
        "is about that dequantized model"
    )


def _dequantized() -> dict[str, Any]:
    """from_pretrained's arguments that load a GGUF file as a plain dense model: Transformers
    lines with GGUF blocks kept packed (`GgufConfig`) would otherwise keep them so, running
    kernels fetched from the Hub where the `kernels` package is installed; older lines always
    dequantize and take no such option."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


@dataclass(frozen=True)
class Outcome:
    """A finished check: the result record and the notes to print with it."""

    result: ArchResult
    notes: tuple[str, ...] = ()


def run_check(
    prepared: Prepared,
    options: arch_check.CheckOptions,
    *,
    repro_dir: Path | None,
    progress: Callable[[str], None] | None = None,
) -> Outcome:
    """Build `prepared` and check it with harness.runner.arch_check.check_model; returns the result record
    (stamped with the versions that judged it, as the sweep's are), with a repro bundle under
    `repro_dir` for each failure. Never raises for a model-side problem: a model that does not
    build is the `build-error` status (a corpus-style problem, exit 3), as in the sweep.
    Transformers' logger is kept below errors during the check, as in the sweep's workers.
    `progress` is told each step as it starts (harness.runner.arch_check.check_model's, and the build)."""
    started = time.perf_counter()
    name = prepared.architecture
    if progress is not None:
        progress(prepared.loading())
    try:
        model, notes = build_model(prepared, options)
        inputs = arch_check.make_inputs(model, options)
    except Exception as exc:
        result = ArchResult(
            architecture=name,
            status="build-error",
            dtype=options.dtype,
            device=options.device,
            seed=options.seed,
            seconds=round(time.perf_counter() - started, 4),
            message=localise.one_line(exc),
            system=options.system,
        )
        return Outcome(
            dataclasses.replace(result, versions=plans.versions(), machine=policy.describe())
        )
    with quiet_transformers():  # as the sweep's workers: the harness's own generate with
        # right-padded inputs would print Transformers' padding advice, which is not the user's
        checked = arch_check.check_model(
            name, model, inputs, options, started=started, progress=progress
        )
    result = checked.result
    if repro_dir is not None and result.failures and checked.subject is not None:
        result = repro.write_bundles(result, checked.subject, repro_dir)
        if not prepared.tiny:
            notes.append(
                "a repro bundle rebuilds the model from its config with random weights (seed "
                f"{options.seed}); `fusion-harness repro` replays tiny configs only, so "
                "reproduce at this size with `fusion-harness check PATH` (or try --tiny)"
            )
    return Outcome(
        dataclasses.replace(result, versions=plans.versions(), machine=policy.describe()),
        tuple(notes),
    )


def format_plan(result: ArchResult) -> str:
    """The fusion plan of a checked model, per module class: what each fuser applied (with
    instance counts) and what was refused and why; "" when fusion did not run."""
    lines = [
        f"  {cls}: " + ", ".join(f"{fuser} x{n}" for fuser, n in sorted(fusers.items()))
        for cls, fusers in sorted(result.applied_by_class.items())
    ]
    lines += [
        f"  refused {r.source_class} [{r.fuser or 'none'}] x{r.count}: {r.reason}"
        f" (e.g. {r.example})"
        for r in result.refusals
    ]
    if not lines:
        return ""
    return "fusion plan (module class: fuser x instances):\n" + "\n".join(lines)


def source_options(prepared: Prepared) -> dict[str, Any]:
    """What the --json document records about PATH, beside the check options."""
    return {
        "path": str(prepared.source.path),
        "architecture": prepared.architecture,
        "tiny": prepared.tiny,
        "weights": _weights_word(prepared),
        "parameters": prepared.parameters,
    }


def _weights_word(prepared: Prepared) -> str:
    """Where the checked weights came from, for the --json document."""
    if not prepared.checkpoint_weights:
        return "random"
    return "gguf (dequantized)" if prepared.source.gguf is not None else "checkpoint"
