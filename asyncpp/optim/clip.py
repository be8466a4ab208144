"""Global gradient norm and clipping, shared by the simulator and the pipeline engine.

The squared norm is accumulated in fp64: torch's clip_grad_norm_ accumulates in the gradient dtype,
which on a 1M-element fp32 embedding gradient is off by ~1e-5 relative, enough to make a pipeline
(which must sum squared norms across stages anyway) and a single process disagree. Clipping uses
clip_grad_norm_'s formula, max_norm / (norm + 1e-6) capped at 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def grad_sq_norm(grads: Sequence[Tensor]) -> float:
    """Sum of squares of all entries, in fp64 (inf/nan propagate)."""
    return float(sum(g.detach().double().pow(2).sum() for g in grads)) if grads else 0.0


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
