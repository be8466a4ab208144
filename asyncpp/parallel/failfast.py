"""Fail fast: an exception that escapes one rank's training ends the job in seconds, not at train.timeout_s.

Without this, the raising rank went through the ordinary teardown: hydra's traceback, `destroy_process_group`,
the interpreter's finalizers. A gloo or NCCL process group waits in its teardown for the work it has in flight,
and that work waits for peers that are themselves waiting for this rank, so the job ended only when the peers
gave up at train.timeout_s (issue 44: 335 s with the default 300 s). Here the failing rank instead:

1. publishes one line (rank, step, action, exception) in the job's key-value store, unless a peer's is there
   already (the first failure of the job wins: `compare_set`). The store is torchrun's agent's (or the launcher's)
   and outlives the rank, so a peer that then sees a broken link says it follows that failure instead of
   reporting its own error as the cause;
2. dumps its flight record (flight.py) next to the run;
3. aborts its process groups (`ProcessGroup.abort` via c10d's `_abort_process_group`: NCCL's communicator abort,
   gloo closes its pairs) — never a teardown that waits for peers;
4. hands the caller a RankFailed, whose entry point (pretrain.py) logs it and leaves at once with os._exit.

The peers' pending receives and collectives then fail within a second on gloo ("Connection closed by peer"), or
torchrun / Slurm tear them down as soon as the failed rank is gone.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from asyncpp.parallel import flight

STORE_KEY = "asyncpp/first_failure"
"""The store key of the job's first failure (torchrun's agent store is per restart attempt)."""
STORE_TIMEOUT_S = 2.0
"""How long a failing rank waits for the store: its host may be the rank that failed (without torchrun's agent)."""


@dataclass
class RankFailed(Exception):
    """One rank's training raised; its process groups are aborted already. `first`: this rank's failure is the
    job's first (its message names it); otherwise `message` says which failure this rank's error followed."""

    message: str
    first: bool
    trace: str = ""
    """The original traceback (printed by the first failure only)."""

    def __str__(self) -> str:
        return self.message


def describe(rank: int, step: int | None, action: str, error: BaseException) -> str:
    """'rank 1 failed at step 5 in action F5.0@v4 (stage 1, microbatch 0, forward): RuntimeError: ...'."""
    at = f" at step {step}" if step is not None else ""
    where = f" in action {action}" if action else ""
    return f"rank {rank} failed{at}{where}: {type(error).__name__}: {_first_line(error)}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:500] if text else "(no message)"


def abandon(error: BaseException, rank: int, step: int | None, action: str) -> RankFailed:
    """Steps 1-3 above; returns the RankFailed to raise (from `error`). Never raises itself, and never waits on
    a peer: every store access is bounded by STORE_TIMEOUT_S."""
    error = _root(error)
    mine = describe(rank, step, action, error)
    culprits = getattr(error, "failed_ranks", ())
    first = _publish(mine) if not culprits or rank in culprits else f"rank(s) {list(culprits)}: {_first_line(error)}"
    comm_ops = flight.dump(f"rank {rank} failed", mine)
    abort_process_groups()
    evidence = f"; this rank's recent communication ops {comm_ops}" if comm_ops else ""
    if first is None or first == mine:
        message = (f"{mine}{evidence}. The other ranks stop now (process groups aborted); the newest complete "
                   "checkpoint is untouched and rerunning the same command resumes from it")
        return RankFailed(message, True, "".join(traceback.format_exception(error)))
    return RankFailed(f"rank {rank} stops: it follows the job's first failure ({first}); its own error: "
                      f"{type(error).__name__}: {_first_line(error)[:200]}", False)


def _root(error: BaseException) -> BaseException:
    """The error that says what failed: a wrapper that only names what this rank waited for (a PipelineTimeout
    around a checkpoint's failure) gives way to an error in its chain that names the failed ranks."""
    seen, e = set(), error
    while e is not None and id(e) not in seen:
        if getattr(e, "failed_ranks", None):
            return e
        seen.add(id(e))
        e = e.__cause__
    return error


def _publish(mine: str) -> str | None:
    """The job's first failure after this one is offered (this one if none was there); None without a store."""
    try:
        store = c10d._get_default_store()
        store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
        return store.compare_set(STORE_KEY, "", mine).decode(errors="replace")
    except (RuntimeError, ValueError, AttributeError, dist.DistStoreError):
        return None


def abort_process_groups() -> None:
    """Abort every process group of this rank (the default one and all created after it) without waiting for
    peers; a backend without an abort is left to os._exit, which closes its sockets all the same."""
    if not dist.is_initialized():
        return
    try:
        c10d._abort_process_group()
    except (RuntimeError, ValueError, NotImplementedError, AttributeError):
        pass  # os._exit follows: the kernel closes the links either way
