"""vLLM's own fuser unit tests, run against our engine, every outcome accounted for.

    python -m harness.peers.vllm_tests [--json FILE] [--cache DIR] [-k EXPR] [--vllm-version V]

vLLM tests its Transformers-backend fusers with hand-written modules: RMSNorm spellings and
near-misses, attention and GLU variants, MoE blocks, MLA. Those modules are a hazard zoo
written by the engine we re-implement. This runs the test modules of vLLM's source
distribution (`tests/models/transformers/fusers/`, fetched once from PyPI, checked against
its pinned sha256 (`SDISTS`), cached under ~/.cache/fusion-harness/vllm-tests/; never copied into this
repository) in a pytest subprocess whose `vllm` is `harness.peers.vllm_mapping`: every
"does vLLM fuse this" question is answered by `fusion.plan`, every vLLM-only concept raises
NotMapped. Nothing of vLLM is installed or imported; it runs in this project's environment.

Each test ends as one of:

- `pass`: our engine decides as vLLM's test expects (and, where the test compares the
  fused and unfused forwards, ours computes the same);
- `not-mapped`: the test needs a vLLM concept with no counterpart (its layer classes,
  tensor-parallel names, its tracer and AST helpers), with the reason; or a test listed in
  `NOT_MAPPED_TESTS` (asserts vLLM's API itself);
- `fail`: our engine decides otherwise. Every fail is matched against `RULES` (each names
  the kind: our refusal by design, a reach gap of ours, a fusion family we do not have)
  and `unclassified` otherwise, which makes the exit status 1: a new disagreement a
  person must look at.

Exit status: 0 every fail classified; 1 an unclassified fail; 2 the sdist could not be
fetched or checked.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.peers.vllm_mapping import RESULTS_ENV


@dataclass(frozen=True)
class Sdist:
    """One vLLM release's source distribution: where PyPI serves it and PyPI's own sha256
    of it (the archive is untrusted until its hash matches)."""

    version: str
    url: str
    sha256: str


SDISTS: dict[str, Sdist] = {
    "0.34.0": Sdist(
        "0.34.0",
        "https://files.pythonhosted.org/packages/92/21/"
        "6e0b077dc4a0b28f5a8ce8bb352a38d7196650d681fd4faa87f8dc622eff/vllm-0.34.0.tar.gz",
        "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113",
    ),
    "0.33.0": Sdist(
        "0.33.0",
        "https://files.pythonhosted.org/packages/f7/25/"
        "aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz",
        "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
    ),
}
"""The releases whose tests this can run; the README's counts were recorded on VERSION's, and
the previous peer's stays reproducible (`--vllm-version 0.33.0`)."""

VERSION = "0.34.0"
"""The peer release judged by default (constraints/vllm-peer.txt pins the same)."""
TEST_DIR = "tests/models/transformers/fusers"
REPO = Path(__file__).resolve().parents[2]

NOT_MAPPED_TESTS: dict[str, str] = {
    "test_fuser_is_cached_per_class_and_structure": "asserts the identity of vLLM's cached "
    "fuser records (its API); our engine caches matches per class too, in its own objects",
}
"""Tests that assert vLLM's API itself, which no placeholder use can reveal (by name)."""


@dataclass(frozen=True)
class Rule:
    """A known kind of fail: the test name or our refusal reason matches `pattern`."""

    category: str
    pattern: str
    why: str


RULES: tuple[Rule, ...] = (
    Rule(
        "no such family of ours",
        r"packed_qkv|PackedQKV",
        "vLLM re-lays one packed q/k/v projection (gpt_bigcode's c_attn); our engine has "
        "no packed-QKV fuser (the same gap as in the peer table)",
    ),
    Rule(
        "ours refuses by design",
        r"is not a Transformers experts-interface",
        "a custom experts class: its forward is not proven equal to a fused experts kernel "
        "(issue 24, defect 7), so our MoE fuser takes only Transformers' experts interface; "
        "vLLM swaps any experts module for its FusedMoE",
    ),
    Rule(
        "ours refuses by design",
        r"calls getattr, which may write",
        "the forward reads eps through `getattr(self, name)`: a dynamic attribute read may "
        "run a property, which our alias analysis does not prove pure",
    ),
    Rule(
        "reach gap of ours",
        r"eps is not read from an attribute",
        "a literal eps in the forward's source: our RMSNorm match binds eps to an "
        "attribute per instance and refuses a constant",
    ),
    Rule(
        "ours fuses more, under another family",
        r"test_mla\.py.*applied instead: sibling",
        "an MLA attention without a query LoRA: vLLM's MLA fuser claims it and stacks "
        "nothing; ours merges q_proj with kv_a_proj (both read the hidden states) into one "
        "sibling GEMM, so our MLA family is not the one that applies",
    ),
    Rule(
        "reach gap of ours",
        r"the block returns a tuple",
        "an MoE block that returns (output, router logits) is refused as a whole",
    ),
)


def cache_root() -> Path:
    """$FUSION_VLLM_TESTS_CACHE, else ~/.cache/fusion-harness/vllm-tests."""
    env = os.environ.get("FUSION_VLLM_TESTS_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "fusion-harness" / "vllm-tests"


def _download(dest: Path, sdist: Sdist) -> Path:
    archive = dest / f"vllm-{sdist.version}.tar.gz"
    with urllib.request.urlopen(sdist.url, timeout=300) as response, archive.open("wb") as out:
        while chunk := response.read(1 << 20):
            out.write(chunk)
    return archive


def test_files(archive: Path, version: str = VERSION) -> dict[str, bytes]:
    """{path under the sdist root: content} of the fuser tests and the package `__init__`
    files above them, in vLLM `version`'s archive. Only regular files at exactly those paths
    are read, so the archive (untrusted until checked) cannot write anywhere else."""
    prefix = f"vllm-{version}/"
    wanted_inits = {
        f"{d}/__init__.py" for d in ("tests", "tests/models", "tests/models/transformers")
    }
    found: dict[str, bytes] = {}
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar:
            if not (member.isfile() and member.name.startswith(prefix)):
                continue
            path = member.name[len(prefix) :]
            directory, _, base = path.rpartition("/")
            in_dir = directory == TEST_DIR and base.endswith(".py") and "/" not in base
            if (in_dir or path in wanted_inits) and not base.startswith("."):
                handle = tar.extractfile(member)
                if handle is not None:
                    found[path] = handle.read()
    if not any(p.startswith(TEST_DIR + "/test_") for p in found):
        raise RuntimeError(f"{archive} holds no {TEST_DIR}/test_*.py")
    return found


def ensure_tests(root: Path | None = None, download=_download, sdist: Sdist | None = None) -> Path:
    """The folder holding the extracted tests of `sdist` (VERSION's by default),
    `<root>/vllm-<version>`, fetched once and checked against its sha256; written atomically
    (staged, then renamed). RuntimeError, and nothing cached, for another hash."""
    sdist = sdist or SDISTS[VERSION]
    root = root if root is not None else cache_root()
    target = root / f"vllm-{sdist.version}"
    if (target / TEST_DIR).is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as scratch:
        archive = download(Path(scratch), sdist)
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        if digest != sdist.sha256:
            raise RuntimeError(
                f"vllm-{sdist.version}.tar.gz has sha256 {digest}, not {sdist.sha256}"
            )
        staged = Path(scratch) / "tree"
        for path, content in test_files(archive, sdist.version).items():
            (staged / path).parent.mkdir(parents=True, exist_ok=True)
            (staged / path).write_bytes(content)
        with contextlib.suppress(OSError):  # another process won the race: its copy is whole
            staged.rename(target)
    return target


def run_tests(tree: Path, select: str | None = None) -> list[dict[str, str]]:
    """Run the fuser tests in a subprocess under the mapping plugin; their outcomes."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "outcomes.json"
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "harness.peers.vllm_mapping",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tree),
            "-c",
            os.devnull,
            str(tree / TEST_DIR),
        ]
        # NOT_MAPPED_TESTS are deselected and recorded below, with their reasons.
        listed = _listed(tree)
        deselect = [f"--deselect={TEST_DIR}/{f}::{t}" for f, t in listed]
        if select:
            command += ["-k", select]
        env = {**os.environ, RESULTS_ENV: str(out), "PYTHONPATH": _pythonpath()}
        subprocess.run([*command, *deselect], cwd=tree, env=env, capture_output=True)
        outcomes = json.loads(out.read_text()) if out.is_file() else []
    recorded = [
        {
            "test": f"{TEST_DIR}/{f}::{t}",
            "file": f,
            "outcome": "not-mapped",
            "detail": NOT_MAPPED_TESTS[t],
            "ours": "",
        }
        for f, t in listed
    ]
    return [*outcomes, *recorded]


def _listed(tree: Path) -> list[tuple[str, str]]:
    """(file, test) of the NOT_MAPPED_TESTS that exist in the extracted files."""
    found = []
    for path in sorted((tree / TEST_DIR).glob("test_*.py")):
        text = path.read_text()
        found += [(path.name, n) for n in NOT_MAPPED_TESTS if f"def {n}(" in text]
    return found


def _pythonpath() -> str:
    return os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


def classify(outcomes: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    """`outcomes` with `category` and `why` on every fail (`unclassified` when no rule
    matches the test name or our refusal reasons)."""
    classified = []
    for outcome in outcomes:
        outcome = dict(outcome)
        if outcome["outcome"] == "fail":
            text = f"{outcome['test']} {outcome.get('ours', '')}"
            rule = next((r for r in RULES if re.search(r.pattern, text)), None)
            outcome["category"] = rule.category if rule else "unclassified"
            outcome["why"] = rule.why if rule else ""
        classified.append(outcome)
    return classified


def table(outcomes: Sequence[dict[str, str]]) -> list[str]:
    """Counts per file and outcome, then the fails by category and the not-mapped reasons."""
    files = sorted({o["file"] for o in outcomes})
    kinds = ("pass", "fail", "not-mapped", "skip")
    lines = [f"{'file':<20}" + "".join(f"{k:>12}" for k in kinds)]
    for name in files:
        counts = Counter(o["outcome"] for o in outcomes if o["file"] == name)
        lines.append(f"{name:<20}" + "".join(f"{counts[k]:>12}" for k in kinds))
    total = Counter(o["outcome"] for o in outcomes)
    lines.append(f"{'all':<20}" + "".join(f"{total[k]:>12}" for k in kinds))
    fails = Counter((o["category"], o["why"]) for o in outcomes if o["outcome"] == "fail")
    if fails:
        lines += ["", "fails (our engine decides otherwise), by kind:"]
        lines += [f"  {n:>3}  {category}: {why}" for (category, why), n in fails.most_common()]
    unclassified = [o for o in outcomes if o.get("category") == "unclassified"]
    for o in unclassified:
        lines.append(f"  unclassified: {o['test']}: {o['detail']} (ours: {o.get('ours', '')})")
    reasons = Counter(o["detail"] for o in outcomes if o["outcome"] == "not-mapped")
    if reasons:
        lines += ["", "not mapped, by reason:"]
        lines += [f"  {n:>3}  {why[:150]}" for why, n in reasons.most_common()]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.peers.vllm_tests",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    parser.add_argument("--json", type=Path, help="write every outcome, classified, here")
    parser.add_argument("--cache", type=Path, help=f"cache folder (default {cache_root()})")
    parser.add_argument("-k", dest="select", help="pytest -k expression: a subset of tests")
    parser.add_argument(
        "--vllm-version",
        choices=sorted(SDISTS),
        default=VERSION,
        help=f"whose fuser tests to run (default {VERSION}, the pinned peer)",
    )
    args = parser.parse_args(argv)
    sdist = SDISTS[args.vllm_version]
    try:
        tree = ensure_tests(args.cache, sdist=sdist)
    except Exception as exc:  # no network, a changed archive: nothing to judge
        print(f"vllm-tests: cannot fetch vLLM {sdist.version}'s tests: {exc}", file=sys.stderr)
        return 2
    outcomes = classify(run_tests(tree, args.select))
    if not outcomes:
        print("vllm-tests: the test run recorded nothing (see pytest's output)", file=sys.stderr)
        return 2
    print(f"vLLM {sdist.version}'s fuser unit tests against our engine ({TEST_DIR}):")
    print("\n".join(table(outcomes)))
    if args.json:
        args.json.write_text(json.dumps(outcomes, indent=1) + "\n")
    return 1 if any(o.get("category") == "unclassified" for o in outcomes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
