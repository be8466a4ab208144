"""The delays of ../shared/spec/semantics.md as code, shared by the simulator and the pipeline engine.

A step t applies, at stage s, the gradient of minibatch b_t computed on the weights x_{t - d},
where d = step_delay(...). Everything that decides *which version* a computation reads goes through
here, so the single-process simulator and the multi-process runtime cannot disagree about it.
"""

from __future__ import annotations

from asyncpp.config import SYNC_SCHEDULES, StalenessConfig


def stage_delay(schedule: str, stage: int, num_stages: int) -> int:
    """Steady-state staleness (in optimizer steps) of the gradients that `stage` applies.

    sync/gpipe/1f1b: 0. 2bw: 1 at every stage, for any depth. pipedream: P-1-s (stage 0 is the
    stalest because its forward of b_t starts P-1 minibatches before that minibatch's loss exists).
    """
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage={stage} is outside [0, num_stages={num_stages})")
    if schedule in SYNC_SCHEDULES:
        return 0
    if schedule == "2bw":
        return 1
    if schedule == "pipedream":
        return num_stages - 1 - stage
    raise ValueError(f"schedule={schedule!r} is not one of {SYNC_SCHEDULES + ('2bw', 'pipedream')}")


def is_sync_step(step: int, total_steps: int, staleness: StalenessConfig) -> bool:
    """True for the synchronous-start and synchronous-cooldown steps (a pipeline flushes there)."""
    return step < staleness.sync_start_steps or step >= total_steps - staleness.sync_cooldown_steps


def step_delay(
    schedule: str, stage: int, num_stages: int, step: int, total_steps: int, staleness: StalenessConfig
) -> int:
    """Delay used at `step`: the stage's steady-state delay, or 0 during sync start/cooldown."""
    if is_sync_step(step, total_steps, staleness):
        return 0
    return stage_delay(schedule, stage, num_stages)
