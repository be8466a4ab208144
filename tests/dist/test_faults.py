"""A rank that dies must not hang the others: they fail, naming their stage and what they waited for."""

from __future__ import annotations

import os

import pytest

from tests.dist.harness import run_ranks
from tests.dist.workers import make_config, pipeline_rank

pytestmark = pytest.mark.dist


def rank_dies_at_step(rank: int, cfg_dict: dict, victim: int, step: int) -> dict:
    import asyncpp.engine as engine

    original = engine.StageEngine._forward

    def forward(self, action):
        if rank == victim and action.step == step:
            os._exit(17)  # no cleanup, no goodbye: like a node that lost power
        return original(self, action)

    engine.StageEngine._forward = forward
    return pipeline_rank(rank, cfg_dict)


@pytest.mark.parametrize("victim", [0, 1])
def test_neighbour_of_a_dead_rank_fails_with_a_named_stage(victim):
    cfg = make_config(parallel={"pp": 2}, train={"steps": 6, "timeout_s": 20.0})
    results = run_ranks(rank_dies_at_step, 2, cfg.to_dict(), victim, 3, timeout=120, expect_dead=True)
    assert results[victim] == ("died", 17)
    survivor = results[1 - victim]
    assert isinstance(survivor, str), survivor  # the traceback text of its error
    assert "PipelineTimeout" in survivor
    assert f"stage {1 - victim} (rank {1 - victim}) gave up waiting for" in survivor
    assert "probably died" in survivor
