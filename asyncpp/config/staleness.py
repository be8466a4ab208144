"""staleness.*: the delay corrections (Error Feedback, DC-ASGD, weight prediction, synchronous phases) and
what of them only the single-process simulator runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncpp.config.base import ModelLimits
from asyncpp.config.schedule import SYNC_SCHEDULES
from asyncpp.typed import ConfigError

if TYPE_CHECKING:  # annotations only: run.py imports this module
    from asyncpp.config.run import RunConfig


@dataclass(kw_only=True)
class StalenessConfig:
    ef_lambda: float = 0.0
    """Update-level Error Feedback coefficient; 0 turns it off (bit-identical to plain delay)."""
    sync_start_steps: int = 0
    sync_cooldown_steps: int = 0
    grad_ef_lambda: float = 0.0
    """Gradient-level Error Feedback (the ablation that diverges): the base optimizer sees
    g_t + lambda * (g_t - g_{t-1}); 0 turns it off."""
    dc_lambda: float = 0.0
    """DC-ASGD Taylor compensation: the base optimizer sees g + dc_lambda * g * g * (x_t - x_{t-d});
    0 turns it off (simulator only with schedule=pipedream)."""
    weight_prediction: bool = False
    """SAPipe-style weight prediction: forward/backward on x_{t-d} + d * (x_{t-d} - x_{t-d-1}) instead
    of x_{t-d}."""
    diagnostics_every: int = 0
    """Every K steps also compute the fresh (non-delayed) update and log update_cosine and
    update_rel_error; 0 turns it off. Simulator only: it needs a second forward/backward per step."""


#: StalenessConfig fields the single-process simulator implements and the pipeline runtime does not: the
#: fresh-vs-delayed diagnostics need a second forward/backward of every step on the fresh weights x_t.
SIMULATOR_ONLY_STALENESS = ("diagnostics_every",)


def simulator_only_options(staleness: StalenessConfig) -> list[str]:
    """'field=value' for each simulator-only staleness option that is on (a pipeline run must refuse them)."""
    return [f"staleness.{n}={getattr(staleness, n)}" for n in SIMULATOR_ONLY_STALENESS if getattr(staleness, n)]


def check_pipeline_options(cfg: RunConfig, model: ModelLimits) -> None:
    """What a multi-process pipeline cannot run (the simulator can), refused before any process group exists."""
    only = simulator_only_options(cfg.staleness)
    if only:
        raise ConfigError(
            f"{', '.join(only)}: the fresh-vs-delayed diagnostics need a second forward/backward of every step "
            "on the fresh weights, which only the single-process simulator runs; run `python pretrain.py ...` "
            "without torchrun, or set staleness.diagnostics_every=0"
        )
    p = cfg.parallel
    if cfg.train.backend != "local" and (p.tp > 1 or p.ep > 1):
        raise ConfigError(f"train.backend={cfg.train.backend} is not combined with tensor/expert parallelism yet "
                          f"(parallel.tp={p.tp}, parallel.ep={p.ep}); use train.backend=local")
    tied = getattr(model, "tie_embeddings", True)
    if cfg.staleness.dc_lambda and cfg.schedule.name == "pipedream" and cfg.parallel.pp > 1 and tied:
        # The tied embedding's copies are read at different delays under PipeDream; DC-ASGD corrects their
        # summed gradient with the first stage's x_{t-d}, which the last stage (delay 0) does not hold.
        raise ConfigError(
            f"staleness.dc_lambda={cfg.staleness.dc_lambda} with schedule=pipedream and model '{model.name}' "
            "(tied embeddings) runs only in the single-process simulator: the last stage does not hold the first "
            "stage's stale version of the tied weight; use schedule=2bw, an untied model "
            "(+model.overrides.tie_embeddings=false), or `python pretrain.py ...` without torchrun"
        )


def check_staleness(cfg: RunConfig, model: ModelLimits) -> None:
    s, sched = cfg.staleness, cfg.schedule.name
    if s.ef_lambda < 0:
        raise ConfigError(
            f"staleness.ef_lambda={s.ef_lambda} must be >= 0 (0 turns Error Feedback off; the paper uses 1)"
        )
    for name in ("grad_ef_lambda", "dc_lambda", "diagnostics_every"):
        if getattr(s, name) < 0:
            raise ConfigError(f"staleness.{name}={getattr(s, name)} must be >= 0 (0 turns it off)")
    for name in ("sync_start_steps", "sync_cooldown_steps"):
        if getattr(s, name) < 0:
            raise ConfigError(f"staleness.{name}={getattr(s, name)} must be >= 0")
    if s.sync_start_steps + s.sync_cooldown_steps > cfg.train.steps:
        raise ConfigError(
            f"staleness.sync_start_steps={s.sync_start_steps} + staleness.sync_cooldown_steps="
            f"{s.sync_cooldown_steps} exceed train.steps={cfg.train.steps}; shorten them"
        )
    delayed_only = ("ef_lambda", "sync_start_steps", "sync_cooldown_steps", "grad_ef_lambda", "dc_lambda",
                    "weight_prediction")
    on = [f"staleness.{n}={getattr(s, n)}" for n in delayed_only if getattr(s, n)]
    if sched in SYNC_SCHEDULES and on:
        raise ConfigError(
            f"staleness options ({', '.join(on)}) only apply to delayed schedules, but "
            f"schedule={sched}; use schedule=2bw or schedule=pipedream, or set them to 0 (false for weight_prediction)"
        )
