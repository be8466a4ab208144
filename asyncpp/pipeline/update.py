"""One stage's update: everything between UPDATE_START(t) and UPDATE(t) (engine.py interprets the actions).

The engine calls, in this order for a step t:
- `start(t, grads)` at UPDATE_START(t): b_t's gradient (and the router loads) enters its reductions
  (reduction.py), none of which blocks;
- `progress()` at every action boundary: the reductions move on as their handles complete, and a finished
  broadcast of x_{t+1} (the distributed optimizer) is installed;
- `complete(t)` at UPDATE(t): waits for what is left of b_t's reductions;
- `apply(t)`: the update rule (asyncpp/core/update.py: corrections, clip, skip, the base step, Error Feedback,
  the router bias) into the buffer of x_{t+1}, and the step's record.

Nothing here calls back into the engine. The reductions call back into this object only: the gradient
corrections need x_t and the version b_t read (`note_read`), and ||Δx|| of an earlier update rides along with
a later step's norm all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from asyncpp.core.balancing import RouterBiasVersions, RouterLoadStats
from asyncpp.core.update import UpdateRule
from asyncpp.optim.build import AnyOptimizer
from asyncpp.optim.clip import diff_sq_sum
from asyncpp.parallel.mesh import Mesh
from asyncpp.parallel.sharding import ParamSharding
from asyncpp.pipeline.reduction import GradientReduction, PendingReduction, ShardedGradientReduction, Wait
from asyncpp.pipeline.sharded import StageShards
from asyncpp.pipeline.timer import StageTimer
from asyncpp.pipeline.weights import WeightVersions
from asyncpp.schedules.actions import Action


@dataclass
class StepRecord:
    step: int
    loss: float = math.nan
    grad_norm: float = math.nan
    update_norm: float = math.nan
    lr: float = math.nan
    skipped: bool = False
    update_finite: bool = True
    """False: a finite gradient gave a non-finite update; x_t was kept (the executor stops every rank)."""
    router_loads: list[float] = field(default_factory=list)
    """Per layer of the model: busiest expert / mean load of this step (0 for non-MoE layers)."""


def counted_in_norm(mesh: Mesh, tied: bool, layout: ParamSharding) -> bool:
    """Whether this rank's copy of a tensor enters the global norms (all-reduced over mesh.norm_group), so
    that every tensor is counted exactly once: the tied weight on the first stage; a TP-replicated tensor on
    TP rank 0; a tensor replicated over the EP group (everything but experts) on EP rank 0. The distributed
    optimizer restricts it further to each tensor's owner (reduction.ShardedGradientReduction)."""
    if tied and not mesh.is_first_stage:
        return False
    if not layout.is_tp_sharded and mesh.tp_rank != 0:
        return False
    return layout.expert or mesh.ep_rank == 0


class StageUpdate:
    """One stage's update between UPDATE_START(t) and UPDATE(t): its weight versions, the gradient's reductions and
    the update rule, driven by the engine through start / progress / complete / apply (the module docstring)."""

    def __init__(self, mesh: Mesh, versions: WeightVersions, optimizer: AnyOptimizer, *, spec, grad_scale: float,
                 is_delayed: Callable[[int], bool], tied_is_delayed: Callable[[int], bool],
                 tied_mask: Sequence[bool], layouts: Sequence[ParamSharding], wait: Wait, timer: StageTimer,
                 balancing: RouterBiasVersions | None = None, load_stats: RouterLoadStats | None = None,
                 tied_rows: tuple[int, int] | None = None):
        """`spec` is the plan's UpdateSpec (pipeline/plan.py); `tied_mask` and `layouts` are per parameter of
        the stage; `wait(work, what)` is the stage's timed wait (p2p.StageComm.wait); `tied_rows` (row0, vocab):
        the stage's tied tensor is those rows of the tied weight (reduction.RowsOfTied)."""
        self.mesh, self.versions, self.optimizer = mesh, versions, optimizer
        versions.retarget(optimizer)
        self.masters = versions.masters  # the optimizer's: updated in place
        # A tied weight's corrections follow its owner, the first stage (the simulator's view of the
        # parameter); its copy here may be read at another delay (original PipeDream's last stage).
        self.is_delayed, self.tied_is_delayed = is_delayed, tied_is_delayed
        self.tied_mask, self.layouts = list(tied_mask), list(layouts)
        if len(self.layouts) != len(versions.params):
            raise ValueError(f"{len(self.layouts)} parameter layouts for {len(versions.params)} parameters")
        expert_mask = [lay.expert for lay in self.layouts]
        self.balancing = balancing if balancing else None
        self.load_stats = load_stats if load_stats else None
        self.shards = None
        if spec.distributed_optimizer and mesh.dims.dp > 1:
            if spec.corrections.dc_lambda or spec.corrections.grad_ef_lambda:
                raise ValueError("parallel.distributed_optimizer=true does not support the gradient corrections "
                                 "(staleness.dc_lambda, staleness.grad_ef_lambda); set them to 0 or turn it off")
            self.shards = StageShards(mesh, optimizer, self.masters, expert=expert_mask, tied=self.tied_mask,
                                      wait=wait, timer=timer)
        owned = self.shards.select(self.masters) if self.shards else self.masters
        if self.shards:
            self.shards.shard_masters(versions)  # bf16: the other owners' fp32 masters are dropped here
        # The step's mathematics after the gradient, shared with the simulator (asyncpp.core.update),
        # on the parameters this rank updates (all of them without the distributed optimizer).
        self.rule = UpdateRule(optimizer, owned, grad_clip=spec.grad_clip, lr_multiplier=spec.lr_multiplier,
                               corrections=spec.corrections, balancing=self.balancing,
                               raise_on_nonfinite_update=False)  # every rank must stop together: stopping.py
        self.error_feedback = self.rule.error_feedback
        self.records: dict[int, StepRecord] = {}
        self._read_version: dict[int, int] = {}  # step -> the weight version its forwards/backwards read
        self._done: dict[int, PendingReduction] = {}  # complete(t)'s result, until apply(t)
        # ||Δx_t||^2 of this stage's applied updates, waiting to ride along with a later step's
        # gradient-norm all-reduce (no extra collective). Lag 2: in 2BW the last stage starts the
        # reduction of b_{t+1} before it applies x_{t+1}, but always after it applied x_t.
        self._update_sq: dict[int, Tensor] = {}
        counted = [counted_in_norm(mesh, t, lay) for t, lay in zip(self.tied_mask, self.layouts)]
        common = {"grad_scale": grad_scale, "tied_mask": self.tied_mask, "layouts": self.layouts,
                  "count_in_norm": counted, "correct": self._correct,
                  "take_update_sq": lambda step: self._update_sq.pop(step, None), "wait": wait,
                  "load_stats": self.load_stats, "tied_rows": tied_rows}
        self.reduction = (ShardedGradientReduction(mesh, ownership=self.shards.ownership, **common) if self.shards
                          else GradientReduction(mesh, **common))

    # ---- the engine's calls ---------------------------------------------------------------------
    def note_read(self, step: int, version: int) -> None:
        """b_step's forwards and backwards read `version` (the gradient corrections need it)."""
        self._read_version[step] = version

    def start(self, step: int, grads: list[Tensor]) -> None:
        """UPDATE_START(step): b_step's gradient, in the masters' dtype, enters its reductions."""
        loads = [load.float() for load in self.balancing.pop_loads(step)] if self.balancing is not None else []
        self.reduction.start(step, grads, loads)  # loads as float, so they ride the DP gradient all-reduce

    def progress(self) -> list[int]:
        """Advance what is in flight without blocking; returns the steps whose reduction did work here."""
        advanced = self.reduction.progress()
        if self.shards and self.versions.filling and self.shards.broadcast_done():
            self.versions.sync()
        return advanced

    def complete(self, step: int) -> None:
        """UPDATE(step), first half: wait for what is left of b_step's reductions."""
        self._done[step] = self.reduction.finish(step)

    def apply(self, a: Action) -> StepRecord:
        """UPDATE(step), second half: the update rule into the buffer of x_{step+1}; the step's record."""
        step = a.step
        pending = self._done.pop(step)
        grad_sq, update_sq, *loads = pending.reduction.tolist()
        if pending.norm_of_step is not None:
            self._record(pending.norm_of_step).update_norm = math.sqrt(update_sq)
        self._read_version.pop(step, None)
        record = self._record(step)
        record.grad_norm, record.router_loads = math.sqrt(grad_sq), loads
        x_t = self.versions.begin_update(step)
        grads, delayed = pending.grads, self._delayed(step)
        counted = self.reduction.count_in_norm  # the distributed optimizer's: owned tensors only
        if self.shards:
            grads, x_t, delayed = self.shards.select(grads), self.shards.select(x_t), self.shards.select(delayed)
            counted = self.shards.select(counted)
        outcome = self.rule.apply(step, grads, record.grad_norm, x_t, delayed, pending.loads)
        record.lr, record.skipped, record.update_finite = outcome.lr, outcome.skipped, outcome.update_finite
        # Chunk by chunk (clip.diff_sq_sum), not a second copy of the stage; the simulator's fp64 sum order. A 0-dim
        # fp64 tensor on the device (a skipped step's is 0): it rides a later step's norm all-reduce, no host read.
        if outcome.skipped:
            counted = [False] * len(counted)
        self._update_sq[step] = diff_sq_sum([q for q, c in zip(self.rule.masters, counted) if c],
                                            [x for x, c in zip(x_t, counted) if c], self.mesh.device)
        if self.shards:  # x_{t+1} of the other owners' parameters: waited for at its first read
            self.versions.fill_newest_later(self.shards.start_broadcast(a, self.versions.newest_buffer()))
        self.versions.recycle(pending.grads)  # the next step but one accumulates into them
        return record

    def drain(self) -> None:
        """At the end of a stream: reduce the norms of the updates no later step carried (every stage)."""
        steps = sorted(self._update_sq)  # the same steps on every stage: each stage ran every UPDATE
        if not steps:
            return
        reduction = self.reduction.all_reduce_norms([self._update_sq.pop(t) for t in steps],
                                                    "the final update-norm all-reduce")
        for t, sq in zip(steps, reduction):
            self._record(t).update_norm = math.sqrt(sq)

    def rescale(self, grad_scale: float) -> None:
        """A new gradient scale (1/m of a new segment, under a batch rampup). Only between segments: a pending
        reduction would mix the two scales."""
        if self.reduction.pending:
            raise RuntimeError(f"the gradient scale changes while steps {sorted(self.reduction.pending)} are still "
                               "being reduced; change it only at a drained segment boundary")
        self.reduction.grad_scale = grad_scale

    def per_parameter(self, values: list) -> list:
        """A list over the parameters the rule updates, spread over every parameter (None: another owner's)."""
        return self.shards.aligned(values) if self.shards else values

    # ---- called back by the reductions ------------------------------------------------------------
    def _correct(self, step: int, grads: list[Tensor], only: list[bool]) -> None:
        """DC-ASGD and gradient-level EF on the gradients marked in `only` (before their norm is taken).
        x_t is the newest version: the schedule applies UPDATE(t-1) before UPDATE_START(t) (schedules/build.py)."""
        if not self.rule.corrects_gradients:
            return
        if self.versions.newest != step:
            raise RuntimeError(f"gradient corrections of step {step} need x_{step}, but the newest version is "
                               f"{self.versions.newest}: the schedule placed UPDATE({step - 1}) too late")
        x_read = self.versions.read_tensors(self._read_version[step], predicted=self.is_delayed(step))
        x_t = [q.detach() for q in self.masters]
        self.rule.correct(grads, self._delayed(step), x_t, x_read, only=only)

    def _delayed(self, step: int) -> list[bool]:
        """Per parameter: whether step's corrections apply to it (its delay at this step is > 0)."""
        own, tied = self.is_delayed(step), self.tied_is_delayed(step)
        return [tied if is_tied else own for is_tied in self.tied_mask]

    def _record(self, step: int) -> StepRecord:
        return self.records.setdefault(step, StepRecord(step))

