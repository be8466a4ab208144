"""Stopping a pipeline inside a segment: every rank agrees on a stop step s without blocking, then ends
its stream with what the stream of [t0, s) still has to do, so the state at s is the one a segment cut at s
would have left.

The agreement. At each UPDATE_START(t) every rank starts a non-blocking MAX all-reduce of "stop requested" on a
group of its own (gloo, so a GPU run never syncs for it), and waits for it at UPDATE(t). That wait costs no
time: UPDATE(t) already waits for every stage's UPDATE_START(t) (the global gradient norm rides an all-reduce
started there; schedules/invariants.py checks every kind is deadlock-free under that rule), and in 2BW
UPDATE(t) comes a step after UPDATE_START(t). Every rank issues the same all-reduces in step order, so the
group's op order is one on every member (NCCL's rule). If step t's all-reduce says "requested", every rank
learns it at its UPDATE(t) and stops at s = t + stop_lookahead.

The same all-reduce carries rank 0's "a timed checkpoint is due" (checkpoint.every_minutes), honoured the same
way: cut at s, save, and go on with a new stream from s. It also carries "an update this rank applied since its
last post was not finite" (core/update.py restored x_t on that rank): every rank raises NonFiniteUpdate at the
same UPDATE, together, so none is left waiting for the others and no checkpoint follows. A finite gradient with
a non-finite update means the optimizer's state or learning rate has overflowed: every later update would be
non-finite too, so skipping the step and going on cannot help, and the newest checkpoint is the last good state.
(Skipping it on every rank would also need the answer before x_{t+1} is first read, right after UPDATE(t) in
2BW: a blocking all-reduce there, i.e. a bubble on every step.)

The switch. When a rank learns of the stop it has executed its actions up to UPDATE(t) and nothing beyond:
the engine posts no receive past an UPDATE it has not executed yet (engine.run). It then runs the actions of
the [t0, s) stream it has not run, in that stream's order (ActionStream.cut). `stop_lookahead` is the smallest
s - t for which this works on every stage of every kind: the executed prefix holds no compute of a step >= s
(2BW's stage 0 has run every forward of b_{t+1} at UPDATE(t); PipeDream's stage 0 runs P-1 steps ahead), and
the stages' streams together are deadlock-free and FIFO (tests/unit/test_stop_midsegment.py checks both on
every stream). Each stage then runs the same computations as the [t0, s) stream, each reading the same
version, and only an UPDATE(t) may move ahead of a backward of b_{t+1} (they touch different buffers): the
state at s is the same, bit for bit.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from asyncpp.core.update import NonFiniteUpdate
from asyncpp.schedules.actions import Action, Op
from asyncpp.schedules.registry import stage_delay


def stop_lookahead(kind: str, num_stages: int) -> int:
    """s - t: the stop step when step t's agreement says "stop" (see the module docstring): the step after t,
    plus the steady-state delay of the stage that runs furthest ahead."""
    return 1 + max(stage_delay(kind, s, num_stages) for s in range(num_stages))


class ActionStream:
    """One segment's actions, which a stop may cut short. `fixed` is the length of the prefix that can no
    longer change: executed, or its receive already posted (the engine's run loop keeps it current)."""

    def __init__(self, actions: Sequence[Action]):
        self.actions = list(actions)
        self.fixed = 0

    def cut(self, shorter: Sequence[Action]) -> None:
        """Continue with what `shorter` (the stream of a segment ending earlier) has not done yet, in its
        order. The fixed prefix must be part of it: a computation of a later step cannot be taken back (its
        messages are sent or awaited)."""
        done = self.actions[:self.fixed]
        wanted = set(shorter)
        extra = [a for a in done if a not in wanted]
        if extra:
            raise RuntimeError(f"cannot cut the stream after action {self.fixed}: {len(extra)} executed or "
                               f"posted actions are not in the shorter stream, e.g. {extra[0]}")
        executed = set(done)
        self.actions = done + [a for a in shorter if a not in executed]


def is_compute(a: Action) -> bool:
    return a.op in (Op.FORWARD, Op.BACKWARD)


def receives_ahead(actions: Sequence[Action], i: int, scan: int, posted: int) -> tuple[int, list[int]]:
    """The compute actions whose receive the engine posts before running action i: every one up to the first
    compute action after i (one ahead, in the order they are consumed: each direction is FIFO on its own
    communicator, so a receive posted early never blocks anything else), but never past an UPDATE not yet
    run: a stop decided there may drop what follows, and a posted receive cannot be taken back. `scan` is
    the first action not yet considered, `posted` the last compute action posted; returns the new scan and
    the indices to post, in order."""
    out = []
    while scan < len(actions) and posted <= i and not (actions[scan].op is Op.UPDATE and scan >= i):
        if is_compute(actions[scan]):
            out.append(scan)
            posted = scan
        scan += 1
    return scan, out


class StopAgreement:
    """The per-step stop all-reduces of one rank (see the module docstring). Collective to construct."""

    def __init__(self, timeout_s: float):
        # Every rank creates it at the same point (the first segment), so new_group's order is one everywhere.
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.timeout_s = timeout_s
        self._inflight: dict[int, tuple[object, torch.Tensor]] = {}

    def post(self, step: int, requested: bool, nonfinite_update: int | None = None,
             checkpoint_due: bool = False) -> None:
        """Start step's all-reduce of [stop requested, the newest step whose update this rank found not finite
        since its last post (+1; 0: none), this rank's clock says a timed checkpoint is due (rank 0 only votes)]."""
        bad = 0 if nonfinite_update is None else nonfinite_update + 1
        flags = torch.tensor([int(requested), bad, int(checkpoint_due)], dtype=torch.int64)
        self._inflight[step] = (dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flags)

    def result(self, step: int, wait) -> tuple[bool, bool]:
        """(any rank had requested a stop, a timed checkpoint is due) when it posted `step` (waits for that
        all-reduce). Raises NonFiniteUpdate if any rank had applied a non-finite update before posting it."""
        work, flags = self._inflight.pop(step)
        wait(work, f"the stop agreement of step {step}")
        stop, bad, checkpoint = flags.tolist()
        if bad:
            raise NonFiniteUpdate(bad - 1, " on at least one stage")  # on every rank, at this same point
        return bool(stop), bool(checkpoint)

    def drain(self, wait) -> tuple[bool, bool]:
        """Wait for what is still in flight (at a segment's end: every rank posted the same steps); whether any
        of it asked for a stop, a timed checkpoint."""
        out = [self.result(step, wait) for step in sorted(self._inflight)]
        return any(s for s, _ in out), any(c for _, c in out)
