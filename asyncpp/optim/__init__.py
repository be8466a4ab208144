"""Optimizers: our batched Muon, AdamW via torch, the Muon/AdamW split and LR schedules."""

from asyncpp.optim.build import (
    OPTIMIZER_NAMES,
    OptimizerSet,
    build_from_config,
    build_optimizer,
    is_muon_param,
    split_params,
)
from asyncpp.optim.lr_schedule import SCHEDULE_KINDS, lr_multiplier
from asyncpp.optim.muon import Muon, adjusted_lr, newton_schulz

__all__ = [
    "OPTIMIZER_NAMES",
    "SCHEDULE_KINDS",
    "Muon",
    "OptimizerSet",
    "adjusted_lr",
    "build_from_config",
    "build_optimizer",
    "is_muon_param",
    "lr_multiplier",
    "newton_schulz",
    "split_params",
]
