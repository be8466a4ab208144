"""Small helpers shared by the hand-written optimizers (validation, state buffers, shape buckets)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor


def check_betas(name: str, betas: tuple[float, ...]) -> None:
    for i, b in enumerate(betas):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{name} betas[{i}]={b} must be in [0, 1)")


def check_lr_wd(name: str, lr: float, weight_decay: float) -> None:
    if not lr >= 0.0:
        raise ValueError(f"{name} lr={lr} must be >= 0")
    if not weight_decay >= 0.0:
        raise ValueError(f"{name} weight_decay={weight_decay} must be >= 0")


def check_matrix_params(name: str, params: Tensor | Iterable[Tensor]) -> list[Tensor]:
    """The params of a matrix optimizer's param group as a list, each checked to be a real matrix
    (ndim >= 2; leading dims are a batch of matrices, e.g. stacked MoE experts)."""
    params = [params] if isinstance(params, Tensor) else list(params)
    for p in params:
        if p.ndim < 2:
            raise ValueError(
                f"{name} got a parameter of shape {tuple(p.shape)} (ndim={p.ndim}); it works on matrices and "
                "needs ndim >= 2. Put vectors and scalars (norm weights, biases) in AdamW: see "
                "asyncpp.optim.build.split_params"
            )
        if torch.is_complex(p):
            raise ValueError(f"{name} does not support complex parameters (shape {tuple(p.shape)}, dtype {p.dtype})")
    return params


def shape_buckets(params: list[Tensor]) -> list[list[Tensor]]:
    """params grouped by (shape, dtype, device), in first-seen order: each bucket can be stacked."""
    buckets: dict[tuple, list[Tensor]] = defaultdict(list)
    for p in params:
        buckets[(tuple(p.shape), p.dtype, p.device)].append(p)
    return list(buckets.values())


def params_with_grad(group: dict[str, Any], name: str) -> list[Tensor]:
    params = [p for p in group["params"] if p.grad is not None]
    for p in params:
        if p.grad.is_sparse:
            raise RuntimeError(f"{name} does not support sparse gradients (shape {tuple(p.shape)})")
    return params


def state_buffers(optimizer: torch.optim.Optimizer, params: list[Tensor], key: str) -> list[Tensor]:
    """state[p][key] for each p, created as zeros on first use."""
    out = []
    for p in params:
        state = optimizer.state[p]
        if key not in state:
            state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        out.append(state[key])
    return out


class GroupwiseOptimizer(torch.optim.Optimizer):
    """The step() every hand-written optimizer here shares: closure, then each param group's params
    that have a gradient. Subclasses implement `_step_group` (foreach over the group) or
    `_step_param` (one parameter at a time)."""

    name = "optimizer"

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = params_with_grad(group, self.name)
            if params:
                self._step_group(params, group)
        return loss

    def _step_group(self, params: list[Tensor], group: dict[str, Any]) -> None:
        for p in params:
            self._step_param(p, group)

    def _step_param(self, p: Tensor, group: dict[str, Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__} implements neither _step_group nor _step_param")
