"""The size of one checkpoint of a run, by part, from the model's shapes and the optimizer's state on meta tensors
(nothing allocated): what the keys of state.py hold, summed over the whole model, each tensor once (DCP writes a
replicated or tied tensor once, a sharded one piece by piece).

    weights/0       x_t at full precision: the fp32 masters under bf16, the weights themselves under fp32
    weights/<age>   the older versions the schedule holds (2BW: x_{t-1}), in the compute dtype
    ef/, gef/       Error Feedback's u_{t-1} and gradient-level EF's g_{t-1}, fp32, only when their lambda is on
    optim/          the optimizer's state after a step (Muon's momentum, AdamW's two moments and step)
    balancing/      the aux-loss-free routers' bias, one per held version

tests/unit/test_checkpoint_size.py checks the total against the tensors of a checkpoint a run wrote."""

from __future__ import annotations

from dataclasses import dataclass

from asyncpp.config import RunConfig
from asyncpp.core.balancing import balanced_routers
from asyncpp.core.masters import MASTER_DTYPE, compute_dtype_of
from asyncpp.core.memory import optimizer_state_bytes
from asyncpp.optim import build_from_config
from asyncpp.schedules.registry import kind_of
from model_zoo import ModelConfig, build_model


@dataclass(frozen=True)
class CheckpointSize:
    """Bytes of one checkpoint's tensors, by part (the files add DCP's index and the manifest: kilobytes)."""

    newest: int
    older: int
    error_feedback: int
    optimizer: int
    router_bias: int
    versions: int
    params: int

    @property
    def total(self) -> int:
        return self.newest + self.older + self.error_feedback + self.optimizer + self.router_bias


def checkpoint_size(cfg: RunConfig, model_cfg: ModelConfig) -> CheckpointSize:
    """One checkpoint of this run (every stage's and rank's share together)."""
    model = build_model(model_cfg, device="meta")  # shapes only; a tied weight is one Parameter
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    pp = cfg.parallel.pp
    versions = max(kind_of(cfg.schedule.name).num_buffers(s, pp, weight_prediction=cfg.staleness.weight_prediction)
                   for s in range(pp))
    compute = compute_dtype_of(cfg.train.precision)
    buffers = bool(cfg.staleness.ef_lambda) + bool(cfg.staleness.grad_ef_lambda)
    state, _ = optimizer_state_bytes(build_from_config(model, cfg.optimizer))
    bias = sum(m.expert_bias.numel() * m.expert_bias.element_size() for m in balanced_routers(model).values())
    return CheckpointSize(newest=numel * MASTER_DTYPE.itemsize, older=numel * compute.itemsize * (versions - 1),
                          error_feedback=numel * MASTER_DTYPE.itemsize * buffers, optimizer=state,
                          router_bias=bias * versions, versions=versions, params=numel)
