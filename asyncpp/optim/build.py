"""Build the base optimizer behind one object: a matrix optimizer (Muon, NorMuon, SOAP) for hidden
matrices and AdamW for the rest, or one elementwise optimizer (AdamW, Lion, Signum, AdEMAMix, MARS)
for everything.

The split follows the Muon literature (Keller Jordan; Moonlight): Muon orthogonalises the update
of hidden weight matrices; embeddings, the LM head and every vector/scalar parameter keep AdamW.
NorMuon and SOAP use the same split (the asyncpp study compares them on equal terms).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

try:  # private helper; its list follows torch's kernels (cuda, cpu, xpu, mps, ...)
    from torch.optim.optimizer import _get_fused_kernels_supported_devices
except ImportError:  # pragma: no cover - older/newer torch without it

    def _get_fused_kernels_supported_devices() -> list[str]:
        return ["cuda", "cpu"]


from asyncpp.config import OptimizerConfig
from asyncpp.optim.adan import Adan
from asyncpp.optim.ademamix import AdEMAMix
from asyncpp.optim.lion import Lion
from asyncpp.optim.mars import MARS
from asyncpp.optim.muon import TP_MODES, Muon
from asyncpp.optim.normuon import NorMuon
from asyncpp.optim.signum import Signum
from asyncpp.optim.soap import SOAP
from asyncpp.parallel.sharding import ShardingPlan, layout_of

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "MATRIX_OPTIMIZERS",
    "OPTIMIZER_NAMES",
    "OptimizerSet",
    "build_optimizer",
    "is_muon_param",
    "split_params",
]

#: Take split_params' hidden matrices; AdamW takes the rest (embeddings, head, norms, biases).
MATRIX_OPTIMIZERS = ("muon", "normuon", "soap")
#: Elementwise: one optimizer over every parameter.
ELEMENTWISE_OPTIMIZERS = ("adamw", "lion", "signum", "ademamix", "mars", "adan")
OPTIMIZER_NAMES = ("adamw", "muon", "normuon", "soap", "lion", "ademamix", "mars", "signum", "adan")
NamedParams = list[tuple[str, nn.Parameter]]

# Leaf names of stacked expert weights [E, m, n] in our MoE modules (SwiGLU experts).
_EXPERT_LEAF_PREFIXES = ("w_gate", "w_up", "w_down")


def _is_expert_stack(name: str, param: nn.Parameter, owner: nn.Module) -> bool:
    """A 3-D parameter is a stack of E expert matrices if its path says "experts", or if it is a
    w_gate/w_up/w_down leaf of a module whose class or path says MoE/expert. Other 3-D parameters
    (depthwise conv kernels [C, 1, k]) are not matrices and go to AdamW."""
    if param.ndim != 3:
        return False
    if "experts" in name:
        return True
    leaf = name.rsplit(".", 1)[-1]
    owner_kind = type(owner).__name__.lower()
    path = name.lower().split(".")[:-1]
    in_moe = "moe" in owner_kind or "expert" in owner_kind or any("moe" in part for part in path)
    return leaf.startswith(_EXPERT_LEAF_PREFIXES) and in_moe


def is_muon_param(name: str, param: nn.Parameter, owner: nn.Module) -> bool:
    """The split rule. Muon takes hidden matrices:
    - ndim == 2, unless the name contains "embed", "lm_head" or "output_layer" (megatron-core's head) (input
      embedding / output head: their rows are looked up or scored one token at a time, not a dense linear map) or the leaf
      is a bias (a stacked per-expert bias [E, d] is vectors, not a matrix);
    - ndim == 3 stacked MoE expert weights (see _is_expert_stack).
    Everything else (embeddings, head, norm weights, biases, scalars, conv kernels) -> AdamW."""
    lowered = name.lower()
    if any(k in lowered for k in ("embed", "lm_head", "output_layer")) or lowered.rsplit(".", 1)[-1].endswith("bias"):
        return False
    if param.ndim == 2:
        return True
    return _is_expert_stack(name, param, owner)


def split_params(model: nn.Module) -> tuple[NamedParams, NamedParams]:
    """(muon, adamw) lists of (qualified name, parameter), each parameter exactly once.

    Tied weights (the LM head sharing the embedding Parameter) are deduplicated by identity; the
    first name in module order wins, which is the embedding's for our models. Frozen parameters
    (requires_grad=False) belong to no optimizer.
    """
    muon: NamedParams = []
    adamw: NamedParams = []
    seen: set[int] = set()
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for leaf, param in module.named_parameters(recurse=False):
            if id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            name = f"{mod_name}.{leaf}" if mod_name else leaf
            (muon if is_muon_param(name, param, module) else adamw).append((name, param))
    return muon, adamw


class OptimizerSet:
    """Several torch optimizers (e.g. {"muon": Muon, "adamw": AdamW}) acting as one.

    Every param group carries `base_lr` (its lr at construction); set_lr_multiplier(m) sets
    lr = base_lr * m, so the schedule is one number for all groups. `base_lr` lives in the
    param group, hence in state_dict, and survives a resume.
    """

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]) -> None:
        if not optimizers:
            raise ValueError("OptimizerSet needs at least one optimizer (the model has no trainable params?)")
        self.optimizers = dict(optimizers)
        for group in self.param_groups:
            group.setdefault("base_lr", group["lr"])

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def params(self) -> list[nn.Parameter]:
        out, seen = [], set()
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def step(self) -> None:
        for opt in self.optimizers.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def set_lr_multiplier(self, m: float) -> None:
        if not m >= 0.0:
            raise ValueError(f"lr multiplier={m} must be >= 0 (check the lr schedule)")
        for group in self.param_groups:
            group["lr"] = group["base_lr"] * m

    def state_dict(self) -> dict[str, dict[str, Any]]:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        if set(state) != set(self.optimizers):
            raise ValueError(
                f"optimizer state has parts {sorted(state)} but this run has {sorted(self.optimizers)}; "
                "resume with the same optimizer.name and model as the checkpoint"
            )
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state[name])

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers.values())

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{k}={type(v).__name__}({sum(len(g['params']) for g in v.param_groups)} params)"
            for k, v in self.optimizers.items()
        )
        return f"OptimizerSet({parts})"


AnyOptimizer = OptimizerSet | torch.optim.Optimizer
"""What a stage, the simulator and the memory plan step: the run's OptimizerSet, or one torch optimizer (the Megatron
front-end's, a test's)."""


def _adamw_kernel_flags(params: list[nn.Parameter]) -> dict[str, bool]:
    """fused=True when every param is a float tensor on one device type with a fused AdamW
    kernel (cuda, cpu, xpu, ... as torch reports it); otherwise the multi-tensor foreach path."""
    device_types = {p.device.type for p in params}
    fused_ok = (
        len(device_types) == 1
        and device_types <= set(_get_fused_kernels_supported_devices())
        and all(p.is_floating_point() for p in params)
    )
    return {"fused": True} if fused_ok else {"foreach": True}


def _decay_groups(named: NamedParams, weight_decay: float) -> list[dict[str, Any]]:
    # Standard practice: no weight decay on 1-D params (norm gains, biases): decaying a norm gain
    # towards 0 shrinks the layer's output rather than regularising it.
    decay = [p for _, p in named if p.ndim >= 2]
    no_decay = [p for _, p in named if p.ndim < 2]
    return [
        g
        for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ]


def _build_adamw(
    named: NamedParams, *, lr: float, weight_decay: float, betas: tuple[float, float], eps: float
) -> torch.optim.AdamW | None:
    groups = _decay_groups(named, weight_decay)
    if not groups:
        return None
    flags = _adamw_kernel_flags([p for _, p in named])
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **flags)


def _build_elementwise(name: str, named: NamedParams, hp: dict[str, Any]) -> torch.optim.Optimizer | None:
    """One elementwise optimizer over `named` (decay on ndim >= 2 only, as AdamW)."""
    groups = _decay_groups(named, hp["weight_decay"])
    if not groups:
        return None
    lr, betas, eps = hp["lr"], hp["betas"], hp["eps"]
    if name == "adamw":
        return _build_adamw(named, lr=lr, weight_decay=hp["weight_decay"], betas=betas, eps=eps)
    if name == "lion":
        return Lion(groups, lr=lr, betas=betas)
    if name == "signum":
        return Signum(groups, lr=lr, momentum=hp["momentum"])
    if name == "ademamix":
        return AdEMAMix(groups, lr=lr, betas=betas, beta3=hp["beta3"], alpha=hp["alpha"],
                        warmup_steps=hp["ademamix_warmup_steps"], eps=eps)
    if name == "mars":
        return MARS(groups, lr=lr, betas=betas, gamma=hp["gamma"], eps=eps)
    if name == "adan":
        return Adan(groups, lr=lr, betas=(*betas, hp["beta3"]), eps=eps)
    raise ValueError(f"optimizer.name={name!r} is not an elementwise optimizer")


def _matrix_group(named: NamedParams, sharding: ShardingPlan | None) -> dict[str, Any]:
    """The matrix optimizer's param group with each parameter's layout, aligned by position (what
    WeightVersions.retarget preserves when it swaps in the master tensors)."""
    layouts = [layout_of(sharding or {}, name) for name, _ in named]
    return {"params": [p for _, p in named], "tp_dims": [s.tp_dim for s in layouts],
            "experts": [s.expert for s in layouts]}


def _check_blockwise_ok(name: str, group: dict[str, Any], tp_group, tp_mode: str) -> None:
    """NorMuon and SOAP only ever see their local shard: fine as a "block" update, but not silently."""
    tp = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
    split = [p for p, d in zip(group["params"], group["tp_dims"]) if d is not None and d % p.ndim >= p.ndim - 2]
    if tp > 1 and split and tp_mode != "block":
        raise ValueError(
            f"optimizer.name={name!r} updates each TP shard of a matrix on its own ({len(split)} matrices are "
            f"TP-sharded, e.g. one of local shape {tuple(split[0].shape)}), which is optimizer.tp_mode='block'; "
            "set optimizer.tp_mode=block to accept that, or use optimizer.name=muon for the exact 'gather' mode"
        )


def _build_matrix(name: str, named: NamedParams, hp: dict[str, Any], parallel: dict[str, Any]) -> torch.optim.Optimizer:
    common = {"lr": hp["lr"], "weight_decay": hp["weight_decay"]}
    group = _matrix_group(named, parallel["sharding"])
    if name == "muon":
        return Muon([group], momentum=hp["momentum"], nesterov=hp["nesterov"], ns_steps=hp["ns_steps"],
                    adjust_lr=hp["adjust_lr"], compute_dtype=hp["muon_compute_dtype"], tp_mode=parallel["tp_mode"],
                    tp_group=parallel["tp_group"], dp_group=parallel["dp_group"],
                    expert_dp_group=parallel["expert_dp_group"], **common)
    _check_blockwise_ok(name, group, parallel["tp_group"], parallel["tp_mode"])
    params = group["params"]
    if name == "normuon":
        return NorMuon(params, momentum=hp["momentum"], beta2=hp["betas"][1], nesterov=hp["nesterov"],
                       eps=hp["eps"], ns_steps=hp["ns_steps"], compute_dtype=hp["muon_compute_dtype"], **common)
    if name == "soap":
        return SOAP(params, betas=hp["betas"], eps=hp["eps"], precondition_frequency=hp["precondition_frequency"],
                    **common)
    raise ValueError(f"optimizer.name={name!r} is not a matrix optimizer")


def build_optimizer(
    model: nn.Module,
    *,
    sharding: ShardingPlan | None = None,
    tp_group: torch.distributed.ProcessGroup | None = None,
    dp_group: torch.distributed.ProcessGroup | None = None,
    expert_dp_group: torch.distributed.ProcessGroup | None = None,
    **hyperparameters,
) -> OptimizerSet:
    """build_from_config with the hyperparameters by keyword (`name`, `lr`, `weight_decay`, ...): their names and
    defaults have one home, asyncpp.config.OptimizerConfig, so an unknown one is a TypeError here too."""
    return build_from_config(model, OptimizerConfig(**hyperparameters), sharding=sharding, tp_group=tp_group,
                             dp_group=dp_group, expert_dp_group=expert_dp_group)


def build_from_config(
    model: nn.Module,
    cfg: OptimizerConfig,
    *,
    sharding: ShardingPlan | None = None,
    tp_group: torch.distributed.ProcessGroup | None = None,
    dp_group: torch.distributed.ProcessGroup | None = None,
    expert_dp_group: torch.distributed.ProcessGroup | None = None,
) -> OptimizerSet:
    """The optimizer of `cfg` (asyncpp.config.OptimizerConfig) for `model`. Elementwise optimizers (adamw, lion, signum, ademamix, mars, adan) take every parameter; adamw_lr is
    ignored. Matrix optimizers (muon, normuon, soap) take split_params' hidden matrices and AdamW takes
    the rest (lr = adamw_lr or lr). Hyperparameters each one reads:
    - adamw: lr, betas, eps, weight_decay
    - lion: lr, betas (beta1 interpolation, beta2 momentum), weight_decay
    - signum: lr, momentum, weight_decay
    - ademamix: lr, betas, beta3 (slow EMA), alpha, ademamix_warmup_steps (alpha/beta3 warmup), eps
    - mars: lr, betas, gamma, eps
    - adan: lr, betas (gradient EMA, difference EMA), beta3 (second moment), eps
    - muon: lr, momentum, nesterov, ns_steps, adjust_lr, muon_compute_dtype (None = the params' dtype)
    - normuon: lr, momentum (beta1), betas[1] (per-neuron beta2), nesterov, ns_steps, eps
    - soap: lr, betas, eps, precondition_frequency
    Weight decay is decoupled (x <- x * (1 - lr * wd)) and skips 1-D parameters.

    Layout (the matrix optimizers; elementwise ones need none): `sharding` maps the names
    split_params(model) reports to their ParamSharding (absent: replicated); Muon then gathers
    TP-sharded matrices over `tp_group` (tp_mode="gather", exact) or orthogonalises each shard
    ("block"), and shares its Newton-Schulz work over `dp_group` (dense matrices) and
    `expert_dp_group` (expert stacks; None: each rank its own). See docs/muon.md. NorMuon and SOAP
    refuse TP-sharded matrices unless tp_mode="block" (they only ever see the local shard)."""
    name, tp_mode = cfg.name, cfg.tp_mode
    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"optimizer.name={name!r} is not one of {OPTIMIZER_NAMES}")
    if tp_mode not in TP_MODES:
        raise ValueError(f"optimizer.tp_mode={tp_mode!r} is not one of {TP_MODES}")
    hp = {**dataclasses.asdict(cfg), "betas": tuple(cfg.betas)}
    matrix_named, other_named = split_params(model)
    optimizers: dict[str, torch.optim.Optimizer | None] = {}
    if name not in MATRIX_OPTIMIZERS:
        optimizers[name] = _build_elementwise(name, matrix_named + other_named, hp)
    else:
        if matrix_named:
            parallel = {"sharding": sharding, "tp_group": tp_group, "dp_group": dp_group,
                        "expert_dp_group": expert_dp_group, "tp_mode": tp_mode}
            optimizers[name] = _build_matrix(name, matrix_named, hp, parallel)
        optimizers["adamw"] = _build_adamw(
            other_named, lr=cfg.adamw_lr if cfg.adamw_lr is not None else cfg.lr, weight_decay=cfg.weight_decay,
            betas=hp["betas"], eps=cfg.eps)
    return OptimizerSet({k: v for k, v in optimizers.items() if v is not None})

