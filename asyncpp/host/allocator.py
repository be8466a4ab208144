"""The host heap: glibc malloc's mmap threshold, set once at process start, and its statistics.

Why a policy at all: torch's CPU tensors come from malloc. glibc serves a request of at least
M_MMAP_THRESHOLD bytes with an mmap of its own (unmapped by free: back to the kernel at once) and smaller
ones from the brk heap. The threshold starts at 128 KiB but, by default, rises to the size of every mmapped
chunk that is freed (up to 32 MiB), so after the first few microbatches activation-sized blocks live on the
heap, where freed holes between live chunks stay resident.

What this explains and what it does not. The growth of a gloo pipeline's RSS with run length (issue 21:
rank 0 484 -> 752 -> 1057 MB at steps 20/80/160) was not the allocator: every sent activation stayed alive
until the segment's drain, because gloo's send handle never reports completion before wait()
(asyncpp/pipeline/p2p.py, StageComm.retire, fixes it at the source; rank 0 is now 410 / 411 / 415 MB). What
is left to the allocator is a bounded retention: the heap's free bytes stay at tens of MB on stage 0 and a
few hundred on the last stage (its [tokens, vocab] fp32 logits and their gradient are freed every
microbatch), flat over the run. A fixed threshold (mallopt(M_MMAP_THRESHOLD, n) also turns the dynamic
adjustment off) keeps every block of n bytes or more in an mmap of its own, so RSS tracks live bytes; the
price is a page fault per 4 KiB of each such block on first touch, which on CPU halves tiny_dense's
throughput (bench/peers.py --memory measures it side by side). Hence off by default; bench/memory_plan.py
sets it, because a memory plan counts live bytes.

The opposite policy trades memory for speed: every block below 32 MiB from the heap (the largest mmap
threshold) and a trim threshold so high that the heap's top is never given back
(`train.host_mmap_threshold=33554432 train.host_trim_threshold=2147483647`). By default glibc trims the top
whenever more than twice the largest freed mmapped block is free there, and the last stage's per-microbatch
logits keep crossing that line: the single process took 34,000 minor page faults and 50 ms of system time
per step (10% of it) at M=8, the head split's last stage 10,000. Retained, the faults are gone (2-53 per
step), and RSS stays flat at its high-water mark.

glibc only: elsewhere (musl, macOS) every function here is a no-op that says so.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""mallopt's parameter numbers (malloc.h)."""
MMAP_THRESHOLD_MAX = 32 * 2**20
"""glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (HEAP_MAX_SIZE / 2): mallopt refuses more."""
TRIM_THRESHOLD_MAX = 2**31 - 1
"""mallopt takes an int."""


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


@dataclass(frozen=True)
class _Option:
    """One mallopt parameter with its valid range, set once at process start (it is process-wide)."""

    number: int
    name: str
    what: str
    limit: int
    range_of: str
    """Whose range the error names: glibc's ceiling or mallopt's int."""

    def set(self, nbytes: int | None) -> bool:
        """mallopt(number, nbytes); None leaves glibc's default. Whether it was applied (False: None, or not
        glibc)."""
        if nbytes is None:
            return False
        if not 0 <= nbytes <= self.limit:
            raise ValueError(f"{self.what} {nbytes} is outside {self.range_of} range [0, {self.limit}]")
        libc = _glibc()
        if libc is None:
            return False
        if libc.mallopt(self.number, nbytes) != 1:
            raise RuntimeError(f"glibc refused mallopt({self.name}, {nbytes})")
        return True


_MMAP = _Option(M_MMAP_THRESHOLD, "M_MMAP_THRESHOLD", "mmap threshold", MMAP_THRESHOLD_MAX, "glibc's")
_TRIM = _Option(M_TRIM_THRESHOLD, "M_TRIM_THRESHOLD", "trim threshold", TRIM_THRESHOLD_MAX, "mallopt's")


def set_mmap_threshold(nbytes: int | None) -> bool:
    """Serve every malloc of `nbytes` or more with its own mmap from now on, and stop glibc from raising the
    threshold (see the module docstring). None leaves glibc's dynamic default. Returns whether it was applied
    (False: None, or not glibc). Call it once, at process start (pretrain.py); it is process-wide."""
    return _MMAP.set(nbytes)


def set_trim_threshold(nbytes: int | None) -> bool:
    """Keep up to `nbytes` of free memory at the top of the heap instead of returning it to the kernel, and stop
    glibc's dynamic adjustment of both thresholds (see the module docstring: with a 32 MiB mmap threshold and
    the maximum here, a CPU stage reuses its heap and stops faulting pages in every microbatch). None leaves
    glibc's default. Returns whether it was applied; process-wide, call it once at start (pretrain.py)."""
    return _TRIM.set(nbytes)


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
