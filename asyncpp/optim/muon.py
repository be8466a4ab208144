"""Muon with batched (stacked) Newton-Schulz, sharded over data parallelism and aware of TP shards.

The mathematics is exactly `torch.optim.Muon` (torch/optim/_muon.py), per matrix:

    buf <- lerp(buf, g, 1 - momentum)              # buf = momentum*buf + (1-momentum)*g (an EMA)
    u   <- lerp(g, buf, momentum) if nesterov else buf
    o   <- NS_k(u)                                 # quintic Newton-Schulz, Frobenius-normalised
    p   <- p * (1 - lr * weight_decay)             # decoupled decay with the *unadjusted* lr, first
    p   <- p - adjust(lr, shape) * o               # then the update with the shape-adjusted lr

What differs is the execution (asyncpp/optim/muon_sharded.py):
- batching: matrices of one shape share NS calls on [K, m, n] stacks (whole buckets on accelerators,
  cache-sized chunks on CPU, where the Nesterov lerp and the final add run chunk by chunk too); a 3-D
  parameter [E, m, n] (stacked MoE experts) is E matrices (NS and the LR adjustment act on the last
  two dims);
- DP sharding (`dp_group`: ranks holding identical parameters and reduced gradients): each rank
  orthogonalises a cost-balanced share of the matrices and all-gathers the results, overlapped with
  the next bucket's NS; every rank then applies the same update. Expert stacks use
  `expert_dp_group` instead (the ranks holding the same experts; None: each rank does its own).
  The result equals single-process Muon bit for bit on CPU (tests/dist/test_muon_distributed.py):
  the same kernels see the same matrices, only grouped into batches differently;
- TP shards (`tp_group` and per-parameter `tp_dims`), `tp_mode`:
  "gather" (default, exact): all-gather the momentum-updated shards along tp_dim, orthogonalise the
      full matrix (on one DP rank), keep this rank's slice; the shape-aware LR uses the full shape.
      Costs one all-gather of the owned matrices per step and NS on full matrices.
  "block" (approximate): orthogonalise each local shard as if it were the whole matrix, LR from
      the shard's shape; no communication, but a different update (the orthogonal factor of a
      block is not the block of the orthogonal factor): Muon of a block-diagonal reparametrisation.
  A tp_dim on a batch dim (e.g. dim 0 of an expert stack) shards whole matrices: nothing to gather.

State is per parameter (`momentum_buffer`, shaped like the parameter, so sharded like it) exactly as
in torch; state_dicts are interchangeable in layout and a resumed run continues bit-identically.

Per-parameter layout lives in the param group, aligned by position with group["params"]:
group["tp_dims"][i] (int or None) and group["experts"][i] (bool). WeightVersions.retarget replaces
group["params"] by master tensors in the same order, so the alignment survives it; nothing is stored
on the tensors. load_state_dict keeps this run's layout (a checkpoint may come from another layout).

Numerics: torch's Muon always runs NS in bf16. Ours runs it in `compute_dtype` (default: the
parameter's dtype, i.e. fp32 on CPU); with compute_dtype=torch.bfloat16 it reproduces
torch.optim.Muon bit for bit on CPU (tests/unit/test_muon.py), because every op (cast, transpose,
norm, clamp, the two fused multiply-adds per iteration, cast back) is the same op in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from asyncpp.optim.common import check_lr_wd, check_matrix_params
from asyncpp.optim.muon_sharded import MatrixJob, orthogonalize_sharded
from asyncpp.optim.orthogonal import (
    NS_COEFFICIENTS,
    MatrixOptimizer,
    Workspace,
    chunk_matrices,
    compute_dtype_name,
    newton_schulz,
    orthogonalize,
)

__all__ = ["ADJUST_LR_CHOICES", "LAYOUT_KEYS", "TP_MODES", "Muon", "adjusted_lr", "newton_schulz"]

ADJUST_LR_CHOICES = ("original", "match_rms_adamw")
TP_MODES = ("gather", "block")
#: Param-group keys holding per-parameter layout, aligned by position with group["params"].
LAYOUT_KEYS = ("tp_dims", "experts")


def adjusted_lr(lr: float, adjust_lr: str, shape: torch.Size | tuple[int, ...]) -> float:
    """Shape-aware LR of a [..., A, B] matrix (A = fan-out, B = fan-in), as torch.optim.Muon.

    "original" (Keller): lr * sqrt(max(1, A/B)). "match_rms_adamw" (Moonlight): lr * 0.2 *
    sqrt(max(A, B)), which gives the update the RMS of an AdamW update so AdamW's lr and weight
    decay can be reused.
    """
    A, B = shape[-2], shape[-1]
    if adjust_lr == "original":
        return lr * math.sqrt(max(1, A / B))
    if adjust_lr == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(A, B))
    raise ValueError(f"adjust_lr={adjust_lr!r} is not one of {ADJUST_LR_CHOICES}")


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _layout(params: list[Tensor], group: dict[str, Any]) -> tuple[list[int | None], list[bool]]:
    """Validated (tp_dims, experts) of a param group, one entry per parameter (defaults: replicated)."""
    n = len(params)
    tp_dims = list(group.get("tp_dims") or [None] * n)
    experts = [bool(e) for e in (group.get("experts") or [False] * n)]
    for key, values in (("tp_dims", tp_dims), ("experts", experts)):
        if len(values) != n:
            raise ValueError(
                f"Muon param group {key!r} has {len(values)} entries but 'params' has {n}; give one per "
                "parameter, in the same order (tp_dims: None = not TP-sharded; experts: False = dense)"
            )
    for i, (p, d) in enumerate(zip(params, tp_dims)):
        if d is None:
            continue
        if not isinstance(d, int) or not -p.ndim <= d < p.ndim:
            raise ValueError(
                f"Muon param group tp_dims[{i}]={d!r} is not a dim of the parameter of shape {tuple(p.shape)}; "
                f"use an int in [{-p.ndim}, {p.ndim}) or None"
            )
        tp_dims[i] = d % p.ndim
    return tp_dims, experts


class Muon(MatrixOptimizer):
    """Muon for matrices (ndim >= 2; leading dims are a batch of matrices), batched by shape, sharded
    over `dp_group` and aware of TP shards (see the module docstring for `tp_mode`).

    Defaults and semantics are those of torch.optim.Muon (lr 1e-3, weight_decay 0.1, momentum
    0.95, nesterov, 5 NS steps, eps 1e-7, adjust_lr "original"); `compute_dtype` picks the NS
    dtype (None = the parameter's dtype; torch.bfloat16 is the GPU fast path and torch's choice).
    `bucket_numel` caps the matrices gathered together and, on accelerators, orthogonalised in one
    call (elements; None: 2**20 on CPU, 2**24 on accelerators): smaller buckets overlap more
    communication with NS and bound the step's transient memory, larger ones batch more. Process groups live on the
    optimizer, not in param groups, so state_dicts hold only plain values.

    Every rank of `dp_group` / `expert_dp_group` / `tp_group` must step the same parameters (same
    p.grad is None pattern) in the same order, or the ranks issue different collectives and hang.
    """

    name = "Muon"

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr: str = "original",
        compute_dtype: torch.dtype | str | None = None,
        *,
        tp_mode: str = "gather",
        tp_group: dist.ProcessGroup | None = None,
        dp_group: dist.ProcessGroup | None = None,
        expert_dp_group: dist.ProcessGroup | None = None,
        bucket_numel: int | None = None,
    ) -> None:
        check_lr_wd("Muon", lr, weight_decay)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon momentum={momentum} must be in [0, 1)")
        if adjust_lr not in ADJUST_LR_CHOICES:
            raise ValueError(f"Muon adjust_lr={adjust_lr!r} is not one of {ADJUST_LR_CHOICES}")
        if not 0 <= ns_steps < 100:
            raise ValueError(f"Muon ns_steps={ns_steps} must be in [0, 100)")
        if tp_mode not in TP_MODES:
            raise ValueError(f"Muon tp_mode={tp_mode!r} is not one of {TP_MODES} (optimizer.tp_mode)")
        if bucket_numel is not None and bucket_numel < 1:
            raise ValueError(f"Muon bucket_numel={bucket_numel} must be >= 1 (elements per gather) or None")
        self.tp_mode, self.bucket_numel = tp_mode, bucket_numel
        self.tp_group, self.dp_group, self.expert_dp_group = tp_group, dp_group, expert_dp_group
        self._workspace = Workspace()  # CPU scratch; not state (never saved, rebuilt on demand)
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr": adjust_lr,
            "compute_dtype": compute_dtype_name(compute_dtype),
        }
        super().__init__(params, defaults)

    # torch.optim.Optimizer pickles/deep-copies only defaults, state and param_groups; the layout below
    # must survive a copy too (the simulator's fresh-update diagnostics step a deep copy). Process
    # groups cannot be copied: the copy shares them, as it shares the parameters' layout.
    _LAYOUT = ("tp_mode", "bucket_numel", "tp_group", "dp_group", "expert_dp_group")

    def __deepcopy__(self, memo: dict) -> Muon:
        import copy

        clone = Muon.__new__(Muon)
        clone.__setstate__(copy.deepcopy(super().__getstate__(), memo))
        for name in self._LAYOUT:
            setattr(clone, name, getattr(self, name))
        clone._workspace = Workspace()
        return clone

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        param_group["params"] = check_matrix_params(self.name, param_group["params"])
        for p in param_group["params"]:
            if not p.is_contiguous():  # the update is added through a [K, m, n] view of the parameter
                raise ValueError(f"Muon needs contiguous parameters; got shape {tuple(p.shape)} with strides "
                                 f"{p.stride()}: pass p.data.contiguous() (or the parameter before transposing it)")
        param_group["tp_dims"], param_group["experts"] = _layout(param_group["params"], param_group)
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch replaces each param group by the saved one; the layout belongs to this run, not the
        # checkpoint (which may predate the keys or come from another TP layout): keep ours.
        layouts = [{k: g[k] for k in LAYOUT_KEYS} for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, layout in zip(self.param_groups, layouts):
            group.update(layout)

    def _job(self, x: Tensor, tp_dim: int | None, expert: bool) -> MatrixJob:
        """What NS sees for update x: the full matrix if its TP shard is gathered, else x itself."""
        shape = list(x.shape)
        tp = _group_size(self.tp_group)
        if self.tp_mode == "gather" and tp > 1 and tp_dim is not None and tp_dim >= x.ndim - 2:
            shape[tp_dim] *= tp
            return MatrixJob(tuple(shape), x.dtype, gather_dim=tp_dim - x.ndim, expert=expert)
        return MatrixJob(tuple(shape), x.dtype, expert=expert)

    def _step_group(self, params: list[Tensor], group: dict[str, Any]) -> None:
        position = {id(p): i for i, p in enumerate(group["params"])}
        where = [position[id(p)] for p in params]
        # Contiguous, so the momentum step can run through [K, m, n] views one chunk at a time.
        bufs = self._momentum_buffers(params, torch.contiguous_format)
        jobs = [self._job(b, group["tp_dims"][i], group["experts"][i]) for b, i in zip(bufs, where)]
        dtype = self.compute_dtype(group)
        device = params[0].device
        # CPU: scratch reused across chunks and steps (see Workspace); accelerators cache blocks already.
        ws = self._workspace if device.type == "cpu" else None
        ns = partial(orthogonalize, steps=group["ns_steps"], coefficients=group["ns_coefficients"],
                     eps=group["eps"], compute_dtype=dtype, workspace=ws)
        momentum = group["momentum"]
        prepare = partial(_momentum_step, params, bufs, momentum)
        source = partial(_ns_input, params, bufs, momentum if group["nesterov"] else None)
        lr = float(group["lr"])
        step_lrs = [adjusted_lr(lr, group["adjust_lr"], job.shape) for job in jobs]
        update = partial(_update, params, 1.0 - lr * group["weight_decay"], step_lrs, ws)
        orthogonalize_sharded(
            jobs, prepare, source, ns, update, device=device, compute_dtype=dtype, dp_group=self.dp_group,
            expert_dp_group=self.expert_dp_group, tp_group=self.tp_group, bucket_numel=self.bucket_numel,
            workspace=ws,
        )


def _matrices(x: Tensor) -> Tensor:
    return x.reshape(-1, *x.shape[-2:])


def _momentum_step(params: list[Tensor], bufs: list[Tensor], momentum: float, job: int, a: int, b: int) -> None:
    """buf <- lerp(buf, g, 1 - momentum) for matrices a:b of parameter `job` (elementwise identical to
    torch.optim.Muon's lerp_). Run chunk by chunk right before NS reads the same matrices, so g and
    buf are read from memory once per step, not twice."""
    bufs[job].view(-1, *bufs[job].shape[-2:])[a:b].lerp_(_matrices(params[job].grad)[a:b], 1.0 - momentum)


def _ns_input(params: list[Tensor], bufs: list[Tensor], nesterov: float | None, job: int, a: int, b: int,
              out: Tensor | None) -> Tensor:
    """NS input of matrices a:b of parameter `job` (after their momentum step), written into `out`
    when given: lerp(g, buf, momentum) for Nesterov (per chunk: a whole-stack temporary would cost a
    page-faulting allocation every step on CPU), else the buffer itself (read only)."""
    buf = _matrices(bufs[job])[a:b]
    if nesterov is None:
        return buf if out is None else out.copy_(buf)
    return torch.lerp(_matrices(params[job].grad)[a:b], buf, nesterov, out=out)


def _update(params: list[Tensor], decay: float, step_lrs: list[float], ws: Workspace | None, job: int, a: int,
            b: int, rows: Tensor) -> None:
    """Matrices a:b of parameter `job`, in torch's order: p *= 1 - lr * wd (the unadjusted lr), then
    p -= step_lr * rows, step_lr adjusted to the shape NS saw (the full matrix in "gather" mode, the
    shard in "block" mode). Each matrix arrives exactly once, so it is decayed exactly once. rows are
    in NS's dtype; adding them to p promotes them, bitwise the same as casting first (and as
    torch.optim.Muon's add of its bf16 update), so on CPU they are cast into scratch (no fresh
    temporary) in cache-sized chunks, right after p's decay found p in cache."""
    p = params[job]
    flat = p.view(-1, *p.shape[-2:])
    chunk = chunk_matrices(p.device, *p.shape[-2:])
    for c in range(0, b - a, chunk):
        target = flat[a + c : min(b, a + c + chunk)]
        if decay != 1.0:
            target.mul_(decay)
        delta = rows[c : c + chunk]
        if ws is not None and delta.dtype != p.dtype:
            delta = ws.get("update", tuple(delta.shape), p.dtype, p.device).copy_(delta)
        target.add_(delta, alpha=-step_lrs[job])
