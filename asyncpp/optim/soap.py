"""SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam", Algorithms 3 and 4):
Adam run in the eigenbasis of Shampoo's preconditioner, for matrices.

Per matrix W [m, n] with gradient G, at the k-th update (k = 1, 2, ...; t = k - 1 is 0-based):

    G' = Q_L^T G Q_R                                   # gradient in the eigenbasis
    M <- beta1 * M + (1 - beta1) * G                   # first moment, kept in the original space
    M' = Q_L^T M Q_R
    V <- beta2 * V + (1 - beta2) * G' * G'             # second moment, kept in the eigenbasis
    N' = (M' / (1 - beta1^k)) / (sqrt(V / (1 - beta2^k)) + eps)
    N  = Q_L N' Q_R^T
    W <- W * (1 - lr * weight_decay)
    W <- W - lr * N
    L <- beta2 * L + (1 - beta2) * G G^T               # Shampoo's statistics (shampoo beta = beta2)
    R <- beta2 * R + (1 - beta2) * G^T G
    if t % precondition_frequency == 0: refresh Q_L, Q_R from L, R

Q_L = I and Q_R = I until the first refresh, so update 0 is an Adam step; the first refresh (right
after it) takes the eigenvectors of L and R (torch.linalg.eigh, sorted by decreasing eigenvalue); every
later one is Algorithm 4: one power-iteration step from the current basis followed by QR,
Q <- QR(P Q[:, order]) with `order` sorting the estimated eigenvalues diag(Q^T P Q) in decreasing
order, and V's rows (for Q_L) / columns (for Q_R) permuted by the same order so each second moment
stays with its eigenvector. V itself is not rotated at a refresh (as in the paper).
A side longer than MAX_PRECOND_DIM keeps Q = I there (no statistics; a plain Adam axis).
Leading dims of a [..., m, n] parameter (stacked MoE experts) are a batch of independent matrices.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from asyncpp.optim.common import GroupwiseOptimizer, check_betas, check_lr_wd, check_matrix_params

__all__ = ["MAX_PRECOND_DIM", "SOAP"]

MAX_PRECOND_DIM = 10_000


def _side_state(p: Tensor, side: int) -> tuple[Tensor, Tensor]:
    """(statistic, basis) of dim `side` (-2: left, -1: right), or two empty tensors for a side too
    long to precondition. Empty tensors (not None) keep the state all-tensor for checkpoints."""
    size = p.shape[side]
    if size > MAX_PRECOND_DIM:
        empty = p.new_zeros(0)
        return empty, empty.clone()
    batch = p.shape[:-2]
    eye = torch.eye(size, dtype=p.dtype, device=p.device).expand(*batch, size, size).contiguous()
    return torch.zeros_like(eye), eye


def _rotate(x: Tensor, q_left: Tensor, q_right: Tensor, back: bool = False) -> Tensor:
    """Q_L^T x Q_R (into the eigenbasis) or, with back=True, Q_L x Q_R^T (out of it)."""
    if q_left.numel():
        x = (q_left if back else q_left.mT) @ x
    if q_right.numel():
        x = x @ (q_right.mT if back else q_right)
    return x


def _eigenbasis(stat: Tensor) -> Tensor:
    """Eigenvectors of the symmetric PSD `stat`, columns in decreasing eigenvalue order."""
    _, vecs = torch.linalg.eigh(stat)
    return vecs.flip(-1)


def _power_qr(stat: Tensor, basis: Tensor) -> tuple[Tensor, Tensor]:
    """One power-iteration step + QR (the paper's Algorithm 4). Returns (new basis, order)."""
    projected = stat @ basis
    estimates = (basis * projected).sum(dim=-2)  # diag(Q^T P Q), one per column
    order = torch.argsort(estimates, dim=-1, descending=True)
    projected = projected.gather(-1, order.unsqueeze(-2).expand_as(projected))
    return torch.linalg.qr(projected).Q, order


class SOAP(GroupwiseOptimizer):
    """SOAP for matrices (ndim >= 2). State per parameter: `step` (float tensor), `exp_avg` (M),
    `exp_avg_sq` (V, eigenbasis), `stat_left`/`stat_right` (L, R), `basis_left`/`basis_right` (Q_L, Q_R).
    Defaults are the paper's (betas 0.95, 0.95; precondition frequency 10)."""

    name = "SOAP"

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        precondition_frequency: int = 10,
    ) -> None:
        check_lr_wd("SOAP", lr, weight_decay)
        check_betas("SOAP", betas)
        if precondition_frequency < 1:
            raise ValueError(f"SOAP precondition_frequency={precondition_frequency} must be >= 1")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "precondition_frequency": precondition_frequency}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        param_group["params"] = check_matrix_params(self.name, param_group["params"])
        super().add_param_group(param_group)

    def _init_state(self, p: Tensor) -> dict[str, Tensor]:
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["stat_left"], state["basis_left"] = _side_state(p, -2)
            state["stat_right"], state["basis_right"] = _side_state(p, -1)
        return state

    def _step_param(self, p: Tensor, group: dict[str, Any]) -> None:
        lr, wd, eps = float(group["lr"]), group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        state = self._init_state(p)
        q_left, q_right = state["basis_left"], state["basis_right"]
        g = p.grad
        state["step"] += 1
        k = int(state["step"].item())
        m, v = state["exp_avg"], state["exp_avg_sq"]
        g_rot = _rotate(g, q_left, q_right)
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g_rot, g_rot, value=1.0 - beta2)
        m_rot = _rotate(m, q_left, q_right) / (1.0 - beta1**k)
        direction = _rotate(m_rot / (v / (1.0 - beta2**k)).sqrt_().add_(eps), q_left, q_right, back=True)
        if wd != 0.0:
            p.mul_(1.0 - lr * wd)
        p.sub_(direction, alpha=lr)
        self._update_preconditioner(g, state, beta2, refresh=(k - 1) % group["precondition_frequency"] == 0)

    @staticmethod
    def _update_preconditioner(g: Tensor, state: dict[str, Tensor], beta: float, refresh: bool) -> None:
        first = int(state["step"].item()) == 1
        for side in ("left", "right"):
            stat, basis = state[f"stat_{side}"], state[f"basis_{side}"]
            if not stat.numel():
                continue
            stat.lerp_(g @ g.mT if side == "left" else g.mT @ g, 1.0 - beta)
            if not refresh:
                continue
            if first:
                basis.copy_(_eigenbasis(stat))
                continue
            new_basis, order = _power_qr(stat, basis)
            basis.copy_(new_basis)
            v = state["exp_avg_sq"]
            dim = -2 if side == "left" else -1
            index = order.unsqueeze(-1) if side == "left" else order.unsqueeze(-2)
            v.copy_(v.gather(dim, index.expand_as(v)))
