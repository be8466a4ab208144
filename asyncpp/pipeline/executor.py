"""The multi-process training loop: one pipeline stage per rank, under torchrun.

It steps and evaluates a stage composed elsewhere (compose.py: the plan, the engine that executes the schedule,
what the stage reads). The run is cut into segments at
evaluation points; between segments every stage has drained (a 2BW pipeline drains only there),
so evaluation runs a plain forward-only pass on the newest weights x_{t+1}, the same weights the
single-process simulator evaluates.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from asyncpp.config import RunConfig
from asyncpp.core.records import PipelineBubble, StepResult
from asyncpp.core.vocab_split import VocabSplit, vocab_pipeline
from asyncpp.parallel.mesh import Mesh
from asyncpp.pipeline.bubble import BubbleGather
from asyncpp.pipeline.build import BuiltStage
from asyncpp.pipeline.engine import StageEngine
from asyncpp.pipeline.p2p import naming_the_peer
from asyncpp.pipeline.plan import StagePlan
from asyncpp.pipeline.report import StageReport
from asyncpp.pipeline.stage import StageForward
from asyncpp.pipeline.stage_data import StageData
from asyncpp.pipeline.state import StageCheckpoint
from asyncpp.pipeline.stopping import ActionStream, StopAgreement, stop_lookahead
from asyncpp.pipeline.update import StepRecord
from asyncpp.schedules.actions import MICROBATCH_OPS, Action, Op
from asyncpp.schedules.build import build_schedule
from asyncpp.schedules.costmodel import VocabPlacement
from asyncpp.train.metrics import evaluates_after, line_due
from asyncpp.train.preemption import CheckpointClock, StopFlag


def segment_actions(kind: str, stage: int, P: int, m: int, delays: Sequence[int], t0: int, t1: int,
                    vocab: tuple[VocabSplit, VocabPlacement] | None = None) -> list[Action]:
    """The schedule of steps [t0, t1) as a self-contained stream (drained at both ends), in absolute
    step and version numbers (versions older than t0 were produced by earlier segments). `vocab`: a
    vocabulary-parallel head's split (with a sharded embedding's costs) and placement; every stage's lists are built
    and the head's S and T (and the embedding's E and G) placed (deterministic: each rank places them alike)."""
    if vocab is not None:
        actions = vocab_pipeline(kind, m, delays[t0:t1], *vocab)[stage]
    else:
        actions = build_schedule(kind, stage, P, m, delays[t0:t1])
    return absolute_steps(actions, delays, t0)


def absolute_steps(actions: Sequence[Action], delays: Sequence[int], t0: int) -> list[Action]:
    """A stream built from step 0 (vocab_pipeline, build_schedule without first_step) as the segment that starts at
    step t0: every action's step and weight version made absolute (step t reads x_{t - d_t})."""
    out = []
    for a in actions:
        t = a.step + t0
        if a.op in MICROBATCH_OPS:
            version = max(t - delays[t], 0)
        else:
            version = t + 1 if a.op == Op.UPDATE else a.version
        out.append(dataclasses.replace(a, step=t, version=version))
    return out


@dataclass(frozen=True)
class Cadence:
    """When the trainer logs and evaluates: the executor posts the bubble's gather on the steps whose log line reads
    it (a pure function of the step and the segment, so every rank posts the same collectives)."""

    steps: int
    eval_every: int
    eval_batches: int
    log_every: int

    @classmethod
    def of(cls, cfg: RunConfig) -> Cadence:
        t = cfg.train
        return cls(steps=t.steps, eval_every=t.eval_every, eval_batches=t.eval_batches, log_every=cfg.logging.log_every)


class PipelineExecutor:
    """One pipeline stage on this rank, behind the trainer's executor protocol (asyncpp/train/trainer.py): it steps
    and evaluates what it is given (compose.pipeline_executor builds it)."""

    stops_at_any_step = False
    """A stop ends a segment at the step every rank agrees on (steps(), stopping.py), not after any step."""

    def __init__(self, plan: StagePlan, stage: BuiltStage, mesh: Mesh, engine: StageEngine, data: StageData,
                 forward: StageForward, cadence: Cadence, report: StageReport, checkpoint: StageCheckpoint):
        """`plan` is the stage's resolved plan and `engine` the runtime built from it (plan.build_stage_runtime),
        running `forward` on `stage` (this rank's built part of the model: pipeline/build.py); `data` what the
        stage reads; `report` and `checkpoint` its summary and its checkpoints."""
        self.plan, self.mesh, self.engine, self.data, self.forward = plan, mesh, engine, data, forward
        self.cadence, self.report, self.checkpoint = cadence, report, checkpoint
        self.spec, self.model, self.sharding = stage.spec, stage.model, stage.sharding
        self.batches = data.batches
        self.is_writer = mesh.is_writer
        self.decides_time = mesh.rank == 0  # rank 0's clock decides timed checkpoints (CheckpointClock)
        self._started: float | None = None  # set when the first segment starts (the timeline's origin)
        self._last_end = math.nan  # when the last stage finished the previous logged step's backward
        self._last_loss = math.nan  # the last logged step's loss (last stage; nan elsewhere)
        self.m = self.batches.microbatches(0)  # of the running segment: steps() sets it (a batch rampup changes it)
        self.stop_lookahead = stop_lookahead(plan.schedule, plan.num_stages)
        self._agreement: StopAgreement | None = None  # created by the first segment, on every rank
        self._bubbles: BubbleGather | None = None  # on the agreement's group, created with it

    @torch.no_grad()
    def evaluate(self, batches: list[Tensor | None]) -> float:
        """Forward-only pass through the drained pipeline on the newest weights (last stage's value). Each batch
        runs through the stage's pieces in parts.py's evaluation order, the same collectives on every stage."""
        engine = self.engine
        engine.versions.use(engine.versions.newest)
        total = 0.0
        if batches:
            engine.entry.post_evaluation_input()
        for i, b in enumerate(batches):
            inputs, labels = self.data.evaluation_batch(b)
            if i + 1 < len(batches):
                engine.entry.post_evaluation_input()  # one batch ahead: the next activation lands while this computes
            for part in engine.parts:
                part.evaluate_before(inputs)
            out = self.forward.through(engine.entry.evaluation_input(inputs), labels)
            losses = [engine.exit.evaluation_output(out)]
            losses += [part.evaluate_after(labels) for part in engine.parts]
            total += sum(loss for loss in losses if loss is not None)
        engine.comm.flush()
        return total / len(batches)

    # ---- the trainer's executor protocol (asyncpp/train/trainer.py) ------------------------------------
    def val_batches(self) -> list:
        """A stage none of whose pieces reads the tokens only relays activations: it needs the number of validation
        batches, not the data."""
        engine = self.engine
        reads = any(piece.reads_batches for piece in (engine.entry, engine.exit, *engine.parts))
        return self.data.val_batches(self.cadence.eval_batches, reads)

    def steps(self, t0: int, t1: int, stop: StopFlag | None = None,
              clock: CheckpointClock | None = None) -> Iterator[StepResult]:
        """Steps [t0, t1) as one stream, drained at both ends. A step's result is complete once its update
        norm, which rides a later step's reduction, has arrived (two updates later), or at the drain.

        A stop request, or rank 0's clock asking for a timed checkpoint, that every rank learns of inside the
        segment ends it early, at the step s they agree on (stopping.py): the results stop at s - 1 and the
        stream ends with the drain of [t0, s). A timed checkpoint is reported as clock.agreed_at = s."""
        if self._started is None:
            with self._naming("every rank's first step (the start barrier)"):
                dist.barrier()  # a common time origin for every stage's timeline (same-host clocks)
            self._started = self._last_end = self.engine.timer.restart()
            self._agreement = StopAgreement(self.plan.timeout_s)  # collective: same point on every rank
            self._bubbles = BubbleGather(self._agreement.group, self.mesh.rank, dist.get_world_size(),
                                         keep=self.is_writer)
        self._start_segment(t0, t1)
        todo = list(range(t0, t1))
        stream = ActionStream(self.actions_of(t0, t1))
        end = None  # the agreed step this segment ends at, once decided
        bad_update = None  # the newest step whose update this rank found not finite, since its last post
        for op, t in self.engine.run(stream):
            if op is Op.UPDATE_START:
                with self._naming(f"the stop agreement of step {t} (posting it)"):
                    self._agreement.post(t, stop is not None and stop.reached(t), bad_update,
                                         clock is not None and clock.due())
                bad_update = None
                continue
            if not self.engine.records[t].update_finite:
                bad_update = t
            # Waited for at every UPDATE(t), on every rank (also after a stop is decided). Raises
            # NonFiniteUpdate on every rank if any rank had applied a non-finite update before posting it.
            stopping, checkpoint = self._agreement.result(t, self.engine.comm.wait)
            if self._logs_line(t, t1):  # the same steps on every rank, after the agreement: one op order
                with self._naming(f"the bubble all-gather of step {t} (posting it)"):
                    self._bubbles.post(t, self.spec.stage, *self.engine.timer.snapshot())
            self._bubbles.collect(t - 1, self.engine.comm.wait)
            if (stopping or checkpoint) and end is None:
                end = min(t + self.stop_lookahead, t1)  # the same on every rank
                if end < t1:
                    stream.cut(self.actions_of(t0, end))
                    todo[:] = [s for s in todo if s < end]
                if not stopping and clock is not None:  # a timed checkpoint, not a stop
                    clock.agreed_at = end
            yield from self._ready(todo)
        # The updates after this rank's last post (the drain's) are agreed on here, at the drain point.
        with self._naming(f"the stop agreement of the end of the segment at step {t1} (posting it)"):
            self._agreement.post(t1, False, bad_update, False)
        stopping, checkpoint = self._agreement.drain(self.engine.comm.wait)
        self._bubbles.drain(self.engine.comm.wait)
        if checkpoint and not stopping and end is None and clock is not None:
            clock.agreed_at = t1  # asked for in the segment's last steps: saved at its end
        self.engine.finish()
        yield from self._ready(todo, drained=True)
        self.engine.versions.use(self.engine.versions.newest)  # evaluation and the caller see x_{end}

    def _start_segment(self, t0: int, t1: int) -> None:
        """A segment runs one m (the trainer cuts segments where a batch rampup changes it): the schedule's
        and the gradient's 1/m follow it. The engine is drained here, so no reduction holds the old scale."""
        m = self.batches.constant(t0, t1)
        if m != self.m:
            self.m = m
            self.engine.update.rescale(1.0 / m)

    def actions_of(self, t0: int, t1: int) -> list[Action]:
        """This stage's actions for steps [t0, t1) as one stream (segment_actions with the plan's delays, head and m)."""
        plan = self.plan
        vocab = (plan.vocab, plan.vocab_placement) if plan.vocab is not None else None
        return segment_actions(plan.schedule, plan.stage, plan.num_stages, self.m, plan.delays, t0, t1, vocab=vocab)

    def _ready(self, todo: list[int], drained: bool = False) -> Iterator[StepResult]:
        """The results of the steps at the head of `todo` that are complete, in order. Collective over the
        last stage's DP group (step_loss), at the same action on every replica."""
        records = self.engine.records
        while todo and (drained or math.isfinite(records.get(todo[0], _NAN_RECORD).update_norm)):
            step = todo.pop(0)
            rec = self.engine.take_record(step)
            loss, dt = math.nan, math.nan
            if self.spec.is_last:
                loss = self.engine.step_loss(step)
                end = self.engine.timer.end_of(Op.BACKWARD, step)
                dt, self._last_end = end - self._last_end, end
            self._last_loss = loss
            yield StepResult(step, loss, rec.grad_norm, rec.update_norm, rec.lr, rec.skipped, self.data.tokens_in(step),
                             dt, rec.router_loads)

    def position(self) -> tuple[int | None, str]:
        """(step, action) of the action this stage runs now, e.g. (5, "F5.0@v4 (stage 1, microbatch 0,
        forward)"); (None, "") outside a segment's actions (its drain, a checkpoint, an evaluation)."""
        a = self.engine.current
        if a is None:
            return None, ""
        microbatch = f", microbatch {a.microbatch}" if a.microbatch >= 0 else ""
        return a.step, f"{a} (stage {self.spec.stage}{microbatch}, {a.op.name.lower().replace('_', ' ')})"

    def stop_agreed(self, requested: bool) -> bool:
        """Collective at a drain point: stop if any rank was asked to (ranks get SIGTERM at different times)."""
        flag = torch.tensor([1.0 if requested else 0.0], device=self.mesh.device)
        with self._naming("every rank's stop decision at a drain point"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _naming(self, what: str):
        """A blocking collective over every rank whose raw backend error (a dead peer) names this stage."""
        return naming_the_peer(self.mesh, what, self.plan.timeout_s)

    def _logs_line(self, step: int, t1: int) -> bool:
        """Whether the trainer writes a log line at `step` (it reads the bubble then): every logging.log_every
        steps, the run's last, and an evaluation (at the end of the segment [t0, t1)). A pure function of the
        step and the segment, so every rank posts the same bubble all-reduces."""
        c = self.cadence
        return line_due(step, c.steps, c.log_every, evaluates_after(step + 1, t1, c.eval_every, c.steps))

    def running_bubble(self, step: int) -> PipelineBubble | None:
        """The pipeline's idle share so far, as every rank's timer saw it at UPDATE(step) (bubble.py: gathered
        without blocking); the metrics writer's, on the steps its log line reports; None elsewhere."""
        return self._bubbles.pop(step) if self._bubbles is not None else None

    def summary(self, wall_s: float) -> dict:
        return self.report.summary(self._last_loss)

    def memory_plan(self):
        return self.report.memory_plan()

    def timeline_events(self) -> list | None:
        return self.report.timeline_events()

    # ---- checkpoints (state.py) ----------------------------------------------------------------
    def save(self, step_done: int) -> None:
        self.checkpoint.save(step_done)

    def resume(self, warn: Callable[[str], None] | None = None) -> int | None:
        return self.checkpoint.resume(warn)

    def wait_saves(self) -> None:
        with self._naming("every rank's part of the background checkpoint"):
            self.checkpoint.saver.wait()


_NAN_RECORD = StepRecord(-1)
