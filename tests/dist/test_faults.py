"""A rank that dies must not hang the others: they fail, naming their stage and what they waited for."""

from __future__ import annotations

import os

import pytest

from tests.dist.harness import run_ranks
from tests.dist.workers import make_config, pipeline_rank

pytestmark = pytest.mark.dist


def rank_dies_at_step(rank: int, cfg_dict: dict, victim: int, step: int) -> dict:
    import asyncpp.pipeline.engine as engine

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


def poisoned_rank(rank: int, cfg_dict: dict, poison: list[int]) -> dict:
    """The last stage's loss is NaN at the `poison` steps (a bad batch)."""
    import asyncpp.pipeline.stage as stage

    original = stage.StageForward.__call__

    def forward(self, step, microbatch, x):
        out = original(self, step, microbatch, x)
        return out * float("nan") if self.spec.is_last and step in poison else out

    stage.StageForward.__call__ = forward
    try:
        return pipeline_rank(rank, cfg_dict)
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return {"error": f"{type(e).__name__}: {e}"}


@pytest.mark.equivalence
def test_non_finite_step_is_skipped_on_every_stage_like_the_simulator():
    import torch

    from tests.dist.workers import reference_run

    cfg = make_config(parallel={"pp": 2}, train={"steps": 5})
    results = run_ranks(poisoned_rank, 2, cfg.to_dict(), [2])
    records = next(r["records"] for r in results if r["records"])
    assert [r["skipped"] for r in records] == [False, False, True, False, False]

    import asyncpp.reference.simulator as simulate

    original = simulate.DelayedUpdateSimulator._accumulate

    def accumulate(self, microbatches, step=None, _state={"t": 0}):
        total = original(self, microbatches, step)
        if _state["t"] == 2:
            for p in self.params:
                p.grad.mul_(float("nan"))
        _state["t"] += 1
        return total

    simulate.DelayedUpdateSimulator._accumulate = accumulate
    try:
        ref = reference_run(cfg)
    finally:
        simulate.DelayedUpdateSimulator._accumulate = original
    assert [s.skipped for s in ref["stats"]] == [False, False, True, False, False]
    for r, s in zip(records, ref["stats"]):
        if not r["skipped"]:
            assert r["loss"] == s.loss
    params = {n: p for res in results for n, p in res["params"].items()}
    for name, p in ref["params"].items():
        assert torch.equal(params[name], p), name


def test_consecutive_non_finite_steps_abort_every_rank_at_the_same_step():
    cfg = make_config(parallel={"pp": 2}, train={"steps": 8, "max_consecutive_skips": 2})
    results = run_ranks(poisoned_rank, 2, cfg.to_dict(), [3, 4, 5])
    for r in results:
        assert r["error"].startswith("TrainingAborted: 2 consecutive steps had a non-finite gradient (last: step 4)")


def rank_dies_saving(rank: int, cfg_dict: dict, victim: int, where: str) -> dict:
    """The victim dies as the checkpoint begins (`where`="start": before its first collective) or inside DCP
    ("dcp": the others are in DCP's own plan gather)."""
    import asyncpp.train.checkpoint as ckpt

    if where == "start":
        original = ckpt.Saver.save

        def save(self, *args, **kwargs):
            if rank == victim:
                os._exit(17)
            return original(self, *args, **kwargs)

        ckpt.Saver.save = save
    else:
        import torch.distributed.checkpoint as dcp  # the module checkpoint.py imports at its first save

        dcp_save = dcp.save

        def inside(*args, **kwargs):
            if rank == victim:
                os._exit(17)
            return dcp_save(*args, **kwargs)

        dcp.save = inside
    return pipeline_rank(rank, cfg_dict)


@pytest.mark.parametrize("where", ["start", "dcp"])
def test_a_rank_dying_in_a_checkpoint_is_named_and_nothing_is_committed(tmp_path, where):
    """The checkpoint's collectives (ours, and DCP's own plan gather) see a dead peer as a raw gloo error: the
    survivor says which stage gave up waiting for which checkpoint, and no checkpoint is committed."""
    cfg = make_config(parallel={"pp": 2}, train={"steps": 4, "timeout_s": 20.0},
                      checkpoint={"enabled": True, "every": 2, "dir": str(tmp_path / "ckpt")})
    results = run_ranks(rank_dies_saving, 2, cfg.to_dict(), 1, where, timeout=120, expect_dead=True)
    assert results[1] == ("died", 17)
    survivor = results[0]
    assert isinstance(survivor, str), survivor
    assert "PipelineTimeout" in survivor
    assert "stage 0 (rank 0) gave up waiting for every rank's part of the checkpoint of step 2" in survivor
    from asyncpp.train.checkpoint import list_checkpoints

    assert list_checkpoints(tmp_path / "ckpt") == []
