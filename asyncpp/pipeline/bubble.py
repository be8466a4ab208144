"""The pipeline's bubble for the log line: every rank's (busy, elapsed) at the steps a line reports, gathered
without blocking.

At UPDATE(t) of such a step every rank starts a non-blocking SUM all-reduce of a [world, 3] float64 tensor that
holds its own (stage, busy seconds, elapsed seconds) in its row and zeros elsewhere: an all-gather by sum. It
goes on the stop agreement's gloo group (stopping.py), at UPDATE(t) right after that step's agreement is read
(posted at UPDATE_START(t)), so every member issues the group's ops in one order (NCCL's rule; the replay tier
checks it), and a GPU run never syncs for it. It is waited for one update later, when it has long arrived: the log line costs no
collective on the critical path. The times are each stage's timer snapshot (timer.StageTimer.snapshot: the
events the device has reached), so no rank waits for its device either.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from asyncpp.core.records import PipelineBubble


class BubbleGather:
    """The per-step bubble all-reduces of one rank. `group`: the stop agreement's; `keep`: this rank reads the
    results (the metrics writer); the others only complete their all-reduces."""

    def __init__(self, group, rank: int, world_size: int, keep: bool):
        self.group, self.rank, self.world_size, self.keep = group, rank, world_size, keep
        self._inflight: dict[int, tuple[object, torch.Tensor]] = {}
        self._results: dict[int, PipelineBubble] = {}

    def post(self, step: int, stage: int, busy_s: float, elapsed_s: float) -> None:
        rows = torch.zeros(self.world_size, 3, dtype=torch.float64)
        rows[self.rank] = torch.tensor([stage, busy_s, elapsed_s], dtype=torch.float64)
        work = dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._inflight[step] = (work, rows)

    def collect(self, step: int, wait) -> None:
        """Complete `step`'s all-reduce if one was posted (wait(work, what) bounds the wait)."""
        if step not in self._inflight:
            return
        work, rows = self._inflight.pop(step)
        wait(work, f"the bubble all-gather of step {step}")
        if self.keep:
            self._results[step] = bubble_of(rows)

    def drain(self, wait) -> None:
        for step in sorted(self._inflight):
            self.collect(step, wait)

    def pop(self, step: int) -> PipelineBubble | None:
        return self._results.pop(step, None)


def bubble_of(rows: torch.Tensor) -> PipelineBubble:
    """[(stage, busy, elapsed)] per rank -> the mean idle share over ranks and per stage (a rank that has not
    timed anything yet counts as idle 0)."""
    idle = [1.0 - busy / elapsed if elapsed > 0 else 0.0 for _, busy, elapsed in rows.tolist()]
    stages = [int(s) for s in rows[:, 0].tolist()]
    per_stage = []
    for s in range(max(stages) + 1):
        mine = [i for i, st in zip(idle, stages) if st == s]
        per_stage.append(sum(mine) / len(mine))
    return PipelineBubble(sum(idle) / len(idle), tuple(per_stage))
