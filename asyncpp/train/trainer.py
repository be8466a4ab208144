"""The single-process training loop: every schedule's mathematics on one device.

pretrain.py builds the model, optimizer, data and metrics and hands them in; this file only runs
steps. Its step is DelayedUpdateSimulator.step, the reference the pipeline engine is tested against.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor, nn

from asyncpp.config import RunConfig
from asyncpp.core.balancing import RouterLoadStats
from asyncpp.core.loss import lm_loss
from asyncpp.core.partition import param_stages
from asyncpp.optim.lr_schedule import lr_multiplier
from asyncpp.pipeline.weights import compute_dtype_of
from asyncpp.reference.simulator import DelayedUpdateSimulator, TiedUse
from asyncpp.schedules.registry import is_sync_step, stage_delay
from asyncpp.train import checkpoint as ckpt
from asyncpp.train.metrics import MetricsLogger
from asyncpp.train.preemption import StopFlag


class DataSource(Protocol):
    def train_microbatch(self, index: int) -> Tensor:
        """Global microbatch `index` (step * m + i) as a [B, T+1] token block; a pure function of index."""

    def val_batches(self) -> list[Tensor]: ...


class TrainingAborted(RuntimeError):
    """Too many consecutive non-finite steps."""


def parameter_delays(
    model: nn.Module, schedule: str, num_stages: int, stage_layers: Sequence[int] | None = None
) -> list[int]:
    """Steady-state delay of each trainable parameter, in model.parameters() order."""
    stages = param_stages(model, num_stages, stage_layers)
    return [
        stage_delay(schedule, stages[name], num_stages)
        for name, p in model.named_parameters()
        if p.requires_grad
    ]


def tied_head_use(model: nn.Module, schedule: str, num_stages: int) -> TiedUse | None:
    """With P > 1 a tied embedding has a copy on the first and the last stage; the LM head reads the
    last stage's copy at the last stage's delay."""
    head = getattr(model, "lm_head", None)
    embed = getattr(model, "embed", None)
    if num_stages == 1 or head is None or embed is None or head.weight is not embed.weight:
        return None
    return TiedUse(head, "weight", embed.weight, stage_delay(schedule, num_stages - 1, num_stages))


def build_simulator(cfg: RunConfig, model: nn.Module, optimizer) -> DelayedUpdateSimulator:
    sched = cfg.optimizer.schedule
    return DelayedUpdateSimulator(
        model,
        optimizer,
        parameter_delays(model, cfg.schedule.name, cfg.parallel.pp, cfg.parallel.stage_layers),
        loss_fn=lm_loss,
        grad_clip=cfg.train.grad_clip,
        ef_lambda=cfg.staleness.ef_lambda,
        lr_multiplier=functools.partial(
            lr_multiplier,
            total_steps=cfg.train.steps,
            warmup_steps=sched.warmup_steps,
            kind=sched.kind,
            min_lr_ratio=sched.min_lr_ratio,
            decay_fraction=sched.decay_fraction,
        ),
        sync_step=functools.partial(is_sync_step, total_steps=cfg.train.steps, staleness=cfg.staleness),
        tied_use=tied_head_use(model, cfg.schedule.name, cfg.parallel.pp),
        grad_ef_lambda=cfg.staleness.grad_ef_lambda,
        dc_lambda=cfg.staleness.dc_lambda,
        weight_prediction=cfg.staleness.weight_prediction,
        diagnostics_every=cfg.staleness.diagnostics_every,
        compute_dtype=compute_dtype_of(cfg.train.precision),
    )


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[Tensor], device: torch.device) -> float:
    """Mean validation loss on the newest weights."""
    was_training = model.training
    model.eval()
    losses = [lm_loss(model, b.to(device)).item() for b in batches]
    model.train(was_training)
    return sum(losses) / len(losses)


def simulator_state(sim: DelayedUpdateSimulator, model: nn.Module, num_past: int | None = None,
                    step: int = 0) -> ckpt.StageState:
    """The simulator's side of a checkpoint: x_t (age 0) and its past versions (ages 1..), u_{t-1}, the
    optimizer. With `num_past`, fresh buffers are made for that many past versions (for a load). x_t is
    the optimizer's copy: the fp32 masters under mixed precision (past versions stay in the compute dtype)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if num_past is not None:
        sim.history.clear()
        for _ in range(num_past):
            sim.history.append([torch.empty_like(p) for p in sim.params])
    versions = {0: [q.detach() for q in sim.masters]}
    versions.update({age + 1: v for age, v in enumerate(sim.history)})
    buffers = {"ef": sim.error_feedback.prev_update, "gef": sim.grad_error_feedback.prev_grad}
    balancing = sim.balancing
    extra = balancing.reset(step, range(num_past + 1)) if num_past is not None and balancing else balancing.tensors()
    return ckpt.StageState(names, versions, buffers, sim.optimizer, sim.masters, extra=extra)


class Trainer:
    def __init__(self, cfg: RunConfig, model: nn.Module, optimizer, data: DataSource, metrics: MetricsLogger,
                 stop: StopFlag | None = None):
        self.stop = stop or StopFlag()
        self.stopped_at: int | None = None
        self.cfg = cfg
        self.model = model
        self.data = data
        self.metrics = metrics
        self.device = torch.device(cfg.train.device)
        self.sim = build_simulator(cfg, model, optimizer)
        self.saver = ckpt.Saver(cfg.checkpoint.async_save)
        self.start_step = 0

    def resume(self) -> int:
        """Load the checkpoint checkpoint.resume points at, if any; returns the step to start from."""
        point = ckpt.resume_point(self.cfg, self.data, warn=self.metrics.message)
        if point is None:
            return 0
        path, step = point
        past = min(step, self.sim.num_past_versions)
        ckpt.load(path, simulator_state(self.sim, self.model, num_past=past, step=step), ages=range(past + 1))
        self.sim.balancing.use(step)
        self.sim.sync_params()  # mixed precision: the load wrote the fp32 masters
        self.start_step = step
        self.metrics.rewind(step)
        self.metrics.message(f"resumed from {path} at step {step}")
        return step

    def save(self, step_done: int) -> None:
        c = self.cfg
        self.saver.save(ckpt.checkpoint_root(c), step_done, simulator_state(self.sim, self.model),
                  config=c.to_dict(), layout={"pp": 1, "dp": 1, "simulated_pp": c.parallel.pp},
                  keep_last=c.checkpoint.keep_last, data=ckpt.data_position(self.data, step_done, c))

    def _microbatches(self, step: int) -> list[Tensor]:
        # dp replicas are simulated as m * dp microbatches: global index (t * dp + r) * m + j, as in the pipeline.
        m = self.cfg.train.num_microbatches * (self.cfg.parallel.dp or 1)
        return [self.data.train_microbatch(step * m + i).to(self.device) for i in range(m)]

    def run(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        val_batches = self.data.val_batches() if t.eval_every else []
        consecutive_skips, skipped, tokens, val_loss = 0, 0, 0, math.nan
        step_times: list[float] = []
        stats = None
        started = time.perf_counter()
        for step in range(self.start_step, t.steps):
            batches = self._microbatches(step)
            t0 = time.perf_counter()
            stats = self.sim.step(step, batches)
            dt = time.perf_counter() - t0
            step_times.append(dt)
            tokens += stats.tokens
            record = {
                "step": step,
                "loss": stats.loss,
                "lr": stats.lr,
                "grad_norm": stats.grad_norm,
                "update_norm": stats.update_norm,
                "tokens_per_s": stats.tokens / dt,
                "step_time_s": dt,
                "skipped": stats.skipped,
                "sync_step": is_sync_step(step, t.steps, cfg.staleness),
            }
            if stats.update_cosine is not None:  # staleness.diagnostics_every steps (their step_time_s includes it)
                record.update(update_cosine=stats.update_cosine, update_rel_error=stats.update_rel_error)
            record.update(_moe_stats(self.model))
            record.update(RouterLoadStats.as_metrics(stats.router_loads))
            last = step == t.steps - 1
            if val_batches and ((step + 1) % t.eval_every == 0 or last):
                val_loss = record["val_loss"] = evaluate(self.model, val_batches, self.device)
            self.metrics.log(record)
            skipped += stats.skipped
            consecutive_skips = consecutive_skips + 1 if stats.skipped else 0
            if consecutive_skips >= t.max_consecutive_skips:
                raise TrainingAborted(
                    f"{consecutive_skips} consecutive steps had a non-finite gradient (last: step {step}); "
                    "lower optimizer.lr or check the data"
                )
            if stats.skipped:
                self.metrics.message(f"step {step}: non-finite gradient, update skipped")
            preempted = self.stop.requested and step + 1 < t.steps
            if preempted or cfg.checkpoint.enabled and ckpt.due(step + 1, t.steps, cfg.checkpoint.every):
                self.save(step + 1)
            if preempted:
                self.stopped_at = step + 1
                self.metrics.message(f"stop requested (signal {self.stop.signal}): checkpoint saved after step {step}")
                break
        self.saver.wait()  # a background save must be committed before the run counts as done
        wall = time.perf_counter() - started
        steady = step_times[min(5, len(step_times) - 1):] if step_times else [math.nan]
        return {
            "steps": t.steps,
            "stopped_at": self.stopped_at,
            "final_loss": stats.loss if stats is not None else math.nan,
            "final_val_loss": val_loss,
            "skipped_steps": skipped,
            "tokens": tokens,
            "wall_time_s": wall,
            "mean_step_time_s": sum(steady) / len(steady),
            "tokens_per_s": tokens / wall,
        }


def _moe_stats(model: nn.Module) -> dict[str, float]:
    """The auxiliary loss of the step's last microbatch (the loads come from RouterLoadStats: the
    whole step's, per layer, as the pipeline logs them)."""
    stats = getattr(model, "moe_stats", None)
    return {k: v for k, v in stats().items() if k == "moe/aux_loss"} if callable(stats) else {}
