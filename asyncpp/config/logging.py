"""logging.*: wandb and the console log."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from asyncpp.config.base import ModelLimits, positive
from asyncpp.typed import ConfigError

if TYPE_CHECKING:  # annotations only: run.py imports this module
    from asyncpp.config.run import RunConfig


@dataclass(kw_only=True)
class LoggingConfig:
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "asyncpp"
    run_name: str | None = None
    log_every: int = 10
    progress: bool = True


def check_logging(cfg: RunConfig, model: ModelLimits) -> None:
    lg = cfg.logging
    positive("logging.log_every", lg.log_every)
    if lg.wandb_mode != "disabled" and not lg.wandb_project.strip():
        raise ConfigError(f"logging.wandb_project={lg.wandb_project!r} is empty with logging.wandb_mode="
                          f"{lg.wandb_mode}; name a project, e.g. logging.wandb_project=asyncpp, "
                          "or use logging=disabled")
