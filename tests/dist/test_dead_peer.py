"""Every dead-peer path names the stage and what it waited for: a rank that dies at a collective outside the
p2p waits (a drain point's stop decision, the per-step stop agreement, the summary) leaves the others with a
PipelineTimeout naming their stage, not a raw gloo "Connection reset by peer"."""

from __future__ import annotations

import os

import pytest

from tests.dist.harness import run_ranks
from tests.dist.workers import make_config, pipeline_rank

pytestmark = pytest.mark.dist


def rank_dies_in(rank: int, cfg_dict: dict, victim: int, method: str, after_calls: int) -> dict:
    from asyncpp.pipeline import executor, stopping

    owner = stopping.StopAgreement if method == "post" else executor.PipelineExecutor
    original, calls = getattr(owner, method), []

    def dying(self, *args, **kwargs):
        if rank == victim and len(calls) == after_calls:
            os._exit(17)  # no goodbye, like a lost node
        calls.append(1)
        return original(self, *args, **kwargs)

    setattr(owner, method, dying)
    return pipeline_rank(rank, cfg_dict)


@pytest.mark.parametrize("method, after_calls, waited_for", [
    ("stop_agreed", 0, "every rank's stop decision at a drain point"),
    ("post", 3, None),  # the survivor may first wait for a gradient or for the agreement: either is named
    ("summary", 0, "every rank's summary"),
])
def test_a_peer_dying_at_a_collective_is_named(method, after_calls, waited_for):
    cfg = make_config(parallel={"pp": 2}, train={"steps": 6, "eval_every": 3, "timeout_s": 20.0})
    results = run_ranks(rank_dies_in, 2, cfg.to_dict(), 1, method, after_calls, timeout=120, expect_dead=True)
    assert results[1] == ("died", 17)
    survivor = results[0]
    assert isinstance(survivor, str), survivor  # the traceback text of its error
    assert "PipelineTimeout: stage 0 (rank 0) gave up waiting for" in survivor, survivor[-1500:]
    assert waited_for is None or waited_for in survivor, survivor[-1500:]
