"""Muon with batched (stacked) Newton-Schulz: one NS call per group of same-shaped matrices.

The mathematics is exactly `torch.optim.Muon` (torch/optim/_muon.py), per matrix:

    buf <- lerp(buf, g, 1 - momentum)              # buf = momentum*buf + (1-momentum)*g (an EMA)
    u   <- lerp(g, buf, momentum) if nesterov else buf
    o   <- NS_k(u)                                 # quintic Newton-Schulz, Frobenius-normalised
    p   <- p * (1 - lr * weight_decay)             # decoupled decay with the *unadjusted* lr, first
    p   <- p - adjust(lr, shape) * o               # then the update with the shape-adjusted lr

What differs is the execution: parameters of one param group are bucketed by (shape, dtype,
device); each bucket's momentum update is one foreach call and its NS is one batched call on a
[K, ..., m, n] stack, instead of K small kernels each. A 3-D parameter [E, m, n] (stacked MoE
experts) is E matrices: NS and the LR adjustment act on the last two dims.

Numerics: torch's Muon always runs NS in bf16. Ours runs it in `compute_dtype` (default: the
parameter's dtype, i.e. fp32 on CPU); with compute_dtype=torch.bfloat16 it reproduces
torch.optim.Muon bit for bit on CPU (tests/unit/test_muon.py), because every op (cast, transpose,
norm, clamp, the two fused multiply-adds per iteration, cast back) is the same op in the same order.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["ADJUST_LR_CHOICES", "Muon", "adjusted_lr", "newton_schulz"]

# Keller Jordan's quintic coefficients (maximise the slope at zero; the iteration lands the
# singular values in roughly [0.7, 1.2] rather than exactly at 1, which does not hurt training).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADJUST_LR_CHOICES = ("original", "match_rms_adamw")
_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def newton_schulz(
    G: Tensor,
    steps: int,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    compute_dtype: torch.dtype | None = None,
) -> Tensor:
    """Approximately orthogonalise every matrix of G [..., m, n]; returns G's shape and dtype.

    Each matrix is divided by its own Frobenius norm (so its spectral norm is <= 1), then
    `steps` quintic iterations X <- aX + (bA + cA^2)X with A = XX^T. Tall matrices are
    transposed first so the Gram matrix A is min(m, n) square (cost m*n*min(m, n)).
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs a [..., m, n] tensor, got shape {tuple(G.shape)}")
    if len(coefficients) != 3:
        raise ValueError(f"newton_schulz coefficients must be 3 floats (a, b, c), got {coefficients}")
    if steps < 0:
        raise ValueError(f"newton_schulz steps={steps} must be >= 0")
    a, b, c = coefficients
    m, n = G.shape[-2:]
    # Flatten the batch dims before transposing so the reshape stays a view of G.
    X = G.reshape(-1, m, n).to(compute_dtype or G.dtype)
    tall = m > n
    if tall:
        X = X.mT
    # Out of place: when compute_dtype == G.dtype, .to() returned G itself, which we must not modify.
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b*A + c*A@A, one rounding (as torch's addmm)
        X = torch.baddbmm(X, B, X, beta=a)  # a*X + B@X
    if tall:
        X = X.mT
    return X.reshape(G.shape).to(G.dtype)


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


def _dtype_name(dtype: torch.dtype | str | None) -> str | None:
    # Stored as a string in the param group so optimizer state_dicts hold only plain values
    # (torch.distributed.checkpoint and json-style tooling stay happy).
    if dtype is None:
        return None
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"Muon compute_dtype={dtype!r} is not one of {sorted(_DTYPES)} (or None)")
    return name


class Muon(torch.optim.Optimizer):
    """Muon for matrices (ndim >= 2; leading dims are a batch of matrices), batched by shape.

    Defaults and semantics are those of torch.optim.Muon (lr 1e-3, weight_decay 0.1, momentum
    0.95, nesterov, 5 NS steps, eps 1e-7, adjust_lr "original"); `compute_dtype` picks the NS
    dtype (None = the parameter's dtype; torch.bfloat16 is the GPU fast path and torch's choice).
    State is per parameter (`momentum_buffer`, shaped like the parameter) exactly as in torch, so
    state_dicts are interchangeable in layout and a resumed run continues bit-identically.
    """

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
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Muon lr={lr} must be >= 0")
        if not weight_decay >= 0.0:
            raise ValueError(f"Muon weight_decay={weight_decay} must be >= 0")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon momentum={momentum} must be in [0, 1)")
        if adjust_lr not in ADJUST_LR_CHOICES:
            raise ValueError(f"Muon adjust_lr={adjust_lr!r} is not one of {ADJUST_LR_CHOICES}")
        if not 0 <= ns_steps < 100:
            raise ValueError(f"Muon ns_steps={ns_steps} must be in [0, 100)")
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr": adjust_lr,
            "compute_dtype": _dtype_name(compute_dtype),
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # Validate here (not only in __init__) so groups added later are checked too.
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        for p in params:
            if p.ndim < 2:
                raise ValueError(
                    f"Muon got a parameter of shape {tuple(p.shape)} (ndim={p.ndim}); Muon orthogonalises "
                    "matrices and needs ndim >= 2. Put vectors and scalars (norm weights, biases) in "
                    "AdamW: see asyncpp.optim.build.split_params"
                )
            if torch.is_complex(p):
                raise ValueError(f"Muon does not support complex parameters (shape {tuple(p.shape)})")
        param_group["params"] = params
        if "compute_dtype" in param_group:
            param_group["compute_dtype"] = _dtype_name(param_group["compute_dtype"])
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            buckets: dict[tuple, list[Tensor]] = defaultdict(list)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"Muon does not support sparse gradients (shape {tuple(p.shape)})")
                buckets[(tuple(p.shape), p.dtype, p.device)].append(p)
            for params in buckets.values():
                self._step_bucket(params, group)
        return loss

    def _momentum_buffers(self, params: list[Tensor]) -> list[Tensor]:
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            bufs.append(state["momentum_buffer"])
        return bufs

    def _step_bucket(self, params: list[Tensor], group: dict[str, Any]) -> None:
        """One Muon step for K parameters of identical shape, dtype and device."""
        lr, wd, momentum = float(group["lr"]), group["weight_decay"], group["momentum"]
        grads = [p.grad for p in params]
        # Momentum buffers stay per parameter (the state_dict layout torch uses, so load/resume
        # needs no re-stacking); the EMA on them is one foreach call, elementwise identical to
        # torch's per-tensor lerp_. The stacks below are transient NS inputs.
        bufs = self._momentum_buffers(params)
        torch._foreach_lerp_(bufs, grads, 1.0 - momentum)
        if group["nesterov"]:
            update = torch.stack(grads).lerp_(torch.stack(bufs), momentum)
        else:
            update = torch.stack(bufs)
        dtype = group["compute_dtype"]
        ortho = newton_schulz(
            update,
            group["ns_steps"],
            group["ns_coefficients"],
            group["eps"],
            compute_dtype=_DTYPES[dtype] if dtype is not None else None,
        )
        # Same order as torch: decay with the unadjusted lr, then the adjusted-lr update.
        if wd != 0.0:
            torch._foreach_mul_(params, 1.0 - lr * wd)
        step_lr = adjusted_lr(lr, group["adjust_lr"], params[0].shape)
        torch._foreach_add_(params, list(ortho.unbind(0)), alpha=-step_lr)
