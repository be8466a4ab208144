"""train.batch_rampup on a real pipeline (issue 20): segments are cut where m changes, each runs its own m, and
the pipeline equals the simulator with the same rampup and resumes exactly in the middle of the ramp."""

from __future__ import annotations

import pytest
import torch

from asyncpp.core.batches import BatchPlan
from tests.dist.harness import run_ranks
from tests.dist.test_pipeline_equivalence import assert_equivalent
from tests.dist.workers import make_config, pipeline_rank

pytestmark = [pytest.mark.equivalence, pytest.mark.dist]

# micro_batch_size 2, dp 1, final m 4 (global batch 8); the batch starts at 4 and grows by 2 every
# 16 / ((8 - 4) / 2) = 8 samples (Megatron's rule, asyncpp/core/batches.py), so over 7 steps
# consumed = 0, 4, 8, 14, 20, ... and m = 2, 2, 3, 3, 4, 4, 4: two changes (steps 2 and 4), and a checkpoint
# every 3 steps falls in the middle of the ramp.
RAMP = {"steps": 7, "micro_batch_size": 2, "num_microbatches": 4, "batch_rampup": [4, 2, 16]}
M = [2, 2, 3, 3, 4, 4, 4]


def test_the_ramp_of_these_tests():
    plan = BatchPlan.of(make_config(train=RAMP))
    assert [plan.microbatches(t) for t in range(7)] == M and plan.changes() == [2, 4]


def test_2bw_pipeline_with_a_batch_rampup_equals_the_simulator():
    cfg = make_config(parallel={"pp": 2}, schedule={"name": "2bw"}, train=RAMP, staleness={"ef_lambda": 1.0},
                      logging={"log_every": 3})
    records, ref, results = assert_equivalent(cfg)
    # As in test_four_stage_2bw_hybrid_moe_...: one thread per process, the same kernels in the same order.
    assert [r["loss"] for r in records] == [s.loss for s in ref["stats"]]
    for r in results:
        for name, p in r["params"].items():
            assert torch.equal(p, ref["params"]["embed.weight" if name == "lm_head.weight" else name]), name
    # The real batch: each step's tokens, and the consumed total, follow m_t.
    seq = cfg.train.seq_len
    assert [r["global_batch_size"] for r in records] == [2 * m for m in M]
    assert [r["consumed_tokens"] for r in records] == [2 * seq * sum(M[: t + 1]) for t in range(7)]
    summary = next(r["summary"] for r in results if r["records"])
    assert summary["tokens"] == 2 * seq * sum(M)
    # The log line's bubble (issue 20): on its steps (every 3rd and the last), every stage's.
    logged = [r for r in records if "bubble_fraction" in r]
    assert [r["step"] for r in logged] == [2, 5, 6]
    for r in logged:
        stages = r["bubble_fraction_per_stage"]
        assert len(stages) == 2 and all(0.0 <= b < 1.0 for b in stages), r
        assert r["bubble_fraction"] == pytest.approx(sum(stages) / 2, rel=1e-12)  # dp 1: a rank is a stage


@pytest.mark.slow  # re-tiered (session 8, the default suite's budget): 13 s; the ramp itself equals the simulator by default
def test_pipeline_resumed_in_the_middle_of_the_ramp_equals_the_uninterrupted_run(tmp_path):
    def run(checkpoint: dict) -> tuple[dict, dict]:
        cfg = make_config(parallel={"pp": 2}, train=RAMP, checkpoint=checkpoint)
        results = run_ranks(pipeline_rank, 2, cfg.to_dict())
        records = {r["step"]: r for res in results for r in res["records"]}
        return records, {n: p for res in results for n, p in res["params"].items()}

    full, full_params = run({"enabled": True, "every": 3, "dir": str(tmp_path / "ckpt")})
    resumed, params = run({"enabled": False, "resume": str(tmp_path / "ckpt" / "step_00000003")})
    assert sorted(resumed) == [3, 4, 5, 6]  # resumed at m=3, before the ramp's last change
    for t in resumed:
        assert resumed[t]["loss"] == full[t]["loss"] and resumed[t]["grad_norm"] == full[t]["grad_norm"], t
        assert resumed[t]["consumed_tokens"] == full[t]["consumed_tokens"], t
    for name, p in full_params.items():
        assert torch.equal(params[name], p), name
