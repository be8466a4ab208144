"""Typed run configuration, validated once, before any process group or model exists.

The hydra tree under configs/ composes into a plain dict; `RunConfig.from_dict` turns it into these
dataclasses (unknown keys and wrong types are rejected there) and `validate` checks the cross-field
rules. Every error names the field, the value and the fix. Library code never sees a DictConfig.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional, Protocol

from asyncpp.typed import ConfigError, from_dict, to_dict

ScheduleName = Literal["sync", "gpipe", "1f1b", "2bw", "pipedream"]
#: Schedules whose mathematics is synchronous training (they differ only in how a pipeline orders work).
SYNC_SCHEDULES = ("sync", "gpipe", "1f1b")


class ModelLimits(Protocol):
    """What validation needs to know about the model (model_zoo.ModelConfig satisfies it)."""

    name: str
    num_layers: int
    max_seq_len: int
    vocab_size: int


@dataclass(kw_only=True)
class ModelSection:
    name: str = "tiny_hybrid"
    """A name from model_zoo.MODEL_NAMES."""


@dataclass(kw_only=True)
class ParallelConfig:
    pp: int = 1
    """Pipeline stages. In a single process this is the number of stages the simulator models."""
    tp: int = 1
    ep: int = 1
    dp: Optional[int] = None
    """Data-parallel replicas; None = world_size / (pp * tp) under torchrun, 1 in one process.
    In one process, dp > 1 simulates the replicas (m * dp microbatches per step)."""
    stage_layers: Optional[tuple[int, ...]] = None
    """Layers per pipeline stage, e.g. [3, 1] (None = even split). The last stage also runs the LM
    head and the loss, so giving it fewer layers balances small-vocabulary-heavy models."""


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 300
    micro_batch_size: int = 8
    num_microbatches: int = 4
    seq_len: int = 128
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables clipping (the norm is still logged)."""
    eval_every: int = 50
    eval_batches: int = 8
    max_consecutive_skips: int = 5
    """Abort after this many consecutive steps with a non-finite gradient."""
    device: str = "cpu"
    """torch device type ("cpu", "cuda"); under torchrun each rank takes cuda:LOCAL_RANK."""
    timeout_s: float = 300.0
    """How long a pipeline rank waits for a neighbour or a collective before failing with an error
    that names its stage and what it was waiting for (a dead rank must not hang the others)."""


@dataclass(kw_only=True)
class LRScheduleConfig:
    kind: Literal["constant", "cosine", "wsd"] = "cosine"
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2
    """WSD only: the final fraction of steps over which the LR decays."""


@dataclass(kw_only=True)
class OptimizerConfig:
    name: Literal["adamw", "muon"] = "muon"
    lr: float = 0.01
    adamw_lr: Optional[float] = None
    """LR of the AdamW part of Muon runs (embeddings, head, norms); None = same as lr."""
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    adjust_lr: Literal["original", "match_rms_adamw"] = "match_rms_adamw"
    schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)


@dataclass(kw_only=True)
class ScheduleConfig:
    name: ScheduleName = "2bw"


@dataclass(kw_only=True)
class StalenessConfig:
    ef_lambda: float = 0.0
    """Update-level Error Feedback coefficient; 0 turns it off (bit-identical to plain delay)."""
    sync_start_steps: int = 0
    sync_cooldown_steps: int = 0


@dataclass(kw_only=True)
class DataConfig:
    name: Literal["default"] = "default"
    """'default' is the embedded CPython-docs corpus (no network needed)."""
    val_fraction: float = 0.02
    cache_dir: Optional[str] = None


@dataclass(kw_only=True)
class LoggingConfig:
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "asyncpp"
    run_name: Optional[str] = None
    log_every: int = 10
    progress: bool = True


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
    seed: int = 1234
    out_dir: str = "outputs/run"

    @classmethod
    def from_dict(cls, data: dict) -> "RunConfig":
        return from_dict(cls, data)

    def to_dict(self) -> dict:
        return to_dict(self)

    def replace(self, **sections) -> "RunConfig":
        return dataclasses.replace(self, **sections)

    def validate(self, model: ModelLimits) -> "RunConfig":
        """Cross-field checks. Raises ConfigError naming the field, the value and the fix."""
        for check in (_check_train, _check_parallel, _check_optimizer, _check_staleness, _check_logging):
            check(self, model)
        return self


def _positive(path: str, value: float, fix: str = "") -> None:
    if value < 1:
        raise ConfigError(f"{path}={value} must be >= 1{'; ' + fix if fix else ''}")


def _check_train(cfg: RunConfig, model: ModelLimits) -> None:
    t = cfg.train
    _positive("train.steps", t.steps)
    _positive("train.micro_batch_size", t.micro_batch_size)
    _positive("train.num_microbatches", t.num_microbatches, "it is the number of microbatches per step (m)")
    _positive("train.seq_len", t.seq_len)
    _positive("train.eval_batches", t.eval_batches)
    _positive("train.max_consecutive_skips", t.max_consecutive_skips)
    if t.seq_len > model.max_seq_len:
        raise ConfigError(
            f"train.seq_len={t.seq_len} is above the maximum sequence length {model.max_seq_len} of "
            f"model '{model.name}'; set train.seq_len<={model.max_seq_len}"
        )
    if t.timeout_s <= 0:
        raise ConfigError(f"train.timeout_s={t.timeout_s} must be > 0 (seconds)")
    if t.grad_clip < 0:
        raise ConfigError(f"train.grad_clip={t.grad_clip} must be >= 0 (0 disables clipping)")
    if t.eval_every < 0:
        raise ConfigError(f"train.eval_every={t.eval_every} must be >= 0 (0 disables evaluation)")


def _check_parallel(cfg: RunConfig, model: ModelLimits) -> None:
    p, m = cfg.parallel, cfg.train.num_microbatches
    for name in ("pp", "tp", "ep"):
        _positive(f"parallel.{name}", getattr(p, name))
    if p.dp is not None:
        _positive("parallel.dp", p.dp, "or leave it null to derive it from the world size")
    if cfg.schedule.name == "pipedream" and p.pp < 2:
        raise ConfigError(
            f"schedule=pipedream with parallel.pp={p.pp}: its per-stage delays P-1-s depend on the number of "
            "stages, so say how many it models, e.g. parallel.pp=4 (one process simulates them)"
        )
    if p.stage_layers is not None and (
        len(p.stage_layers) != p.pp or sum(p.stage_layers) != model.num_layers or min(p.stage_layers) < 0
    ):
        raise ConfigError(
            f"parallel.stage_layers={list(p.stage_layers)} must have parallel.pp={p.pp} non-negative entries "
            f"summing to the {model.num_layers} layers of model '{model.name}'"
        )
    if p.stage_layers is None and p.pp > model.num_layers:
        raise ConfigError(
            f"parallel.pp={p.pp} is more stages than model '{model.name}' has layers ({model.num_layers}); "
            f"set parallel.pp<={model.num_layers}"
        )
    if p.stage_layers is None and model.num_layers % p.pp:
        raise ConfigError(
            f"model '{model.name}' has {model.num_layers} layers, which parallel.pp={p.pp} stages cannot share "
            f"evenly; give an explicit split, e.g. parallel.stage_layers={_example_split(model.num_layers, p.pp)}"
        )
    if cfg.schedule.name in ("2bw", "pipedream", "1f1b") and m < p.pp:
        raise ConfigError(
            f"schedule={cfg.schedule.name} needs train.num_microbatches >= parallel.pp, got "
            f"train.num_microbatches={m} < parallel.pp={p.pp}: 2BW keeps only two weight versions, which "
            f"covers the in-flight microbatches only when m >= P; raise train.num_microbatches to {p.pp}"
        )


def _example_split(num_layers: int, pp: int) -> list[int]:
    base, extra = divmod(num_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def _check_optimizer(cfg: RunConfig, model: ModelLimits) -> None:
    o = cfg.optimizer
    if o.lr <= 0:
        raise ConfigError(f"optimizer.lr={o.lr} must be > 0")
    if o.adamw_lr is not None and o.adamw_lr <= 0:
        raise ConfigError(f"optimizer.adamw_lr={o.adamw_lr} must be > 0 (or null to reuse optimizer.lr)")
    if o.weight_decay < 0:
        raise ConfigError(f"optimizer.weight_decay={o.weight_decay} must be >= 0")
    for i, b in enumerate(o.betas):
        if not 0.0 <= b < 1.0:
            raise ConfigError(f"optimizer.betas[{i}]={b} must be in [0, 1)")
    if not 0.0 <= o.momentum < 1.0:
        raise ConfigError(f"optimizer.momentum={o.momentum} must be in [0, 1)")
    _positive("optimizer.ns_steps", o.ns_steps)
    s = o.schedule
    if not 0 <= s.warmup_steps <= cfg.train.steps:
        raise ConfigError(
            f"optimizer.schedule.warmup_steps={s.warmup_steps} must be in [0, train.steps={cfg.train.steps}]"
        )
    if not 0.0 <= s.min_lr_ratio <= 1.0:
        raise ConfigError(f"optimizer.schedule.min_lr_ratio={s.min_lr_ratio} must be in [0, 1]")
    if not 0.0 < s.decay_fraction <= 1.0:
        raise ConfigError(f"optimizer.schedule.decay_fraction={s.decay_fraction} must be in (0, 1]")


def _check_staleness(cfg: RunConfig, model: ModelLimits) -> None:
    s, sched = cfg.staleness, cfg.schedule.name
    if s.ef_lambda < 0:
        raise ConfigError(
            f"staleness.ef_lambda={s.ef_lambda} must be >= 0 (0 turns Error Feedback off; the paper uses 1)"
        )
    for name in ("sync_start_steps", "sync_cooldown_steps"):
        if getattr(s, name) < 0:
            raise ConfigError(f"staleness.{name}={getattr(s, name)} must be >= 0")
    if s.sync_start_steps + s.sync_cooldown_steps > cfg.train.steps:
        raise ConfigError(
            f"staleness.sync_start_steps={s.sync_start_steps} + staleness.sync_cooldown_steps="
            f"{s.sync_cooldown_steps} exceed train.steps={cfg.train.steps}; shorten them"
        )
    delayed_only = s.ef_lambda > 0 or s.sync_start_steps > 0 or s.sync_cooldown_steps > 0
    if sched in SYNC_SCHEDULES and delayed_only:
        raise ConfigError(
            f"staleness options (ef_lambda={s.ef_lambda}, sync_start_steps={s.sync_start_steps}, "
            f"sync_cooldown_steps={s.sync_cooldown_steps}) only apply to delayed schedules, but "
            f"schedule={sched}; use schedule=2bw or schedule=pipedream, or set them to 0"
        )


def _check_logging(cfg: RunConfig, model: ModelLimits) -> None:
    _positive("logging.log_every", cfg.logging.log_every)


__all__ = [
    "ConfigError",
    "DataConfig",
    "LRScheduleConfig",
    "LoggingConfig",
    "ModelLimits",
    "ModelSection",
    "OptimizerConfig",
    "ParallelConfig",
    "RunConfig",
    "SYNC_SCHEDULES",
    "ScheduleConfig",
    "StalenessConfig",
    "TrainConfig",
]
