"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2).

Per element, with decoupled weight decay:

    c <- beta1 * m + (1 - beta1) * g          # the interpolation that is signed
    x <- x * (1 - lr * weight_decay)          # = x - lr * wd * x, as in the paper's "update + wd * x"
    x <- x - lr * sign(c)
    m <- beta2 * m + (1 - beta2) * g          # the momentum tracked for the next step

The update has RMS 1 (every entry is +-1), so Lion's lr is usually 3-10x below AdamW's and its
weight decay 3-10x above (the paper's and the asyncpp study's convention: lr 5e-4, wd 0.5).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from asyncpp.optim.common import GroupwiseOptimizer, check_betas, check_lr_wd, state_buffers

__all__ = ["Lion"]


class Lion(GroupwiseOptimizer):
    """Lion with decoupled weight decay; state per parameter: `exp_avg` (m)."""

    name = "Lion"

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        check_lr_wd("Lion", lr, weight_decay)
        check_betas("Lion", betas)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    def _step_group(self, params: list[Tensor], group: dict[str, Any]) -> None:
        lr, wd = float(group["lr"]), group["weight_decay"]
        beta1, beta2 = group["betas"]
        grads = [p.grad for p in params]
        exp_avgs = state_buffers(self, params, "exp_avg")
        direction = torch._foreach_lerp(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_sign_(direction)
        if wd != 0.0:
            torch._foreach_mul_(params, 1.0 - lr * wd)
        torch._foreach_add_(params, direction, alpha=-lr)
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta2)
