"""A model's fp32 masters beside its low-precision parameters (train.precision=bf16), one home for both executors:
the single-process simulator (reference/simulator.py) and a pipeline stage's weight versions (pipeline/weights.py)
build, retarget and feed them with the same pieces, so both compute the same floats."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from asyncpp.optim.build import AnyOptimizer

#: dtype of the master weights, the optimizer state and the gradient sums in every precision.
MASTER_DTYPE = torch.float32
PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


def compute_dtype_of(precision: str) -> torch.dtype:
    """train.precision -> the dtype of the module's parameters, activations and weight versions."""
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision={precision!r} is not one of {sorted(PRECISIONS)}; e.g. train.precision=bf16")
    return PRECISIONS[precision]


def is_mixed(compute_dtype: torch.dtype | None) -> bool:
    """Whether the masters are separate from the module's parameters (compute dtype below fp32)."""
    return compute_dtype is not None and compute_dtype != MASTER_DTYPE


@torch.no_grad()
def make_masters(params: Sequence[nn.Parameter], compute_dtype: torch.dtype) -> list[nn.Parameter]:
    """fp32 copies of `params` (their current values, so no precision is lost at initialisation), after
    which the parameters themselves are cast to `compute_dtype` in place (the same Parameter objects,
    so optimizers, tied references and hooks built before stay valid)."""
    masters = [nn.Parameter(p.detach().to(MASTER_DTYPE, copy=True), requires_grad=p.requires_grad) for p in params]
    for p in params:
        p.data = p.data.to(compute_dtype)
    return masters


def retarget(optimizer: AnyOptimizer, params: Sequence[Tensor], masters: Sequence[Tensor]) -> None:
    """Make a freshly built optimizer step `masters` instead of `params` (matched by identity)."""
    swap = {id(p): q for p, q in zip(params, masters)}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if optimizer_state_of(optimizer, p):
                raise RuntimeError("retarget() needs an optimizer that has not stepped yet")
        group["params"] = [swap.get(id(p), p) for p in group["params"]]


class GradSums:
    """Per-parameter fp32 sums of the gradients autograd produces for low-precision parameters.

    A post-accumulate-grad hook moves each microbatch's gradient out of `p.grad` (which autograd
    would otherwise keep summing in bf16) into an fp32 tensor, so a step's gradient is
    sum_fp32(bf16 g_microbatch). pop() hands the sums over and starts new ones: in 2BW the next
    step's backwards run before the previous step's optimizer has consumed its gradient.
    """

    def __init__(self, params: Sequence[Tensor], dtype: torch.dtype = MASTER_DTYPE):
        self.dtype = dtype
        self.sums: list[Tensor | None] = [None] * len(params)
        self._handles = [p.register_post_accumulate_grad_hook(functools.partial(self._add, i))
                         for i, p in enumerate(params) if p.requires_grad]

    def _add(self, index: int, p: Tensor) -> None:
        g, p.grad = p.grad, None
        total = self.sums[index]
        if total is None:
            self.sums[index] = g.to(self.dtype, copy=True)
        else:
            total.add_(g)

    def pop(self) -> list[Tensor | None]:
        """The sums since the last pop (None where no gradient arrived)."""
        out, self.sums = self.sums, [None] * len(self.sums)
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def optimizer_state_of(optimizer: AnyOptimizer, p) -> bool:
    inner = getattr(optimizer, "optimizers", None)
    optimizers = inner.values() if isinstance(inner, dict) else (inner or [optimizer])
    return any(p in opt.state and opt.state[p] for opt in optimizers)
