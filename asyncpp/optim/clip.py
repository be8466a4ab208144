"""Global gradient norm and clipping, shared by the simulator and the pipeline engine.

The squared norm is accumulated in fp64: torch's clip_grad_norm_ accumulates in the gradient dtype,
which on a 1M-element fp32 embedding gradient is off by ~1e-5 relative, enough to make a pipeline
(which must sum squared norms across stages anyway) and a single process disagree. Clipping uses
clip_grad_norm_'s formula, max_norm / (norm + 1e-6) capped at 1.

Both norms run over a tensor in chunks of NORM_CHUNK elements: a whole-tensor fp64 copy and its square
would be 4x the tensor's fp32 bytes at once (an embedding's gradient: 0.75 GB on smollm2_360m), a peak the
memory plan does not hold (issue 19). The chunking depends only on the tensor's size, so every executor
computes the same sums in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

NORM_CHUNK = 1 << 20
"""Elements per fp64 chunk of the norms: 16 MiB of temporaries (the fp64 copy and its square)."""


def _sq_sum(x: Tensor) -> Tensor:
    """Sum of squares of one tensor's entries, in fp64, chunk by chunk (a 0-dim fp64 tensor)."""
    flat = x.detach().reshape(-1)
    if flat.numel() <= NORM_CHUNK:
        return flat.double().pow(2).sum()
    return sum(c.double().pow(2).sum() for c in flat.split(NORM_CHUNK))


def grad_sq_sum(grads: Sequence[Tensor], device: torch.device | str) -> Tensor:
    """Sum of squares of all entries, in fp64 (inf/nan propagate), as a 0-dim tensor on `device`: no host read.
    The pipeline keeps it on the device until the update's one read of the reduced norms (docs/gpu.md)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return sum(_sq_sum(g) for g in grads)


def grad_sq_norm(grads: Sequence[Tensor]) -> float:
    """grad_sq_sum read to the host (the simulator's form): the same fp64 sums in the same order."""
    return float(grad_sq_sum(grads, "cpu"))


@torch.no_grad()
def diff_sq_sum(new: Sequence[Tensor], old: Sequence[Tensor], device: torch.device | str) -> Tensor:
    """||new - old||^2 over all entries, in fp64: the update norm, a 0-dim tensor on `device` (no host read).
    The fp32 difference is formed one chunk at a time too (no copy of a whole tensor, let alone of the stage)."""
    total = 0.0
    for a, b in zip(new, old, strict=True):
        pieces = zip(a.detach().reshape(-1).split(NORM_CHUNK), b.detach().reshape(-1).split(NORM_CHUNK))
        total = total + sum(_sq_sum(x - y) for x, y in pieces)
    if not isinstance(total, Tensor):  # nothing to compare
        return torch.zeros((), dtype=torch.float64, device=device)
    return total


def diff_sq_norm(new: Sequence[Tensor], old: Sequence[Tensor]) -> float:
    """diff_sq_sum read to the host (the simulator's form): the same fp64 sums in the same order."""
    return float(diff_sq_sum(new, old, "cpu"))


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor the gradients are multiplied by; 1.0 when clipping is off or not needed."""
    if max_norm <= 0 or not math.isfinite(norm):
        return 1.0
    return min(max_norm / (norm + 1e-6), 1.0)


@torch.no_grad()
def clip_(grads: Sequence[Tensor], max_norm: float, norm: float) -> None:
    coef = clip_coefficient(norm, max_norm)
    if coef < 1.0:
        torch._foreach_mul_(list(grads), coef)
