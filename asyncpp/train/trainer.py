"""The one training loop, over either executor: the single-process reference (asyncpp/reference/executor.py)
or one pipeline stage per rank (asyncpp/pipeline/executor.py).

The trainer owns what does not depend on how steps are executed: the segments of a run (cut at evaluation and
checkpoint points, where a pipeline drains), the step-record schema and the metrics, the abort rule for
non-finite steps, preemption and the summary. An executor runs the steps of a segment and yields their results
in order; everything collective it needs is issued inside the executor, at the same point on every rank.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from asyncpp.config import RunConfig
from asyncpp.core.balancing import RouterLoadStats
from asyncpp.core.batches import BatchPlan
from asyncpp.core.records import PipelineBubble, StepMetrics, StepResult
from asyncpp.schedules.registry import is_sync_step
from asyncpp.train.checkpoint import due
from asyncpp.train.metrics import evaluates_after, line_due
from asyncpp.train.preemption import EXIT_CODE, CheckpointClock, StopFlag, announce


class TrainingAborted(RuntimeError):
    """Too many consecutive non-finite steps."""


class Executor(Protocol):
    stops_at_any_step: bool
    """True: a stop request is honoured after any step (nothing is in flight between steps)."""
    is_writer: bool
    """This rank writes metrics (the pipeline's last stage, DP and TP rank 0)."""
    decides_time: bool
    """This rank's clock decides timed checkpoints (CheckpointClock; the pipeline's rank 0, the only process)."""
    batches: BatchPlan
    """m_t and the data position of every step (asyncpp/core/batches.py), at this executor's dp."""

    def resume(self, warn: Callable[[str], None]) -> int | None:
        """Load checkpoint.resume's checkpoint, if any (collective in a pipeline); its step, else None."""

    def steps(self, t0: int, t1: int, stop: StopFlag | None = None,
              clock: CheckpointClock | None = None) -> Iterator[StepResult]:
        """Run steps [t0, t1) and yield their results in step order; drained at t1. An executor that does
        not stop at any step may end the segment early on `stop` or for a timed checkpoint (then it sets
        clock.agreed_at), at a step every rank agrees on."""

    def val_batches(self) -> list: ...

    def evaluate(self, batches: list) -> float:
        """Mean validation loss on the newest weights (collective in a pipeline)."""

    def save(self, step_done: int) -> None: ...

    def stop_agreed(self, requested: bool) -> bool:
        """Whether every rank stops here (collective in a pipeline)."""

    def wait_saves(self) -> None: ...

    def position(self) -> tuple[int | None, str]:
        """(step, action) of the action running now, for a failure report; (None, "") outside the actions."""

    def summary(self, wall_s: float) -> dict:
        """Executor-specific summary fields (the pipeline's bubble per stage; collective there)."""

    def running_bubble(self, step: int) -> PipelineBubble | None:
        """The pipeline's idle share so far at `step` (every stage's, gathered without blocking), on the metrics
        rank at the steps a log line reports; None without a pipeline."""


def segment_bounds(total_steps: int, *every: int, start: int = 0, at: Sequence[int] = ()) -> list[tuple[int, int]]:
    """Drain points: every multiple of each `every` (evaluation, checkpoint; 0 = never), the steps `at` (where
    a batch rampup changes m: a segment runs one m) and the end."""
    cuts = {total_steps} | {c for c in at if 0 < c < total_steps}
    for k in every:
        if k > 0:
            cuts |= set(range(k, total_steps, k))
    cuts = sorted(c for c in cuts if c > start)
    return list(zip([start] + cuts[:-1], cuts))


class Sink(Protocol):
    def log(self, record: StepMetrics) -> None: ...

    def message(self, text: str) -> None: ...

    def rewind(self, step: int) -> None: ...


class _Quiet:
    """Where records go on ranks that do not write metrics."""

    def log(self, record: StepMetrics) -> None:
        pass

    def message(self, text: str) -> None:
        pass

    def rewind(self, step: int) -> None:
        pass


class Trainer:
    """The training loop over an executor: segments, step records and metrics, the non-finite abort rule,
    preemption, checkpoints and the summary (the module docstring)."""

    def __init__(self, cfg: RunConfig, executor: Executor, metrics: Sink | None = None, stop: StopFlag | None = None):
        self.cfg, self.executor = cfg, executor
        self.metrics = metrics if metrics is not None and executor.is_writer else _Quiet()
        self.stop = stop or StopFlag()
        self.start_step = 0
        self.stopped_at: int | None = None
        self.skipped = self.consecutive_skips = self.tokens = 0
        self.steps_done = 0
        self.last_loss = self.val_loss = math.nan
        self.step_times: list[float] = []
        self.clock = CheckpointClock(0.0)  # run() sets the configured one
        self.activity: tuple[int | None, str] | None = None
        """(step, what) while the trainer itself runs something collective outside the executor's actions (a
        checkpoint, an evaluation, the resume): what position() reports then."""

    def position(self) -> tuple[int | None, str]:
        """(step, action) this rank is at now, for a failure report (parallel/failfast.py): the trainer's own
        activity, else the executor's current action, else the step after the last one done."""
        if self.activity is not None:
            return self.activity
        step, action = self.executor.position()
        return (self.steps_done, "") if step is None else (step, action)

    def resume(self) -> int:
        """Load checkpoint.resume's checkpoint, if any; returns the step the run continues from."""
        self.activity = (None, "resuming from a checkpoint")
        step = self.executor.resume(self.metrics.message)
        self.activity = None
        if step is None:
            return 0
        if step >= self.cfg.train.steps:
            raise ValueError(f"the run already reached train.steps={self.cfg.train.steps} (resumed at step {step}); "
                             "raise train.steps to train further")
        self.start_step = step
        self.metrics.rewind(step)
        self.metrics.message(f"resumed at step {step}")
        return step

    def run(self) -> dict:
        t, ck = self.cfg.train, self.cfg.checkpoint
        self.stop.arm()  # a signal now checkpoints at a step boundary (before: exits at once, nothing to lose)
        val = self.executor.val_batches() if t.eval_every else []
        started = time.perf_counter()
        self.clock = CheckpointClock(ck.every_minutes if ck.enabled else 0.0,
                                     decides=self.executor.decides_time)
        for t0, t1 in segment_bounds(t.steps, t.eval_every, ck.every if ck.enabled else 0, start=self.start_step,
                                     at=self.executor.batches.changes()):
            done = self._segment(t0, t1, val)
            while done < t1 and self.clock.agreed_at == done:  # cut for a timed checkpoint: save, then go on
                self._save(done, why=f"checkpoint.every_minutes={ck.every_minutes:g}")
                done = self._segment(done, t1, val)
            if done < t1 or self._stop_at_drain(done):
                self._stop(done)
                break
        self.executor.wait_saves()  # a background save must be committed before the run counts as done
        return self._summary(time.perf_counter() - started)

    def _segment(self, t0: int, t1: int, val: list) -> int:
        """Run [t0, t1); returns the step count done (< t1 when a stop or a timed checkpoint was honoured
        mid-segment: the executor ended it at a step every rank agreed on)."""
        t, ck = self.cfg.train, self.cfg.checkpoint
        done = t0
        for result in self.executor.steps(t0, t1, self.stop, self.clock):
            done = result.step + 1
            evaluated = bool(val) and evaluates_after(done, t1, t.eval_every, t.steps)
            if evaluated:
                self.activity = (result.step, f"the evaluation after step {result.step}")
                self.val_loss = self.executor.evaluate(val)
                self.activity = None
            self._log(result, self.val_loss if evaluated else None)
            if self.executor.stops_at_any_step and done < t1:
                if self.stop.reached(result.step):
                    return done
                if self.clock.due():  # one process: its own clock decides, at once
                    self.clock.agreed_at = done
                    return done
        if done < t1:
            return done
        timed = self.clock.agreed_at == t1 or (self.executor.stops_at_any_step and self.clock.due())
        if ck.enabled and due(t1, t.steps, ck.every):
            self._save(t1)
        elif ck.enabled and timed:
            self._save(t1, why=f"checkpoint.every_minutes={ck.every_minutes:g}")
        return t1

    def _save(self, step_done: int, why: str | None = None) -> None:
        self.activity = (step_done, f"the checkpoint of step {step_done}")
        self.executor.save(step_done)
        self.activity = None
        self.clock.saved()
        if why is not None:
            self.metrics.message(f"checkpoint at step {step_done} ({why})")

    def _stop_at_drain(self, step_done: int) -> bool:
        requested = self.stop.requested and step_done < self.cfg.train.steps
        return self.executor.stop_agreed(requested)

    def _stop(self, step_done: int) -> None:
        """Checkpoint at this step boundary (unless just saved) and end the run resumably; every rank says so."""
        ck = self.cfg.checkpoint
        if not (ck.enabled and due(step_done, self.cfg.train.steps, ck.every)):
            self._save(step_done)
        self.executor.wait_saves()  # the checkpoint is committed before the rank reports it
        self.stopped_at = step_done
        cause = "another rank's signal"
        if self.stop.requested:
            seen = "" if self.stop.seen_at is None else f" in step {self.stop.seen_at}"
            cause = f"signal {self.stop.signal}{seen}"
        took = f"took {self.stop.elapsed():.1f} s from the signal" if self.stop.requested else "agreed with the others"
        evidence = f"; its communication ops at the signal {self.stop.evidence}" if self.stop.evidence else ""
        announce(f"stop requested ({cause}): checkpoint at step {step_done}; exiting {EXIT_CODE}; {took}{evidence}")

    def _log(self, r: StepResult, val_loss: float | None) -> None:
        self.tokens += r.tokens
        self.steps_done = r.step + 1
        self.step_times.append(r.step_time_s)
        self.last_loss = r.loss
        batches = self.executor.batches
        record = StepMetrics(
            step=r.step, loss=r.loss, lr=r.lr, grad_norm=r.grad_norm, update_norm=r.update_norm,
            tokens_per_s=r.tokens / r.step_time_s if r.step_time_s > 0 else math.nan, step_time_s=r.step_time_s,
            skipped=r.skipped, sync_step=is_sync_step(r.step, self.cfg.train.steps, self.cfg.staleness),
            # Megatron's "global batch size" and consumed samples, in tokens: under a batch rampup neither is a
            # multiple of the step.
            global_batch_size=batches.global_batch(r.step),
            consumed_tokens=batches.samples_before(r.step + 1) * self.cfg.train.seq_len,
            update_cosine=r.update_cosine, update_rel_error=r.update_rel_error,  # staleness.diagnostics_every
            moe=RouterLoadStats.as_metrics(r.router_loads), val_loss=val_loss)
        if self.executor.is_writer and line_due(r.step, self.cfg.train.steps, self.cfg.logging.log_every,
                                                val_loss is not None):
            record.bubble = self.executor.running_bubble(r.step)
        self.metrics.log(record)
        if len(self.step_times) == 4:
            self._warn_if_work_at_risk(sum(self.step_times[1:]) / 3)  # the first step pays for warm-up
        self._count_skip(r)

    def _warn_if_work_at_risk(self, step_s: float) -> None:
        """Warn when a crash could lose more than checkpoint.warn_loss_minutes of work (from the step time)."""
        ck, remaining = self.cfg.checkpoint, self.cfg.train.steps - self.start_step
        if ck.warn_loss_minutes <= 0 or not math.isfinite(step_s):
            return
        at_risk = [remaining * step_s]
        if ck.enabled and ck.every:
            at_risk.append(ck.every * step_s)
        if ck.enabled and ck.every_minutes:
            at_risk.append(ck.every_minutes * 60 + step_s)
        if min(at_risk) > ck.warn_loss_minutes * 60:
            self.metrics.message(
                f"warning: a crash can lose up to {min(at_risk) / 60:.0f} min of work (steps take {step_s:.2f} s; "
                f"checkpoint.enabled={ck.enabled}, every={ck.every}, every_minutes={ck.every_minutes:g}); set "
                f"checkpoint.every_minutes below checkpoint.warn_loss_minutes={ck.warn_loss_minutes:g}")

    def _count_skip(self, r: StepResult) -> None:
        """Every rank counts: the skip decision comes from the all-reduced norm, so all ranks see the same
        skips and abort at the same step (no rank is left waiting for the others)."""
        self.skipped += r.skipped
        self.consecutive_skips = self.consecutive_skips + 1 if r.skipped else 0
        if r.skipped:
            self.metrics.message(f"step {r.step}: non-finite gradient, update skipped on every stage")
        if self.consecutive_skips >= self.cfg.train.max_consecutive_skips:
            raise TrainingAborted(
                f"{self.consecutive_skips} consecutive steps had a non-finite gradient (last: step {r.step}); "
                "lower optimizer.lr or check the data"
            )

    def _summary(self, wall: float) -> dict:
        steady = self.step_times[min(5, len(self.step_times) - 1):] if self.step_times else [math.nan]
        # Every step up to steps_done was trained once in the weights this run ends with, whichever attempt
        # trained it (a resumed run restarts from the checkpoint's step; recomputed steps count once).
        steps_done = self.steps_done or self.start_step
        return {
            "steps": steps_done,
            "planned_steps": self.cfg.train.steps,
            "stopped_at": self.stopped_at,
            "final_loss": self.last_loss,
            "final_val_loss": self.val_loss,
            "skipped_steps": self.skipped,
            "tokens": self.executor.batches.samples_before(steps_done) * self.cfg.train.seq_len,
            "tokens_this_attempt": self.tokens,
            "wall_time_s": wall,
            "mean_step_time_s": sum(steady) / len(steady),
            "tokens_per_s": self.tokens / wall,  # this attempt's
            **self.executor.summary(wall),
        }
