"""Per-step metrics: metrics.jsonl, summary.json, wandb, the per-iteration log line and a progress bar.

One writer per run (rank 0 / the last pipeline stage in multi-process runs), so a run directory holds
exactly one metrics.jsonl whatever the number of ranks. Lines are flushed as they are written so a
killed run keeps everything up to its last step.

The console: every `log_every` iterations a Megatron-style line (iteration, consumed tokens, ms/iter,
tokens/s, lr, loss, grad norm, skipped steps, bubble, peak memory, TFLOP/s, MFU), and every message, go
through the `logging` module to stdout and to <out_dir>/pretrain.log. The writer attaches those handlers
itself: under torchrun it is the last stage, a rank whose hydra job logging is off, and hydra's own
pretrain.log belongs to rank 0. A tqdm bar with an ETA is drawn only when its stream is a terminal (in a
redirected log or a slurm .err file it would be one long \r-separated line); log lines then print above it.

Invariants across attempts (reruns, restarts, resumes) of one run directory:
- metrics.jsonl holds each step at most once: an attempt's first record (its start step: 0, or the step
  it resumed at) drops every older line of that step or later, and a torn last line, before it appends.
- summary.json is written only by a successful end (atomically); a crash never replaces it.
- wandb: the run id lives in <out_dir>/wandb_run_id, so every attempt resumes the same wandb run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import uuid
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from asyncpp.core.records import PipelineBubble, StepMetrics
from asyncpp.train.throughput import Throughput, peak_memory_bytes

LOG_FILE = "pretrain.log"
LOG_FORMAT = "[%(asctime)s] %(message)s"


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


def evaluates_after(step_done: int, segment_end: int, eval_every: int, total_steps: int) -> bool:
    """Whether the trainer evaluates once `step_done` steps are done: at the end of a segment that ends on an
    eval_every multiple or the run's last step (never with eval_every=0). The trainer and the pipeline's bubble
    gather (which must know the log steps in advance) both ask here."""
    return eval_every > 0 and step_done == segment_end and (segment_end % eval_every == 0
                                                             or segment_end == total_steps)


def line_due(step: int, total_steps: int, log_every: int, evaluated: bool = False) -> bool:
    """Whether step `step` ends a log window: every log_every iterations, the last one, and evaluations."""
    return (step + 1) % log_every == 0 or step + 1 == total_steps or evaluated


class MetricsLogger:
    """The run's one metrics writer: metrics.jsonl, summary.json, wandb, the console line and the progress bar
    (the module docstring)."""

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
        throughput: Throughput | None = None,
        device: str = "cpu",
    ):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.out_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - open until close()
        self._rewound = False  # until this attempt's first record has dropped what it will rewrite
        self.log_every, self.total_steps = log_every, total_steps
        self.throughput, self.device = throughput, device
        self._logger = _RunLog(self.out_dir / LOG_FILE)
        self._bar_stream = sys.stderr  # tqdm's
        show_bar = progress and self._bar_stream.isatty()
        self._bar = tqdm(total=total_steps, desc="train", dynamic_ncols=True, disable=not show_bar,
                         file=self._bar_stream)
        self._redirect = contextlib.ExitStack()
        if show_bar:  # log lines print above the bar instead of through it
            self._redirect.enter_context(logging_redirect_tqdm(loggers=[self._logger.logger]))
        self._window = IterationWindow()
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
                # No run history and summary footer (~30 lines) after the run's own summary table: summary.json
                # and the offline directory hold them (`wandb sync <run dir>/wandb/offline-run-*` uploads it).
                settings=wandb.Settings(quiet=True),
            )

    def log(self, record: StepMetrics) -> None:
        """Write one step's record (its to_json() line). The first record of an attempt rewinds the file
        to its step, so a rerun without a checkpoint (step 0) or a resume never duplicates a step."""
        if not self._rewound:
            self.rewind(record.step)
        line = record.to_json()
        self._file.write(json.dumps({k: _jsonable(v) for k, v in line.items()}) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in line.items() if k != "step"}, step=record.step)
        evaluated = record.val_loss is not None
        if evaluated:
            self._last_val = record.val_loss
        self._bar.update(1)
        self._window.add(record)
        iteration = record.step + 1
        if line_due(record.step, self.total_steps, self.log_every, evaluated):
            self._logger.info(self.iteration_line(iteration, record))
            self._window = IterationWindow()
        if record.step % self.log_every == 0 or evaluated:
            shown = {"loss": f"{record.loss:.3f}"}
            if self._last_val is not None:
                shown["val"] = f"{self._last_val:.3f}"
            shown["tok/s"] = f"{record.tokens_per_s:.0f}"
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
        self._window = IterationWindow()
        self._bar.reset(total=self._bar.total)
        self._bar.update(step)

    def message(self, text: str) -> None:
        """A line to the console (above the progress bar, if any) and to pretrain.log."""
        self._logger.info(text)

    def iteration_line(self, iteration: int, record: StepMetrics) -> str:
        """The Megatron-style line for the window of steps that ends with `record` (iteration = step + 1)."""
        w = self._window
        seconds = w.seconds / w.steps if w.steps else math.nan
        parts = [f"iteration {iteration:>{len(str(self.total_steps))}}/{self.total_steps}",
                 # the trainer's, from the batch plan (cumulative under a batch rampup)
                 f"consumed tokens {record.consumed_tokens:,}", f"global batch {record.global_batch_size:,}",
                 f"{seconds * 1e3:.1f} ms/iter", f"{w.tokens_per_s:,.0f} tokens/s",
                 f"lr {record.lr:.3e}", f"loss {w.mean_loss:.4f}",
                 f"grad norm {record.grad_norm:.3f}", f"skipped {w.skipped}"]
        if record.val_loss is not None:
            parts.append(f"val loss {record.val_loss:.4f}")
        parts.append(bubble_part(record.bubble))
        parts.append(f"peak mem {peak_memory_bytes(self.device) / 2**20:,.0f} MiB")
        parts += self._flops_parts(w.tokens_per_s)
        return " | ".join(parts)

    def _flops_parts(self, tokens_per_s: float) -> list[str]:
        if self.throughput is None or not tokens_per_s > 0:
            return []
        mfu = self.throughput.mfu(tokens_per_s)
        return [f"{self.throughput.tflops_per_device(tokens_per_s):.3g} TFLOP/s/device",
                f"MFU {mfu:.1%}" if mfu is not None else "MFU n/a (no peak for this device; set train.peak_tflops)"]

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """End the run. With a summary (a successful end) write summary.json atomically; without one (or
        with an empty one: a crash) leave the previous summary.json as it is."""
        self._bar.close()
        self._redirect.close()
        if summary:
            self._logger.info(summary_table(summary, self.out_dir / "summary.json"))
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
        self._logger.close()


def summary_table(summary: dict[str, Any], path: Path) -> str:
    """The run's end in a few aligned rows (summary.json, at `path`, holds every field; the console used to get
    it as one JSON line of ~3,000 characters)."""
    def num(key: str, fmt: str) -> str | None:
        value = summary.get(key)
        return None if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)

    steps = f"{summary.get('steps')} of {summary.get('planned_steps')}"
    if summary.get("stopped_at") is not None:
        steps += f" (stopped at step {summary['stopped_at']}, checkpointed)"
    rows = [("steps", steps), ("final loss", num("final_loss", ".4f")), ("final val loss", num("final_val_loss", ".4f")),
            ("skipped steps", num("skipped_steps", "d")), ("tokens", num("tokens", ",d")),
            ("wall time", num("wall_time_s", ".1f") and f"{summary['wall_time_s']:.1f} s"),
            ("tokens/s", num("tokens_per_s", ",.0f")),
            ("mean step", num("mean_step_time_s", ".3f") and f"{summary['mean_step_time_s'] * 1e3:.1f} ms")]
    per_rank = summary.get("bubble_fraction_per_rank")
    if per_rank:
        rows.append(("bubble", f"{summary['bubble_fraction']:.3f} mean; per rank "
                               + " ".join(f"{b:.3f}" for b in per_rank)))
    if summary.get("suggested_stage_layers") is not None:
        rows.append(("suggested stage_layers", str(summary["suggested_stage_layers"])))
    width = max(len(name) for name, _ in rows)
    lines = [f"summary ({path}):"] + [f"  {name:<{width}}  {value}" for name, value in rows if value is not None]
    return "\n".join(lines)


def bubble_part(bubble: PipelineBubble | None) -> str:
    """The pipeline's idle share so far: the mean over its ranks and the worst stage (a step record's
    bubble, gathered from every stage's timer)."""
    if bubble is None:
        return "bubble n/a (one process: no pipeline)"
    mean, stages = bubble.mean, bubble.per_stage
    if not stages:
        return f"bubble {mean:.3f} (so far)"
    worst = max(range(len(stages)), key=lambda s: stages[s])
    return f"bubble {mean:.3f} mean, {stages[worst]:.3f} max (stage {worst}; so far)"


class IterationWindow:
    """The steps since the last log line: Megatron averages the loss over the log interval, and the step
    time and tokens/s are the window's, not one (noisy) step's."""

    def __init__(self) -> None:
        self.steps = self.skipped = 0
        self.seconds = self.tokens = self.loss_sum = 0.0
        self.loss_steps = 0

    def add(self, record: StepMetrics) -> None:
        seconds = record.step_time_s
        self.steps += 1
        self.skipped += bool(record.skipped)
        if math.isfinite(seconds):
            self.seconds += seconds
            self.tokens += record.tokens_per_s * seconds
        loss = record.loss
        if math.isfinite(loss):
            self.loss_sum, self.loss_steps = self.loss_sum + loss, self.loss_steps + 1

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.loss_steps if self.loss_steps else math.nan

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.nan


class _RunLog:
    """The run's text log: a `logging` logger with its own console (stdout) and <out_dir>/pretrain.log
    handlers. It does not propagate, so hydra's root handlers (which write rank 0's pretrain.log in a
    single process) do not print or store each line twice."""

    def __init__(self, path: Path):
        # One logger per run directory: two loggers open in one process (tests) never share handlers.
        self.logger = logging.getLogger(f"asyncpp.run.{path.parent.resolve()}")
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False
        self.logger.disabled = False  # hydra's job_logging=disabled (ranks > 0) disables existing loggers
        formatter = logging.Formatter(LOG_FORMAT, datefmt="%Y-%m-%d %H:%M:%S")
        self._handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout),
                                                 logging.FileHandler(path, mode="a", encoding="utf-8")]
        for handler in self._handlers:
            handler.setFormatter(formatter)
            self.logger.addHandler(handler)

    def info(self, text: str) -> None:
        self.logger.info(text)

    def close(self) -> None:
        for handler in self._handlers:
            self.logger.removeHandler(handler)
            handler.close()
