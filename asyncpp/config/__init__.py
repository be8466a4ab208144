"""Typed run configuration, validated once, before any process group or model exists.

The hydra tree under configs/ composes into a plain dict; `RunConfig.from_dict` turns it into these
dataclasses (unknown keys and wrong types are rejected there) and `validate` checks the cross-field
rules. Every error names the field, the value and the fix. Library code never sees a DictConfig.

One module per section, each field beside its check: model, parallel, train, optimizer, schedule, staleness,
data, checkpoint, logging; run.py holds RunConfig and `validate`, which runs every section's check in one
order; base.py what they share. This package re-exports the names callers import.
"""

from asyncpp.config.base import ModelLimits
from asyncpp.config.checkpoint import CheckpointConfig
from asyncpp.config.data import DataConfig, parse_blend, parse_split
from asyncpp.config.logging import LoggingConfig
from asyncpp.config.model import ModelSection
from asyncpp.config.optimizer import LRScheduleConfig, OptimizerConfig
from asyncpp.config.parallel import ParallelConfig, check_parallel_sizes, divisors
from asyncpp.config.run import RunConfig
from asyncpp.config.schedule import SYNC_SCHEDULES, ScheduleConfig
from asyncpp.config.staleness import (
    SIMULATOR_ONLY_STALENESS,
    StalenessConfig,
    check_pipeline_options,
    simulator_only_options,
)
from asyncpp.config.train import DEFAULT_MICROBATCHES, TrainConfig, derive_num_microbatches
from asyncpp.typed import ConfigError

__all__ = [
    "DEFAULT_MICROBATCHES",
    "SIMULATOR_ONLY_STALENESS",
    "SYNC_SCHEDULES",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "LRScheduleConfig",
    "LoggingConfig",
    "ModelLimits",
    "ModelSection",
    "OptimizerConfig",
    "ParallelConfig",
    "RunConfig",
    "ScheduleConfig",
    "StalenessConfig",
    "TrainConfig",
    "check_parallel_sizes",
    "check_pipeline_options",
    "derive_num_microbatches",
    "divisors",
    "parse_blend",
    "parse_split",
    "simulator_only_options",
]
