"""What checking your own model will hold in memory, and whether this machine has it.

`estimate_memory` counts the copies `fusion-harness check` holds at once (unfused, fused,
float64 reference, the lifecycle's twins) item by item; `available_memory` reads what the
device has; `check_memory` refuses an estimate over it unless forced (`OwnModelError`,
exit 2). Nothing here builds a model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.base.errors import InputError
from harness.runner import arch_check


class OwnModelError(ValueError, InputError):
    """A PATH, config or machine the check refuses; the message is one line for the user
    (the command exits 2)."""


LIFECYCLE_COPIES = 14
"""Model-sized tensor sets (in the model's dtype) the lifecycle checks add at their peak to
the unfused, fused and reference models. Held: `optimizer-before-fuse` keeps an unfused copy,
a snapshot of its parameters, their gradients and AdamW's two moment buffers (5), and a fused
copy with its gradients and two moments (4), kept for the operations after it
(`harness.oracles.lifecycle.training._fused_late`); AdamW's foreach step adds two parameter-sized temporaries:
11. Measured on a small Qwen3 config in float32, the peak resident memory above the
interpreter's own was the three models plus 14 copies (the allocator keeps freed blocks of
the earlier operations), so 14 is used."""

LIFECYCLE_DISK_COPIES = 2
"""Checkpoints `save-pretrained` writes to the temporary directory (unfused and fused)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """What one check holds at once, in bytes, item by item (activations left out: a batch of
    2 x 6 tokens is small beside the weights)."""

    parameters: int
    dtype: str
    items: tuple[tuple[str, int], ...]
    disk: int = 0
    """Bytes the lifecycle's save-pretrained writes to the temporary directory."""

    @property
    def total(self) -> int:
        return sum(size for _, size in self.items)

    def format(self) -> str:
        """One line: the total, then each item ("memory estimate 5.55 MB for 106,816
        parameters in float32: unfused 427 kB + fused copy 427 kB + ...")."""
        parts = " + ".join(f"{label} {human_bytes(size)}" for label, size in self.items)
        disk = f"; disk {human_bytes(self.disk)} in the temporary directory" if self.disk else ""
        return (
            f"memory estimate {human_bytes(self.total)} for {self.parameters:,} parameters in "
            f"{self.dtype}: {parts}{disk}"
        )


def human_bytes(size: float) -> str:
    """`size` in B, kB, MB, GB or TB (powers of 1000), three significant figures."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(size) < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.3g} {unit}"
        size /= 1000
    return f"{size:.3g} TB"


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype`."""
    return torch.empty((), dtype=dtype).element_size()


def estimate_memory(parameters: int, dtype: str, lifecycle: str) -> MemoryEstimate:
    """What check_model holds at once for a model of `parameters` in `dtype` (a
    harness.runner.arch_check.DTYPES name), lifecycle mode `lifecycle` included.

    The parity check keeps three models at once: the unfused one, the fused deep copy (its
    merged weights replace the originals, they do not add to them) and the float64 reference,
    a deep copy upcast to 8 bytes per parameter. The lifecycle checks (any mode but `off`)
    add LIFECYCLE_COPIES model-sized tensor sets at their peak (derived and measured there),
    and save-pretrained writes
    LIFECYCLE_DISK_COPIES checkpoints to disk. Activations are left out (2 x 6 tokens).
    """
    width = dtype_bytes(arch_check.DTYPES[dtype])
    model = parameters * width
    items = [
        ("unfused", model),
        ("fused copy", model),
        ("float64 reference", parameters * dtype_bytes(torch.float64)),
    ]
    disk = 0
    if lifecycle != "off":
        items.append(
            (f"lifecycle peak ({LIFECYCLE_COPIES} model copies)", model * LIFECYCLE_COPIES)
        )
        disk = LIFECYCLE_DISK_COPIES * model
    return MemoryEstimate(parameters, dtype, tuple(items), disk)


def parse_mem_available(meminfo: str) -> int | None:
    """MemAvailable of /proc/meminfo text, in bytes; None when the line is absent."""
    found = re.search(r"^MemAvailable:\s+(\d+)\s*kB", meminfo, re.MULTILINE)
    return int(found.group(1)) * 1024 if found else None


def available_memory(device: str, meminfo: Path = Path("/proc/meminfo")) -> tuple[int, str] | None:
    """(bytes free, where) for `device`: MemAvailable for the CPU, the free memory CUDA reports
    for a GPU; None when this machine cannot tell."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free, f"free on {device}"
    try:
        available = parse_mem_available(meminfo.read_text(encoding="ascii", errors="replace"))
    except OSError:
        return None
    return (available, "MemAvailable") if available is not None else None


def check_memory(
    estimate: MemoryEstimate | None, available: tuple[int, str] | None, *, force: bool
) -> str:
    """A line comparing `estimate` with `available` memory; OwnModelError (the check is
    refused) when the estimate exceeds it or either is unknown, unless `force`.

    Refusing before anything is allocated is the point: a model that does not fit would be
    killed by the kernel's out-of-memory killer minutes in, or swap the machine to a halt.
    """
    if estimate is None:
        if force:
            return (
                "memory: not estimated (the model does not construct on the meta device); --force"
            )
        raise OwnModelError(
            "cannot estimate the memory the check needs (the model does not construct on the "
            "meta device); --force runs it anyway"
        )
    if available is None:
        if force:
            return f"{estimate.format()}; available memory unknown; --force"
        raise OwnModelError(
            f"{estimate.format()}; this machine does not report its available memory "
            "(/proc/meminfo); --force runs it anyway"
        )
    free, where = available
    line = f"{estimate.format()}; {where} {human_bytes(free)}"
    if estimate.total <= free:
        return line
    if force:
        return f"{line}; over it, --force"
    raise OwnModelError(
        f"{line}: the check would not fit. Try --tiny (the corpus's tiny shape, random "
        "weights), --lifecycle off, a smaller --dtype, or --force to run it anyway"
    )
