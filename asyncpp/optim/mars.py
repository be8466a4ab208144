"""MARS-AdamW (Yuan et al. 2024, "MARS: Unleashing the Power of Variance Reduction for Training Large
Models", Algorithm 2), in the paper's practical "approximate" form.

Per parameter tensor, at the k-th update (k = 1, 2, ...):

    c  = g_k + gamma * beta1 / (1 - beta1) * (g_k - g_{k-1})    # scaled stochastic recursive momentum
    c  = c / ||c||_2   if ||c||_2 > 1                            # per tensor
    m <- beta1 * m + (1 - beta1) * c
    v <- beta2 * v + (1 - beta2) * c^2
    x <- x * (1 - lr * weight_decay)
    x <- x - lr * (m / (1 - beta1^k)) / (sqrt(v / (1 - beta2^k)) + eps)

Exact MARS uses grad f(x_{k-1}; xi_k), a second backward on the previous weights with the current
batch; the approximate variant (the paper's choice for LLM training, "MARS-approx") reuses the previous
step's gradient g_{k-1} = grad f(x_{k-1}; xi_{k-1}) instead, so it needs no extra pass. g_0 := g_1:
the correction is 0 at the first step, as in the exact algorithm where x_0 = x_1.
The norm ||c|| is taken per parameter tensor (as the authors' implementation does).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from asyncpp.optim.common import GroupwiseOptimizer, check_betas, check_lr_wd, state_buffers

__all__ = ["MARS"]


class MARS(GroupwiseOptimizer):
    """MARS-AdamW (approximate); state per parameter: `step` (float tensor), `exp_avg`, `exp_avg_sq`,
    `last_grad` (g_{k-1}). Defaults are the paper's GPT-2 settings."""

    name = "MARS"

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.99),
        gamma: float = 0.025,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        check_lr_wd("MARS", lr, weight_decay)
        check_betas("MARS", betas)
        if not gamma >= 0.0:
            raise ValueError(f"MARS gamma={gamma} must be >= 0 (0 is AdamW with per-tensor gradient clipping)")
        defaults = {"lr": lr, "betas": tuple(betas), "gamma": gamma, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    def _step_param(self, p: Tensor, group: dict[str, Any]) -> None:
        lr, wd, eps, gamma = float(group["lr"]), group["weight_decay"], group["eps"], group["gamma"]
        beta1, beta2 = group["betas"]
        g = p.grad
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            state["last_grad"] = g.clone(memory_format=torch.preserve_format)
        (m,), (v,) = (state_buffers(self, [p], key) for key in ("exp_avg", "exp_avg_sq"))
        state["step"] += 1
        k = int(state["step"].item())
        c = torch.add(g, g - state["last_grad"], alpha=gamma * beta1 / (1.0 - beta1))
        c.div_(c.norm().clamp_(min=1.0))  # c / ||c|| when ||c|| > 1, without a device sync
        m.lerp_(c, 1.0 - beta1)
        v.mul_(beta2).addcmul_(c, c, value=1.0 - beta2)
        denom = (v / (1.0 - beta2**k)).sqrt_().add_(eps)
        if wd != 0.0:
            p.mul_(1.0 - lr * wd)
        p.addcdiv_(m, denom, value=-lr / (1.0 - beta1**k))
        state["last_grad"].copy_(g)
