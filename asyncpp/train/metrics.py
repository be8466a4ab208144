"""Per-step metrics: metrics.jsonl, summary.json, wandb and a console progress bar.

One writer per run (rank 0 / the last pipeline stage in multi-process runs), so a run directory holds
exactly one metrics.jsonl whatever the number of ranks. Lines are flushed as they are written so a
killed run keeps everything up to its last step.

Invariants across attempts (reruns, restarts, resumes) of one run directory:
- metrics.jsonl holds each step at most once: an attempt's first record (its start step: 0, or the step
  it resumed at) drops every older line of that step or later, and a torn last line, before it appends.
- summary.json is written only by a successful end (atomically); a crash never replaces it.
- wandb: the run id lives in <out_dir>/wandb_run_id, so every attempt resumes the same wandb run.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them visible instead of crashing the writer
    return value


def _record_step(line: str) -> float:
    """The step of one metrics.jsonl line; a torn last line (a killed writer) sorts last, so it is dropped."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf


WANDB_ID_FILE = "wandb_run_id"


def wandb_run_id(out_dir: str | os.PathLike) -> str:
    """The run directory's wandb id: read from <out_dir>/wandb_run_id, or made and stored there (atomic:
    two starts racing end with one id)."""
    path = Path(out_dir) / WANDB_ID_FILE
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    tmp = path.with_name(f"{WANDB_ID_FILE}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(uuid.uuid4().hex[:16])
    try:
        os.link(tmp, path)  # fails if another start stored an id first: keep theirs
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_text().strip()


class MetricsLogger:
    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        total_steps: int,
        config: dict | None = None,
        wandb_mode: str = "disabled",
        wandb_project: str = "asyncpp",
        run_name: str | None = None,
        progress: bool = True,
        log_every: int = 10,
    ):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.out_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - open until close()
        self._rewound = False  # until this attempt's first record has dropped what it will rewrite
        self.log_every = log_every
        self._bar = tqdm(total=total_steps, desc="train", dynamic_ncols=True, disable=not progress)
        self._last_val: float | None = None
        self._wandb = None
        if wandb_mode != "disabled":
            import wandb  # imported lazily: a disabled run must not pay wandb's start-up

            self._wandb = wandb.init(
                project=wandb_project,
                name=run_name or self.out_dir.name,  # the run directory's name (run_identity.py)
                id=wandb_run_id(self.out_dir),  # the same wandb run across restarts and requeues
                resume="allow",
                mode=wandb_mode,
                dir=str(self.out_dir),
                config=config,
                reinit="finish_previous",
            )

    def log(self, record: dict[str, Any]) -> None:
        """Write one step's record (must contain 'step'). The first record of an attempt rewinds the file
        to its step, so a rerun without a checkpoint (step 0) or a resume never duplicates a step."""
        if not self._rewound:
            self.rewind(record["step"])
        self._file.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        if "val_loss" in record:
            self._last_val = record["val_loss"]
        self._bar.update(1)
        if record["step"] % self.log_every == 0 or "val_loss" in record:
            shown = {"loss": f"{record.get('loss', float('nan')):.3f}"}
            if self._last_val is not None:
                shown["val"] = f"{self._last_val:.3f}"
            if "tokens_per_s" in record:
                shown["tok/s"] = f"{record['tokens_per_s']:.0f}"
            self._bar.set_postfix(shown, refresh=False)

    def rewind(self, step: int) -> None:
        """Drop the records of steps >= `step` (written by an earlier attempt, which this one recomputes)
        and a torn last line, so metrics.jsonl holds each step once. Rewritten through a temporary file
        and an atomic rename, so a crash here leaves the old file, never a truncated one; nothing is
        written when nothing is dropped (a full disk then cannot block a resume)."""
        self._file.close()
        path = self.out_dir / "metrics.jsonl"
        lines = path.read_text().splitlines(keepends=True) if path.exists() else []
        kept = [line for line in lines if line.endswith("\n") and _record_step(line) < step]
        if len(kept) != len(lines):
            tmp = path.with_suffix(".jsonl.tmp")
            try:
                with open(tmp, "w") as f:
                    f.write("".join(kept))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise OSError(e.errno, f"rewinding {path} to step {step} failed ({e.strerror}); the file is "
                              f"unchanged; free space in {self.out_dir}") from e
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - open until close()
        self._rewound = True
        self._bar.reset(total=self._bar.total)
        self._bar.update(step)

    def message(self, text: str) -> None:
        """A console line that does not break the progress bar."""
        self._bar.write(text)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """End the run. With a summary (a successful end) write summary.json atomically; without one (or
        with an empty one: a crash) leave the previous summary.json as it is."""
        self._bar.close()
        self._file.close()
        if summary:
            tmp = self.out_dir / "summary.json.tmp"
            with open(tmp, "w") as f:
                f.write(json.dumps({k: _jsonable(v) for k, v in summary.items()}, indent=2))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.out_dir / "summary.json")
        if self._wandb is not None:
            if summary:
                self._wandb.summary.update(summary)
            self._wandb.finish(exit_code=0 if summary else 1)
