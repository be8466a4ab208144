"""The host heap: glibc malloc's mmap threshold, set once at process start, and its statistics.

Why a policy at all: torch's CPU tensors come from malloc. glibc serves a request of at least
M_MMAP_THRESHOLD bytes with an mmap of its own (unmapped by free: back to the kernel at once) and smaller
ones from the brk heap. The threshold starts at 128 KiB but, by default, rises to the size of every mmapped
chunk that is freed (up to 32 MiB). A pipeline stage frees activation-sized blocks every microbatch, so after
the first few the threshold sits above them and they move onto the heap, where 2BW's stashed activations (live
across the step boundary) and the update's temporaries interleave with them. The heap's free holes below live
chunks are not returned, and in that interleaving they are not refilled either: measured on tiny_dense
(bench/peers.py --memory, 2BW, M=4), rank 0's heap held 175-290 MB of live blocks at every step boundary while
its free bytes grew 117 -> 283 -> 737 MB at steps 20/80/160 (mallinfo2), in 270 free chunks of 0.5-14 MB, and
RSS grew with them. A fixed threshold (mallopt(M_MMAP_THRESHOLD, n) also turns the dynamic adjustment off)
keeps every block of n bytes or more in an mmap of its own, and RSS flat. The price is a page fault per 4 KiB
of each such block on first touch (bench/peers.py --memory measures it side by side).

glibc only: elsewhere (musl, macOS) every function here is a no-op that says so.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

M_MMAP_THRESHOLD = -3
"""mallopt's parameter number (malloc.h)."""
MMAP_THRESHOLD_MAX = 32 * 2**20
"""glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (HEAP_MAX_SIZE / 2): mallopt refuses more."""


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@cache
def _glibc() -> ctypes.CDLL | None:
    """The process's C library if it is glibc (mallopt's numbers and mallinfo2's layout are glibc's)."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    if hasattr(libc, "mallinfo2"):  # glibc >= 2.33
        libc.mallinfo2.restype = _MallInfo2
    return libc


def set_mmap_threshold(nbytes: int | None) -> bool:
    """Serve every malloc of `nbytes` or more with its own mmap from now on, and stop glibc from raising the
    threshold (see the module docstring). None leaves glibc's dynamic default. Returns whether it was applied
    (False: None, or not glibc). Call it once, at process start (pretrain.py); it is process-wide."""
    if nbytes is None:
        return False
    if not 0 <= nbytes <= MMAP_THRESHOLD_MAX:
        raise ValueError(f"mmap threshold {nbytes} is outside glibc's range [0, {MMAP_THRESHOLD_MAX}]")
    libc = _glibc()
    if libc is None:
        return False
    if libc.mallopt(M_MMAP_THRESHOLD, nbytes) != 1:
        raise RuntimeError(f"glibc refused mallopt(M_MMAP_THRESHOLD, {nbytes})")
    return True


@dataclass(frozen=True)
class HeapStats:
    """glibc's malloc statistics over all arenas, in bytes (mallinfo2)."""

    heap_bytes: int
    """Obtained from the kernel for the heaps (brk and the thread arenas): in use + free."""
    heap_in_use_bytes: int
    heap_free_bytes: int
    """Free inside the heaps: resident if it was ever touched, and what fragmentation leaves behind."""
    mmapped_bytes: int
    """In blocks at or above the mmap threshold, each its own mapping."""
    mmapped_blocks: int


def heap_stats() -> HeapStats | None:
    """The allocator's figures now; None where they are not available (not glibc, or glibc < 2.33)."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    mi = libc.mallinfo2()
    return HeapStats(heap_bytes=mi.arena, heap_in_use_bytes=mi.uordblks, heap_free_bytes=mi.fordblks,
                     mmapped_bytes=mi.hblkhd, mmapped_blocks=mi.hblks)
