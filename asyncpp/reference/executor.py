"""The reference executor: the single-process simulator behind the trainer's executor protocol.

Every schedule's mathematics on one device (asyncpp/reference/simulator.py). It can stop, evaluate and save
at any step boundary, because nothing is in flight between steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from asyncpp.config import RunConfig
from asyncpp.core.batches import BatchPlan
from asyncpp.core.loss import LossFn, lm_loss
from asyncpp.core.masters import compute_dtype_of
from asyncpp.core.partition import param_stages, stage_split
from asyncpp.core.records import DataSource, StepResult
from asyncpp.core.transfer import to_device
from asyncpp.core.update import lr_multiplier_for
from asyncpp.optim.build import AnyOptimizer
from asyncpp.reference.simulator import DelayedUpdateSimulator, TiedUse
from asyncpp.schedules.registry import is_sync_step, stage_delay
from asyncpp.train import checkpoint as ckpt


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


def build_simulator(cfg: RunConfig, model: nn.Module, optimizer: AnyOptimizer,
                    loss_fn: LossFn = lm_loss) -> DelayedUpdateSimulator:
    s = cfg.staleness
    return DelayedUpdateSimulator(
        model,
        optimizer,
        parameter_delays(model, cfg.schedule.name, cfg.parallel.pp,
                         stage_split(cfg, model.config) if cfg.parallel.pp > 1 else None),
        loss_fn=loss_fn,
        grad_clip=cfg.train.grad_clip,
        ef_lambda=s.ef_lambda,
        lr_multiplier=lr_multiplier_for(cfg),
        sync_step=lambda t: is_sync_step(t, cfg.train.steps, s),
        tied_use=tied_head_use(model, cfg.schedule.name, cfg.parallel.pp),
        grad_ef_lambda=s.grad_ef_lambda,
        dc_lambda=s.dc_lambda,
        weight_prediction=s.weight_prediction,
        diagnostics_every=s.diagnostics_every,
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


def simulator_parts(sim: DelayedUpdateSimulator, model: nn.Module) -> ckpt.StageParts:
    """The simulator's side of a checkpoint (the pipeline's assembly, train/checkpoint/parts.py): x_t, the
    optimizer's copy (the fp32 masters under mixed precision), and its past versions (ages 1..; compute dtype),
    u_{t-1} (and g_{t-1}), the optimizer, the router-bias versions; every tensor whole, named as in the model."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return ckpt.StageParts(names, sim.versions, sim.rule, sim.optimizer, sim.masters, sim.balancing)


def simulator_state(sim: DelayedUpdateSimulator, model: nn.Module, num_past: int | None = None,
                    step: int = 0) -> ckpt.StageState:
    """simulator_parts(...).state(), for a caller that saves or loads by hand (ckpt.save / ckpt.load). With
    `num_past`, made ready for a load of step `step` first (fresh buffers for its past versions and router biases;
    `num_past` must be the count the run holds at that step)."""
    parts = simulator_parts(sim, model)
    if num_past is not None:
        ages = parts.versions.expect(step)
        if len(ages) != num_past + 1:
            raise ValueError(f"num_past={num_past}, but at step {step} the simulator holds {len(ages) - 1} past "
                             f"versions (min(step, {sim.num_past_versions}))")
        if parts.balancing:
            parts.balancing.expect(step, ages)
    return parts.state()


class ReferenceExecutor:
    """Runs steps one after another in this process; evaluates, saves and stops at any step boundary."""

    stops_at_any_step = True
    is_writer = True
    decides_time = True

    def __init__(self, cfg: RunConfig, model: nn.Module, optimizer: AnyOptimizer, data: DataSource):
        self.cfg, self.model, self.data = cfg, model, data
        self.device = torch.device(cfg.train.device)
        self.sim = build_simulator(cfg, model, optimizer)
        self.batches = BatchPlan.of(cfg)  # parallel.dp replicas, simulated as m_t * dp microbatches per step
        self.checkpoint = ckpt.Checkpointer(cfg, lambda: simulator_parts(self.sim, model), data, self.batches,
                                            layout={"pp": 1, "dp": 1, "simulated_pp": cfg.parallel.pp})
        self.saver = self.checkpoint.saver

    def resume(self, warn: Callable[[str], None]) -> int | None:
        """Load the checkpoint checkpoint.resume points at, if any; returns its step."""
        return self.checkpoint.resume(warn)

    def steps(self, t0: int, t1: int, stop=None, clock=None) -> Iterator[StepResult]:
        """The trainer stops and checkpoints this executor itself, after any step (stops_at_any_step)."""
        for step in range(t0, t1):
            yield self.sim.step(step, self._microbatches(step))

    def _microbatches(self, step: int) -> list[Tensor]:
        # dp replicas are simulated as m_t * dp microbatches, replica by replica: the pipeline's global indices
        # (BatchPlan.microbatch_index), so the simulator averages over exactly the samples the pipeline reads.
        b = self.batches
        return [to_device(self.data.train_microbatch(b.microbatch_index(step, r, j)), self.device)
                for r in range(b.dp) for j in range(b.microbatches(step))]

    def val_batches(self) -> list[Tensor]:
        return self.data.val_batches()

    def evaluate(self, batches: list[Tensor]) -> float:
        return evaluate(self.model, batches, self.device)

    def save(self, step_done: int) -> None:
        self.checkpoint.save(step_done)

    def stop_agreed(self, requested: bool) -> bool:
        return requested

    def position(self) -> tuple[int | None, str]:
        """No action stream here: the trainer reports the step (Executor.position)."""
        return None, ""

    def wait_saves(self) -> None:
        self.saver.wait()

    def summary(self, wall_s: float) -> dict:
        return {}

    def running_bubble(self, step: int) -> None:
        return None  # one process runs every stage back to back: no pipeline, no bubble
