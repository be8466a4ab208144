"""The trainer over a scripted executor: segments, evaluation and checkpoint points, stop requests, the abort
rule and the summary's accounting, without a model (the executors have their own equivalence tests)."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import pytest

from asyncpp.config import RunConfig
from asyncpp.core.batches import BatchPlan
from asyncpp.core.records import PipelineBubble, StepResult
from asyncpp.train.preemption import StopFlag
from asyncpp.train.trainer import Trainer, TrainingAborted, segment_bounds


class Scripted:
    """An executor whose step t has loss 10 - t and is skipped when t is in `skip`; it logs what it is asked."""

    is_writer = True
    decides_time = True
    batches = BatchPlan(steps=10, micro_batch_size=1, dp=1, num_microbatches=4)  # config()'s: 100 tokens a step

    def __init__(self, stops_at_any_step: bool, skip=(), stop: StopFlag | None = None, stop_after: int = -1,
                 resume_at: int | None = None):
        self.stops_at_any_step, self.skip, self.stop, self.stop_after = stops_at_any_step, set(skip), stop, stop_after
        self.resume_at, self.calls = resume_at, []

    def resume(self, warn):
        return self.resume_at

    def steps(self, t0, t1, stop=None, clock=None):
        self.calls.append(("segment", t0, t1))
        for t in range(t0, t1):
            if t == self.stop_after and self.stop is not None:
                self.stop.set()
            yield StepResult(t, 10.0 - t, 1.0, 0.1, 1e-3, t in self.skip, tokens=100, step_time_s=0.5)

    def val_batches(self):
        return ["b"]

    def evaluate(self, batches):
        self.calls.append(("evaluate",))
        return 1.0

    def save(self, step_done):
        self.calls.append(("save", step_done))

    def stop_agreed(self, requested):
        return requested

    def wait_saves(self):
        pass

    def summary(self, wall_s):
        return {}

    def running_bubble(self, step):
        return PipelineBubble(0.25, (0.3, 0.2))  # a pipeline idle a quarter of the time so far, stage 0 most


class Sink:
    def __init__(self):
        self.records, self.messages = [], []

    def log(self, record):
        self.records.append(record.to_json())  # the metrics.jsonl line

    def message(self, text):
        self.messages.append(text)

    def rewind(self, step):
        self.records = [r for r in self.records if r["step"] < step]


def config(**train) -> RunConfig:
    return RunConfig.from_dict({"train": {"steps": 10, "eval_every": 4, "micro_batch_size": 1, "num_microbatches": 4,
                                          "seq_len": 25, **train},
                                "checkpoint": {"every": 5}, "logging": {"wandb_mode": "disabled"}})


def test_segments_cut_at_evaluation_and_checkpoint_points():
    assert segment_bounds(10, 4, 5) == [(0, 4), (4, 5), (5, 8), (8, 10)]
    assert segment_bounds(10, 4, 5, start=5) == [(5, 8), (8, 10)]


def test_one_record_per_step_with_evaluation_and_checkpoints_at_their_points():
    executor, sink = Scripted(stops_at_any_step=False), Sink()
    summary = Trainer(config(), executor, sink).run()
    assert [r["step"] for r in sink.records] == list(range(10))
    assert [r["step"] for r in sink.records if "val_loss" in r] == [3, 7, 9]
    assert [c for c in executor.calls if c[0] == "save"] == [("save", 5), ("save", 10)]
    assert sink.records[0]["tokens_per_s"] == 200.0 and sink.records[0]["sync_step"] is False
    assert summary["steps"] == 10 and summary["tokens"] == 1000 and summary["final_loss"] == 1.0


@pytest.mark.parametrize("anywhere, stopped_at", [(True, 3), (False, 4)])
def test_a_stop_request_checkpoints_at_the_next_boundary_the_executor_allows(anywhere, stopped_at):
    stop = StopFlag()
    executor = Scripted(stops_at_any_step=anywhere, stop=stop, stop_after=2)
    summary = Trainer(config(), executor, Sink(), stop=stop).run()
    assert summary["stopped_at"] == stopped_at and summary["steps"] == stopped_at
    assert executor.calls[-1] == ("save", stopped_at)


def test_resumed_summary_counts_every_trained_step_once():
    executor = Scripted(stops_at_any_step=True, resume_at=5)
    trainer = Trainer(config(), executor, Sink())
    assert trainer.resume() == 5
    summary = trainer.run()
    assert summary["steps"] == 10 and summary["tokens"] == 1000 and summary["tokens_this_attempt"] == 500


def test_consecutive_non_finite_steps_abort_every_rank_at_the_same_step():
    executor = Scripted(stops_at_any_step=True, skip={2, 3, 4})
    with pytest.raises(TrainingAborted, match=r"3 consecutive steps .* step 4"):
        Trainer(config(max_consecutive_skips=3), executor, Sink()).run()
    summary = Trainer(config(max_consecutive_skips=4), Scripted(True, skip={2, 3, 4}), Sink()).run()
    assert summary["skipped_steps"] == 3 and math.isfinite(summary["final_loss"])


def test_a_timed_checkpoint_saves_at_the_step_the_clock_asks_for_and_the_run_goes_on():
    cfg = config()
    cfg = cfg.replace(checkpoint=dataclasses.replace(cfg.checkpoint, every=0, every_minutes=1e-9))  # due at once
    executor, sink = Scripted(stops_at_any_step=True), Sink()
    summary = Trainer(cfg, executor, sink).run()
    assert [c[1] for c in executor.calls if c[0] == "save"] == list(range(1, 11))  # after every step, once
    assert [r["step"] for r in sink.records] == list(range(10)) and summary["stopped_at"] is None
    assert sum("every_minutes" in m for m in sink.messages) == 9  # the end-of-run save is not a timed one


def test_no_timed_checkpoint_when_the_clock_is_off_or_not_yet_due():
    for minutes in (0.0, 60.0):
        cfg = config()
        cfg = cfg.replace(checkpoint=dataclasses.replace(cfg.checkpoint, every=0, every_minutes=minutes))
        executor = Scripted(stops_at_any_step=True)
        Trainer(cfg, executor, Sink()).run()
        assert [c for c in executor.calls if c[0] == "save"] == [("save", 10)]


def test_a_run_that_can_lose_more_than_the_limit_warns_once():
    cfg = config()
    cfg = cfg.replace(checkpoint=dataclasses.replace(cfg.checkpoint, every=0, every_minutes=0.0,
                                                     warn_loss_minutes=0.05))  # 10 steps of 0.5 s = 5 s > 3 s
    sink = Sink()
    Trainer(cfg, Scripted(stops_at_any_step=True), sink).run()
    assert sum("a crash can lose up to" in m for m in sink.messages) == 1
    quiet = Sink()
    cfg = cfg.replace(checkpoint=dataclasses.replace(cfg.checkpoint, warn_loss_minutes=1.0))
    Trainer(cfg, Scripted(stops_at_any_step=True), quiet).run()
    assert not any("a crash can lose" in m for m in quiet.messages)


def test_a_stop_flag_remembers_the_step_it_was_first_seen_in():
    """The stop message names it ("signal 15 in step t"): bench/faults.py checks the checkpoint is at s <= t + 2."""
    stop = StopFlag(at_step=3)
    assert not stop.reached(2) and stop.seen_at is None
    assert stop.reached(3) and stop.reached(4)
    assert stop.seen_at == 3


@pytest.mark.parametrize("armed", [False, True])
def test_a_signal_before_the_first_step_exits_at_once_and_after_it_asks_for_a_checkpoint(armed, tmp_path):
    """Before the trainer's loop (a rank blocked in the rendezvous for a peer that already failed) SIGTERM keeps
    its default action and ends the process at once; once armed it only sets the flag."""
    code = ("import os, signal, time\n"
            "from asyncpp.train.preemption import StopFlag\n"
            f"flag = StopFlag().install()\n{'flag.arm()' if armed else ''}\n"
            "os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(0.2)\nprint('requested', flag.requested)\n")
    exit_file = tmp_path / "exit"
    proc = _run_with_exit_file(code, exit_file)
    if armed:
        assert proc.returncode == 0 and "requested True" in proc.stdout, proc.stderr
        assert not exit_file.exists()
    else:
        assert proc.returncode == -15 and "requested" not in proc.stdout, (proc.returncode, proc.stderr)


@pytest.mark.parametrize("gap, exits", [(0.5, False), (3.5, True)])
def test_a_repeated_signal_is_the_same_request_and_a_later_one_insists(gap, exits, tmp_path):
    """slurm's scancel --signal=TERM reaches every rank and torchrun, which forwards it again: a second SIGTERM
    within REPEAT_S is the same request (the rank still checkpoints); one after it exits at once, unsaved."""
    code = ("import os, signal, time\n"
            "from asyncpp.train.preemption import StopFlag\n"
            "flag = StopFlag().install()\nflag.arm()\n"
            f"os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep({gap})\nos.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(0.2)\nprint('still here', flag.requested)\n")
    exit_file = tmp_path / "exit"
    proc = _run_with_exit_file(code, exit_file)
    if exits:
        assert proc.returncode == 143 and "signal 15 again" in proc.stderr, (proc.returncode, proc.stderr)
        assert exit_file.read_text().startswith("143 signal 15 again")
    else:
        assert proc.returncode == 0 and "still here True" in proc.stdout, proc.stderr
        assert not exit_file.exists()


def _run_with_exit_file(code: str, exit_file):
    """`code` in a fresh interpreter (its own signal handlers) that reports deliberate exits to `exit_file`."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "ASYNCPP_EXIT_FILE": str(exit_file)})
