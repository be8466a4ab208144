"""optimizer.*: the optimizer's hyperparameters with their defaults (asyncpp.optim.build reads them from here)
and the LR schedule, with their checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from asyncpp.config.base import ModelLimits, positive
from asyncpp.typed import ConfigError

if TYPE_CHECKING:  # annotations only: run.py imports this module
    from asyncpp.config.run import RunConfig


@dataclass(kw_only=True)
class LRScheduleConfig:
    kind: Literal["constant", "cosine", "wsd"] = "cosine"
    warmup_steps: int | None = None
    """Linear warmup steps; None = round(warmup_fraction x train.steps), so any train.steps fits."""
    warmup_fraction: float = 0.1
    """The warmup's share of the run when warmup_steps is None (the paper's recipe: 10%)."""
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2
    """WSD only: the final fraction of steps over which the LR decays."""

    def warmup_for(self, total_steps: int) -> int:
        """The warmup in steps for a run of `total_steps` (the one place the fraction is turned into steps)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return round(self.warmup_fraction * total_steps)


@dataclass(kw_only=True)
class OptimizerConfig:
    name: Literal["adamw", "muon", "normuon", "soap", "lion", "ademamix", "mars", "signum", "adan"] = "muon"
    """muon/normuon/soap take the hidden matrices (AdamW the rest); the others take every parameter."""
    lr: float = 0.01
    adamw_lr: float | None = None
    """LR of the AdamW part of Muon runs (embeddings, head, norms); None = same as lr."""
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    adjust_lr: Literal["original", "match_rms_adamw"] = "match_rms_adamw"
    muon_compute_dtype: Literal["float32", "bfloat16"] | None = None
    """Muon/NorMuon Newton-Schulz dtype; null = the parameters' (fp32). bfloat16 is torch.optim.Muon's choice
    and ~5x faster on GPUs and AVX512-BF16 CPUs; momentum, weights and the update stay fp32."""
    tp_mode: Literal["gather", "block"] = "gather"
    """Muon on TP-sharded matrices: 'gather' all-gathers each shard's momentum and orthogonalizes the full
    matrix (exact, one all-gather per step); 'block' orthogonalizes each shard on its own (no communication,
    a different update). NorMuon/SOAP only do 'block'. docs/muon.md has the trade-off."""
    precondition_frequency: int = 10
    """SOAP: refresh the eigenbasis of the Shampoo statistics every this many steps (the paper's f)."""
    beta3: float = 0.9999
    """AdEMAMix: coefficient of the slow gradient EMA. Adan: coefficient of the second moment (its third beta)."""
    alpha: float = 5.0
    """AdEMAMix: weight of the slow EMA in the update's numerator."""
    ademamix_warmup_steps: int = 0
    """AdEMAMix: steps over which alpha and beta3 warm up (the paper: the whole run); 0 = no warmup."""
    gamma: float = 0.025
    """MARS: scale of the variance-reduction term gamma * beta1 / (1 - beta1) * (g_t - g_{t-1})."""
    schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)


def check_optimizer(cfg: RunConfig, model: ModelLimits) -> None:
    o = cfg.optimizer
    if o.lr <= 0:
        raise ConfigError(f"optimizer.lr={o.lr} must be > 0")
    if o.adamw_lr is not None and o.adamw_lr <= 0:
        raise ConfigError(f"optimizer.adamw_lr={o.adamw_lr} must be > 0 (or null to reuse optimizer.lr)")
    if o.weight_decay < 0:
        raise ConfigError(f"optimizer.weight_decay={o.weight_decay} must be >= 0")
    if o.eps <= 0:
        raise ConfigError(f"optimizer.eps={o.eps} must be > 0 (it keeps AdamW's denominator away from 0); "
                          "e.g. optimizer.eps=1e-8")
    for i, b in enumerate(o.betas):
        if not 0.0 <= b < 1.0:
            raise ConfigError(f"optimizer.betas[{i}]={b} must be in [0, 1)")
    if not 0.0 <= o.momentum < 1.0:
        raise ConfigError(f"optimizer.momentum={o.momentum} must be in [0, 1)")
    positive("optimizer.ns_steps", o.ns_steps)
    if o.name in ("normuon", "soap") and cfg.parallel.tp > 1 and o.tp_mode != "block":
        raise ConfigError(f"optimizer.name={o.name} with parallel.tp={cfg.parallel.tp} updates each TP shard of a "
                          "matrix on its own; set optimizer.tp_mode=block to accept that, or use optimizer.name=muon")
    _check_optimizer_extras(o)
    _check_unused_options(o)
    s = o.schedule
    if not 0 <= s.warmup_steps <= cfg.train.steps:
        raise ConfigError(
            f"optimizer.schedule.warmup_steps={s.warmup_steps} must be in [0, train.steps={cfg.train.steps}]; "
            f"lower it, or set optimizer.schedule.warmup_steps=null to warm up for optimizer.schedule."
            f"warmup_fraction={s.warmup_fraction} of the run"
        )
    if not 0.0 <= s.min_lr_ratio <= 1.0:
        raise ConfigError(f"optimizer.schedule.min_lr_ratio={s.min_lr_ratio} must be in [0, 1]")
    if not 0.0 < s.decay_fraction <= 1.0:
        raise ConfigError(f"optimizer.schedule.decay_fraction={s.decay_fraction} must be in (0, 1]")


#: The optimizer fields that only some optimizers read (every configs/optimizer/*.yaml lists them all at their
#: defaults, so a sweep can switch optimizer=...). Muon, NorMuon and SOAP run AdamW on the rest of the model.
OPTIMIZER_FIELD_USERS = {
    "adamw_lr": ("muon", "normuon", "soap"),
    "betas": ("adamw", "muon", "normuon", "soap", "lion", "ademamix", "mars", "adan"),
    "eps": ("adamw", "muon", "normuon", "soap", "ademamix", "mars", "adan"),
    "momentum": ("muon", "normuon", "signum"),
    "nesterov": ("muon", "normuon"),
    "ns_steps": ("muon", "normuon"),
    "adjust_lr": ("muon",),
    "muon_compute_dtype": ("muon", "normuon"),
    "tp_mode": ("muon", "normuon", "soap"),
    "precondition_frequency": ("soap",),
    "beta3": ("ademamix", "adan"),
    "alpha": ("ademamix",),
    "ademamix_warmup_steps": ("ademamix",),
    "gamma": ("mars",),
}


def _check_unused_options(o: OptimizerConfig) -> None:
    """An option changed from its default for an optimizer that never reads it is a mistake (a sweep that meant
    another optimizer, a Muon setting left on an AdamW run): refused rather than silently ignored."""
    defaults = OptimizerConfig()
    for name, users in OPTIMIZER_FIELD_USERS.items():
        value = getattr(o, name)
        if o.name not in users and value != getattr(defaults, name):
            raise ConfigError(
                f"optimizer.{name}={value!r} is not read by optimizer.name={o.name} (only by {', '.join(users)}); "
                f"drop it (its default is {getattr(defaults, name)!r}), or choose one of those optimizers")


def _check_optimizer_extras(o: OptimizerConfig) -> None:
    """The fields only some optimizers read (SOAP, AdEMAMix, MARS, Adan)."""
    positive("optimizer.precondition_frequency", o.precondition_frequency, "SOAP refreshes its eigenbasis every "
              "this many steps; the paper uses optimizer.precondition_frequency=10")
    if not 0.0 <= o.beta3 < 1.0:
        raise ConfigError(f"optimizer.beta3={o.beta3} must be in [0, 1) (AdEMAMix's slow EMA, Adan's second "
                          "moment; e.g. optimizer.beta3=0.999)")
    if o.alpha < 0:
        raise ConfigError(f"optimizer.alpha={o.alpha} must be >= 0 (AdEMAMix's slow-EMA weight; e.g. optimizer.alpha=5)")
    if o.ademamix_warmup_steps < 0:
        raise ConfigError(
            f"optimizer.ademamix_warmup_steps={o.ademamix_warmup_steps} must be >= 0 (0 = no alpha/beta3 warmup; "
            "the paper warms up over the whole run, optimizer.ademamix_warmup_steps=${train.steps})"
        )
    if not 0.0 <= o.gamma <= 1.0:
        raise ConfigError(f"optimizer.gamma={o.gamma} must be in [0, 1] (MARS's variance-reduction scale; "
                          "the paper uses optimizer.gamma=0.025)")
