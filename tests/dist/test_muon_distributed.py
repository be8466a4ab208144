"""Parallel-aware Muon (asyncpp/optim/muon.py) against single-process Muon, on spawned gloo ranks.

- DP sharding: each rank orthogonalises a share of the matrices and all-gathers the results; the
  update must equal single-process Muon bit for bit (same kernels, same matrices, same dtype).
- TP "gather": the update of each shard must be exactly the slice of the single-process update of
  the full matrix (bit for bit: the gathered matrix is the full one, NS and the LR see full shapes).
- TP "block": must equal single-process Muon run on each shard as if it were its own parameter.
Bitwise equality needs the same thread count as the ranks (harness.py runs them single-threaded),
so the references run with one thread too.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import muon_workers as w
from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.equivalence, pytest.mark.dist, pytest.mark.usefixtures("one_thread")]
STEPS = 3
DTYPES = [None, "bfloat16"]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """One spawn of 2 ranks runs every 2-rank case (process start-up dominates the test time)."""
    return run_ranks(w.two_rank_cases, 2, STEPS, DTYPES)


def assert_same(actual: list, expected: list, what: str) -> None:
    assert len(actual) == len(expected)
    for i, (a, b) in enumerate(zip(actual, expected)):
        assert a.shape == b.shape, (what, i, a.shape, b.shape)
        assert torch.equal(a, b), f"{what}[{i}] {tuple(b.shape)}: max diff {(a - b).abs().max().item():.3g}"


def total_matrices(layout: list) -> int:
    return sum(torch.Size(shape[:-2]).numel() for shape, _, _ in layout)


@pytest.mark.parametrize("compute_dtype", DTYPES)
def test_dp_sharded_equals_single_process(two_ranks, compute_dtype):
    results = [r[("dp", compute_dtype)] for r in two_ranks]
    params, grads = w.full_tensors(w.MIXED, STEPS)
    ref, ref_bufs = w.run_muon(params, grads, {}, compute_dtype=compute_dtype)
    for r in results:
        assert_same(r["params"], ref, "params")
        assert_same(r["bufs"], ref_bufs, "momentum")
        assert_same(r["params_local_experts"], ref, "params (experts not shared)")
    # The work was shared, not repeated: every matrix orthogonalised once, and evenly (greedy by cost).
    counts = [r["ns_matrices"] for r in results]
    assert sum(counts) == STEPS * total_matrices(w.MIXED), counts
    assert min(counts) > 0


def tp_reference(compute_dtype):
    params, grads = w.full_tensors(w.TP_LAYOUT, STEPS)
    return w.run_muon(params, grads, {}, compute_dtype=compute_dtype)


@pytest.mark.parametrize("compute_dtype", DTYPES)
def test_tp_gather_is_the_slice_of_the_full_update_and_block_is_muon_per_shard(two_ranks, compute_dtype):
    results = [r[("tp", compute_dtype)] for r in two_ranks]
    full, full_bufs = tp_reference(compute_dtype)
    dims = [d for _, d, _ in w.TP_LAYOUT]
    params, grads = w.full_tensors(w.TP_LAYOUT, STEPS)
    for rank, r in enumerate(results):
        assert_same(r["gather"]["params"], [w.shard(p, d, 2, rank) for p, d in zip(full, dims)], "gather params")
        assert_same(r["gather"]["bufs"], [w.shard(b, d, 2, rank) for b, d in zip(full_bufs, dims)], "gather momentum")
        # block: plain Muon on this rank's shards, each its own parameter (no TP group at all)
        local = [w.shard(p, d, 2, rank) for p, d in zip(params, dims)]
        local_grads = [[w.shard(g, d, 2, rank) for g, d in zip(gs, dims)] for gs in grads]
        block, _ = w.run_muon(local, local_grads, {}, compute_dtype=compute_dtype)
        assert_same(r["block"]["params"], block, "block params")
        # and block really is a different update where a matrix dim is split
        split = [i for i, d in enumerate(dims) if d is not None and d >= len(w.TP_LAYOUT[i][0]) - 2]
        assert all(not torch.equal(r["block"]["params"][i], r["gather"]["params"][i]) for i in split)


def test_tp2_dp2_gather_equals_single_process():
    results = run_ranks(w.tp_dp_rank, 4, STEPS, "bfloat16")
    full, _ = tp_reference("bfloat16")
    dims = [d for _, d, _ in w.TP_LAYOUT]
    for r in results:
        assert_same(r["params"], [w.shard(p, d, 2, r["tp"]) for p, d in zip(full, dims)], f"rank tp{r['tp']}dp{r['dp']}")
    # Within one TP group both ranks orthogonalise the same (full) matrices; across DP they split them.
    by_tp = {}
    for r in results:
        by_tp.setdefault(r["tp"], []).append(r["ns_matrices"])
    for counts in by_tp.values():
        assert min(counts) > 0 and max(counts) < sum(counts)
