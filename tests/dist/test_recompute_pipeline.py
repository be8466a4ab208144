"""Issue 20, activation recomputation under 2BW: the replay in the backward reads the weight version (and the
router bias version) its forward read, so a P=2 2BW pipeline with recomputation equals the same pipeline
without it bit for bit (same kernels, same order), losses and final weights."""

from __future__ import annotations

import pytest
import torch

from tests.dist.test_pipeline_equivalence import run_pipeline
from tests.dist.workers import make_config

pytestmark = [pytest.mark.equivalence, pytest.mark.dist]


def _run(recompute):
    # Aux-loss-free balancing on: its bias is versioned like the weights, and a replay must read the
    # forward's version of it too. m = 4 > P: forwards of b_{t+1} run between b_t's forward and backward.
    cfg = make_config(model={"name": "tiny_hybrid", "overrides": {"moe": {"bias_update_rate": 0.05}}},
                      parallel={"pp": 2}, train={"steps": 4, "recompute": recompute},
                      staleness={"ef_lambda": 1.0})
    records, params, _ = run_pipeline(cfg)
    return [r["loss"] for r in records], params


@pytest.fixture(scope="module")
def without_recompute():
    return _run("none")


@pytest.mark.parametrize("recompute", [pytest.param("full", marks=pytest.mark.slow),  # 13 s: re-tiered (session 8)
                                       ["selective", "full"]])
def test_2bw_with_recompute_equals_2bw_without_bit_for_bit(recompute, without_recompute):
    ref_losses, ref_params = without_recompute
    losses, params = _run(recompute)
    assert losses == ref_losses
    for name, p in ref_params.items():
        assert torch.equal(params[name], p), name
