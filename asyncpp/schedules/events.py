"""A timeline event: one span of one stage, measured (the pipeline's timer) or predicted (the cost model).
Plain data, so the cost model stays torch-free and below the runtime; train/timeline.py renders these."""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("F", "B", "S", "T", "E", "G", "U0", "U", "comm", "idle")


@dataclass(frozen=True)
class TimelineEvent:
    stage: int
    label: str
    start: float
    end: float
    kind: str
    """One of KINDS."""
    step: int = -1
    microbatch: int = -1

    @property
    def duration(self) -> float:
        return self.end - self.start
