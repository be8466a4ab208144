"""Optimizers (our batched Muon and NorMuon, SOAP, Lion, Signum, AdEMAMix, MARS, Adan; AdamW via torch),
the matrix/AdamW split, LR schedules and the staleness corrections."""

from asyncpp.optim.adan import Adan
from asyncpp.optim.ademamix import AdEMAMix
from asyncpp.optim.build import (
    ELEMENTWISE_OPTIMIZERS,
    MATRIX_OPTIMIZERS,
    OPTIMIZER_NAMES,
    OptimizerSet,
    build_from_config,
    build_optimizer,
    is_muon_param,
    split_params,
)
from asyncpp.optim.lion import Lion
from asyncpp.optim.lr_schedule import SCHEDULE_KINDS, lr_multiplier
from asyncpp.optim.mars import MARS
from asyncpp.optim.muon import Muon, adjusted_lr, newton_schulz
from asyncpp.optim.normuon import NorMuon
from asyncpp.optim.signum import Signum
from asyncpp.optim.soap import SOAP

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "MARS",
    "MATRIX_OPTIMIZERS",
    "OPTIMIZER_NAMES",
    "SCHEDULE_KINDS",
    "SOAP",
    "AdEMAMix",
    "Adan",
    "Lion",
    "Muon",
    "NorMuon",
    "OptimizerSet",
    "Signum",
    "adjusted_lr",
    "build_from_config",
    "build_optimizer",
    "is_muon_param",
    "lr_multiplier",
    "newton_schulz",
    "split_params",
]
