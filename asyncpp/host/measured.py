"""Measured memory of this process, to put next to the plan (asyncpp/core/memory.py).

Host: the resident-set high-water mark (VmHWM in /proc/self/status). tracemalloc cannot see it: torch's
CPU tensors come from its own allocator (malloc/mmap), not Python's. Writing 5 to /proc/self/clear_refs
resets the mark (Linux >= 4.0), so a phase (the build, the training steps) gets a peak of its own.
Elsewhere, resource.getrusage's ru_maxrss (no reset). CUDA: torch.cuda.max_memory_allocated, the
caching allocator's peak of live tensors (reset with reset_peak_memory_stats).
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def host_rss_bytes() -> int:
    """Resident set size now (0 where /proc is missing)."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else 0


def host_peak_bytes() -> int:
    """Resident-set high-water mark since the process started or since reset_host_peak()."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def reset_host_peak() -> bool:
    """Start a new high-water mark at the current RSS. False where the kernel offers no reset."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def device_peak_bytes(device: torch.device) -> int | None:
    """Peak bytes of live tensors the device's allocator saw (None on the CPU: see host_peak_bytes)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return None


def reset_device_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
