"""Checkpoints written before issue 34's restructure still resume, bit for bit.

tests/fixtures/checkpoints_aee4099/ holds step 2 of a 4-step 2BW pipeline run (PP=2, Error Feedback, weight
prediction: three weight versions, u_{t-1}, Muon + AdamW state, the data position) saved by the code of commit
aee4099 (tests/fixtures/make_old_checkpoints.py says how). Today's code resumes it and must continue exactly as
today's uninterrupted run: the restructure moved the stage's wiring, the update and the checkpoint state
into other objects, and changed neither the numbers nor the checkpoint's keys."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.workers import pipeline_rank
from tests.fixtures.make_old_checkpoints import config

pytestmark = [pytest.mark.equivalence, pytest.mark.dist]

OLD = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoints_aee4099" / "2bw_ef_prediction" / "step_00000002"


def pipeline(cfg) -> tuple[dict[int, dict], dict, list[int]]:
    results = run_ranks(pipeline_rank, 2, cfg.to_dict())
    records = {r["step"]: r for res in results for r in res["records"]}
    params = {n: p for res in results for n, p in res["params"].items()}
    return records, params, [res["num_buffers"] for res in results]


def test_a_checkpoint_of_the_old_layout_resumes_bitwise(tmp_path):
    base = config(tmp_path / "unused", weight_prediction=True)
    full, full_params, _ = pipeline(base.replace(checkpoint=base.checkpoint.__class__(enabled=False),
                                                 out_dir=str(tmp_path / "full")))
    old = tmp_path / "old" / OLD.name
    shutil.copytree(OLD, old)  # a resume must not need to write next to the fixture
    resumed_cfg = base.replace(checkpoint=base.checkpoint.__class__(enabled=False, resume=str(old)),
                               out_dir=str(tmp_path / "resumed"))
    resumed, resumed_params, buffers = pipeline(resumed_cfg)
    assert sorted(resumed) == [2, 3] and buffers == [3, 3]  # it resumed at 2, with prediction's third version
    for t in (2, 3):
        assert resumed[t]["loss"] == full[t]["loss"] and resumed[t]["grad_norm"] == full[t]["grad_norm"], t
    assert full_params.keys() == resumed_params.keys()
    for name, p in full_params.items():
        assert torch.equal(resumed_params[name], p), name
