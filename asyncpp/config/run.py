"""The whole run's config: its sections, the top-level fields (seed, out_dir, dry_run) and `validate`, which fills
in the derived fields and runs every section's check, in one order."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from asyncpp.config.base import ModelLimits, positive
from asyncpp.config.checkpoint import CheckpointConfig, check_checkpoint
from asyncpp.config.data import DataConfig, check_data
from asyncpp.config.logging import LoggingConfig, check_logging
from asyncpp.config.model import ModelSection
from asyncpp.config.optimizer import OptimizerConfig, check_optimizer
from asyncpp.config.parallel import ParallelConfig, check_dry_run_size, check_parallel, check_tp_ep
from asyncpp.config.schedule import ScheduleConfig
from asyncpp.config.staleness import StalenessConfig, check_staleness
from asyncpp.config.train import TrainConfig, check_batch_rampup, check_train, derive_num_microbatches
from asyncpp.typed import ConfigError, from_dict, to_dict


@dataclass(kw_only=True)
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    seed: int = 1234
    out_dir: str = "outputs/run"
    dry_run: int = 0
    """> 0: lay the job out for this many ranks on a fake process group (no GPU, no memory: meta tensors)
    and print each stage's shard shapes and per-rank memory instead of training."""
    dry_run_trace: bool = False
    """With dry_run=N: also run one stage's training steps at real size on meta tensors under a dispatch mode
    (asyncpp/analysis/traced.py): the traced peak next to the plan, every host read with its call site, every
    collective and p2p op."""
    dry_run_stage: int | None = None
    """With dry_run_trace: the stage to trace; None = the one with the largest planned memory."""
    dry_run_trace_microbatches: int | None = None
    """With dry_run_trace: trace this many microbatches per step instead of the run's m, and predict the run's step
    at its own m from them (an action's time does not depend on m: stagetime.job_time). A trace costs time in
    proportion to m: the MoE recipes' steps of 64 and 128 microbatches take hours to trace,
    parallel.pp microbatches minutes. The
    traced peak is then the peak at that m (the plan printed above it is at the run's m)."""

    @classmethod
    def from_dict(cls, data: dict) -> RunConfig:
        return from_dict(cls, data)

    def to_dict(self) -> dict:
        return to_dict(self)

    def replace(self, **sections) -> RunConfig:
        return dataclasses.replace(self, **sections)

    def validate(self, model: ModelLimits) -> RunConfig:
        """Cross-field checks, on the config with its derived values filled in (the microbatch count of
        train.global_batch_size, the warmup of warmup_fraction). Returns that resolved config; raises
        ConfigError naming the field, the value and the fix. Under torchrun, set parallel.dp from the
        world size first (asyncpp.job.resolve does), so the microbatch count is derived from the real dp."""
        _check_finite(self, model)
        cfg = _resolve_derived(self)
        for check in (_check_run, check_train, check_batch_rampup, check_parallel, check_tp_ep, check_optimizer,
                      check_staleness, check_data, check_logging, check_checkpoint):
            check(cfg, model)
        return cfg


def _resolve_derived(cfg: RunConfig) -> RunConfig:
    """The config with its derived fields filled in; the checks below then see plain numbers."""
    t, s = cfg.train, cfg.optimizer.schedule
    if not 0.0 <= s.warmup_fraction <= 1.0:
        raise ConfigError(f"optimizer.schedule.warmup_fraction={s.warmup_fraction} must be in [0, 1] (the share of "
                          "train.steps spent warming up); e.g. optimizer.schedule.warmup_fraction=0.1")
    positive("train.steps", t.steps)
    check_dry_run_size(cfg)
    m = derive_num_microbatches(t, cfg.parallel.dp or 1)
    warmup = s.warmup_for(t.steps)
    train = dataclasses.replace(t, num_microbatches=m, global_batch_size=m * t.micro_batch_size * (cfg.parallel.dp or 1))
    schedule = dataclasses.replace(s, warmup_steps=warmup)
    return cfg.replace(train=train, optimizer=dataclasses.replace(cfg.optimizer, schedule=schedule))


def _check_finite(cfg: RunConfig, model: ModelLimits) -> None:
    """nan passes every range check below (nan < 0 is False) and inf most of them, so refuse both first."""
    for path, value, default in _float_fields(cfg):
        if not math.isfinite(value):
            raise ConfigError(f"{path}={value} must be a finite number; e.g. the default {path}={default}")


def _float_fields(obj: object, prefix: str = "") -> Iterator[tuple[str, float, object]]:
    """(dotted path, value, default) of every float in a config dataclass, tuple entries included."""
    for f in dataclasses.fields(obj):
        value, path = getattr(obj, f.name), prefix + f.name
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(value):
            yield from _float_fields(value, path + ".")
        elif isinstance(value, float):
            yield path, value, default
        elif isinstance(value, tuple):
            defaults = default if isinstance(default, tuple) and len(default) == len(value) else [None] * len(value)
            for i, (v, d) in enumerate(zip(value, defaults)):
                if isinstance(v, float):
                    yield f"{path}[{i}]", v, d


SEED_MAX = 2**32 - 1
"""megatron-core seeds its dataset shuffles with numpy.random.RandomState, which takes 32-bit seeds."""


def _check_run(cfg: RunConfig, model: ModelLimits) -> None:
    if not 0 <= cfg.seed <= SEED_MAX:
        raise ConfigError(f"seed={cfg.seed} must be in [0, {SEED_MAX}] (the data order is seeded by numpy, which "
                          "takes 32-bit seeds); e.g. seed=1234")

    if not cfg.out_dir.strip():
        raise ConfigError(f"out_dir={cfg.out_dir!r} is empty; give a directory, or leave the default "
                          "(hydra's run directory)")
