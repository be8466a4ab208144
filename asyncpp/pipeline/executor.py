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
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from asyncpp.config import SYNC_SCHEDULES, RunConfig
from asyncpp.core.balancing import RouterBiasVersions, RouterLoadStats, balanced_routers
from asyncpp.core.loss import cross_entropy
from asyncpp.optim.lr_schedule import lr_multiplier
from asyncpp.parallel.mesh import Mesh
from asyncpp.parallel.sharding import ShardingPlan, global_view, layout_of
from asyncpp.pipeline.engine import StageEngine, StepRecord
from asyncpp.pipeline.p2p import StageComm
from asyncpp.pipeline.stage import StageSpec, prune_to_stage, stage_forward, tied_parameters
from asyncpp.pipeline.weights import WeightVersions, compute_dtype_of
from asyncpp.schedules.actions import Action, Op
from asyncpp.schedules.build import build_schedule
from asyncpp.schedules.registry import is_sync_step, stage_delay, step_delay
from asyncpp.train import checkpoint as ckpt
from asyncpp.train.metrics import MetricsLogger
from asyncpp.train.preemption import StopFlag
from asyncpp.train.timeline import plot_gantt, write_chrome_trace
from asyncpp.train.trainer import DataSource, TrainingAborted

LossFn = Callable[[Tensor, Tensor], Tensor]
Parallelize = Callable[[nn.Module], tuple[ShardingPlan, LossFn]]


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


def segment_bounds(total_steps: int, *every: int, start: int = 0) -> list[tuple[int, int]]:
    """Drain points: every multiple of each `every` (evaluation, checkpoint; 0 = never) and the end."""
    cuts = {total_steps}
    for k in every:
        if k > 0:
            cuts |= set(range(k, total_steps, k))
    cuts = sorted(c for c in cuts if c > start)
    return list(zip([start] + cuts[:-1], cuts))


class PipelineRun:
    def __init__(self, cfg: RunConfig, model: nn.Module, mesh: Mesh, data: DataSource, build_optimizer,
                 stop: StopFlag | None = None, parallelize: Parallelize | None = None):
        """`parallelize(stage_model)` applies the model's TP/EP plan to the pruned stage in place and
        returns (its ShardingPlan, the loss function for its logits); None = no TP/EP.
        `build_optimizer(stage_model, sharding_plan)` builds the stage's optimizer."""
        self.cfg, self.mesh, self.data = cfg, mesh, data
        self.stop = stop or StopFlag()
        self.stopped_at: int | None = None
        self.saver = ckpt.Saver(cfg.checkpoint.async_save)
        self.start_step = 0
        self.spec = StageSpec(mesh.pp_rank, mesh.num_stages, len(model.layers), cfg.parallel.stage_layers)
        self.model = prune_to_stage(model, self.spec)
        self.sharding, self.loss_fn = parallelize(self.model) if parallelize is not None else ({}, cross_entropy)
        self.m = cfg.train.num_microbatches
        self.delays = [
            step_delay(cfg.schedule.name, self.spec.stage, mesh.num_stages, t, cfg.train.steps, cfg.staleness)
            for t in range(cfg.train.steps)
        ]
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        optimizer = build_optimizer(self.model, self.sharding)
        dtype = compute_dtype_of(cfg.train.precision)  # bf16: params cast here, fp32 masters kept apart
        versions = WeightVersions(params, num_weight_buffers(cfg.schedule.name, self.spec.stage, mesh.num_stages),
                                  compute_dtype=dtype)
        hidden = model.config.hidden_size
        # Under sequence parallelism a stage boundary carries this TP rank's sequence shard only.
        seq = cfg.train.seq_len // mesh.dims.tp if cfg.parallel.sequence_parallel else cfg.train.seq_len
        comm = StageComm(mesh, (cfg.train.micro_batch_size, seq, hidden), dtype,
                         cfg.train.timeout_s)
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
            layouts=[layout_of(self.sharding, n) for n, _ in named],
            balancing=RouterBiasVersions(balanced_routers(self.model), versions.num_buffers),
            load_stats=RouterLoadStats.of(self.model, counted=mesh.tp_rank == 0 and mesh.ep_rank == 0),
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
        return self.loss_fn(out, tokens[:, 1:])

    @torch.no_grad()
    def evaluate(self, batches: list[Tensor]) -> float:
        """Forward-only pass through the drained pipeline on the newest weights (last stage's value)."""
        self.engine.versions.use(self.engine.versions.newest)
        comm, total = self.engine.comm, 0.0
        receives = not self.spec.is_first
        if receives and batches:
            comm.post_recv_forward()
        for i, b in enumerate(batches):
            b = b.to(self.mesh.device) if b is not None else None
            if receives and i + 1 < len(batches):
                comm.post_recv_forward()  # one batch ahead: the next activation lands while this one computes
            x = b[:, :-1] if self.spec.is_first else comm.recv_forward("a validation activation")
            out = stage_forward(self.model, self.spec, x)
            if self.spec.is_last:
                total += self.loss_fn(out, b[:, 1:]).item()
            else:
                comm.send_forward(out)
        comm.flush()
        return total / len(batches)

    def run(self, metrics: MetricsLogger | None) -> dict:
        cfg, t = self.cfg, self.cfg.train
        # Middle stages only relay activations: they need the number of validation batches, not the data.
        reads = self.spec.is_first or self.spec.is_last
        val = (self.data.val_batches() if reads else [None] * t.eval_batches) if t.eval_every else []
        if len(val) != (t.eval_batches if t.eval_every else 0):  # every stage must relay the same count
            raise ValueError(f"the data source gave {len(val)} validation batches, train.eval_batches={t.eval_batches}")
        self.tokens_per_step = self.m * t.micro_batch_size * t.seq_len * self.mesh.dims.dp
        if self.start_step >= t.steps:
            raise ValueError(f"the run already reached train.steps={t.steps} (resumed at step {self.start_step}); "
                             "raise train.steps to train further")
        dist.barrier()  # a common time origin for every stage's timeline (same-host clocks)
        started = self.engine.timer.origin = time.perf_counter()
        self._log = _StepLog(metrics, started, t.max_consecutive_skips)
        val_loss = math.nan
        ck = cfg.checkpoint
        for t0, t1 in segment_bounds(t.steps, t.eval_every, ck.every if ck.enabled else 0, start=self.start_step):
            todo = list(range(t0, t1))
            self.engine.execute(
                segment_actions(cfg.schedule.name, self.spec.stage, self.mesh.num_stages, self.m, self.delays, t0, t1),
                after_update=lambda _, todo=todo: self._emit_ready(todo),
            )
            self.engine.finish()
            evaluated = val and (t1 % t.eval_every == 0 or t1 == t.steps)
            val_loss = self.evaluate(val) if evaluated else val_loss
            self._emit_ready(todo, flush=True, val_loss=val_loss if evaluated else None)
            preempted = t1 < t.steps and self.stop.agreed(self.mesh.device)
            if preempted or ck.enabled and ckpt.due(t1, t.steps, ck.every):
                self.save(t1)
            if preempted:
                self.stopped_at = t1
                break
        self.saver.wait()  # commit a background save before the run counts as done
        self.engine.versions.use(self.engine.versions.newest)  # leave the module on x_T
        summary = self._summary(started, val_loss)
        summary["skipped_steps"] = self._log.skipped
        summary["stopped_at"] = self.stopped_at
        return summary

    # ---- checkpoints ------------------------------------------------------------------------
    def stage_state(self, extra: dict[str, Tensor] | None = None) -> ckpt.StageState:
        """This stage's share of a checkpoint, keyed by full-model names (a tied head as embed.weight)."""
        tied = {id(p) for p in tied_parameters(self.model, self.spec)}
        names = ["embed.weight" if id(p) in tied else n for n, p in self.model.named_parameters() if p.requires_grad]
        v = self.engine.versions
        versions = {v.newest - version: v.tensors(version) for version in v.held()}
        d = self.mesh.dims
        shards = [global_view(layout, self.mesh.device_mesh, d.tp, d.ep) for layout in self.engine.layouts]
        balancing = self.engine.balancing
        if extra is None:
            extra = balancing.tensors() if balancing is not None else {}
        return ckpt.StageState(names, versions, {"ef": self.engine.error_feedback.prev_update},
                               self.engine.optimizer, v.masters, shards, extra=extra)

    def save(self, step_done: int) -> None:
        """Collective; called at a drain point, where every stage holds x_{step_done} as its newest."""
        c = self.cfg
        d = self.mesh.dims
        layout = {"pp": d.pp, "dp": d.dp, "tp": d.tp, "ep": d.ep, "stage_layers": c.parallel.stage_layers}
        self.saver.save(ckpt.checkpoint_root(c), step_done, self.stage_state(), config=c.to_dict(), layout=layout,
                  keep_last=c.checkpoint.keep_last, data=ckpt.data_position(self.data, step_done, c))

    def resume(self) -> int:
        """Collective. Load checkpoint.resume's checkpoint, if any; returns the step to start from."""
        point = ckpt.resume_point(self.cfg, self.data)
        if point is None:
            return 0
        path, step = point
        v = self.engine.versions
        v.set_newest(step)  # buffers now stand for x_step, x_step-1, ...: DCP fills them in place
        ages = [step - version for version in v.held()]
        balancing = self.engine.balancing
        extra = balancing.reset(step, ages) if balancing is not None else {}
        ckpt.load(path, self.stage_state(extra), ages=ages)
        v.set_newest(step)
        if balancing is not None:
            balancing.use(step)
        self.start_step = step
        return step

    def _emit_ready(self, todo: list[int], flush: bool = False, val_loss: float | None = None) -> None:
        """Log, in order, the steps whose record is complete. A step's update norm rides a later
        step's reduction, so it is complete two updates later, or at the segment's end (`flush`).
        Collective over the last stage's DP group (step_loss), at the same action on every replica."""
        records = self.engine.records
        while todo and (flush or math.isfinite(records.get(todo[0], _NAN_RECORD).update_norm)):
            step = todo.pop(0)
            loss = self.engine.step_loss(step) if self.spec.is_last else math.nan
            end = self.engine.timer.end_of(Op.BACKWARD, step) if self.spec.is_last else math.nan
            self._log.emit(self._record(step, records.pop(step), loss, end, val_loss if not todo else None))

    def write_timeline(self, out_dir: str, max_steps: int = 6) -> None:
        """Every stage's measured events -> timeline.json (Chrome trace) and timeline.png (Gantt of
        the first `max_steps` steps after warm-up), written by the metrics rank. Collective."""
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.mesh.dp_rank, self.mesh.tp_rank, self.engine.timer.events))
        if not self.mesh.is_writer:
            return
        events = [e for dp, tp, evs in gathered if dp == 0 and tp == 0 for e in evs]
        write_chrome_trace(events, Path(out_dir) / "timeline.json")
        first, last = 1, min(self.cfg.train.steps - 1, 1 + max_steps)
        window = [e for e in events if first <= e.step <= last]
        if window:
            plot_gantt(window, Path(out_dir) / "timeline.png",
                       title=f"{self.cfg.schedule.name}: P={self.mesh.num_stages}, m={self.m}, steps {first}-{last}",
                       xlim=(min(e.start for e in window), max(e.end for e in window)))

    def _record(self, step: int, rec, loss: float, end: float, val_loss: float | None) -> dict:
        dt = end - self._log.last_end
        self._log.last_end = end
        out = {"step": step, "loss": loss, "lr": rec.lr, "grad_norm": rec.grad_norm,
               "update_norm": rec.update_norm, "tokens_per_s": self.tokens_per_step / dt if dt > 0 else math.nan,
               "step_time_s": dt, "skipped": rec.skipped,
               "sync_step": is_sync_step(step, self.cfg.train.steps, self.cfg.staleness)}
        if val_loss is not None:
            out["val_loss"] = val_loss
        out.update(RouterLoadStats.as_metrics(rec.router_loads))
        return out

    def _summary(self, started: float, val_loss: float) -> dict:
        wall = time.perf_counter() - started
        busy = self.engine.timer.busy()
        per_stage = [None] * dist.get_world_size()
        dist.all_gather_object(per_stage, {"stage": self.spec.stage, "busy_s": busy, "wall_s": wall,
                                           **self.engine.timer.mean_durations()})
        bubbles = [1.0 - s["busy_s"] / s["wall_s"] for s in per_stage]
        steps = self.cfg.train.steps
        tokens = self.tokens_per_step * (steps - self.start_step)
        return {
            "steps": steps, "final_loss": self._log.last_loss, "final_val_loss": val_loss,
            "tokens": tokens, "wall_time_s": wall, "tokens_per_s": tokens / wall,
            "bubble_fraction": sum(bubbles) / len(bubbles), "bubble_fraction_per_rank": bubbles,
            "mean_forward_s_per_rank": [s.get("F", math.nan) for s in per_stage],
            "mean_backward_s_per_rank": [s.get("B", math.nan) for s in per_stage],
            "mean_update_s_per_rank": [s.get("U", 0.0) + s.get("U0", 0.0) for s in per_stage],
        }



_NAN_RECORD = StepRecord(-1)


class _StepLog:
    """Where finished step records go (the metrics rank's logger; nowhere on other ranks).

    Every rank keeps the counts: the skip decision comes from the all-reduced gradient norm, so all
    ranks see the same skips and abort at the same step (no rank is left waiting for the others)."""

    def __init__(self, metrics: MetricsLogger | None, started: float, max_consecutive_skips: int):
        self.metrics, self.last_end = metrics, started
        self.skipped, self.consecutive, self.max_consecutive = 0, 0, max_consecutive_skips
        self.last_loss = math.nan

    def emit(self, record: dict) -> None:
        self.skipped += bool(record["skipped"])
        self.consecutive = self.consecutive + 1 if record["skipped"] else 0
        self.last_loss = record["loss"]
        if self.metrics is not None:
            self.metrics.log(record)
            if record["skipped"]:
                self.metrics.message(f"step {record['step']}: non-finite gradient, update skipped on every stage")
        if self.consecutive >= self.max_consecutive:
            raise TrainingAborted(
                f"{self.consecutive} consecutive steps had a non-finite gradient (last: step {record['step']}); "
                "lower optimizer.lr or check the data"
            )
