"""checkpoint.*: where, how often and how checkpoints are written and which one a run resumes from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from asyncpp.config.base import ModelLimits
from asyncpp.typed import ConfigError

if TYPE_CHECKING:  # annotations only: run.py imports this module
    from asyncpp.config.run import RunConfig


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: str | None = None
    """Where step_* checkpoints go; None = <out_dir>/checkpoints."""
    every: int = 0
    """Save every N steps (and at the end of the run); 0 = only at the end."""
    every_minutes: float = 30.0
    """Also save once this much wall-clock time has passed since the last save or the start (rank 0's clock,
    agreed by every rank at a step boundary, like Megatron's --save-interval by time); 0 = off."""
    warn_loss_minutes: float = 60.0
    """Warn at start (after the first steps, from their time) when a crash could lose more than this much work."""
    keep_last: int = 3
    resume: str = "auto"
    """'auto' = the newest complete checkpoint in `dir` if there is one, 'none', a step_* path, or a run directory
    (its newest; quoted for hydra where the name holds '=' or ',', which pretrain.py does itself)."""
    enabled: bool = True
    """Write checkpoints (resuming is governed by `resume` alone)."""
    async_save: bool = False
    """Write shards in the background (DCP async_save); rank 0 commits the checkpoint from DCP's completion
    callback as soon as every shard is written, so a crash after that never loses it."""
    init_from: str | None = None
    """Continued pretraining: a run that starts from scratch (nothing to resume) takes its weights from this file
    instead of drawing them: the .pt `python -m tools.hf import <hf dir> --out <file>` writes (or a torch.save'd
    full-model state dict). Every layout loads it (each rank copies its slices); the optimizer, the Error Feedback
    state and the data start fresh at step 0, like Megatron's --finetune. A resumed run reads its checkpoint."""


def check_checkpoint(cfg: RunConfig, model: ModelLimits) -> None:
    c = cfg.checkpoint
    if c.every < 0:
        raise ConfigError(f"checkpoint.every={c.every} must be >= 0 (0 = only at the end)")
    if c.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={c.keep_last} must be >= 1")
    for name in ("every_minutes", "warn_loss_minutes"):
        if getattr(c, name) < 0:
            raise ConfigError(f"checkpoint.{name}={getattr(c, name)} must be >= 0 (0 = off)")
    if c.init_from is not None:
        _check_init_from(c.init_from)
    if c.resume not in ("auto", "none") and not c.resume.rstrip("/").split("/")[-1].startswith("step_"):
        raise ConfigError(
            f"checkpoint.resume={c.resume!r} must be 'auto', 'none', a path to a step_* checkpoint directory, or a "
            "run directory that holds checkpoints (outputs/<name>: its newest); this path holds no complete checkpoint"
        )


def _check_init_from(path: str) -> None:
    p = Path(path).expanduser()
    if p.is_dir():
        raise ConfigError(f"checkpoint.init_from={path!r} is a directory; a Hugging Face model is imported first: "
                          f"`python -m tools.hf import {path} --out <file>.pt`, then checkpoint.init_from=<file>.pt")
    if not p.is_file():
        raise ConfigError(f"checkpoint.init_from={path!r}: no such file; give the .pt that `python -m tools.hf import "
                          "<hf dir> --out <file>.pt` wrote")
