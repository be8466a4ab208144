"""What each rank runs in the single-GPU pipeline test, and its GPU simulator reference.

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so these ranks use gloo. gloo all-reduces
CUDA tensors but sends and receives only CPU tensors, so the stage link is staged through host memory
(HostStagedComm); everything else (model, weight versions, optimizer, reductions) is on the GPU.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from asyncpp.config import RunConfig
from asyncpp.optim import build_from_config
from asyncpp.parallel.mesh import Mesh, ParallelDims
from asyncpp.pipeline.build import build_rank_stage
from asyncpp.pipeline.compose import pipeline_executor
from asyncpp.pipeline.p2p import StageComm
from asyncpp.reference.executor import build_simulator
from asyncpp.train.trainer import Trainer
from model_zoo import build_model, get_model_config
from tests.dist.workers import Collect, data_for


class HostStagedComm(StageComm):
    """StageComm whose payloads cross gloo as CPU tensors (gloo has no CUDA send/recv)."""

    def _buffer(self) -> Tensor:
        return torch.empty(self.shape, dtype=self.dtype)

    def _arrived(self, buf: Tensor) -> Tensor:
        return buf.to(self.mesh.device)

    def _payload(self, tensor: Tensor) -> Tensor:
        return tensor.detach().to("cpu").contiguous()


def gpu_pipeline_rank(rank: int, cfg_dict: dict) -> dict:
    os.environ["LOCAL_RANK"] = "0"  # both ranks share GPU 0; DeviceMesh would otherwise pick cuda:LOCAL_RANK
    torch.cuda.set_device(0)
    cfg = RunConfig.from_dict(cfg_dict)
    model_cfg = get_model_config(cfg.model.name)
    cfg = cfg.validate(model_cfg)
    device = torch.device("cuda", 0)
    mesh = Mesh(ParallelDims.for_world(torch.distributed.get_world_size(), pp=cfg.parallel.pp), device)
    torch.manual_seed(cfg.seed)
    stage = build_rank_stage(cfg, model_cfg, mesh, device)
    run = pipeline_executor(cfg, stage, mesh, data_for(cfg, model_cfg.vocab_size),
                            lambda stage, *_: build_from_config(stage, cfg.optimizer), comm_cls=HostStagedComm)
    sink = Collect()
    Trainer(cfg, run, sink).run()
    params = {n: p.detach().cpu().clone() for n, p in run.model.named_parameters()}
    return {"stage": mesh.pp_rank, "records": sink.records, "params": params}


def gpu_reference_run(cfg: RunConfig) -> dict:
    """The single-process simulator of the same run on the GPU."""
    model_cfg = get_model_config(cfg.model.name)
    device = torch.device("cuda", 0)
    torch.manual_seed(cfg.seed)
    model = build_model(model_cfg, device=device)
    sim = build_simulator(cfg, model, build_from_config(model, cfg.optimizer))
    data = data_for(cfg, model_cfg.vocab_size)
    m = cfg.train.num_microbatches
    stats = [sim.step(t, [data.train_microbatch(t * m + j).to(device) for j in range(m)])
             for t in range(cfg.train.steps)]
    return {"stats": stats, "params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()}}
