"""What the trainer and its two executors exchange: the data source they read and the result of a step."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotations only: tools/report.py reads the record without importing torch
    from torch import Tensor


class DataSource(Protocol):
    def train_microbatch(self, index: int) -> Tensor:
        """Global microbatch `index` (step * m + i) as a [B, T+1] token block; a pure function of index."""

    def val_batches(self) -> list[Tensor]: ...


@dataclass
class StepResult:
    """One step as either executor reports it (the fields of a metrics.jsonl line, before the trainer's own)."""

    step: int
    loss: float
    """Mean training loss of b_t over microbatches and DP replicas (computed on the weights it read)."""
    grad_norm: float
    """Global L2 norm of the (delayed, corrected) gradient before clipping."""
    update_norm: float
    """||x_{t+1} - x_t||, Error Feedback included."""
    lr: float
    skipped: bool
    """The gradient was not finite: x_{t+1} = x_t, the version counter still advanced."""
    tokens: int
    step_time_s: float
    router_loads: list[float] = field(default_factory=list)
    """RouterLoadStats.vector(): per layer, the load ratio, then the mean balancing loss (empty without MoE)."""
    update_cosine: float | None = None
    """Diagnostics steps only (simulator): cosine between the applied and the fresh update."""
    update_rel_error: float | None = None


@dataclass(frozen=True)
class PipelineBubble:
    """The pipeline's idle share so far, from every rank's stage timer (busy time over elapsed time): what the
    log line reports on its steps (asyncpp/pipeline/bubble.py gathers it without blocking)."""

    mean: float
    """Mean over the ranks (summary.json's bubble_fraction, at the end of a run)."""
    per_stage: tuple[float, ...]
    """Per stage, the mean over its ranks (DP/TP replicas)."""

    def as_metrics(self) -> dict:
        return {"bubble_fraction": self.mean, "bubble_fraction_per_stage": list(self.per_stage)}


@dataclass
class StepMetrics:
    """One line of metrics.jsonl (and one wandb log call): the schema of what a run reports per step. The trainer
    fills it from a StepResult (asyncpp/train/trainer.py); `to_json` is the line, in this field order, with the
    optional groups present only when they were measured."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    update_norm: float
    tokens_per_s: float
    step_time_s: float
    skipped: bool
    sync_step: bool
    """A synchronous step of a delayed schedule (staleness.sync_start_steps / sync_cooldown_steps), or any step
    of a synchronous one."""
    global_batch_size: int | None
    """Sequences in the step (Megatron's global batch size: it changes under a batch rampup). None only in a line
    read back from a run older than the batch rampup (from_json)."""
    consumed_tokens: int | None
    """Tokens of every step up to and including this one (None as global_batch_size)."""
    update_cosine: float | None = None
    """staleness.diagnostics_every steps (simulator): cosine between the applied and the fresh update."""
    update_rel_error: float | None = None
    moe: dict[str, float] = field(default_factory=dict)
    """RouterLoadStats.as_metrics: moe/layer{i}/load_max_over_mean, moe/load_max, moe/load_mean, moe/aux_loss."""
    val_loss: float | None = None
    bubble: PipelineBubble | None = None
    """The pipeline's idle share so far, on the steps a log line reports (pipeline runs only)."""

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in ("step", "loss", "lr", "grad_norm", "update_norm", "tokens_per_s",
                                             "step_time_s", "skipped", "sync_step", "global_batch_size",
                                             "consumed_tokens")}
        if self.update_cosine is not None:
            out.update(update_cosine=self.update_cosine, update_rel_error=self.update_rel_error)
        out.update(self.moe)
        if self.val_loss is not None:
            out["val_loss"] = self.val_loss
        if self.bubble is not None:
            out.update(self.bubble.as_metrics())
        return out

    @classmethod
    def from_json(cls, line: dict) -> StepMetrics:
        """A metrics.jsonl line read back (tools/report.py, bench/pipeline.py): to_json's inverse for a line this
        version writes. What a line of an older run (or a partial one) means where it lacks a field:
        - a float metric (loss, lr, the norms, tokens_per_s, step_time_s): NaN, not recorded. The strings "nan",
          "inf" and "-inf" (how the writer keeps a non-finite value visible, asyncpp/train/metrics.py) are those
          floats again, here and in every optional field;
        - skipped, sync_step: False (both were written from the first version on; a partial line lacks them);
        - global_batch_size, consumed_tokens: None, unknown (lines before the batch rampup, commit 091d441);
        - update_cosine and update_rel_error, val_loss, the moe/* group, the bubble: absent, as to_json leaves them.
        A line without "step" is no step's record: ValueError."""
        if "step" not in line:
            raise ValueError(f"a metrics.jsonl line without 'step' is no step's record: {str(line)[:200]}")
        bubble = None
        if "bubble_fraction" in line:
            bubble = PipelineBubble(_float(line["bubble_fraction"]),
                                    tuple(_float(v) for v in line.get("bubble_fraction_per_stage", ())))
        optional = {k: _float(line[k]) if k in line else None for k in ("update_cosine", "update_rel_error", "val_loss")}
        return cls(step=int(line["step"]), **{k: _float(line.get(k)) for k in _FLOAT_FIELDS},
                   skipped=bool(line.get("skipped", False)), sync_step=bool(line.get("sync_step", False)),
                   global_batch_size=line.get("global_batch_size"), consumed_tokens=line.get("consumed_tokens"),
                   moe={k: _float(v) for k, v in line.items() if k.startswith("moe/")}, bubble=bubble, **optional)


_FLOAT_FIELDS = ("loss", "lr", "grad_norm", "update_norm", "tokens_per_s", "step_time_s")


def _float(value: object) -> float:
    """A metric read back as a float: absent (None) is NaN; the writer's "nan"/"inf" strings are those floats."""
    return math.nan if value is None else float(value)
