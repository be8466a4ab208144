"""Signum: sign of the momentum (Bernstein et al. 2018, "signSGD: Compressed Optimisation for
Non-Convex Problems", Algorithm 1 "Signum"), with decoupled weight decay.

Per element:

    m <- beta * m + (1 - beta) * g
    x <- x * (1 - lr * weight_decay)
    x <- x - lr * sign(m)

Lion with beta1 = beta2; it is here as the simplest sign-based baseline of the optimizer study.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from asyncpp.optim.common import GroupwiseOptimizer, check_lr_wd, state_buffers

__all__ = ["Signum"]


class Signum(GroupwiseOptimizer):
    """Signum; state per parameter: `momentum_buffer` (m)."""

    name = "Signum"

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
    ) -> None:
        check_lr_wd("Signum", lr, weight_decay)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Signum momentum={momentum} must be in [0, 1)")
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    def _step_group(self, params: list[Tensor], group: dict[str, Any]) -> None:
        lr, wd = float(group["lr"]), group["weight_decay"]
        bufs = state_buffers(self, params, "momentum_buffer")
        torch._foreach_lerp_(bufs, [p.grad for p in params], 1.0 - group["momentum"])
        if wd != 0.0:
            torch._foreach_mul_(params, 1.0 - lr * wd)
        torch._foreach_add_(params, torch._foreach_sign(bufs), alpha=-lr)
