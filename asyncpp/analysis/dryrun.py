"""Lay a job out at its real world size without GPUs: a fake process group, meta tensors.

For every pipeline stage, one of its ranks builds the mesh (real DeviceMesh code, groups on the fake
backend), the stage (model on meta, pruned, TP/EP plan applied: every shard gets its real shape), the
optimizer, the weight versions and the Error-Feedback buffer, and reports the per-rank memory with
asyncpp.core.memory. Nothing is allocated and nothing is communicated, so a 10B model on 64 ranks lays out
on a laptop in seconds. All ranks of a stage hold the same shapes (TP/EP shards are equal), so one
rank per stage is representative.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from torch import nn

from asyncpp.config import RunConfig
from asyncpp.parallel.mesh import Mesh, ParallelDims
from asyncpp.parallel.sharding import ShardingPlan, layout_of
from asyncpp.pipeline.build import mesh_for, stage_spec_of
from asyncpp.pipeline.memory import stage_memory
from asyncpp.pipeline.plan import StagePlan, build_stage_runtime
from asyncpp.pipeline.stage import StageSpec, tied_parameters
from model_zoo import ModelConfig

BuildStage = Callable[[Mesh, StageSpec], tuple[nn.Module, ShardingPlan]]
BuildOptimizer = Callable[[nn.Module, ShardingPlan, Mesh], object]


def fake_group(rank: int, world_size: int) -> None:
    # torch's in-process fake backend: every collective returns at once. Internal to torch's test
    # utilities, but it is the supported way to trace a distributed program without peers.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def stage_report(cfg: RunConfig, model_cfg: ModelConfig, mesh: Mesh, spec: StageSpec, build_stage: BuildStage,
                 build_optimizer: BuildOptimizer) -> dict:
    """One rank's report: its stage built on meta tensors, and the engine the run builds for it (the same
    StagePlan and builder as the trainer's executor, pipeline/plan.py), so the weight versions, the
    distributed optimizer's share and the Error-Feedback buffer are the ones the run allocates."""
    stage, sharding = build_stage(mesh, spec)
    named = [(n, p) for n, p in stage.named_parameters() if p.requires_grad]
    engine = build_stage_runtime(
        StagePlan.of(cfg, model_cfg, spec, mesh.dims), spec, stage, mesh, build_optimizer(stage, sharding, mesh),
        _never_run, grad_scale=1.0, layouts=[layout_of(sharding, n) for n, _ in named],
        tied=tied_parameters(stage, spec))
    report = stage_memory(cfg, model_cfg, mesh, spec, engine.versions, engine.update.optimizer,
                          engine.update.error_feedback.prev_update)
    shards = {n: {"shape": list(p.shape), "tp_dim": layout_of(sharding, n).tp_dim,
                  "expert": layout_of(sharding, n).expert} for n, p in named}
    return {"stage": spec.stage, "rank": mesh.rank, "layers": [spec.layers.start, spec.layers.stop],
            "params": sum(p.numel() for _, p in named),
            "num_buffers": engine.versions.num_buffers, "memory": report.to_dict(), "table": report.table(),
            "shards": shards}


def _never_run(step: int, microbatch: int, x):
    raise RuntimeError("a dry run builds the stage's engine but runs no action")


def dry_run(cfg: RunConfig, model_cfg: ModelConfig, world_size: int, build_stage: BuildStage, build_optimizer: BuildOptimizer,
            out: Path | None = None, echo: Callable[[str], None] = print) -> list[dict]:
    """Per-stage reports of `cfg`'s layout at `world_size` ranks (JSON to `out` if given)."""
    p = cfg.parallel
    dims = ParallelDims.for_world(world_size, pp=p.pp, tp=p.tp, ep=p.ep, dp=p.dp)
    echo(f"dry run: model={model_cfg.name} world={world_size} -> pp={dims.pp} dp={dims.dp} (ep={dims.ep} x "
         f"edp={dims.edp}) tp={dims.tp}, schedule={cfg.schedule.name}, precision={cfg.train.precision}, "
         f"optimizer={cfg.optimizer.name}, ef_lambda={cfg.staleness.ef_lambda}, "
         f"distributed_optimizer={p.distributed_optimizer and dims.dp > 1} (meta tensors: \"allocated\" "
         "rows are sized from the real shard shapes, nothing is allocated)")
    reports = []
    started = time.perf_counter()
    for s in range(dims.pp):
        rank = (s * dims.dp) * dims.tp  # dp rank 0, tp rank 0 of stage s
        # Progress: a stage of a 10B model takes seconds to lay out, a 64-rank job a minute or more.
        echo(f"dry run: stage {s + 1} of {dims.pp} (rank {rank}), {time.perf_counter() - started:.1f} s so far")
        fake_group(rank, world_size)
        try:
            mesh = mesh_for(cfg, model_cfg, dims, "cpu")
            spec = stage_spec_of(cfg, model_cfg, s)  # the helper's head replica, the vocabulary rows, are counted
            reports.append(stage_report(cfg, model_cfg, mesh, spec, build_stage, build_optimizer))
        finally:
            dist.destroy_process_group()
        echo(reports[-1]["table"] + f"\n  parameters on this rank: {reports[-1]['params'] / 1e6:.1f}M")
    worst = max(reports, key=lambda r: r["memory"]["total_bytes"])
    echo(f"largest rank: stage {worst['stage']}, {worst['memory']['total_bytes'] / 2**30:.2f} GiB "
         "(+ CUDA context, allocator slack and communication buffers, not counted)")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"world_size": world_size, "layout": dataclasses.asdict(dims), "stages": reports},
                                  indent=1))
        echo(f"wrote {out}")
    return reports
