"""The schedule registry: the one place that knows what each schedule kind means (semantics.md). No torch.

A step t applies, at stage s, the gradient of minibatch b_t computed on the weights x_{t - d}. For every
kind the registry says whether it is delayed, each stage's steady-state delay d, how many weight buffers a
stage holds, and for which (P, m) it is valid. The config, the schedule builder, its invariants, the
pipeline engine, the Megatron front-end and the simulator all ask here, so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class ScheduleKindError(ValueError):
    """A schedule kind used where it is not valid (unknown name, m < P for 2bw, a stage out of range)."""


def buffers_for_delay(delay: int, *, weight_prediction: bool = False) -> int:
    """The weight versions that serve reads at `delay` steps: x_t back to x_{t-d} (d + 1); weight prediction
    extrapolates from x_{t-d-1} too, so it keeps one more. The one rule for every holder of versions: the
    pipeline's stages (through ScheduleKind.num_buffers), the simulator's history, the memory plan and the
    checkpoint estimate."""
    return delay + 1 + (1 if weight_prediction and delay else 0)


@dataclass(frozen=True)
class ScheduleKind:
    name: str
    delayed: bool
    """Whether the steady state applies stale gradients (False: synchronous mathematics, the pipeline flushes)."""
    lazy_update: bool = False
    """UPDATE(t) waits until the first forward that needs x_{t+1} (2bw), instead of right after the step's
    last backward. Lazy placement is what hides the global reductions of b_t behind m-(P-1-s) F/B pairs."""
    per_stage_delay: bool = False
    """Delay P-1-s at stage s (original PipeDream) instead of one delay for every stage."""
    min_microbatches_per_stage: bool = False
    """Needs m >= P: in-flight microbatches span at most two minibatches only then (2bw)."""
    all_forwards_first: bool = False
    """GPipe order within a stream (every forward, then every backward) instead of 1F1B."""

    def stage_delay(self, stage: int, num_stages: int) -> int:
        """Steady-state staleness (in optimizer steps) of the gradients `stage` applies."""
        _check_stage(stage, num_stages)
        if not self.delayed:
            return 0
        return num_stages - 1 - stage if self.per_stage_delay else 1

    def allowed_delays(self, stage: int, num_stages: int) -> tuple[int, ...]:
        """The d_t a stage may use: 0 (a synchronous step) or the kind's steady-state delay."""
        d = self.stage_delay(stage, num_stages)
        return (0, d) if d else (0,)

    def num_buffers(self, stage: int, num_stages: int, *, weight_prediction: bool = False) -> int:
        """Weight versions a stage holds: 1 sync, 2 for 2bw, P-s for pipedream (buffers_for_delay)."""
        return buffers_for_delay(self.stage_delay(stage, num_stages), weight_prediction=weight_prediction)

    def serves(self, num_stages: int, num_microbatches: int) -> bool:
        """Whether two-or-more weight versions cover the in-flight work of P stages with m microbatches."""
        return num_stages >= 1 and num_microbatches >= (num_stages if self.min_microbatches_per_stage else 1)

    def check(self, num_stages: int, num_microbatches: int) -> None:
        """Raise ScheduleKindError, naming both numbers and the fix, if (P, m) cannot be served."""
        if num_stages < 1 or num_microbatches < 1:
            raise ScheduleKindError(f"need num_stages >= 1 and num_microbatches >= 1, got {num_stages}, {num_microbatches}")
        if not self.serves(num_stages, num_microbatches):
            raise ScheduleKindError(
                f"schedule={self.name} needs train.num_microbatches >= parallel.pp, got train.num_microbatches="
                f"{num_microbatches} < parallel.pp={num_stages}: with fewer microbatches than stages two weight "
                f"versions cannot cover the in-flight work; raise train.num_microbatches to {num_stages}"
            )


KINDS: dict[str, ScheduleKind] = {
    k.name: k
    for k in (
        ScheduleKind("sync", delayed=False),
        ScheduleKind("gpipe", delayed=False, all_forwards_first=True),
        ScheduleKind("1f1b", delayed=False),
        ScheduleKind("2bw", delayed=True, lazy_update=True, min_microbatches_per_stage=True),
        ScheduleKind("pipedream", delayed=True, per_stage_delay=True),
    )
}
SYNC_KINDS = tuple(n for n, k in KINDS.items() if not k.delayed)
DELAYED_KINDS = tuple(n for n, k in KINDS.items() if k.delayed)


def kind_of(name: str) -> ScheduleKind:
    try:
        return KINDS[name]
    except KeyError:
        raise ScheduleKindError(f"schedule={name!r} is not one of {tuple(KINDS)}") from None


def _check_stage(stage: int, num_stages: int) -> None:
    if not 0 <= stage < num_stages:
        raise ScheduleKindError(f"stage={stage} is outside [0, num_stages={num_stages})")


class SyncWindows(Protocol):
    """What decides the synchronous steps (asyncpp.config.StalenessConfig satisfies it)."""

    sync_start_steps: int
    sync_cooldown_steps: int


def stage_delay(schedule: str, stage: int, num_stages: int) -> int:
    """Steady-state delay of `stage` under `schedule` (0 sync, 1 for 2bw, P-1-s for pipedream)."""
    return kind_of(schedule).stage_delay(stage, num_stages)


def is_sync_step(step: int, total_steps: int, staleness: SyncWindows) -> bool:
    """True for the synchronous-start and synchronous-cooldown steps (a pipeline flushes there)."""
    return step < staleness.sync_start_steps or step >= total_steps - staleness.sync_cooldown_steps


def step_delay(
    schedule: str, stage: int, num_stages: int, step: int, total_steps: int, staleness: SyncWindows
) -> int:
    """Delay used at `step`: the stage's steady-state delay, or 0 during sync start/cooldown."""
    if is_sync_step(step, total_steps, staleness):
        return 0
    return stage_delay(schedule, stage, num_stages)


def version_of(step: int, delay: int) -> int:
    """The weight version b_step runs on at delay `delay` (x_{-k} := x_0: warm-up steps read x_0)."""
    return max(step - delay, 0)
