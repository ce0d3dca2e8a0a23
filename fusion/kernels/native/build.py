"""Build a C kernel source shipped in `fusion/kernels/csrc/` into a shared library, once per
machine, and load it with `ctypes`.

Why at run time rather than at install: the kernels are compiled with `-march=native` (the
vector width and instruction set of the machine they run on; `FUSION_NATIVE_MARCH` overrides), and the package stays pure
Python (`pip install .` needs no compiler; a machine without one simply runs without the
native kernels).

The cache (explicit, keyed): `<cache dir>/native/<name>-<key>.so`, where the key hashes the
source text, the compiler's identity (`cc --version`), the flags, the CPU's feature flags and
the architecture, so a changed source, compiler or machine never loads a stale library. The
cache dir is `$FUSION_HARNESS_CACHE`, else `$XDG_CACHE_HOME/fusion-harness`, else
`~/.cache/fusion-harness`. A build writes a temporary file in the same directory and renames
it into place (atomic), so concurrent processes (pytest-xdist workers) never load a
half-written library.

Why not `torch.utils.cpp_extension`: the operator schema, fake and autograd registrations
already live in Python (`fusion::linear_product`, `ops`), so an extension would add only its
build, and that build takes tens of seconds for a one-line operator (torch's headers; ninja
required) against well under a second for this kernel with `cc`, paid on every fresh machine
and every changed `-march`.

Fail closed: every failure (no compiler, a compile error, an unwritable cache, a library that
will not load) returns a `Built` with `library=None` and a `reason` naming what failed; the
caller then keeps its PyTorch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent.parent / "csrc"
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11")
"""Compiler flags besides `-march` (`march()`). `-fopenmp`: the kernels split work across
torch's thread count, in torch's own OpenMP runtime: torch's Linux wheels ship `libgomp.so.1`
under that soname, so the loader binds the kernel to the copy already loaded. That is
checked after loading (`openmp_runtimes`), not assumed. No `-ffast-math`: the kernels'
rounding is the IEEE order their source spells out."""

OPENMP_RUNTIMES = ("libgomp", "libiomp5", "libomp")
"""File-name stems of the OpenMP runtimes a process may map (GCC's, Intel's, LLVM's)."""

MARCH_ENV = "FUSION_NATIVE_MARCH"
"""Overrides `-march=native` (e.g. `x86-64-v3` builds the AVX2 code path on an AVX-512
machine: the tests do, so every vector width is checked wherever CI runs)."""
COMPILE_TIMEOUT_S = 120


@dataclass(frozen=True)
class Built:
    """The outcome of `build`: the loaded library, or None and why not."""

    library: ctypes.CDLL | None
    reason: str
    path: Path | None = None


def openmp_runtimes(maps: str) -> list[str]:
    """The distinct OpenMP runtime files mapped in a process, from the text of its
    `/proc/<pid>/maps`. Two or more mean two thread pools: the kernel's threads would not be
    torch's (oversubscription, and `torch.set_num_threads` would not reach them)."""
    found = set()
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        name = os.path.basename(path)
        if any(
            name.startswith(stem + ".") or name.startswith(stem + "-") for stem in OPENMP_RUNTIMES
        ):
            found.add(os.path.realpath(path) if os.path.isabs(path) else path)
    return sorted(found)


def one_openmp_runtime(maps_path: Path = Path("/proc/self/maps")) -> str:
    """'' when this process maps at most one OpenMP runtime, else why not (the files); a
    process whose maps cannot be read is not known to have one, and is refused (fail closed:
    the caller keeps its PyTorch path)."""
    try:
        maps = maps_path.read_text()
    except OSError as exc:
        return f"cannot check for one OpenMP runtime: {maps_path}: {exc.strerror or exc}"
    runtimes = openmp_runtimes(maps)
    if len(runtimes) > 1:
        return f"{len(runtimes)} OpenMP runtimes loaded ({', '.join(runtimes)})"
    return ""


def cache_dir() -> Path:
    """Where built libraries live (see the module docstring)."""
    explicit = os.environ.get("FUSION_HARNESS_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "fusion-harness"


def compiler() -> str | None:
    """The C compiler to use: `$CC` if set, else `cc`; None when it is not on PATH."""
    return shutil.which(os.environ.get("CC", "cc"))


def march() -> str:
    """The `-march` value: `$FUSION_NATIVE_MARCH`, else `native`."""
    return os.environ.get(MARCH_ENV) or "native"


def flags() -> tuple[str, ...]:
    """Every compiler flag of a build here."""
    return (*FLAGS, f"-march={march()}")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler_identity(cc: str) -> str:
    done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    return cc + "\n" + done.stdout


def cache_key(source: str, identity: str) -> str:
    """The cache key of `source` built by the compiler `identity` on this machine: 16 hex
    digits of a SHA-256 over everything that changes the built code."""
    parts = [source, identity, " ".join(flags()), _cpu_flags(), platform.machine()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def build(name: str) -> Built:
    """Load `csrc/<name>.c` built for this machine, building it first if the cache lacks it.

    Never raises for an environment problem: the reason is in the result (fail closed)."""
    source_path = SOURCE_DIR / f"{name}.c"
    try:
        source = source_path.read_text()
    except OSError as exc:
        return Built(None, f"cannot read {source_path}: {exc}")
    cc = compiler()
    if cc is None:
        return Built(None, f"no C compiler ({os.environ.get('CC', 'cc')!r} is not on PATH)")
    try:
        key = cache_key(source, _compiler_identity(cc))
    except (OSError, subprocess.SubprocessError) as exc:
        return Built(None, f"cannot run the C compiler {cc}: {exc}")
    directory = cache_dir() / "native"
    target = directory / f"{name}-{key}.so"
    if not target.exists():
        problem = _compile(cc, source_path, directory, target)
        if problem:
            return Built(None, problem)
    try:
        return Built(ctypes.CDLL(str(target)), "built", target)
    except OSError as exc:
        return Built(None, f"cannot load {target}: {exc}")


def _compile(cc: str, source: Path, directory: Path, target: Path) -> str:
    """Compile `source` to `target` through a temporary file; '' on success, else why not."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(suffix=".so", prefix=".build-", dir=directory)
        os.close(handle)
    except OSError as exc:
        return f"cannot write the kernel cache {directory}: {exc}"
    try:
        done = subprocess.run(
            [cc, *flags(), str(source), "-o", temporary],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip()[-800:]
            return f"{cc} failed on {source.name} (exit {done.returncode}): {tail}"
        os.replace(temporary, target)
        return ""
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot compile {source.name} with {cc}: {exc}"
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
