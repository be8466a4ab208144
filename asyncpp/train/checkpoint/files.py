"""The checkpoint directory: where it is, which step_* directories are complete, their order (the lineage)
and pruning to checkpoint.keep_last. Plain files: no tensor, no process group."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from asyncpp.config import RunConfig

MANIFEST = "manifest.json"


TMP_PREFIX = ".tmp-step_"


def checkpoint_root(cfg: RunConfig) -> Path:
    """cfg: a RunConfig. <out_dir>/checkpoints unless checkpoint.dir says otherwise."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.out_dir) / "checkpoints"


def is_complete(path: str | os.PathLike) -> bool:
    """A committed checkpoint: its manifest is written last, after every shard and DCP's .metadata."""
    return (Path(path) / MANIFEST).is_file()


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if is_complete(p))


def latest(root: str | os.PathLike) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def step_of(path: str | os.PathLike) -> int | None:
    """The step in a step_<N> directory's name, or None."""
    name = Path(path).name
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def resume_target(resume: str) -> str:
    """checkpoint.resume as given -> a step_* path: 'auto', 'none' and a step_* path as they are; a run directory
    (outputs/<name>, as a run prints it) or a checkpoint directory -> its newest complete checkpoint, so the run
    directory can be named as printed. A directory with none stays as it is (preflight then says what it holds)."""
    path = Path(resume)
    if resume in ("auto", "none") or step_of(path) is not None or not path.is_dir():
        return resume
    newest = latest(path / "checkpoints") or latest(path)
    return str(newest) if newest is not None else resume


def read_manifest(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not is_complete(path):
        raise FileNotFoundError(
            f"{path} is not a complete asyncpp checkpoint (no {MANIFEST}); pick a step_* directory that has one"
        )
    return json.loads((path / MANIFEST).read_text())


def prune(root: Path, keep_last: int, step: int | None = None, protect: Path | None = None) -> None:
    """Called right after the commit of `step`: only complete checkpoints count, so the newest `keep_last` good
    ones always survive (a refused or failed save commits nothing and prunes nothing). Only the history being
    written is pruned: checkpoints of later steps (another history; preflight refuses to start one in the same
    directory, but a shared checkpoint.dir may still hold one) and the checkpoint the run resumed from are kept."""
    complete = [p for p in list_checkpoints(root) if step is None or (step_of(p) or 0) <= step]
    kept = {Path(protect).resolve()} if protect is not None else set()
    for old in complete[:-keep_last] if keep_last > 0 else []:
        if old.resolve() not in kept:
            shutil.rmtree(old, ignore_errors=True)
    clean_stale(root)  # leftovers of saves that died (none is in flight here)


def clean_stale(root: str | os.PathLike) -> list[Path]:
    """Remove the temporary directories of saves that died (`.tmp-step_*`); returns what was removed.
    Only while no save is in flight: at the start of a run (before any process group) or after a commit."""
    root = Path(root)
    stale = sorted(root.glob(f"{TMP_PREFIX}*")) if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale
