"""Adan (Xie, Zhou, Li, Lin, Yan 2022/2024, "Adan: Adaptive Nesterov Momentum Algorithm for Faster
Optimizing Deep Models", Algorithm 1), in the authors' released form: bias-corrected EMAs, betas
written as EMA coefficients (beta = 1 - the paper's beta), and decoupled weight decay.

Per element, at the k-th update (k = 1, 2, ...), with g_0 = g_1 (so the first difference is zero):

    d   = g_k - g_{k-1}
    m  <- beta1 * m + (1 - beta1) * g_k                   # gradient EMA
    v  <- beta2 * v + (1 - beta2) * d                     # gradient-difference EMA
    n  <- beta3 * n + (1 - beta3) * (g_k + beta2 * d)^2   # second moment of the Nesterov gradient
    x  <- x * (1 - lr * weight_decay)
    x  <- x - lr * (m / (1 - beta1^k) + beta2 * v / (1 - beta2^k)) / (sqrt(n / (1 - beta3^k)) + eps)

The weight decay is the multiplicative form every optimizer here shares (the authors' `no_prox=True`);
their default divides by (1 + lr * wd) after the step instead, which agrees to O((lr * wd)^2).

Under 2BW's one-step delay g_k is the gradient applied at update k (computed at x_{k-1}), so the
difference d is between consecutive *applied* gradients, which is what a delayed Adan sees.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from asyncpp.optim.common import GroupwiseOptimizer, check_betas, check_lr_wd, state_buffers

__all__ = ["Adan"]


class Adan(GroupwiseOptimizer):
    """Adan; state per parameter: `step` (a float tensor, as torch's Adam), `exp_avg` (m),
    `exp_avg_diff` (v), `exp_avg_sq` (n), `prev_grad` (g_{k-1}). Defaults are the authors'."""

    name = "Adan"

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float, float] = (0.98, 0.92, 0.99),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        check_lr_wd("Adan", lr, weight_decay)
        if len(betas) != 3:
            raise ValueError(f"Adan betas={tuple(betas)} must be three coefficients (gradient, difference, second moment)")
        check_betas("Adan", tuple(betas))
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    def _step_param(self, p: Tensor, group: dict[str, Any]) -> None:
        lr, wd, eps = float(group["lr"]), group["weight_decay"], group["eps"]
        beta1, beta2, beta3 = group["betas"]
        state = self.state[p]
        g = p.grad
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            state["prev_grad"] = g.detach().clone()  # g_0 = g_1: the first difference is zero
        (m,), (v,), (n,) = (state_buffers(self, [p], key) for key in ("exp_avg", "exp_avg_diff", "exp_avg_sq"))
        state["step"] += 1
        k = int(state["step"].item())
        prev = state["prev_grad"]
        diff = g - prev
        m.lerp_(g, 1.0 - beta1)
        v.lerp_(diff, 1.0 - beta2)
        nesterov = diff.mul_(beta2).add_(g)  # g + beta2 * d, reusing diff's memory
        n.mul_(beta3).addcmul_(nesterov, nesterov, value=1.0 - beta3)
        denom = (n / (1.0 - beta3**k)).sqrt_().add_(eps)
        numer = torch.add(m / (1.0 - beta1**k), v, alpha=beta2 / (1.0 - beta2**k))
        if wd != 0.0:
            p.mul_(1.0 - lr * wd)
        p.addcdiv_(numer, denom, value=-lr)
        prev.copy_(g)
