"""What the trainer and its two executors exchange: the data source they read and the result of a step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

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
