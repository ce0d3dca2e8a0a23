"""Repro bundles: write one directory per distinct failure, and replay it.

A bundle is plain text only (never a pickle), runnable with torch, transformers and this
package:

    bundle.json     versions, architecture, model_type + config dict, seed, dtype, device,
                    batch/seq of the inputs, failure kind, module qualname, fuser, source class,
                    error (and traceback tail), tolerance and observed error, signature,
                    system (the system under test, harness.runner.systems; absent = fusion)
    original.py     the forward source(s) before fusion      } when the fuser rewrote a forward
    rewritten.py    the forward source(s) after fusion       }
    forward.diff    their unified diff                       }
    repro.py        rebuilds the tiny model from bundle.json, fuses, checks; exit 1 if the
                    failure reproduces, 0 if not
    repro_liger.py  (system liger) the same without this package (harness.peers.liger_repro)

The model is rebuilt from the JSON config and the seed (corpus.config_from_dict +
corpus.build_from_config), so the bundle survives refactors of the corpus's shrinker.
Directories are named by architecture, kind, fuser and a hash of the failure signature: the
same failure found twice (another layer, another run) maps to the same directory and is
written once.

A bundle is untrusted input (it arrives attached to a bug report), so replay validates it
completely before building anything (`load_bundle`): bundle.json must be a regular file (no
symlink, FIFO or device) of at most MAX_BUNDLE_BYTES, JSON nested at most MAX_DEPTH deep, with
every field of the schema; batch, seq and every size of the config within the tiny-model bounds
the corpus uses (`check_config_sizes`); and no config field that loads code or reaches the
network (`check_config_safety`). Nothing is unpickled or executed. Strings from a bundle are
printed escaped (`printable`), so a bundle cannot drive the terminal. Exit status 1 means only
"the failure reproduces"; a malformed or unsafe bundle is 2 with a one-line reason on stderr.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import os
import platform
import re
import shutil
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusion.kernels import policy
from harness.base import architectures
from harness.base.results import ArchResult, Failure, json_safe
from harness.peers import liger_repro
from harness.runner import arch_check, systems

BUNDLE_FORMAT = 1
KINDS = (
    "fuse-error",
    "fused-forward-error",
    "model-parity",
    "module-parity",
    "module-error",
    "lifecycle",  # a lifecycle operation (harness.oracles.lifecycle) failed on the fused model
    "fused-warning",  # the fused forward raised a warning the unfused one did not
    "compile-error",  # an Inductor system's compile (or compiled forward) raised
    "not-applied",  # a system (liger) applied nothing that ran: no promised kernel launched
)

_NONE = type(None)
_NUMBER = (int, float, str, _NONE)  # str: "nan"/"inf" (strict JSON has no non-finite floats)
FIELDS: dict[str, tuple[type, ...]] = {
    "format": (int,),
    "versions": (dict,),
    "architecture": (str,),
    "model_type": (str,),
    "config": (dict,),
    "seed": (int,),
    "dtype": (str,),
    "device": (str,),
    "batch": (int,),
    "seq": (int,),
    "kind": (str,),
    "qualname": (str, _NONE),
    "fuser": (str, _NONE),
    "source_class": (str, _NONE),
    "error": (str,),
    "detail": (str,),
    "tolerance": _NUMBER,
    "observed": _NUMBER,
    "signature": (str,),
}
"""Every bundle.json field and the JSON types it may hold; replay checks each one."""

OPTIONAL_FIELDS: dict[str, tuple[type, ...]] = {"system": (str,), "machine": (dict,)}
"""Fields a bundle may lack (written before they existed), with their JSON types: `system`,
the system under test (harness.runner.systems), is "fusion" when absent."""

MAX_BUNDLE_BYTES = 4 * 1024 * 1024
"""Largest bundle.json replay reads (real ones are tens of kB: a config and a traceback tail)."""

MAX_DEPTH = 16
"""Deepest JSON nesting accepted (a config nests sub-configs and rope dicts a few levels)."""

MAX_BATCH, MAX_SEQ = 8, 64
"""Input bounds: the harness uses batch 2, 6 tokens; a little room for hand-made bundles."""

SIZE_SLACK = 16
"""A config size may exceed the corpus's tiny target for its name by this factor (per-arch
overrides raise a few sizes); beyond it the model would not be tiny. Loose on purpose: the
parameter count (MAX_PARAMETERS) bounds the whole model, this bounds each size on its own
(a vocabulary or a position table alone can ask for gigabytes)."""

UNSIZED = re.compile(r".*(window|chunk|index_topk|block_size|budget|ngram).*")
"""Shrinker rules for values that size nothing (attention windows, chunk lengths): exempt."""

MAX_PARAMETERS = 20_000_000
"""Backstop on the rebuilt model's parameter count (counted on the meta device, no memory):
catches a large size under a name the corpus's shrinker rules do not know."""

IMPLEMENTATIONS = frozenset({"eager", "sdpa", "grouped_mm", "batched_mm"})
"""Values a `*_implementation` config field may take: Transformers' built-in attention and
experts code. Anything else may name a Hub kernel repository that would be downloaded and run."""

FORBIDDEN_KEYS = re.compile(
    r"auto_map|trust_remote_code|custom_pipelines|quantization_config|use_kernels|"
    r"kernel_config|.*(hub|remote|_repo|repo_id|revision|_url).*"
)
"""Config field names that load code or reach the network (remote code, quantization backends,
Hub kernels, repositories); a bundle holding one anywhere in its config is refused."""

REPRO_SCRIPT = '''\
"""Replay of a fusion-harness failure: {title}

Rebuilds the tiny model from bundle.json (config + seed), fuses a copy with fusion.fuse, runs
the unfused, fused and float64 forwards and re-checks the failing module; prints the outcome.
Exit status: 1 if the failure reproduces, 0 if it does not, 2 if the bundle cannot be replayed.
Needs only torch, transformers and the fusion-harness package; equivalent to
`fusion-harness repro <this directory>`.
"""

import sys
from pathlib import Path

from harness.runner.repro import replay_main

if __name__ == "__main__":
    sys.exit(replay_main(Path(__file__).resolve().parent))
'''


class BundleError(ValueError):
    """A bundle that cannot be replayed: missing file, bad JSON, missing or ill-typed field."""


@dataclass(frozen=True)
class Bundle:
    """A validated bundle.json (plus where it was read from)."""

    path: Path
    fields: dict[str, Any]

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    @property
    def options(self) -> arch_check.CheckOptions:
        f = self.fields
        # Lifecycle checks replay only for a lifecycle failure: any other kind is judged on
        # the forward, and skipping them keeps the replay fast and about that one failure.
        return arch_check.CheckOptions(
            dtype=f["dtype"],
            device=f["device"],
            seed=f["seed"],
            batch=f["batch"],
            seq=f["seq"],
            lifecycle="quick" if f["kind"] == "lifecycle" else "off",
            system=self.system,
        )

    @property
    def system(self) -> str:
        """The system under test the bundle's failure was found in ("fusion" if unrecorded)."""
        return self.fields.get("system", systems.DEFAULT)

    def where(self) -> str:
        f = self.fields
        at = f"{f['qualname']} ({f['source_class']}) [{f['fuser']}]" if f["qualname"] else "model"
        judged = "" if self.system == systems.DEFAULT else f" (system {self.system})"
        return f"{f['architecture']}{judged}: {f['kind']} at {at}"


@dataclass(frozen=True)
class Replay:
    """The outcome of replaying a bundle: did the same failure (kind, qualname, fuser) recur?"""

    bundle: Bundle
    reproduces: bool
    now: Failure | None
    result: ArchResult


def versions() -> dict[str, str]:
    """Versions that decide whether a replay can be expected to behave the same."""
    import torch
    import transformers

    try:
        from importlib.metadata import version

        harness_version = version("fusion-harness")
    except Exception:  # running from a checkout that is not installed
        harness_version = "unknown"
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "fusion-harness": harness_version,
    }


def bundle_dirname(architecture: str, failure: Failure, system: str = systems.DEFAULT) -> str:
    """Directory name: readable prefix plus a hash of (architecture, signature) to de-duplicate.

    A system other than fusion is part of both (the same logits failure of two systems is two
    bundles); fusion's names are the ones it had before systems existed.
    """
    key = f"{architecture}|{failure.signature}"
    prefix = architecture
    if system != systems.DEFAULT:
        key, prefix = f"{system}|{key}", f"{architecture}--{system}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    readable = f"{prefix}--{failure.kind}--{failure.fuser or 'model'}"
    return f"{re.sub(r'[^A-Za-z0-9._+-]', '_', readable)}--{digest}"


def bundle_fields(failure: Failure, subject: arch_check.Subject) -> dict[str, Any]:
    """The bundle.json content for `failure` found on `subject` (a Subject with a config)."""
    options = subject.options
    return {
        "format": BUNDLE_FORMAT,
        "versions": versions(),
        "architecture": subject.architecture,
        "model_type": subject.model_type,
        "config": subject.config,
        "seed": options.seed,
        "dtype": options.dtype,
        "device": options.device,
        "batch": options.batch,
        "seq": options.seq,
        "kind": failure.kind,
        "qualname": failure.qualname,
        "fuser": failure.fuser,
        "source_class": failure.source_class,
        "error": failure.message,
        "detail": failure.detail,
        "tolerance": json_safe(failure.tolerance),
        "observed": json_safe(failure.observed),
        "signature": failure.signature,
        "system": options.system,
        "machine": policy.describe(),
    }


def source_records(failure: Failure, applied) -> list:
    """The Applied records whose forward sources explain `failure`.

    A module failure: the records at its qualname. A model-level failure (no qualname): one
    record per distinct (class, fuser), since every rewrite is a suspect. Records without
    sources (whole-module replacements) are left out.
    """
    if failure.qualname is not None:
        records = [r for r in applied if r.qualname == failure.qualname]
    else:
        records = list({(r.source_class, r.fuser): r for r in applied}.values())
    return [r for r in records if r.original_source is not None]


def source_files(records) -> dict[str, str]:
    """original.py, rewritten.py and forward.diff for the records (empty if none)."""
    if not records:
        return {}
    original, rewritten, diff = [], [], []
    for r in records:
        header = f"# {r.qualname} ({r.source_class}) [{r.fuser}]: {r.description}\n"
        before, after = r.original_source, r.rewritten_source or ""
        original.append(header + before)
        rewritten.append(header + after)
        diff.extend(
            difflib.unified_diff(
                before.splitlines(keepends=True),
                after.splitlines(keepends=True),
                fromfile=f"{r.source_class}.forward (original, {r.qualname})",
                tofile=f"{r.source_class}.forward (rewritten by {r.fuser})",
            )
        )
    return {
        "original.py": "\n\n".join(original),
        "rewritten.py": "\n\n".join(rewritten),
        "forward.diff": "".join(diff),
    }


def write_bundle(root: Path, failure: Failure, subject: arch_check.Subject) -> Path | None:
    """Write the bundle for `failure` under `root`; return its directory.

    Returns the existing directory untouched when the same failure was bundled before
    (de-duplication), and None when the model has no Transformers config to rebuild it from.
    The directory appears atomically (written aside, then renamed), so a crash never leaves a
    half-written bundle that would fail to replay.
    """
    if subject.config is None or subject.model_type is None:
        return None
    target = root / bundle_dirname(subject.architecture, failure, subject.options.system)
    if target.exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".{target.name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    fields = bundle_fields(failure, subject)
    files = {
        "bundle.json": json.dumps(fields, indent=2, allow_nan=False) + "\n",
        "repro.py": REPRO_SCRIPT.format(title=Bundle(target, fields).where()),
        **source_files(source_records(failure, subject.applied)),
    }
    for name, text in files.items():
        (staging / name).write_text(text, encoding="utf-8")
    if subject.options.system == "liger":
        _standalone(staging, fields)
    try:
        staging.rename(target)
    except OSError:  # another writer got there first: same failure, keep theirs
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _standalone(staging: Path, fields: dict[str, Any]) -> None:
    """The liger system's standalone replay (torch, transformers, liger-kernel only:
    `harness.peers.liger_repro`) added to the bundle; where it cannot be made (the model does
    not rebuild), STANDALONE_ERROR.txt says why and the bundle stays replayable as usual."""
    try:
        liger_repro.write_standalone(staging, fields)
    except Exception as exc:  # the bundle itself is complete without it
        text = f"no standalone replay: {type(exc).__name__}: {exc}\n"
        (staging / "STANDALONE_ERROR.txt").write_text(text, encoding="utf-8")


def write_bundles(result: ArchResult, subject: arch_check.Subject, root: Path) -> ArchResult:
    """`result` with a bundle written for each failure and its path recorded on the failure.

    Never raises for a bundle that cannot be written (read-only or full file system): the
    verdict is what matters, so the failure keeps `bundle=None` and the result's message says
    why no bundle was written.
    """
    failures, problems = [], []
    for failure in result.failures:
        try:
            path = write_bundle(root, failure, subject)
        except OSError as exc:
            path = None
            problems.append(f"{exc.strerror or exc} ({exc.filename or root})")
        failures.append(dataclasses.replace(failure, bundle=str(path) if path else None))
    message = result.message
    if problems:
        message += f" [repro bundle not written: {problems[0]}]"
    return dataclasses.replace(result, failures=failures, message=message)


def printable(text: object, limit: int = 2000) -> str:
    """`text` safe for a terminal: control and other unprintable characters escaped
    (\\x1b, \\n, \\u202e, ...), and cut to `limit` characters; a bundle cannot move the cursor,
    recolour, retitle or hide text."""
    out = []
    for char in str(text):
        if char.isprintable():
            out.append(char)
        else:
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
    escaped = "".join(out)
    return escaped if len(escaped) <= limit else escaped[:limit] + f"... ({len(escaped)} chars)"


def _read_bundle_json(file: Path) -> bytes:
    """The bytes of bundle.json, refusing anything but a small regular file.

    Opened without following a symlink and without blocking (a FIFO would hang a plain open),
    then checked with fstat on the open descriptor, so what is checked is what is read.
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(file, flags)
    except FileNotFoundError:
        raise BundleError(f"{file}: missing") from None
    except OSError as exc:
        reason = "a symbolic link" if file.is_symlink() else exc.strerror
        raise BundleError(f"{file}: cannot be read safely: {reason}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise BundleError(f"{file}: not a regular file")
    with os.fdopen(fd, "rb") as handle:
        if info.st_size > MAX_BUNDLE_BYTES:
            raise BundleError(
                f"{file}: {info.st_size} bytes, more than the {MAX_BUNDLE_BYTES} a bundle may have"
            )
        data = handle.read(MAX_BUNDLE_BYTES + 1)
    if len(data) > MAX_BUNDLE_BYTES:  # it grew after fstat
        raise BundleError(f"{file}: more than the {MAX_BUNDLE_BYTES} bytes a bundle may have")
    return data


def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value, without recursion (any depth is measured safely)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, level + 1) for child in children)
    return deepest


def load_bundle(path: Path) -> Bundle:
    """Read and validate `path`/bundle.json; BundleError names what is missing or wrong.

    Returns a Bundle only when the file is a small regular file of strict JSON that fits the
    schema, its sizes are tiny and its config loads no code (module docstring). Only JSON is
    read: nothing in a bundle is ever unpickled or executed by replay.
    """
    if not path.is_dir():
        raise BundleError(f"{path}: not a directory (a bundle is a directory with bundle.json)")
    file = path / "bundle.json"
    data = _read_bundle_json(file)
    try:
        fields = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise BundleError(f"{file}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise BundleError(f"{file}: not valid JSON: {exc}") from None
    except RecursionError:
        raise BundleError(f"{file}: JSON nested too deeply") from None
    if not isinstance(fields, dict):
        raise BundleError(f"{file}: expected a JSON object, found {type(fields).__name__}")
    if json_depth(fields) > MAX_DEPTH:
        raise BundleError(f"{file}: JSON nested more than {MAX_DEPTH} levels deep")
    for name, types in FIELDS.items():
        if name not in fields:
            raise BundleError(f"{file}: field {name!r} is missing")
        value = fields[name]
        if isinstance(value, bool) or not isinstance(value, types):
            wanted = " or ".join("null" if t is _NONE else t.__name__ for t in types)
            raise BundleError(
                f"{file}: field {name!r} must be {wanted}, found {type(value).__name__}"
            )
    for name, types in OPTIONAL_FIELDS.items():
        if name in fields and (
            isinstance(fields[name], bool) or not isinstance(fields[name], types)
        ):
            wanted = " or ".join(t.__name__ for t in types)
            raise BundleError(
                f"{file}: field {name!r} must be {wanted}, found {type(fields[name]).__name__}"
            )
    _check_values(file, fields)
    check_config_safety(fields["config"], where=f"{file}: config")
    return Bundle(path, fields)


def _check_values(file: Path, fields: dict[str, Any]) -> None:
    if fields["format"] != BUNDLE_FORMAT:
        raise BundleError(f"{file}: field 'format' is {fields['format']}, expected {BUNDLE_FORMAT}")
    if fields["dtype"] not in arch_check.DTYPES:
        raise BundleError(f"{file}: field 'dtype' must be one of {list(arch_check.DTYPES)}")
    if fields["device"] != "cpu" and not re.fullmatch(r"cuda(:\d{1,2})?", fields["device"]):
        raise BundleError(f"{file}: field 'device' must be cpu, cuda or cuda:N")
    if fields.get("system", systems.DEFAULT) not in systems.NAMES:
        raise BundleError(f"{file}: field 'system' must be one of {list(systems.NAMES)}")
    if fields["kind"] not in KINDS:
        raise BundleError(f"{file}: field 'kind' must be one of {list(KINDS)}")
    if fields["kind"].startswith("module") and fields["qualname"] is None:
        raise BundleError(f"{file}: field 'qualname' is null for a {fields['kind']} failure")
    for name, most in (("batch", MAX_BATCH), ("seq", MAX_SEQ)):
        if not 1 <= fields[name] <= most:
            raise BundleError(f"{file}: field {name!r} must be between 1 and {most}")
    if not 0 <= fields["seed"] < 2**63:
        raise BundleError(f"{file}: field 'seed' must be between 0 and 2**63 - 1")
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,100}", fields["model_type"]):
        raise BundleError(f"{file}: field 'model_type' is not a model type name")
    for name, value in fields["versions"].items():
        if not isinstance(value, str):
            raise BundleError(f"{file}: field 'versions' must map names to strings ({name!r})")


def check_config_safety(config: Any, *, where: str = "config") -> None:
    """Refuse a config (a JSON dict, sub-configs included) that would load code or reach the
    network when Transformers builds it: a FORBIDDEN_KEYS field, an `*implementation` field
    other than Transformers' built-in ones, or a URL anywhere. Raises BundleError naming the
    field; returns None when the config is plain data."""
    stack: list[tuple[str, Any]] = [(where, config)]
    while stack:
        at, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                here = f"{at}.{key}"
                if FORBIDDEN_KEYS.fullmatch(key):
                    raise BundleError(
                        f"{printable(here)}: refused, this field can load code or reach the network"
                    )
                builtin = item is None or (isinstance(item, str) and item in IMPLEMENTATIONS)
                if key.endswith(("implementation", "implementation_internal")) and not builtin:
                    raise BundleError(
                        f"{printable(here)}: {printable(json.dumps(item), 80)} refused; "
                        f"allowed: null, {', '.join(sorted(IMPLEMENTATIONS))}"
                    )
                stack.append((here, item))
        elif isinstance(value, list):
            stack.extend((f"{at}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, str) and "://" in value:
            raise BundleError(f"{printable(at)}: refused, a URL in a config")


def check_config_sizes(config: Any, *, where: str = "config") -> None:
    """Refuse a built config object (defaults filled in) whose sizes are not tiny.

    Every int attribute the corpus's shrinker has a rule for (widths, heads, layers, experts,
    vocabularies, positions, ...; sub-configs too; not windows or chunks, UNSIZED) may be at
    most SIZE_SLACK times the tiny target of that rule. Raises BundleError naming the first
    size over its bound.
    """
    from corpus.rules import KEEP, SIZES, is_int, rule_for
    from corpus.tiny import config_values, is_config

    stack = [(where, config)]
    while stack:
        at, cfg = stack.pop()
        for name, value in config_values(cfg).items():
            if is_config(value):
                stack.append((f"{at}.{name}", value))
                continue
            rule = rule_for(name)
            if not is_int(value) or rule is None or UNSIZED.fullmatch(name):
                continue
            target = rule(2**62, SIZES)
            if target is KEEP or not is_int(target):
                continue
            bound = max(SIZE_SLACK * target, 8)
            if value > bound:
                raise BundleError(
                    f"{printable(at)}.{name} is {value}: not a tiny model (at most {bound})"
                )


def _count_parameters(bundle: Bundle, config: Any) -> int:
    """Parameters of the bundle's model, constructed on the meta device (no memory used)."""
    import torch

    import corpus
    from corpus.catalog import model_class

    name = bundle["architecture"] if bundle["architecture"] in corpus.all_types() else None
    arch = name or corpus.arch_for_config(config)
    with torch.device("meta"):
        model = model_class(arch)._from_config(copy.deepcopy(config))
    return sum(p.numel() for p in model.parameters())


def rebuild(bundle: Bundle):
    """The tiny model of `bundle`, rebuilt from its config and seed, and its inputs.

    The config object is checked for tiny sizes (check_config_sizes) and the model's parameter
    count on the meta device before any weight is allocated; BundleError if either is too big.
    """
    import corpus

    options = bundle.options
    config = corpus.config_from_dict(bundle["model_type"], bundle["config"])
    check_config_sizes(config, where=f"{bundle.path / 'bundle.json'}: config")
    try:
        parameters = _count_parameters(bundle, config)
    except BundleError:
        raise
    except Exception:  # it does not construct on meta; the real build reports why
        parameters = 0
    if parameters > MAX_PARAMETERS:
        raise BundleError(
            f"{bundle.path / 'bundle.json'}: the model would have {parameters:,} parameters, "
            f"more than the {MAX_PARAMETERS:,} of a tiny model"
        )
    name = bundle["architecture"] if bundle["architecture"] in corpus.all_types() else None
    model = corpus.build_from_config(
        config, seed=options.seed, dtype=options.torch_dtype, device=options.device, name=name
    )
    return model, arch_check.make_inputs(model, options)


def replay(bundle: Bundle, *, fuse: arch_check.FuseFn | None = None) -> Replay:
    """Rebuild, fuse and check the bundle's model; does the same failure occur?

    "Same" means the same kind at the same qualname by the same fuser: the message may change
    (another observed error, a reworded exception) and it is still the bug the bundle is about.
    Raises BundleError when the model cannot be rebuilt from the bundle, or has no module at
    the bundle's qualname (then no replay could reproduce it: the bundle is malformed).
    """
    try:
        model, inputs = rebuild(bundle)
    except BundleError:
        raise
    except Exception as exc:
        raise BundleError(f"{bundle.path}: cannot rebuild the model: {exc}") from exc
    qualname = bundle["qualname"]
    if qualname is not None and not has_submodule(model, qualname):
        raise BundleError(
            f"{bundle.path / 'bundle.json'}: field 'qualname' {printable(qualname, 200)!r} "
            f"names no module of the rebuilt {printable(bundle['architecture'], 80)} model"
        )
    checked = arch_check.check_model(
        bundle["architecture"], model, inputs, bundle.options, fuse=fuse
    )
    key = (bundle["kind"], bundle["qualname"], bundle["fuser"])
    match = [f for f in checked.result.failures if (f.kind, f.qualname, f.fuser) == key]
    return Replay(bundle, bool(match), match[0] if match else None, checked.result)


def has_submodule(model: Any, qualname: str) -> bool:
    """Whether `model` has a submodule at `qualname` ("" is the model itself): a bundle about
    a module the rebuilt model lacks cannot reproduce, so it is malformed, not "does not
    reproduce"."""
    try:
        model.get_submodule(qualname)
    except AttributeError:
        return False
    return True


def replay_main(path: Path, *, fuse: arch_check.FuseFn | None = None) -> int:
    """Replay the bundle at `path`, print the outcome; 1 reproduces, 0 does not, 2 unusable.

    Exit status 1 is reserved for "reproduces": a malformed or unsafe bundle, or a replay that
    breaks for another reason, is 2 with a one-line "fusion-harness: error: ..." on stderr, and
    Ctrl-C is 130. Every string that comes from the bundle is printed escaped. Test plugins
    named in the environment are imported first, like every harness entry point does (see
    harness.base.architectures), so a test can inject a fault into a replay subprocess.
    """
    try:
        architectures.plugin_architectures(architectures.plugins_from_env())
        bundle = load_bundle(path)
        print(f"bundle: {printable(bundle.where())}")
        print(f"recorded: {printable(bundle['error'])}")
        for note in version_notes(bundle):
            print(f"note: {printable(note)}")
        outcome = replay(bundle, fuse=fuse)
    except (BundleError, architectures.PluginError) as exc:
        return _error(str(exc))
    except KeyboardInterrupt:
        print("fusion-harness: interrupted", file=sys.stderr)
        return 130
    except (Exception, RecursionError) as exc:  # never exit 1 ("reproduces") by traceback
        return _error(f"replay of {path} failed: {type(exc).__name__}: {exc}")
    if outcome.reproduces:
        print(f"REPRODUCES: {printable(outcome.now.message)}")
        return 1
    result = outcome.result
    now = f"{result.status}{': ' + result.message if result.message else ''}"
    print(f"does not reproduce (now: {printable(now)})")
    return 0


def _error(message: str) -> int:
    """Print a one-line error the way every fusion-harness command does; exit status 2."""
    sys.stdout.flush()
    print(f"fusion-harness: error: {printable(message)}", file=sys.stderr)
    return 2


def version_notes(bundle: Bundle) -> list[str]:
    """One line per library whose version differs from the one that wrote the bundle, and
    one per kernel-deciding fact (CPU, ATen capability, native kernel, policy, table) that
    differs: the replay may then run other kernels than the failing run did."""
    now = versions()
    recorded = bundle["versions"]
    notes = [
        f"bundle written with {lib} {recorded[lib]}, replaying with {now[lib]}"
        for lib in ("torch", "transformers")
        if lib in recorded and recorded[lib] != now[lib]
    ]
    machine = bundle.fields.get("machine")
    if isinstance(machine, dict):
        here = policy.describe()
        notes += [
            f"bundle recorded {key} {machine[key]!r}, replaying with {here[key]!r}: the "
            "replay may take other kernels"
            for key in ("cpu", "capability", "native", "policy", "table")
            if key in machine and machine[key] != here.get(key)
        ]
    return notes
