"""Preemption: SIGTERM (slurm's warning before it kills a job) -> checkpoint at the next step boundary
and exit cleanly. The flag is an explicit object handed to the training loop; only pretrain.py
installs the signal handler (side effects stay at the edge).

Latency: the single-process loop stops after the current step. A pipeline stops at its next drain
point (evaluation or checkpoint boundary: `checkpoint.every` steps at most), where all stages agree
on the decision with one tiny all-reduce; set `checkpoint.every` so that many steps fit in the grace
period (slurm: `--signal=B:TERM@<seconds>`).
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

EXIT_CODE = 143  # 128 + SIGTERM, what a job killed by SIGTERM reports: the scheduler may requeue it


class StopFlag:
    def __init__(self) -> None:
        self.requested = False
        self.signal: int | None = None

    def set(self, signum: int = signal.SIGTERM, frame=None) -> None:
        self.requested, self.signal = True, signum

    def install(self, *signals: int) -> StopFlag:
        for s in signals or (signal.SIGTERM,):
            signal.signal(s, self.set)
        return self

    def agreed(self, device: torch.device) -> bool:
        """Collective at a drain point: stop if any rank was asked to (ranks get SIGTERM at different times)."""
        if not (dist.is_available() and dist.is_initialized()):
            return self.requested
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
