"""What a pipeline stage reports besides its steps: the run's summary (busy time, bubble, stage balance,
memory per rank), its memory plan next to the measured peak, and the timeline's events. Collective where it
gathers from every rank; the executor (executor.py) calls it at the end of a run and at start."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch.distributed as dist

from asyncpp.config import RunConfig
from asyncpp.core.layer_costs import layer_costs
from asyncpp.core.memory import MemoryReport
from asyncpp.core.partition import stage_balance, stage_split
from asyncpp.host.measured import device_peak_bytes, host_peak_bytes
from asyncpp.parallel.mesh import Mesh
from asyncpp.pipeline.engine import StageEngine
from asyncpp.pipeline.memory import stage_memory
from asyncpp.pipeline.stage import StageSpec
from model_zoo import ModelConfig


class StageReport:
    """What a stage reports besides its steps: the run's summary, its memory plan and its timeline (the module
    docstring). Reads the engine; changes nothing."""

    def __init__(self, cfg: RunConfig, model_cfg: ModelConfig, mesh: Mesh, spec: StageSpec, engine: StageEngine,
                 naming: Callable[[str], object], process_baseline_bytes: int | None = None):
        """`naming(what)` wraps a blocking collective so that a dead peer's error names it (p2p.naming_the_peer);
        `process_baseline_bytes` the RSS before the build, if the entry point measured it."""
        self.cfg, self.model_cfg, self.mesh, self.spec, self.engine = cfg, model_cfg, mesh, spec, engine
        self._naming = naming
        self.process_baseline_bytes = process_baseline_bytes

    def summary(self, last_loss: float) -> dict:
        """Per-stage busy time and bubble (collective), both on the device's clock (the timer's); `last_loss`,
        this rank's last logged loss (nan but on the last stage)."""
        wall, busy = self.engine.timer.elapsed(), self.engine.timer.busy()
        per_stage = [None] * dist.get_world_size()
        with self._naming("every rank's summary (all_gather)"):
            dist.all_gather_object(per_stage, {"stage": self.spec.stage, "busy_s": busy, "wall_s": wall,
                                               "loss": last_loss, "memory": self.memory_measured(),
                                               **self.engine.timer.mean_durations()})
        bubbles = [1.0 - s["busy_s"] / s["wall_s"] for s in per_stage]
        last = self.mesh.num_stages - 1
        return {
            # Every rank's summary has the last stage's final loss: each decides its exit code on it.
            "final_loss": next(s["loss"] for s in per_stage if s["stage"] == last),
            "memory_per_rank": [s["memory"] for s in per_stage],
            "bubble_fraction": sum(bubbles) / len(bubbles), "bubble_fraction_per_rank": bubbles,
            **self._balance(per_stage),
            "mean_forward_s_per_rank": [s.get("F", math.nan) for s in per_stage],
            "mean_backward_s_per_rank": [s.get("B", math.nan) for s in per_stage],
            "mean_update_s_per_rank": [s.get("U", 0.0) + s.get("U0", 0.0) for s in per_stage],
        }

    def memory_plan(self) -> MemoryReport:
        """This rank's planned memory (asyncpp/core/memory.py), from its real tensors and schedule."""
        e = self.engine.update
        return stage_memory(self.cfg, self.model_cfg, self.mesh, self.spec, e.versions, e.optimizer,
                            e.error_feedback.prev_update)

    def _balance(self, per_rank: list[dict]) -> dict:
        """Per-stage busy time (mean over a stage's ranks) and, if the stages are imbalanced, a better
        parallel.stage_layers from it (asyncpp.core.partition.stage_balance): the usual cause of a bubble
        that a bubble-free schedule shows is the last stage's LM head and loss."""
        P = self.mesh.num_stages
        busy = [[r["busy_s"] for r in per_rank if r["stage"] == s] for s in range(P)]
        cfg = self.model_cfg
        weights = layer_costs(cfg, self.cfg.train.seq_len, self.cfg.train.micro_batch_size,
                              self.mesh.device.type).layers
        return stage_balance(stage_split(self.cfg, cfg), [sum(b) / len(b) for b in busy], weights)

    def memory_measured(self) -> dict:
        """The plan's total next to this process's measured peak: the device allocator's peak on CUDA, the
        resident-set high-water mark (since start: the build included) on the CPU. The host figure also
        holds what the plan does not count (the interpreter, torch and its libraries: `process_baseline`,
        the RSS before the stage was built, when the entry point recorded it)."""
        plan = self.memory_plan()
        device = self.mesh.device
        cuda = device_peak_bytes(device)
        return {"rank": self.mesh.rank, "stage": self.spec.stage, "plan_total_bytes": plan.total,
                "plan": {i.name: i.nbytes for i in plan.items},
                "measured_peak_bytes": cuda if cuda is not None else host_peak_bytes(),
                "measured": "cuda_max_memory_allocated" if cuda is not None else "host_rss_high_water_mark",
                "process_baseline_bytes": self.process_baseline_bytes}

    def timeline_events(self) -> list | None:
        """Every stage's measured events (DP and TP rank 0 of each), on the metrics rank; None elsewhere.
        Collective."""
        gathered = [None] * dist.get_world_size()
        with self._naming("every rank's timeline events (all_gather)"):
            dist.all_gather_object(gathered, (self.mesh.dp_rank, self.mesh.tp_rank, self.engine.timer.events))
        if not self.mesh.is_writer:
            return None
        return [e for dp, tp, evs in gathered if dp == 0 and tp == 0 for e in evs]
