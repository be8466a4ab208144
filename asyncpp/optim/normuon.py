"""NorMuon (Li, Liu, Liang, Chen, Zhao 2025, "NorMuon: Making Muon more efficient and scalable",
Algorithm 1): Muon followed by a per-neuron (per-row) Adam-style second-moment normalisation.

Per matrix W of shape [m, n] (m = output neurons, torch's Linear layout [out, in]):

    M <- beta1 * M + (1 - beta1) * G                # = lerp(M, G, 1 - beta1), as our Muon
    U  = lerp(G, M, beta1) if nesterov else M       # nesterov=False is the paper's rule
    O  = NS_k(U)                                    # Muon's quintic Newton-Schulz
    v <- beta2 * v + (1 - beta2) * mean_cols(O * O) # v in R^m: one second moment per neuron
    O^ = O / (sqrt(v) + eps)                        # v broadcast along each row
    W <- W * (1 - lr * weight_decay)
    W <- W - (0.2 * lr * sqrt(m * n) / ||O^||_F) * O^

The last line gives every update an RMS of exactly 0.2 * lr (the paper's "eta hat"), so NorMuon
shares AdamW's lr and weight decay as Muon's match_rms_adamw does; `adjust_lr` is therefore not
used. Stacked [E, m, n] expert weights are E matrices (v is [E, m, 1], norms per matrix).
Same-shaped parameters are bucketed and share one batched NS call. Unlike Muon, NorMuon is not
parallel-aware: a TP-sharded matrix gets the per-shard ("block") update (see docs/muon.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from asyncpp.optim.common import check_lr_wd, shape_buckets
from asyncpp.optim.orthogonal import NS_COEFFICIENTS, MatrixOptimizer, compute_dtype_name, newton_schulz

__all__ = ["NorMuon"]

NS_EPS = 1e-7  # Newton-Schulz's Frobenius normalisation guard (Muon's eps)


class NorMuon(MatrixOptimizer):
    """NorMuon for matrices (ndim >= 2). State per parameter: `momentum_buffer` (M, shaped like the
    parameter) and `second_momentum_buffer` (v, shaped [..., m, 1])."""

    name = "NorMuon"

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        beta2: float = 0.95,
        nesterov: bool = True,
        eps: float = 1e-8,
        ns_steps: int = 5,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        compute_dtype: torch.dtype | str | None = None,
    ) -> None:
        check_lr_wd("NorMuon", lr, weight_decay)
        for name, beta in (("momentum", momentum), ("beta2", beta2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"NorMuon {name}={beta} must be in [0, 1)")
        if not 0 <= ns_steps < 100:
            raise ValueError(f"NorMuon ns_steps={ns_steps} must be in [0, 100)")
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "beta2": beta2,
            "nesterov": nesterov,
            "eps": eps,
            "ns_steps": ns_steps,
            "ns_coefficients": tuple(ns_coefficients),
            "compute_dtype": compute_dtype_name(compute_dtype, "NorMuon"),
        }
        super().__init__(params, defaults)

    def _second_moments(self, params: list[Tensor]) -> list[Tensor]:
        out = []
        for p in params:
            state = self.state[p]
            if "second_momentum_buffer" not in state:
                state["second_momentum_buffer"] = torch.zeros_like(p[..., :1], memory_format=torch.contiguous_format)
            out.append(state["second_momentum_buffer"])
        return out

    def _step_group(self, params: list[Tensor], group: dict[str, Any]) -> None:
        for bucket in shape_buckets(params):
            self._step_bucket(bucket, group)

    def _step_bucket(self, params: list[Tensor], group: dict[str, Any]) -> None:
        """One NorMuon step for K parameters of identical shape, dtype and device."""
        lr, wd = float(group["lr"]), group["weight_decay"]
        update = torch.stack(self._ns_inputs(params, group["momentum"], group["nesterov"]))
        ortho = newton_schulz(update, group["ns_steps"], group["ns_coefficients"], NS_EPS,
                              compute_dtype=self.compute_dtype(group))
        second = self._second_moments(params)
        torch._foreach_lerp_(second, list(ortho.square().mean(dim=-1, keepdim=True).unbind(0)), 1.0 - group["beta2"])
        normed = ortho / torch.stack(second).sqrt().add_(group["eps"])
        m, n = params[0].shape[-2:]
        # per-matrix step size 0.2 * lr * sqrt(mn) / ||O^||_F (clamped: an all-zero gradient moves nothing)
        scale = (0.2 * lr * math.sqrt(m * n)) / normed.norm(dim=(-2, -1), keepdim=True).clamp_(min=1e-30)
        if wd != 0.0:
            torch._foreach_mul_(params, 1.0 - lr * wd)
        torch._foreach_sub_(params, list((normed * scale).unbind(0)))
