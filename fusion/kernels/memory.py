"""What this machine's memory holds, for measurements that must stream from it: the
last-level cache (sysfs), the memory available now, and how many bytes a streamed
measurement cycles through (`stream_bytes`).

Layer: a leaf of `fusion.kernels` (imports nothing of fusion): the calibration and the native
kernel's prefetch choice both measure kernels on weights that are not in any cache.
"""

from __future__ import annotations

from pathlib import Path

STREAM_FACTOR = 4
"""Weight copies cycled per measurement cover this many times the last-level cache
(`stream_bytes`): cycling through more than a cache holds evicts every line before its reuse
under LRU, and the factor leaves room for the adaptive replacement of real caches and for a
VM that reports less cache than its host shares with it."""

FALLBACK_CACHE_BYTES = 64 << 20
"""The last-level cache assumed where the OS does not say (as large as common server parts,
so the stream errs on the long side)."""


def last_level_cache_bytes(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The size of the largest data or unified cache CPU 0 reports (sysfs `index*/size`,
    e.g. '266240K'), or `FALLBACK_CACHE_BYTES` where there is none to read."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for index in sorted(root.glob("index*")):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = units.get(text[-1:].upper(), 1)
        digits = text[:-1] if text[-1:].upper() in units else text
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else FALLBACK_CACHE_BYTES


def available_bytes() -> int | None:
    """The memory available now (`/proc/meminfo` MemAvailable), or None where it cannot be
    read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return None


def stream_bytes() -> int:
    """How much memory the weight copies of one measurement cycle through:
    `STREAM_FACTOR` x this machine's last-level cache, so each call reads its weight from
    memory as a decode step reads a model's layers; at most a quarter of the memory
    available now (a measurement never pushes the machine into swap or the OOM killer)."""
    wanted = STREAM_FACTOR * last_level_cache_bytes()
    available = available_bytes()
    return wanted if available is None else max(1 << 20, min(wanted, available // 4))
