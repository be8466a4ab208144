"""What every config section's check shares: the model's limits it validates against and the >= 1 rule."""

from __future__ import annotations

from typing import Protocol

from asyncpp.typed import ConfigError


class ModelLimits(Protocol):
    """What validation needs to know about the model (model_zoo.ModelConfig satisfies it)."""

    name: str
    num_layers: int
    max_seq_len: int
    vocab_size: int


def positive(path: str, value: float, fix: str = "") -> None:
    if value < 1:
        raise ConfigError(f"{path}={value} must be >= 1{'; ' + fix if fix else ''}")
