"""A trainer run's pipeline stage, composed: its plan, what it reads, its forward, its runtime, its report and its
checkpoints, handed to the executor that steps and evaluates them.

asyncpp/job.py calls it for a run; the traced dry run (analysis/traced.py), the benches and the multi-rank tests
compose their stage through it too, so that they run the stage the trainer runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from torch import nn

from asyncpp.config import RunConfig
from asyncpp.core.batches import BatchPlan
from asyncpp.core.records import DataSource
from asyncpp.optim.build import AnyOptimizer
from asyncpp.parallel.mesh import Mesh
from asyncpp.parallel.sharding import ShardingPlan, layout_of
from asyncpp.pipeline.build import BuiltStage
from asyncpp.pipeline.executor import Cadence, PipelineExecutor
from asyncpp.pipeline.p2p import StageComm, naming_the_peer
from asyncpp.pipeline.parts import StagePart
from asyncpp.pipeline.plan import StagePlan, build_stage_runtime
from asyncpp.pipeline.report import StageReport
from asyncpp.pipeline.stage import StageForward, tied_parameters
from asyncpp.pipeline.stage_data import StageData
from asyncpp.pipeline.state import StageCheckpoint

BuildOptimizer = Callable[[nn.Module, ShardingPlan], AnyOptimizer]
"""build_optimizer(stage_model, sharding_plan) -> the stage's optimizer (job.optimizer_for)."""


def pipeline_executor(cfg: RunConfig, stage: BuiltStage, mesh: Mesh, source: DataSource,
                      build_optimizer: BuildOptimizer, *, comm_cls: type[StageComm] = StageComm,
                      parts: Sequence[StagePart] = (), process_baseline_bytes: int | None = None,
                      executor_cls: type[PipelineExecutor] = PipelineExecutor) -> PipelineExecutor:
    """The executor of this rank's stage. `stage` is its built part of the model (build.py: pruned, sharded,
    initialized); `comm_cls` the stage links (a test stages them through host memory: tests/gpu/workers.py);
    `parts` more parts the stage runs (parts.py: their actions are in the executor's `actions_of` lists);
    `process_baseline_bytes` the process's RSS before the build (what the memory plan does not count), for the
    summary."""
    model, spec = stage.model, stage.spec
    batches = BatchPlan.of(cfg, mesh.dims.dp)
    data = StageData(source, batches, mesh.dp_rank, mesh.device, cfg.train.seq_len)
    plan = StagePlan.of(cfg, model.config, spec, mesh.dims)
    forward = StageForward(model, spec, stage.loss_fn, mesh, cfg.parallel.sequence_parallel, data)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    engine = build_stage_runtime(
        plan, spec, model, mesh, build_optimizer(model, stage.sharding), forward,
        grad_scale=1.0 / batches.microbatches(0), layouts=[layout_of(stage.sharding, n) for n, _ in named],
        tied=tied_parameters(model, spec), head_labels=data.labels, embed_inputs=data.inputs, comm_cls=comm_cls,
        extra_parts=parts)
    naming = functools.partial(naming_the_peer, mesh, timeout_s=plan.timeout_s)
    report = StageReport(cfg, model.config, mesh, spec, engine, naming, process_baseline_bytes)
    checkpoint = StageCheckpoint(cfg, mesh, spec, model, engine, source, batches, naming)
    return executor_cls(plan, stage, mesh, engine, data, forward, Cadence.of(cfg), report, checkpoint)
