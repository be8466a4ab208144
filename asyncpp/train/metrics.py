"""Per-step metrics: metrics.jsonl, summary.json, wandb and a console progress bar.

One writer per run (rank 0 / the last pipeline stage in multi-process runs), so a run directory holds
exactly one metrics.jsonl whatever the number of ranks. Lines are flushed as they are written so a
killed run keeps everything up to its last step.
"""

from __future__ import annotations

import json
import math
import os
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
        self.log_every = log_every
        self._bar = tqdm(total=total_steps, desc="train", dynamic_ncols=True, disable=not progress)
        self._last_val: float | None = None
        self._wandb = None
        if wandb_mode != "disabled":
            import wandb  # imported lazily: a disabled run must not pay wandb's start-up

            self._wandb = wandb.init(
                project=wandb_project,
                name=run_name,
                mode=wandb_mode,
                dir=str(self.out_dir),
                config=config,
                reinit="finish_previous",
            )

    def log(self, record: dict[str, Any]) -> None:
        """Write one step's record (must contain 'step')."""
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
        """A run resumed at `step` recomputes steps >= step: drop their records (written before the
        interruption) so metrics.jsonl holds each step once. Rewritten through a temporary file and
        an atomic rename, so a crash here leaves the old file, never a truncated one."""
        self._file.close()
        path = self.out_dir / "metrics.jsonl"
        kept = [line for line in path.read_text().splitlines(keepends=True) if _record_step(line) < step]
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - open until close()
        self._bar.reset(total=self._bar.total)
        self._bar.update(step)

    def message(self, text: str) -> None:
        """A console line that does not break the progress bar."""
        self._bar.write(text)

    def close(self, summary: dict[str, Any]) -> None:
        self._bar.close()
        self._file.close()
        tmp = self.out_dir / "summary.json.tmp"
        tmp.write_text(json.dumps({k: _jsonable(v) for k, v in summary.items()}, indent=2))
        os.replace(tmp, self.out_dir / "summary.json")
        if self._wandb is not None:
            self._wandb.summary.update(summary)
            self._wandb.finish()
