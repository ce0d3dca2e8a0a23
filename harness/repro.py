"""Repro bundles: write one directory per distinct failure, and replay it.

A bundle is plain text only (never a pickle), runnable with torch, transformers and this
package:

    bundle.json     versions, architecture, model_type + config dict, seed, dtype, device,
                    batch/seq of the inputs, failure kind, module qualname, fuser, source class,
                    error (and traceback tail), tolerance and observed error, signature
    original.py     the forward source(s) before fusion      } when the fuser rewrote a forward
    rewritten.py    the forward source(s) after fusion       }
    forward.diff    their unified diff                       }
    repro.py        rebuilds the tiny model from bundle.json, fuses, checks; exit 1 if the
                    failure reproduces, 0 if not

The model is rebuilt from the JSON config and the seed (corpus.config_from_dict +
corpus.build_from_config), so the bundle survives refactors of the corpus's shrinker.
Directories are named by architecture, kind, fuser and a hash of the failure signature: the
same failure found twice (another layer, another run) maps to the same directory and is
written once.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import platform
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import architectures, check
from harness.results import ArchResult, Failure, json_safe

BUNDLE_FORMAT = 1
KINDS = ("fuse-error", "fused-forward-error", "model-parity", "module-parity", "module-error")

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

from harness.repro import replay_main

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
    def options(self) -> check.CheckOptions:
        f = self.fields
        return check.CheckOptions(
            dtype=f["dtype"], device=f["device"], seed=f["seed"], batch=f["batch"], seq=f["seq"]
        )

    def where(self) -> str:
        f = self.fields
        at = f"{f['qualname']} ({f['source_class']}) [{f['fuser']}]" if f["qualname"] else "model"
        return f"{f['architecture']}: {f['kind']} at {at}"


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


def bundle_dirname(architecture: str, failure: Failure) -> str:
    """Directory name: readable prefix plus a hash of (architecture, signature) to de-duplicate."""
    digest = hashlib.sha1(f"{architecture}|{failure.signature}".encode()).hexdigest()[:10]
    readable = f"{architecture}--{failure.kind}--{failure.fuser or 'model'}"
    return f"{re.sub(r'[^A-Za-z0-9._+-]', '_', readable)}--{digest}"


def bundle_fields(failure: Failure, subject: check.Subject) -> dict[str, Any]:
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


def write_bundle(root: Path, failure: Failure, subject: check.Subject) -> Path | None:
    """Write the bundle for `failure` under `root`; return its directory.

    Returns the existing directory untouched when the same failure was bundled before
    (de-duplication), and None when the model has no Transformers config to rebuild it from.
    The directory appears atomically (written aside, then renamed), so a crash never leaves a
    half-written bundle that would fail to replay.
    """
    if subject.config is None or subject.model_type is None:
        return None
    target = root / bundle_dirname(subject.architecture, failure)
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
    try:
        staging.rename(target)
    except OSError:  # another writer got there first: same failure, keep theirs
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_bundles(result: ArchResult, subject: check.Subject, root: Path) -> ArchResult:
    """`result` with a bundle written for each failure and its path recorded on the failure."""
    failures = []
    for failure in result.failures:
        path = write_bundle(root, failure, subject)
        failures.append(dataclasses.replace(failure, bundle=str(path) if path else None))
    return dataclasses.replace(result, failures=failures)


def load_bundle(path: Path) -> Bundle:
    """Read and validate `path`/bundle.json; BundleError names what is missing or wrong.

    Only JSON is read: nothing in a bundle is ever unpickled or executed by replay.
    """
    if not path.is_dir():
        raise BundleError(f"{path}: not a directory (a bundle is a directory with bundle.json)")
    file = path / "bundle.json"
    try:
        fields = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BundleError(f"{file}: missing") from None
    except json.JSONDecodeError as exc:
        raise BundleError(f"{file}: not valid JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise BundleError(f"{file}: expected a JSON object, found {type(fields).__name__}")
    for name, types in FIELDS.items():
        if name not in fields:
            raise BundleError(f"{file}: field {name!r} is missing")
        value = fields[name]
        if isinstance(value, bool) or not isinstance(value, types):
            wanted = " or ".join("null" if t is _NONE else t.__name__ for t in types)
            raise BundleError(
                f"{file}: field {name!r} must be {wanted}, found {type(value).__name__}"
            )
    _check_values(file, fields)
    return Bundle(path, fields)


def _check_values(file: Path, fields: dict[str, Any]) -> None:
    if fields["format"] != BUNDLE_FORMAT:
        raise BundleError(f"{file}: field 'format' is {fields['format']}, expected {BUNDLE_FORMAT}")
    if fields["dtype"] not in check.DTYPES:
        raise BundleError(f"{file}: field 'dtype' must be one of {list(check.DTYPES)}")
    if fields["kind"] not in KINDS:
        raise BundleError(f"{file}: field 'kind' must be one of {list(KINDS)}")
    if fields["kind"].startswith("module") and fields["qualname"] is None:
        raise BundleError(f"{file}: field 'qualname' is null for a {fields['kind']} failure")


def rebuild(bundle: Bundle):
    """The tiny model of `bundle`, rebuilt from its config and seed, and its inputs."""
    import corpus

    options = bundle.options
    config = corpus.config_from_dict(bundle["model_type"], bundle["config"])
    name = bundle["architecture"] if bundle["architecture"] in corpus.all_types() else None
    model = corpus.build_from_config(
        config, seed=options.seed, dtype=options.torch_dtype, device=options.device, name=name
    )
    return model, check.make_inputs(model, options)


def replay(bundle: Bundle, *, fuse: check.FuseFn | None = None) -> Replay:
    """Rebuild, fuse and check the bundle's model; does the same failure occur?

    "Same" means the same kind at the same qualname by the same fuser: the message may change
    (another observed error, a reworded exception) and it is still the bug the bundle is about.
    Raises BundleError when the model cannot be rebuilt from the bundle.
    """
    try:
        model, inputs = rebuild(bundle)
    except Exception as exc:
        raise BundleError(f"{bundle.path}: cannot rebuild the model: {exc}") from exc
    checked = check.check_model(bundle["architecture"], model, inputs, bundle.options, fuse=fuse)
    key = (bundle["kind"], bundle["qualname"], bundle["fuser"])
    match = [f for f in checked.result.failures if (f.kind, f.qualname, f.fuser) == key]
    return Replay(bundle, bool(match), match[0] if match else None, checked.result)


def replay_main(path: Path, *, fuse: check.FuseFn | None = None) -> int:
    """Replay the bundle at `path`, print the outcome; 1 reproduces, 0 does not, 2 unusable.

    Test plugins named in the environment are imported first, like every harness entry point
    does (see harness.architectures), so a test can inject a fault into a replay subprocess.
    """
    architectures.plugin_architectures(architectures.plugins_from_env())
    try:
        bundle = load_bundle(path)
        print(f"bundle: {bundle.where()}")
        print(f"recorded: {bundle['error']}")
        for note in version_notes(bundle):
            print(f"note: {note}")
        outcome = replay(bundle, fuse=fuse)
    except BundleError as exc:
        print(f"error: {exc}")
        return 2
    if outcome.reproduces:
        print(f"REPRODUCES: {outcome.now.message}")
        return 1
    result = outcome.result
    print(
        f"does not reproduce (now: {result.status}{': ' + result.message if result.message else ''})"
    )
    return 0


def version_notes(bundle: Bundle) -> list[str]:
    """One line per library whose version differs from the one that wrote the bundle."""
    now = versions()
    recorded = bundle["versions"]
    return [
        f"bundle written with {lib} {recorded[lib]}, replaying with {now[lib]}"
        for lib in ("torch", "transformers")
        if lib in recorded and recorded[lib] != now[lib]
    ]
