"""Learning-rate multipliers: pure functions of the step, no torch.

`step` is the 0-based index of the update about to be applied (step t of semantics.md), and
the optimizer uses lr = base_lr * lr_multiplier(t, ...) for it (OptimizerSet.set_lr_multiplier).

Warmup (all kinds) is linear: (step + 1) / warmup_steps for step < warmup_steps, so update 0
already moves the weights (lr/warmup) and update warmup_steps - 1 is the first at full lr.
Megatron uses step / warmup_steps, whose first update runs at lr 0 and is wasted; we shift by one.

- "constant": warmup, then 1.
- "cosine": warmup, then 1 -> min_lr_ratio along half a cosine, reaching min_lr_ratio at
  step == total_steps (the last update, total_steps - 1, is just above it); clamped after that.
- "wsd" (warmup-stable-decay): warmup, 1 until the last decay_fraction * total_steps steps,
  then linear to min_lr_ratio at step == total_steps. If that window would start inside warmup,
  it starts when warmup ends instead (the decay is then shorter, never overlapping warmup).
"""

from __future__ import annotations

import math

__all__ = ["SCHEDULE_KINDS", "lr_multiplier"]

SCHEDULE_KINDS = ("constant", "cosine", "wsd")


def _check(
    step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float, decay_fraction: float
) -> None:
    if step < 0:
        raise ValueError(f"lr_multiplier step={step} must be >= 0")
    if total_steps <= 0:
        raise ValueError(f"lr schedule total_steps={total_steps} must be > 0")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"lr schedule warmup_steps={warmup_steps} must be in [0, total_steps={total_steps}]")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"lr schedule min_lr_ratio={min_lr_ratio} must be in [0, 1]")
    if not 0.0 <= decay_fraction <= 1.0:
        raise ValueError(f"lr schedule decay_fraction={decay_fraction} must be in [0, 1]")


def _linear_decay(step: int, start: int, end: int, min_lr_ratio: float) -> float:
    """1 at `start`, min_lr_ratio at `end` and after, linear in between."""
    if step >= end:
        return min_lr_ratio
    progress = max(0.0, (step - start) / (end - start))
    return 1.0 - (1.0 - min_lr_ratio) * progress


def lr_multiplier(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int,
    kind: str,
    min_lr_ratio: float = 0.1,
    decay_fraction: float = 0.2,
) -> float:
    """The factor applied to every param group's base lr at update `step` (see module doc)."""
    if kind not in SCHEDULE_KINDS:
        raise ValueError(f"optimizer.schedule.kind={kind!r} is not one of {SCHEDULE_KINDS}")
    _check(step, total_steps, warmup_steps, min_lr_ratio, decay_fraction)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    if kind == "cosine":
        if step >= total_steps:
            return min_lr_ratio
        # warmup_steps == total_steps leaves no decay phase; step >= total_steps was handled above.
        progress = (step - warmup_steps) / (total_steps - warmup_steps)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    # wsd
    decay_steps = round(decay_fraction * total_steps)
    if decay_steps == 0:
        return 1.0
    decay_start = max(warmup_steps, total_steps - decay_steps)
    if step < decay_start:
        return 1.0
    return _linear_decay(step, decay_start, total_steps, min_lr_ratio)
