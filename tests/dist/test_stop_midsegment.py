"""A stop request inside a segment (no evaluation or checkpoint point for the rest of the run): every rank
agrees on a stop step, drains there, checkpoints it, and a rerun finishes bit-identical to an uninterrupted run.

The request is raised by StopFlag's test hook at a fixed step on ONE rank (deterministic in CI; the others
learn it from the agreement). The real-signal run is tests/dist/test_preemption.py and bench/faults.py."""

from __future__ import annotations

import pytest
import torch

from asyncpp.pipeline.stopping import stop_lookahead
from asyncpp.train.checkpoint import list_checkpoints
from tests.dist.harness import run_ranks
from tests.dist.workers import make_config, pipeline_rank

pytestmark = [pytest.mark.dist, pytest.mark.equivalence]

STEPS = 12


def stopped_rank(rank: int, cfg_dict: dict, requester: int, at_step: int) -> dict:
    import asyncpp.train.trainer as trainer_module
    from asyncpp.train.preemption import StopFlag

    original = trainer_module.Trainer.__init__

    def init(self, cfg, executor, metrics=None, stop=None):
        original(self, cfg, executor, metrics, StopFlag(at_step=at_step if rank == requester else None))

    trainer_module.Trainer.__init__ = init
    return pipeline_rank(rank, cfg_dict)


def config(tmp_path, kind: str, P: int):
    split = {"stage_layers": [2, 1, 1]} if P == 3 else {}  # tiny models have 4 layers
    return make_config(parallel={"pp": P, **split}, schedule={"name": kind},
                       staleness={"ef_lambda": 1.0 if kind in ("2bw", "pipedream") else 0.0},
                       train={"steps": STEPS, "num_microbatches": max(P, 2)},
                       checkpoint={"enabled": True, "every": 0, "dir": str(tmp_path / "ckpt")})


def params_of(results) -> dict:
    return {n: p for res in results for n, p in res["params"].items()}


@pytest.mark.parametrize("kind, P, requester, at_step", [
    pytest.param("2bw", 2, 1, 3, marks=pytest.mark.slow),  # 17 s; session 8: the stop streams' unit test and the
    pytest.param("2bw", 3, 0, 2, marks=pytest.mark.slow),
    pytest.param("1f1b", 2, 0, 4, marks=pytest.mark.slow),
    pytest.param("pipedream", 3, 2, 1, marks=pytest.mark.slow),
])
# (session 8) NCCL replay of 2bw-P2-stop-midsegment stay in the default tier
def test_a_stop_mid_segment_checkpoints_the_agreed_step_and_the_rerun_is_bit_identical(tmp_path, kind, P,
                                                                                       requester, at_step):
    full = run_ranks(pipeline_rank, P, config(tmp_path / "full", kind, P).to_dict())

    cfg = config(tmp_path / "part", kind, P)
    part = run_ranks(stopped_rank, P, cfg.to_dict(), requester, at_step)
    # The request is posted at UPDATE_START(at_step) and agreed at UPDATE(at_step): the stop step is this one.
    expected = at_step + stop_lookahead(kind, P)
    assert expected < STEPS - 1  # really mid-segment: the only drain point is the end
    assert {res["summary"]["stopped_at"] for res in part} == {expected}
    assert [c.name for c in list_checkpoints(tmp_path / "part" / "ckpt")] == [f"step_{expected:08d}"]
    steps = [r["step"] for res in part for r in res["records"]]
    assert steps == list(range(expected))

    resumed = run_ranks(pipeline_rank, P, cfg.to_dict())  # checkpoint.resume=auto: the same command
    records = {r["step"]: r for res in resumed for r in res["records"]}
    reference = {r["step"]: r for res in full for r in res["records"]}
    assert sorted(records) == list(range(expected, STEPS))
    for t in records:
        assert records[t]["loss"] == reference[t]["loss"], t
    full_params, resumed_params = params_of(full), params_of(resumed)
    for name, p in full_params.items():
        assert torch.equal(resumed_params[name], p), name


@pytest.mark.slow  # re-tiered (session 8, the default suite's budget): 14 s
def test_timed_checkpoints_cut_the_stream_where_rank_0_asks_and_change_no_number(tmp_path):
    """checkpoint.every_minutes tiny: rank 0's clock asks at every step; every rank saves at the same agreed
    steps (mid-segment), and losses and weights equal the run without timed checkpoints, bit for bit."""
    plain = config(tmp_path / "plain", "2bw", 2)
    plain = plain.replace(checkpoint=plain.checkpoint.__class__(enabled=True, every=0, every_minutes=0.0,
                                                                dir=str(tmp_path / "plain" / "ckpt")))
    timed = plain.replace(checkpoint=plain.checkpoint.__class__(enabled=True, every=0, every_minutes=1e-9,
                                                                keep_last=100, dir=str(tmp_path / "timed" / "ckpt")))
    reference = run_ranks(pipeline_rank, 2, plain.to_dict())
    results = run_ranks(pipeline_rank, 2, timed.to_dict())
    saved = [int(c.name.split("_")[1]) for c in list_checkpoints(tmp_path / "timed" / "ckpt")]
    # Asked at UPDATE_START(0), agreed at UPDATE(0): the first cut is at the lookahead, then every lookahead steps.
    k = stop_lookahead("2bw", 2)
    assert saved == [*range(k, STEPS, k), STEPS], saved
    losses = {r["step"]: r["loss"] for res in results for r in res["records"]}
    expected = {r["step"]: r["loss"] for res in reference for r in res["records"]}
    assert losses == expected
    for name, p in params_of(reference).items():
        assert torch.equal(params_of(results)[name], p), name
