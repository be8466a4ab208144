"""A pipeline stage frees what it sent once the step it belongs to is over, on gloo too.

gloo's send handle reports completion only inside wait(), so a stage that freed sends only when `poll` saw
them complete kept every activation (and input gradient) of a segment alive until the
segment's drain, and its resident memory grew with run length (issue 21: rank 0's RSS 484 -> 752 -> 1057 MB at
steps 20/80/160 of bench/peers.py --memory). StageComm.retire(t), called at UPDATE(t) once the cross-stage
norm all-reduce has completed, frees the sends of steps <= t. Checked here on real gloo ranks: after every
retire, nothing of a finished step is pending, and at most the sends of the two steps 2BW keeps in flight
are (m per step and direction). The same for the vocabulary-parallel head's held broadcasts and reduces
(VocabHead.retire at UPDATE(t))."""

from __future__ import annotations

import pytest

from asyncpp import job
from asyncpp.pipeline.build import build_rank_stage
from asyncpp.pipeline.compose import pipeline_executor
from asyncpp.pipeline.vocab_head import VocabHead
from asyncpp.train.trainer import Trainer
from tests.dist.harness import run_ranks
from tests.dist.workers import Collect, data_for, make_config, rank_layout

pytestmark = [pytest.mark.dist]


def pending_after_retire(rank: int, cfg_dict: dict) -> dict:
    """One rank's run; after each retire(t): t and the steps of the sends still pending on each link."""
    import torch

    cfg, model_cfg, mesh = rank_layout(cfg_dict)
    torch.manual_seed(cfg.seed)
    stage = build_rank_stage(cfg, model_cfg, mesh, "cpu")
    run = pipeline_executor(cfg, stage, mesh, data_for(cfg, model_cfg.vocab_size), job.optimizer_for(cfg, mesh))
    engine, seen = run.engine, []
    retire = engine._retire_sends

    def recording(step: int) -> None:
        retire(step)
        links = [[s for *_, s in engine.comm._pending]]
        head = engine.part(VocabHead)
        if head is not None:  # the head's broadcasts (last stage) and reduces (the others) not waited for
            links.append(head._held.steps())
        seen.append((step, links))

    engine._retire_sends = recording
    Trainer(cfg, run, Collect()).run()
    return {"stage": mesh.pp_rank, "seen": seen}


@pytest.mark.parametrize("pp, head", [pytest.param(3, "last", marks=pytest.mark.slow), (2, "vocab")])  # 9 s: session 8
def test_sends_of_finished_steps_are_freed_at_the_update(pp, head):
    m, steps = 3, 8
    cfg = make_config(parallel={"pp": pp, "head": head},
                      model={"name": "tiny_dense", "overrides": {"tie_embeddings": False}},
                      train={"steps": steps, "num_microbatches": m})
    for r in run_ranks(pending_after_retire, pp, cfg.to_dict()):
        assert [t for t, _ in r["seen"]] == list(range(steps)), r["stage"]
        for t, links in r["seen"]:
            for pending in links:
                assert all(s is not None and s > t for s in pending), (r["stage"], t, pending)
                # forwards and backwards of steps t+1 and t+2 at most (both directions of a middle stage)
                assert len(pending) <= 2 * 2 * m, (r["stage"], t, pending)
