"""What each rank runs in the layout-independence tests (tests/dist/test_layout_independent_init.py)."""

from __future__ import annotations

import torch

import pretrain
from asyncpp.config import RunConfig
from asyncpp.parallel.mesh import Mesh, ParallelDims
from asyncpp.pipeline.build import build_rank_stage
from asyncpp.pipeline.executor import PipelineExecutor
from asyncpp.train.trainer import Trainer
from model_zoo import get_model_config
from tests.dist.workers import Collect, data_for


def fresh_stage_rank(rank: int, cfg_dict: dict) -> dict:
    """This rank's freshly built stage (its initial weights, before any step) and the records of training it."""
    cfg = RunConfig.from_dict(cfg_dict)
    model_cfg = get_model_config(cfg.model.name, **(cfg.model.overrides or {}))
    cfg.validate(model_cfg)
    p = cfg.parallel
    dims = ParallelDims.for_world(torch.distributed.get_world_size(), pp=p.pp, tp=p.tp, ep=p.ep, dp=p.dp)
    mesh = Mesh(dims, torch.device("cpu"))
    stage = build_rank_stage(cfg, model_cfg, mesh, "cpu")
    initial = {n: t.detach().clone() for n, t in stage.model.named_parameters()}
    run = PipelineExecutor(cfg, stage, mesh, data_for(cfg, model_cfg.vocab_size), pretrain.optimizer_for(cfg, mesh))
    sink = Collect()
    Trainer(cfg, run, sink).run()
    return {"stage": mesh.pp_rank, "dp": mesh.dp_rank, "tp": mesh.tp_rank, "ep": mesh.ep_rank, "records": sink.records,
            "params": initial, "layouts": {n: (lay.tp_dim, lay.expert) for n, lay in run.sharding.items()}}
