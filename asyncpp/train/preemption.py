"""Preemption: a stop request (SIGTERM from slurm or torchrun, SIGINT from Ctrl-C, SIGUSR1 from slurm's
`--signal`) -> checkpoint at a step boundary every rank agrees on, then exit 143. The flag is an explicit
object handed to the training loop; only pretrain.py installs the signal handler (side effects stay at the
edge).

Latency: the single-process loop stops after the current step. A pipeline agrees on a stop step inside a
segment (asyncpp/pipeline/stopping.py): 2BW completes the step the signal came in and the next, a synchronous
kind the step it came in (`stop_lookahead(kind, P)` steps after the first UPDATE_START that sees it), plus
the drain and the save. Both are far below torchrun's 30 s grace between its SIGTERM and its SIGKILL for
the tiny and the small models; the time taken is printed on every rank.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from asyncpp.parallel import flight
from asyncpp.train.run_identity import EXIT_STOPPED, record_exit

EXIT_CODE = EXIT_STOPPED  # 128 + SIGTERM, what a job killed by SIGTERM reports: the scheduler may requeue it
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""SIGTERM: slurm's preemption and torchrun's shutdown; SIGINT: Ctrl-C; SIGUSR1: `sbatch --signal=USR1@N`."""


REPEAT_S = 3.0
"""A second signal this soon after the first is the same request delivered twice, not a user insisting: under
slurm `scancel --signal=TERM` reaches every process of the step, the ranks and torchrun, and torchrun then forwards
it to the ranks again (the real cluster: the second copy came up to a second later, under load, and ended the rank
without its checkpoint); a Ctrl-C in a terminal reaches the ranks and torchrun alike."""


class StopFlag:
    """Set by a signal (or, in tests, by reaching `at_step`); read by the loops at step boundaries.

    A second signal while the first is being honoured (REPEAT_S or more after it) exits at once with EXIT_CODE,
    without a checkpoint: the user insisted (a second Ctrl-C), or the scheduler is about to kill the job anyway.

    Before the trainer's loop begins (`arm`) the signals keep their default action, which ends the process at
    once: there is nothing to save yet, and a rank blocked in setup inside a C call (the rendezvous, waiting for
    a peer that already failed a pre-flight check) would never get to run a Python handler, so it would sit out
    torchrun's 30 s grace time and be SIGKILLed.
    """

    def __init__(self, at_step: int | None = None) -> None:
        self.requested = False
        self.armed = False
        self._signals: tuple[int, ...] = ()
        self.signal: int | None = None
        self.since: float | None = None  # time.monotonic() of the first request
        self.seen_at: int | None = None
        """The step boundary at which a loop first saw the request: the single process after step t, a pipeline
        at UPDATE_START(t), i.e. while b_t's backward was still running on this stage."""
        self.evidence = ""
        """Where the flight recorder wrote this rank's communication ops when the signal came (flight.dump's words:
        "are in <file>"); empty when nothing records (a single process) or for the test hook."""
        self.at_step = at_step
        """Test hook (pretrain.py: ASYNCPP_STOP_AT_STEP): request a stop when a step >= at_step is reached, as
        if SIGTERM had arrived then, so a stop mid-segment is deterministic in CI."""

    def set(self, signum: int = signal.SIGTERM, frame=None) -> None:
        if self.requested and frame is not None and time.monotonic() - self.since < REPEAT_S:
            return  # the same request again: torchrun forwarding the SIGTERM slurm already gave every process
        if self.requested and frame is not None:  # a second real signal
            message = f"signal {signum} again: exiting {EXIT_CODE} now, without a checkpoint"
            os.write(2, f"{message}\n".encode())
            record_exit(EXIT_CODE, message)
            os._exit(EXIT_CODE)
        if not self.requested:
            self.requested, self.signal, self.since = True, signum, time.monotonic()
            if frame is not None:  # what was in flight when the scheduler asked: one small file, a few ms
                self.evidence = flight.dump(f"signal {signum}: a stop was requested")

    def arm(self) -> None:
        """From now on a signal asks for a checkpoint at a step boundary (the trainer's loop has begun)."""
        self.armed = True
        for s in self._signals:
            signal.signal(s, self.set)

    def reached(self, step: int) -> bool:
        """Whether a stop is requested, checked at the boundary after `step` (fires the test hook)."""
        if self.at_step is not None and step >= self.at_step and not self.requested:
            self.set(signal.SIGTERM)
        if self.requested and self.seen_at is None:
            self.seen_at = step
        return self.requested

    def elapsed(self) -> float:
        """Seconds since the first request (nan if none)."""
        return time.monotonic() - self.since if self.since is not None else float("nan")

    def install(self, *signals: int) -> StopFlag:
        """Handle `signals` (default: STOP_SIGNALS) from `arm` on; until then they end the process at once."""
        self._signals = signals or STOP_SIGNALS
        for s in self._signals:
            signal.signal(s, self.set if self.armed else signal.SIG_DFL)
        return self

    def agreed(self, device: torch.device) -> bool:
        """Collective at a drain point: stop if any rank was asked to (ranks get SIGTERM at different times)."""
        if not (dist.is_available() and dist.is_initialized()):
            return self.requested
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class CheckpointClock:
    """Wall-clock checkpoints (checkpoint.every_minutes). One clock decides, rank 0's (`decides`), so every rank
    saves at the same step: a pipeline learns it through its per-step stop agreement (pipeline/stopping.py),
    the single process at once. `agreed_at` is the step boundary every rank agreed to save at."""

    def __init__(self, every_minutes: float, decides: bool = True):
        self.every_s = every_minutes * 60.0
        self.decides = decides
        self.last = time.monotonic()
        self.agreed_at: int | None = None

    def due(self) -> bool:
        """This rank's vote: whether its clock says a save is due (False on ranks that do not decide)."""
        return self.decides and self.every_s > 0 and time.monotonic() - self.last >= self.every_s

    def saved(self) -> None:
        self.last, self.agreed_at = time.monotonic(), None


def announce(text: str) -> None:
    """A line every rank prints (stderr): a stop is the one event each rank's log must show. One write(2) of
    the whole line, so that the ranks' lines, merged by torchrun into one stream, never interleave."""
    sys.stderr.flush()
    os.write(2, f"{text}\n".encode())
