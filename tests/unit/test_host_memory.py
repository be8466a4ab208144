"""The host heap's policy (asyncpp/host/allocator.py) and the chunked norms (asyncpp/optim/clip.py),
the two fixes for host memory above the plan (issues 19 and 21)."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from asyncpp.host.allocator import (
    MMAP_THRESHOLD_MAX,
    TRIM_THRESHOLD_MAX,
    heap_stats,
    set_mmap_threshold,
    set_trim_threshold,
)
from asyncpp.optim import clip
from asyncpp.optim.clip import diff_sq_norm, grad_sq_norm

glibc = pytest.mark.skipif(heap_stats() is None, reason="mallopt/mallinfo2 are glibc's (>= 2.33)")

# A fresh interpreter: frees a 4 MiB block (glibc's dynamic threshold then rises above 1 MiB), then allocates
# 1 MiB blocks and reports whether they were mmapped (each its own mapping) or taken from the heap.
_PROBE = textwrap.dedent("""
    import sys
    import torch
    from asyncpp.host.allocator import heap_stats, set_mmap_threshold
    if sys.argv[1] != "none":
        assert set_mmap_threshold(int(sys.argv[1]))
    big = torch.empty(1 << 20)  # 4 MiB of fp32, mmapped at glibc's initial 128 KiB threshold
    del big
    before = heap_stats().mmapped_blocks
    keep = [torch.empty(1 << 18) for _ in range(8)]  # 8 x 1 MiB, alive while we look
    print(heap_stats().mmapped_blocks - before)
""")


def _probe(script: str, threshold: str) -> int:
    """Run `script` in a fresh interpreter (the heap policy is process-wide) and return the number it prints."""
    out = subprocess.run([sys.executable, "-c", script, threshold], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    return int(out.stdout.split()[-1])


def _mmapped_new_blocks(threshold: str) -> int:
    return _probe(_PROBE, threshold)


@glibc
def test_dynamic_threshold_moves_blocks_to_the_heap_and_a_fixed_one_keeps_them_mmapped():
    # The mechanism behind issue 21's growing RSS: after one large free, glibc serves 1 MiB blocks from the
    # heap (where freed holes stay resident); with the threshold fixed every one of them is its own mapping.
    assert _mmapped_new_blocks("none") == 0
    assert _mmapped_new_blocks("131072") == 8


@pytest.mark.parametrize("set_threshold, limit, range_of", [(set_mmap_threshold, MMAP_THRESHOLD_MAX, "glibc's"),
                                                          (set_trim_threshold, TRIM_THRESHOLD_MAX, "mallopt's")])
def test_threshold_none_leaves_glibc_alone_and_out_of_range_is_refused(set_threshold, limit, range_of):
    assert set_threshold(None) is False
    with pytest.raises(ValueError, match=f"outside {range_of} range"):
        set_threshold(limit + 1)
    with pytest.raises(ValueError, match=f"outside {range_of} range"):
        set_threshold(-1)


# A fresh interpreter with every block below 32 MiB on the heap: frees an 8 MiB block at the heap's top (malloc
# itself, so that nothing is allocated after it) and reports how many bytes the heap gave back to the kernel.
_TRIM_PROBE = textwrap.dedent("""
    import ctypes
    import sys
    from asyncpp.host.allocator import heap_stats, set_mmap_threshold, set_trim_threshold
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
    assert set_mmap_threshold(32 << 20)
    if sys.argv[1] != "none":
        assert set_trim_threshold(int(sys.argv[1]))
    top = libc.malloc(8 << 20)
    ctypes.memset(top, 1, 8 << 20)  # touched: resident
    before = heap_stats().heap_bytes
    libc.free(top)
    print(before - heap_stats().heap_bytes)
""")


def _trimmed_bytes(threshold: str) -> int:
    return _probe(_TRIM_PROBE, threshold)


@glibc
def test_a_high_trim_threshold_keeps_the_heap_top_for_reuse():
    # glibc's default gives a freed block at the heap's top back to the kernel, and the next one faults its
    # pages in again (the per-microbatch page faults train.host_trim_threshold removes); retained, it stays.
    assert _trimmed_bytes("none") >= 8 << 20
    assert _trimmed_bytes(str(TRIM_THRESHOLD_MAX)) == 0


def _exact_sq(t: torch.Tensor) -> float:
    # fsum of the exact fp64 squares of fp32 values: the correctly rounded sum, independent of order.
    return math.fsum(v * v for v in t.double().reshape(-1).tolist())


@pytest.mark.parametrize("chunk", [7, 1 << 20])
def test_chunked_norms_equal_the_exact_sums(monkeypatch, chunk):
    monkeypatch.setattr(clip, "NORM_CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    a = [torch.randn(33, 5, generator=g), torch.randn(100, generator=g) * 1e3, torch.randn(3, generator=g)]
    b = [torch.randn(t.shape, generator=g) for t in a]
    # Every square is exact in fp64 (a product of two fp32 values), so the only error is the summation's: at
    # most n * 2^-53 relative for n positive terms (n < 300 here), far below 1e-12.
    assert grad_sq_norm(a) == pytest.approx(sum(_exact_sq(t) for t in a), rel=1e-12)
    # The difference is formed in fp32 (as the update x_{t+1} - x_t is), then squared exactly.
    assert diff_sq_norm(a, b) == pytest.approx(sum(_exact_sq(x - y) for x, y in zip(a, b)), rel=1e-12)


def test_chunked_norm_propagates_non_finite_values():
    assert math.isnan(grad_sq_norm([torch.tensor([1.0, float("nan")])]))
    assert math.isinf(grad_sq_norm([torch.ones(10), torch.tensor([float("inf")])]))
