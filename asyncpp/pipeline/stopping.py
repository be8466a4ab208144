"""Stopping a pipeline inside a segment: every rank agrees on a stop step s without blocking, then ends
its stream with the drain of [t0, s), exactly the stream a segment cut at s would have had.

The agreement. At each UPDATE(t) every rank starts a non-blocking MAX all-reduce of "stop requested" on a
group of its own (gloo, so a GPU run never syncs for it), and waits for step t-1's result at UPDATE(t): one
step later, when it has long arrived. Every rank issues the same all-reduces in step order, so the group's
op order is one on every member (NCCL's rule). If step t's all-reduce says "requested", every rank learns
it at its UPDATE(t+1) and stops after step s = t + lookahead.

The same all-reduce carries rank 0's "a timed checkpoint is due" (checkpoint.every_minutes), honoured the same
way: cut at s, save, and go on with a new stream from s. It also carries "my update of step t was not finite" (core/update.py restored x_t on that rank):
every rank raises NonFiniteUpdate at UPDATE(t+1), together, so none is left waiting for the others and no
checkpoint follows. Skipping the step on every rank and going on would need the answer before x_{t+1} is first
read, right after UPDATE(t) in 2BW: a blocking all-reduce there, i.e. a bubble on every step.

The switch. The stream of [t0, t1) and the one of [t0, s) differ only from the drain on. A rank at
UPDATE(t+1) has executed its actions up to there and posted the receive of the next compute action; that
prefix must be a prefix of the [t0, s) stream too. `stop_lookahead` is the smallest lookahead for which it
is, for every kind, stage and P (tests/unit/test_stop_midsegment.py checks it on every stream): two steps
for a synchronous kind, plus the steady-state delay (2BW's UPDATE(t) waits for the first forward of
b_{t+2}; PipeDream's stage 0 runs P-1 steps ahead of its update).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from asyncpp.core.update import NonFiniteUpdate
from asyncpp.schedules.actions import Action, Op
from asyncpp.schedules.registry import stage_delay

STOP_LAG = 1
"""Steps between starting a step's agreement all-reduce and waiting for it."""


def stop_lookahead(kind: str, num_stages: int) -> int:
    """s - t: the stop step when step t's agreement says "stop" (see the module docstring)."""
    return STOP_LAG + 2 + max(stage_delay(kind, s, num_stages) for s in range(num_stages))


class ActionStream:
    """One segment's actions, which a stop may cut short. `fixed` is the length of the prefix that can no
    longer change: executed, or its receive already posted (the engine's run loop keeps it current)."""

    def __init__(self, actions: Sequence[Action]):
        self.actions = list(actions)
        self.fixed = 0

    def cut(self, shorter: Sequence[Action]) -> None:
        """Continue with `shorter` instead: it must agree with the fixed prefix (else the stages would
        disagree on what was sent and received)."""
        shorter = list(shorter)
        if shorter[:self.fixed] != self.actions[:self.fixed]:
            differs = next(i for i, (a, b) in enumerate(zip(shorter, self.actions)) if a != b)
            raise RuntimeError(f"cannot cut the stream at action {self.fixed}: the stop stream differs at "
                               f"action {differs} ({shorter[differs]} vs {self.actions[differs]})")
        self.actions = shorter


def is_compute(a: Action) -> bool:
    return a.op in (Op.FORWARD, Op.BACKWARD, Op.HEAD)


class StopAgreement:
    """The per-step stop all-reduces of one rank (see the module docstring). Collective to construct."""

    def __init__(self, timeout_s: float):
        # Every rank creates it at the same point (the first segment), so new_group's order is one everywhere.
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.timeout_s = timeout_s
        self._inflight: dict[int, tuple[object, torch.Tensor]] = {}

    def post(self, step: int, requested: bool, nonfinite_update: bool = False, checkpoint_due: bool = False) -> None:
        """Start step's all-reduce of [stop requested, this rank's update of `step` was not finite, this rank's
        clock says a timed checkpoint is due (rank 0 only votes)]."""
        flags = torch.tensor([int(requested), int(nonfinite_update), int(checkpoint_due)], dtype=torch.int32)
        self._inflight[step] = (dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flags)

    def result(self, step: int, wait) -> tuple[bool, bool]:
        """(any rank had requested a stop, a timed checkpoint is due) when it posted `step` (waits for that
        all-reduce). Raises NonFiniteUpdate if any rank's update of `step` was not finite."""
        work, flags = self._inflight.pop(step)
        wait(work, f"the stop agreement of step {step}")
        stop, nonfinite, checkpoint = flags.tolist()
        if nonfinite:
            raise NonFiniteUpdate(step, " on at least one stage")  # on every rank, at this same point
        return bool(stop), bool(checkpoint)

    def drain(self, wait) -> tuple[bool, bool]:
        """Wait for what is still in flight (at a segment's end: every rank posted the same steps); whether any
        of it asked for a stop, a timed checkpoint."""
        out = [self.result(step, wait) for step in sorted(self._inflight)]
        return any(s for s, _ in out), any(c for _, c in out)
