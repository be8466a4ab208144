"""dry_run=N reports the weight versions the run allocates (issue 34): the dry run builds each stage's engine
through the same StagePlan and builder as the trainer's executor, so weight prediction's extra version is there
too (it was missing when the dry run counted the buffers itself)."""

from __future__ import annotations

import dataclasses

import pytest

from asyncpp import job
from model_zoo import get_model_config
from tests.dist.harness import run_ranks
from tests.dist.workers import make_config, pipeline_rank

pytestmark = pytest.mark.dist


# Weight prediction is the case that drifted; the plain one (2 buffers) runs under -m slow.
@pytest.mark.parametrize("prediction", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["plain", "weight_prediction"])
def test_dry_run_reports_the_versions_the_run_allocates(prediction, tmp_path):
    cfg = make_config(parallel={"pp": 2}, train={"steps": 3},
                      staleness={"weight_prediction": prediction}, out_dir=str(tmp_path))
    ranks = run_ranks(pipeline_rank, 2, cfg.to_dict())
    model_cfg = get_model_config(cfg.model.name)
    planned = job.run_dry(dataclasses.replace(cfg, dry_run=2).validate(model_cfg), model_cfg, echo=lambda text: None)
    for rank in ranks:
        report = planned[rank["stage"]]
        rows = {i["name"].split(" (")[0]: i["bytes"] for i in report["memory"]["items"]}
        assert rank["num_buffers"] == report["num_buffers"] == (3 if prediction else 2)  # 2BW (+1 predicting)
        assert rows["weight versions"] == rank["version_bytes"] > 0
