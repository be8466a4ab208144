"""Writing a checkpoint: refuse a non-finite state, write the shards (synchronously or in the background),
commit (manifest, rename, prune) atomically, and agree on failures over every rank."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from asyncpp.train.checkpoint.files import MANIFEST, TMP_PREFIX, latest, prune
from asyncpp.train.checkpoint.rng import gather_rng
from asyncpp.train.checkpoint.runtime import (
    barrier,
    is_distributed,
    my_rank,
    quiet_single_process_dcp,
    torch_dcp,
)
from asyncpp.train.checkpoint.state import StageState, flat_state, nonfinite_tensors

FORMAT_VERSION = 1


class NonFiniteState(ValueError):
    """A checkpoint was refused because a tensor of the state is NaN or infinite (raised on every rank)."""


class SaveFailedOnRanks(RuntimeError):
    """DCP's save raised on every rank because some ranks' writes failed (not the disk: a bug, a bad tensor) or a
    peer died inside its collectives. `failed_ranks`: the ranks whose own write raised (empty if unknown), so
    that the others report that they follow that failure (parallel/failfast.py)."""

    def __init__(self, message: str, failed_ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.failed_ranks = failed_ranks

    @classmethod
    def of(cls, error: BaseException, final: Path) -> SaveFailedOnRanks:
        failures = getattr(error, "failures", None)
        if not isinstance(failures, dict) or not failures:
            return cls(f"DCP's collectives failed while saving {final}: {error}")
        rank, (first, _) = min(failures.items(), key=lambda kv: kv[0])
        text = str(first).strip().splitlines()[0] if str(first).strip() else ""
        return cls(f"writing checkpoint {final} failed on rank(s) {sorted(failures)}: rank {rank}: "
                   f"{type(first).__name__}: {text}", tuple(sorted(failures)))


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (a full disk, a read-only directory); nothing was committed."""


class NoSpaceLeft(CheckpointWriteError):
    """The checkpoint directory's disk filled up during a save (raised on every rank): pretrain.py exits with
    EXIT_NO_SPACE, which launchers do not retry (a restart would hit the same full disk)."""


NO_SPACE = "no space left on device"


def _refuse_nonfinite(state: StageState, step: int, root: Path) -> None:
    """Collective: raise NonFiniteState on every rank if any rank's state is not finite."""
    bad = nonfinite_tensors(state)
    everyone = [bad]
    if is_distributed():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, bad)
    found = [(r, k) for r, keys in enumerate(everyone) for k in keys]
    if found:
        shown = ", ".join(f"{k} (rank {r})" for r, k in found[:5])
        good = latest(root)
        raise NonFiniteState(
            f"checkpoint of step {step} refused: {len(found)} tensor(s) hold NaN/Inf, e.g. {shown}; nothing was "
            f"written or pruned, the newest good checkpoint is {good or 'none'}. The run diverged: lower "
            "optimizer.lr (or train.grad_clip), or resume from that checkpoint with other settings")


def code_version() -> str:
    try:
        root = Path(__file__).resolve().parents[2]  # asyncpp/
        sha = subprocess.run(["git", "rev-parse", "HEAD"], check=False, cwd=root, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain"], check=False, cwd=root, capture_output=True, text=True, timeout=5)
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if sha.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


class Saver:
    """Writes checkpoints. Collective: every rank calls save() at the same step boundary.

    With `async_save`, DCP stages the tensors to host memory, returns, and writes the shards in a
    background thread on a gloo group of its own (so it never interleaves with training collectives).
    Rank 0 commits the checkpoint (manifest, then rename) from that thread as soon as DCP's future
    resolves: DCP's coordinator (rank 0) resolves only after every rank's shards and the global .metadata
    are on disk, so the commit needs no barrier and no call from the training loop, and a crash after it
    never loses the checkpoint. Until then it is a temporary directory that no resume ever picks up.
    wait() (at the next save and at the end) re-raises a background failure and is a barrier.
    """

    def __init__(self, async_save: bool = False, timeout_s: float | None = None):
        """`timeout_s` (train.timeout_s): the background group's timeout, as every training group has; without it
        new_group's default (gloo: 30 min) would let a dead peer hang the background write that long."""
        self.async_save = async_save
        timeout = {"timeout": timedelta(seconds=timeout_s)} if timeout_s is not None else {}
        self._group = dist.new_group(backend="gloo", **timeout) if async_save and is_distributed() else None
        self._pending: _Pending | None = None
        self.resumed_from: Path | None = None
        """The checkpoint this run resumed from (set by the executor's resume): never pruned by this run, so a
        failed attempt can always start again where it did."""

    def save(self, root: str | os.PathLike, step: int, state: StageState, *, config: dict, layout: dict,
             keep_last: int = 3, data: dict | None = None) -> Path:
        """Raises NonFiniteState (every rank, nothing written) if the state holds NaN/Inf, and
        CheckpointWriteError if a synchronous write fails (its partial directory removed)."""
        self.wait()
        root = Path(root)
        _refuse_nonfinite(state, step, root)
        final = root / f"step_{step:08d}"
        token = [uuid.uuid4().hex[:8]]
        if is_distributed():
            dist.broadcast_object_list(token, src=0)
        tmp = root / f"{TMP_PREFIX}{step:08d}-{token[0]}"
        if my_rank() == 0:
            tmp.mkdir(parents=True, exist_ok=False)
        barrier()
        manifest = {"format": FORMAT_VERSION, "step": step, "config": config, "layout": layout,
                    "code_version": code_version(), "rng": gather_rng(), "saved_at": time.time(), "data": data}
        commit = _Commit(tmp, final, root, keep_last, manifest, self.resumed_from, _bytes_needed(state, root))
        quiet_single_process_dcp()
        if self.async_save:
            future = torch_dcp().async_save(flat_state(state), checkpoint_id=str(tmp), process_group=self._group,
                                    no_dist=not is_distributed())
            self._pending = _Pending(future, commit)
            return final
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            torch_dcp().save(flat_state(state), checkpoint_id=str(tmp), no_dist=not is_distributed())
        except (Exception, CheckpointException) as e:  # the same on every rank (a BaseException)
            if _os_error(e) is None and is_distributed() and not commit.out_of_space(e):  # not the disk: a rank's
                # write raised, or a peer died inside DCP's collectives
                commit.abandon()
                raise SaveFailedOnRanks.of(e, final) from e
            raise commit.failed(e) from e
        barrier()  # every rank's shards are on disk (DCP's coordinator wrote .metadata after them)
        error = None
        if my_rank() == 0:
            try:
                commit.run()
            except OSError as e:  # the manifest or the rename failed: say so on every rank, not only here
                error = commit.failed(e)
        _agree(error)
        return final

    def wait(self) -> None:
        """Collective. Finish a background save (committed by rank 0 as soon as it was complete); a
        failure on any rank raises CheckpointWriteError on every rank."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.done.wait()
        _agree(pending.error)

    @property
    def committed(self) -> bool:
        """True when no background save is pending, or rank 0 has committed it (other ranks: written)."""
        return self._pending is None or self._pending.done.is_set()


@dataclass
class _Commit:
    tmp: Path
    final: Path
    root: Path
    keep_last: int
    manifest: dict
    protect: Path | None = None
    need: int = 0
    """The bytes the checkpoint takes (_bytes_needed), for a full disk's message."""

    def run(self) -> None:
        """Rank 0, after every rank's shards and DCP's .metadata are written: manifest, rename, prune."""
        _write_durably(self.tmp / MANIFEST, json.dumps(self.manifest))
        trash = None
        if self.final.exists():  # a checkpoint of the same step from an earlier attempt: replace it
            trash = self.root / f"{TMP_PREFIX}replaced-{self.final.name}-{uuid.uuid4().hex[:8]}"
            os.replace(self.final, trash)
        os.replace(self.tmp, self.final)
        _fsync_dir(self.root)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        prune(self.root, self.keep_last, self.manifest["step"], self.protect)

    def abandon(self) -> None:
        """Remove the partial directory (rank 0; a stale one left by a dead rank 0 goes at the next start)."""
        if my_rank() == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def out_of_space(self, error: BaseException) -> bool:
        """Whether `error` is the disk filling up: ENOSPC in its chain (a DCP failure keeps each rank's), or less
        room left than the checkpoint takes. torch's file writer reports a full disk as a RuntimeError ("unexpected
        pos"), and DCP wraps every rank's error, so the errno alone does not always say."""
        cause = _os_error(error)
        if (cause is not None and cause.errno == errno.ENOSPC) or "No space left" in str(error):
            return True
        try:
            return shutil.disk_usage(self.root).free + _size(self.tmp) < self.need
        except OSError:
            return False

    def failed(self, error: BaseException) -> CheckpointWriteError:
        """Remove the partial directory (rank 0) and say what happened and what is still there."""
        if self.out_of_space(error):
            self.abandon()
            return NoSpaceLeft(
                f"{NO_SPACE}: writing checkpoint {self.final} needs ~{_gib(self.need)} but {self.root} has "
                f"{_gib(shutil.disk_usage(self.root).free)} free (the partial {self.tmp.name} removed, nothing "
                f"pruned; the newest complete checkpoint is {latest(self.root) or 'none'}). Free at least "
                f"{_gib(self.need)} there, lower checkpoint.keep_last, or point checkpoint.dir at a disk with "
                f"room for checkpoint.keep_last={self.keep_last} + 1 checkpoints, then rerun to resume")
        self.abandon()
        cause = _os_error(error)
        why = str(cause) if cause is not None else f"{type(error).__name__}: {error}"
        return CheckpointWriteError(
            f"writing checkpoint {self.final} failed: {why}; the partial {self.tmp.name} was removed and "
            f"nothing was pruned; the newest complete checkpoint is {latest(self.root) or 'none'}. Free space in "
            f"{self.root} or point checkpoint.dir at a writable disk with room for two checkpoints")


class _Pending:
    """A background save: DCP's future plus rank 0's commit, run from the thread that resolves it."""

    def __init__(self, future, commit: _Commit):
        self.future, self.commit = future, commit
        self.done = threading.Event()
        self.error: BaseException | None = None
        future.add_done_callback(self._finish)  # runs at once if the future is already resolved

    def _finish(self, future) -> None:
        try:
            future.result()
            if my_rank() == 0:
                self.commit.run()
        except BaseException as e:  # noqa: BLE001 - kept and re-raised by result() on the training thread
            self.error = self.commit.failed(e)
            self.error.__cause__ = e
        finally:
            self.done.set()


def _agree(error: BaseException | None) -> None:
    """Collective: raise `error` here, and a CheckpointWriteError naming the failed rank on every other
    rank, if any rank failed (no rank is left waiting in a barrier for one that raised)."""
    failed = [None if error is None else str(error)]
    if is_distributed():
        failed = [None] * dist.get_world_size()
        dist.all_gather_object(failed, None if error is None else str(error))
    if error is not None:
        raise error
    first = next(((r, e) for r, e in enumerate(failed) if e is not None), None)
    if first is not None:
        raise (NoSpaceLeft if first[1].startswith(NO_SPACE) else CheckpointWriteError)(f"rank {first[0]}: {first[1]}")


def _bytes_needed(state: StageState, root: Path) -> int:
    """What a checkpoint of this run takes on disk: the newest complete one's size, else this rank's tensors times
    the ranks (stages differ in size; an estimate, for the message and the full-disk test only)."""
    newest = latest(root)
    if newest is not None:
        return _size(newest)
    local = sum(t.numel() * t.element_size() for t in flat_state(state, wrap=False).values() if hasattr(t, "numel"))
    return local * (dist.get_world_size() if is_distributed() else 1)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _os_error(error: BaseException) -> OSError | None:
    """The OSError inside DCP's CheckpointException (which keeps each failed rank's exception)."""
    seen = [error]
    while seen:
        e = seen.pop()
        if isinstance(e, OSError):
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            seen.extend(v[0] if isinstance(v, tuple) else v for v in failures.values())
        if e.__cause__ is not None:
            seen.append(e.__cause__)
    return None


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a rename in `path` survive a power loss (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root: str | os.PathLike, step: int, state: StageState, **kwargs) -> Path:
    """Collective, synchronous: writes `root/step_<step>` atomically and prunes old checkpoints."""
    return Saver().save(root, step, state, **kwargs)


def due(step_done: int, total_steps: int, every: int) -> bool:
    """Save after `step_done` steps? Every `every` steps and at the end of the run."""
    return step_done == total_steps or (every > 0 and step_done % every == 0)
