"""The multi-process training loop: one pipeline stage per rank, under torchrun.

Wiring only: the stage's part of the model (stage.py), its weight versions (weights.py), the
schedule (schedules/), the engine that executes it (engine.py). The run is cut into segments at
evaluation points; between segments every stage has drained (a 2BW pipeline drains only there),
so evaluation runs a plain forward-only pass on the newest weights x_{t+1}, the same weights the
single-process simulator evaluates.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from asyncpp.config import SYNC_SCHEDULES, RunConfig
from asyncpp.engine import StageEngine
from asyncpp.mesh import Mesh
from asyncpp.metrics import MetricsLogger
from asyncpp.optim.lr_schedule import lr_multiplier
from asyncpp.p2p import StageComm
from asyncpp.schedules.actions import Action, Op
from asyncpp.schedules.build import build_schedule
from asyncpp.simulate import cross_entropy
from asyncpp.semantics import is_sync_step, stage_delay, step_delay
from asyncpp.stage import StageSpec, prune_to_stage, stage_forward, tied_parameters
from asyncpp.trainer import DataSource
from asyncpp.weights import WeightVersions


def num_weight_buffers(schedule: str, stage: int, num_stages: int) -> int:
    """1 for synchronous schedules, 2 for 2BW, P-s for PipeDream (semantics.md)."""
    if schedule in SYNC_SCHEDULES:
        return 1
    return stage_delay(schedule, stage, num_stages) + 1


def segment_actions(kind: str, stage: int, P: int, m: int, delays: Sequence[int], t0: int, t1: int) -> list[Action]:
    """The schedule of steps [t0, t1) as a self-contained stream (drained at both ends), in absolute
    step and version numbers (versions older than t0 were produced by earlier segments)."""
    out = []
    for a in build_schedule(kind, stage, P, m, delays[t0:t1]):
        t = a.step + t0
        if a.op in (Op.FORWARD, Op.BACKWARD):
            version = max(t - delays[t], 0)
        else:
            version = t + 1 if a.op == Op.UPDATE else a.version
        out.append(dataclasses.replace(a, step=t, version=version))
    return out


def segment_bounds(total_steps: int, eval_every: int) -> list[tuple[int, int]]:
    """Drain points: after every eval step and at the end."""
    cuts = sorted({t for t in range(eval_every, total_steps, eval_every)} | {total_steps}) if eval_every else [total_steps]
    starts = [0] + cuts[:-1]
    return list(zip(starts, cuts))


class PipelineRun:
    def __init__(self, cfg: RunConfig, model: nn.Module, mesh: Mesh, data: DataSource, build_optimizer):
        self.cfg, self.mesh, self.data = cfg, mesh, data
        self.spec = StageSpec(mesh.pp_rank, mesh.num_stages, len(model.layers))
        self.model = prune_to_stage(model, self.spec)
        self.m = cfg.train.num_microbatches
        self.delays = [
            step_delay(cfg.schedule.name, self.spec.stage, mesh.num_stages, t, cfg.train.steps, cfg.staleness)
            for t in range(cfg.train.steps)
        ]
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = build_optimizer(self.model)
        versions = WeightVersions(params, num_weight_buffers(cfg.schedule.name, self.spec.stage, mesh.num_stages))
        hidden = model.config.hidden_size
        comm = StageComm(mesh, (cfg.train.micro_batch_size, cfg.train.seq_len, hidden), torch.float32)
        sched = cfg.optimizer.schedule
        self.engine = StageEngine(
            module=self.model, mesh=mesh, comm=comm, optimizer=optimizer, versions=versions,
            forward_fn=self._forward, grad_scale=1.0 / self.m, grad_clip=cfg.train.grad_clip,
            ef_lambda=cfg.staleness.ef_lambda,
            lr_multiplier=lambda t: lr_multiplier(
                t, total_steps=cfg.train.steps, warmup_steps=sched.warmup_steps, kind=sched.kind,
                min_lr_ratio=sched.min_lr_ratio, decay_fraction=sched.decay_fraction),
            is_delayed=lambda t: self.delays[t] > 0,
            tied=tied_parameters(self.model, self.spec),
        )

    def _tokens(self, step: int, microbatch: int) -> Tensor:
        """Global microbatch index (t * dp + dp_rank) * m + j: DP=2 with m equals DP=1 with 2m."""
        index = (step * self.mesh.dims.dp + self.mesh.dp_rank) * self.m + microbatch
        return self.data.train_microbatch(index).to(self.mesh.device)

    def _forward(self, step: int, microbatch: int, x: Tensor | None) -> Tensor:
        tokens = self._tokens(step, microbatch) if (self.spec.is_first or self.spec.is_last) else None
        out = stage_forward(self.model, self.spec, tokens[:, :-1] if self.spec.is_first else x)
        if not self.spec.is_last:
            return out
        return cross_entropy(out, tokens[:, 1:])

    @torch.no_grad()
    def evaluate(self, batches: list[Tensor]) -> float:
        """Forward-only pass through the drained pipeline on the newest weights (last stage's value)."""
        self.engine.versions.use(self.engine.versions.newest)
        comm, total = self.engine.comm, 0.0
        for b in batches:
            b = b.to(self.mesh.device)
            out = stage_forward(self.model, self.spec, b[:, :-1] if self.spec.is_first else comm.recv_forward())
            if self.spec.is_last:
                total += cross_entropy(out, b[:, 1:]).item()
            else:
                comm.send_forward(out)
        comm.flush()
        return total / len(batches)

    def run(self, metrics: MetricsLogger | None) -> dict:
        cfg, t = self.cfg, self.cfg.train
        val = self.data.val_batches() if t.eval_every else []
        tokens_per_step = self.m * t.micro_batch_size * t.seq_len * self.mesh.dims.dp
        started = time.perf_counter()
        last_end, summary_losses, skipped = started, {}, 0
        for t0, t1 in segment_bounds(t.steps, t.eval_every):
            self.engine.execute(segment_actions(cfg.schedule.name, self.spec.stage, self.mesh.num_stages,
                                                self.m, self.delays, t0, t1))
            self.engine.finish()
            val_loss = self.evaluate(val) if val else math.nan
            for step in range(t0, t1):
                record = self.engine.records.pop(step)
                skipped += record.skipped
                loss = self.engine.step_loss(step) if self.spec.is_last else math.nan
                summary_losses[step] = loss
                end = self.engine.timer.end_of(Op.UPDATE, step)
                dt, last_end = end - last_end, end
                if metrics is not None:
                    metrics.log(self._record(step, record, loss, dt, tokens_per_step, val_loss if step == t1 - 1 else None))
        self.engine.versions.use(self.engine.versions.newest)  # leave the module on x_T
        summary = self._summary(started, summary_losses, tokens_per_step, val_loss if val else math.nan)
        summary["skipped_steps"] = skipped
        return summary

    def _record(self, step, rec, loss, dt, tokens_per_step, val_loss) -> dict:
        out = {"step": step, "loss": loss, "lr": rec.lr, "grad_norm": rec.grad_norm,
               "update_norm": rec.update_norm, "tokens_per_s": tokens_per_step / dt if dt > 0 else math.nan,
               "step_time_s": dt, "skipped": rec.skipped,
               "sync_step": is_sync_step(step, self.cfg.train.steps, self.cfg.staleness)}
        if val_loss is not None:
            out["val_loss"] = val_loss
        return out

    def _summary(self, started: float, losses: dict, tokens_per_step: int, val_loss: float) -> dict:
        wall = time.perf_counter() - started
        busy = self.engine.timer.busy()
        per_stage = [None] * dist.get_world_size()
        dist.all_gather_object(per_stage, {"stage": self.spec.stage, "busy_s": busy, "wall_s": wall})
        bubbles = [1.0 - s["busy_s"] / s["wall_s"] for s in per_stage]
        steps = self.cfg.train.steps
        return {
            "steps": steps, "final_loss": losses.get(steps - 1, math.nan), "final_val_loss": val_loss,
            "tokens": tokens_per_step * steps, "wall_time_s": wall, "tokens_per_s": tokens_per_step * steps / wall,
            "bubble_fraction": sum(bubbles) / len(bubbles), "bubble_fraction_per_rank": bubbles,
        }

