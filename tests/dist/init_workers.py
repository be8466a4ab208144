"""What each rank runs in the layout-independence tests (tests/dist/test_layout_independent_init.py)."""

from __future__ import annotations

from asyncpp import job
from asyncpp.pipeline.build import build_rank_stage
from asyncpp.pipeline.compose import pipeline_executor
from asyncpp.train.trainer import Trainer
from tests.dist.workers import Collect, data_for, rank_layout


def fresh_stage_rank(rank: int, cfg_dict: dict) -> dict:
    """This rank's freshly built stage (its initial weights, before any step) and the records of training it."""
    cfg, model_cfg, mesh = rank_layout(cfg_dict)
    stage = build_rank_stage(cfg, model_cfg, mesh, "cpu")
    initial = {n: t.detach().clone() for n, t in stage.model.named_parameters()}
    run = pipeline_executor(cfg, stage, mesh, data_for(cfg, model_cfg.vocab_size), job.optimizer_for(cfg, mesh))
    sink = Collect()
    Trainer(cfg, run, sink).run()
    return {"stage": mesh.pp_rank, "dp": mesh.dp_rank, "tp": mesh.tp_rank, "ep": mesh.ep_rank, "records": sink.records,
            "params": initial, "layouts": {n: (lay.tp_dim, lay.expert) for n, lay in run.sharding.items()}}
