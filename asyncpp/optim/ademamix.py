"""AdEMAMix (Pagliardini, Ablin, Grangier 2024, "The AdEMAMix Optimizer: Better, Faster, Older",
Algorithm 1): Adam whose numerator mixes a fast and a slow EMA of the gradient.

Per element, at the k-th update (k = 1, 2, ...):

    alpha_k = alpha * min(k / T, 1)                              (T = warmup_steps; alpha if T == 0)
    beta3_k = min(exp(ln(beta1) ln(beta3) / ((1 - k/T) ln(beta3) + (k/T) ln(beta1))), beta3)
                                                                 (beta3 if T == 0; k/T capped at 1)
    m1 <- beta1 * m1 + (1 - beta1) * g                           # fast EMA, bias-corrected
    m2 <- beta3_k * m2 + (1 - beta3_k) * g                       # slow EMA, not bias-corrected
    nu <- beta2 * nu + (1 - beta2) * g^2
    x  <- x * (1 - lr * weight_decay)
    x  <- x - lr * (m1 / (1 - beta1^k) + alpha_k * m2) / (sqrt(nu / (1 - beta2^k)) + eps)

The alpha and beta3 schedulers (T_alpha = T_beta3 = T, the paper's recommendation is the whole run)
keep the slow EMA from dominating while it is still mostly its zero initialisation. The beta3
scheduler interpolates the half-life, not beta itself, from beta1 at k = 0 to beta3 at k = T.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from asyncpp.optim.common import GroupwiseOptimizer, check_betas, check_lr_wd, state_buffers

__all__ = ["AdEMAMix", "alpha_schedule", "beta3_schedule"]


def alpha_schedule(k: int, alpha: float, warmup_steps: int) -> float:
    """Linear warmup of the slow-EMA weight: alpha * min(k / T, 1)."""
    return alpha if warmup_steps <= 0 else alpha * min(k / warmup_steps, 1.0)


def beta3_schedule(k: int, beta1: float, beta3: float, warmup_steps: int) -> float:
    """The paper's f_beta3: beta1 at k = 0, beta3 at k >= T, linear in 1/ln(beta) in between."""
    if warmup_steps <= 0 or beta1 <= 0.0 or beta3 <= 0.0 or beta3 == beta1:
        return beta3
    frac = min(k / warmup_steps, 1.0)
    log1, log3 = math.log(beta1), math.log(beta3)
    return min(math.exp(log1 * log3 / ((1.0 - frac) * log3 + frac * log1)), beta3)


class AdEMAMix(GroupwiseOptimizer):
    """AdEMAMix with decoupled weight decay; state per parameter: `step` (a float tensor, as torch's
    Adam), `exp_avg` (m1), `exp_avg_slow` (m2), `exp_avg_sq` (nu). Defaults are the paper's."""

    name = "AdEMAMix"

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        beta3: float = 0.9999,
        alpha: float = 5.0,
        warmup_steps: int = 0,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        check_lr_wd("AdEMAMix", lr, weight_decay)
        check_betas("AdEMAMix", (*betas, beta3))
        if not alpha >= 0.0:
            raise ValueError(f"AdEMAMix alpha={alpha} must be >= 0")
        if warmup_steps < 0:
            raise ValueError(f"AdEMAMix warmup_steps={warmup_steps} must be >= 0 (0 = no alpha/beta3 warmup)")
        defaults = {"lr": lr, "betas": tuple(betas), "beta3": beta3, "alpha": alpha,
                    "warmup_steps": warmup_steps, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    def _step_param(self, p: Tensor, group: dict[str, Any]) -> None:
        lr, wd, eps = float(group["lr"]), group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
        (m1,), (m2,), (nu,) = (state_buffers(self, [p], key) for key in ("exp_avg", "exp_avg_slow", "exp_avg_sq"))
        state["step"] += 1
        k = int(state["step"].item())
        alpha = alpha_schedule(k, group["alpha"], group["warmup_steps"])
        beta3 = beta3_schedule(k, beta1, group["beta3"], group["warmup_steps"])
        g = p.grad
        m1.lerp_(g, 1.0 - beta1)
        m2.lerp_(g, 1.0 - beta3)
        nu.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (nu / (1.0 - beta2**k)).sqrt_().add_(eps)
        numer = torch.add(m1 / (1.0 - beta1**k), m2, alpha=alpha)
        if wd != 0.0:
            p.mul_(1.0 - lr * wd)
        p.addcdiv_(numer, denom, value=-lr)
