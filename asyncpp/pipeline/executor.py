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
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from asyncpp.config import RunConfig
from asyncpp.core.batches import BatchPlan
from asyncpp.core.records import DataSource, PipelineBubble, StepResult
from asyncpp.core.transfer import to_device
from asyncpp.core.vocab_split import VocabSplit, vocab_pipeline
from asyncpp.parallel.mesh import Mesh
from asyncpp.parallel.sharding import layout_of
from asyncpp.parallel.tp import enter_region
from asyncpp.pipeline.bubble import BubbleGather
from asyncpp.pipeline.build import BuiltStage
from asyncpp.pipeline.p2p import StageComm, naming_the_peer
from asyncpp.pipeline.parts import StagePart
from asyncpp.pipeline.plan import StagePlan, build_stage_runtime
from asyncpp.pipeline.report import StageReport
from asyncpp.pipeline.stage import stage_forward, tied_parameters
from asyncpp.pipeline.state import StageCheckpoint
from asyncpp.pipeline.stopping import ActionStream, StopAgreement, stop_lookahead
from asyncpp.pipeline.update import StepRecord
from asyncpp.pipeline.vocab_embedding import VocabEmbedding
from asyncpp.pipeline.vocab_head import VocabHead
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
    out = []
    for a in actions:
        t = a.step + t0
        if a.op in MICROBATCH_OPS:
            version = max(t - delays[t], 0)
        else:
            version = t + 1 if a.op == Op.UPDATE else a.version
        out.append(dataclasses.replace(a, step=t, version=version))
    return out


class PipelineExecutor:
    """One pipeline stage on this rank, behind the trainer's executor protocol (asyncpp/train/trainer.py)."""

    stops_at_any_step = False
    """A stop ends a segment at the step every rank agrees on (steps(), stopping.py), not after any step."""

    def __init__(self, cfg: RunConfig, stage: BuiltStage, mesh: Mesh, data: DataSource, build_optimizer,
                 comm_cls: type[StageComm] = StageComm, parts: Sequence[StagePart] = (),
                 process_baseline_bytes: int | None = None):
        """`stage` is this rank's built part of the model (asyncpp/pipeline/build.py: pruned, sharded,
        initialized); `build_optimizer(stage_model, sharding_plan)` builds the stage's optimizer; `comm_cls` the
        stage links (a test stages them through host memory: tests/gpu/workers.py); `parts` more parts the stage
        runs (parts.py: their actions are in `actions_of`'s lists); `process_baseline_bytes` the process's RSS
        before the build (what the memory plan does not count), for the summary."""
        self.cfg, self.mesh, self.data = cfg, mesh, data
        self.is_writer = mesh.is_writer
        self.decides_time = mesh.rank == 0  # rank 0's clock decides timed checkpoints (CheckpointClock)
        self._started: float | None = None  # set when the first segment starts (the timeline's origin)
        self._last_end = math.nan  # when the last stage finished the previous logged step's backward
        self._last_loss = math.nan  # the last logged step's loss (last stage; nan elsewhere)
        self.spec, self.model, self.sharding, self.loss_fn = stage.spec, stage.model, stage.sharding, stage.loss_fn
        self.batches = BatchPlan.of(cfg, mesh.dims.dp)
        self.m = self.batches.microbatches(0)  # of the running segment: steps() sets it (a batch rampup changes it)
        self.stop_lookahead = stop_lookahead(cfg.schedule.name, mesh.num_stages)
        self._agreement: StopAgreement | None = None  # created by the first segment, on every rank
        self._bubbles: BubbleGather | None = None  # on the agreement's group, created with it
        self.plan = StagePlan.of(cfg, self.model.config, self.spec, mesh.dims)
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.engine = build_stage_runtime(
            self.plan, self.spec, self.model, mesh, build_optimizer(self.model, self.sharding), self._forward,
            grad_scale=1.0 / self.m, layouts=[layout_of(self.sharding, n) for n, _ in named],
            tied=tied_parameters(self.model, self.spec),
            head_labels=self._labels,
            embed_inputs=self._inputs, comm_cls=comm_cls, extra_parts=parts)
        self.report = StageReport(cfg, self.model.config, mesh, self.spec, self.engine, self._naming,
                                  process_baseline_bytes)
        self.checkpoint = StageCheckpoint(cfg, mesh, self.spec, self.model, self.engine, data, self.batches,
                                          self._naming)

    def _tokens(self, step: int, microbatch: int) -> Tensor:
        """The global microbatch index of the plan: DP=2 with m equals DP=1 with 2m (asyncpp/core/batches.py)."""
        index = self.batches.microbatch_index(step, self.mesh.dp_rank, microbatch)
        return to_device(self.data.train_microbatch(index), self.mesh.device)  # CUDA: pinned, no host sync

    def _forward(self, step: int, microbatch: int, x: Tensor | None) -> Tensor:
        # The last stage reads the labels here unless a vocabulary-parallel head reads them at S (`_labels`); the
        # first stage its tokens unless a sharded embedding looked them up at E (x is then their embedding).
        embedded = self.spec.embed is not None
        reads = (self.spec.is_first and not embedded) or (self.spec.is_last and self.spec.vocab is None)
        tokens = self._tokens(step, microbatch) if reads else None
        if self.spec.vocab is not None and self.spec.is_last:  # the normed hidden states: the head is every stage's
            return self._head_input(stage_forward(self.model, self.spec, x, head=False))  # P >= 2: never first
        out = stage_forward(self.model, self.spec, tokens[:, :-1] if self.spec.is_first and not embedded else x)
        if not self.spec.is_last:
            return out
        return self.loss_fn(out, tokens[:, 1:])

    def _head_input(self, h: Tensor) -> Tensor:
        """The last stage's final norm, entering the head's TP region as the TP head does (tp.enter_region: under
        sequence parallelism the all-gather of the sequence, whose backward sums the TP ranks' partial input
        gradients; else a copy whose backward all-reduces them)."""
        d = self.mesh.dims
        normed = self.model.norm(h)
        return enter_region(normed, self.mesh.tp_group, self.cfg.parallel.sequence_parallel) if d.tp > 1 else normed

    def _inputs(self, step: int, microbatch: int) -> Tensor:
        """The input token ids of (step, microbatch): every stage's rows of a sharded embedding look them up."""
        return self._tokens(step, microbatch)[:, :-1]

    def _labels(self, step: int, microbatch: int) -> Tensor:
        """The next-token ids of (step, microbatch): every stage's rows of a vocabulary-parallel head need them."""
        return self._tokens(step, microbatch)[:, 1:]

    @torch.no_grad()
    def evaluate(self, batches: list[Tensor]) -> float:
        """Forward-only pass through the drained pipeline on the newest weights (last stage's value)."""
        self.engine.versions.use(self.engine.versions.newest)
        comm, total = self.engine.comm, 0.0
        receives = not self.spec.is_first
        if receives and batches:
            comm.post_recv_forward()
        vocab, embedding = self.engine.part(VocabHead), self.engine.part(VocabEmbedding)
        for i, b in enumerate(batches):
            b = to_device(b, self.mesh.device) if b is not None else None
            if receives and i + 1 < len(batches):
                comm.post_recv_forward()  # one batch ahead: the next activation lands while this one computes
            embedded = embedding.evaluate(b[:, :-1]) if embedding is not None else None  # every stage's part
            if self.spec.is_first:
                x = embedded if embedding is not None else b[:, :-1]
            else:
                x = comm.recv_forward("a validation activation")
            out = stage_forward(self.model, self.spec, x, head=vocab is None)
            if vocab is not None:  # every stage joins the head's pass of the batch (its labels: val_batches)
                if not self.spec.is_last:
                    comm.send_forward(out)
                hidden = self._head_input(out) if self.spec.is_last else None
                loss = vocab.evaluate(hidden, b[:, 1:])
                total += loss if self.spec.is_last else 0.0
            elif self.spec.is_last:
                total += self.loss_fn(out, b[:, 1:]).item()
            else:
                comm.send_forward(out)
        comm.flush()
        return total / len(batches)

    # ---- the trainer's executor protocol (asyncpp/train/trainer.py) ------------------------------------
    def val_batches(self) -> list:
        """Middle stages only relay activations: they need the number of validation batches, not the data."""
        t = self.cfg.train
        needs_data = self.spec.is_first or self.spec.is_last or self.spec.vocab is not None  # a head shard: labels
        val = self.data.val_batches() if needs_data else [None] * t.eval_batches
        if len(val) != t.eval_batches:  # every stage must relay the same count
            raise ValueError(f"the data source gave {len(val)} validation batches, train.eval_batches={t.eval_batches}")
        return val

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
            self._agreement = StopAgreement(self.cfg.train.timeout_s)  # collective: same point on every rank
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
        vocab = (self.plan.vocab, self.plan.vocab_placement) if self.plan.vocab is not None else None
        return segment_actions(self.cfg.schedule.name, self.spec.stage, self.mesh.num_stages, self.m,
                               self.plan.delays, t0, t1, vocab=vocab)

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
            tokens = self.batches.global_batch(step) * self.cfg.train.seq_len
            yield StepResult(step, loss, rec.grad_norm, rec.update_norm, rec.lr, rec.skipped, tokens,
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
        return naming_the_peer(self.mesh, what, self.cfg.train.timeout_s)

    def _logs_line(self, step: int, t1: int) -> bool:
        """Whether the trainer writes a log line at `step` (it reads the bubble then): every logging.log_every
        steps, the run's last, and an evaluation (at the end of the segment [t0, t1)). A pure function of the
        step and the segment, so every rank posts the same bubble all-reduces."""
        t = self.cfg.train
        return line_due(step, t.steps, self.cfg.logging.log_every, evaluates_after(step + 1, t1, t.eval_every, t.steps))

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
