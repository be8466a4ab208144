"""Staleness corrections (semantics.md, "Staleness mitigations"), each composable with any base optimizer.

Written here rather than taken from a library: these corrections are the paper's contribution and its
baselines, and no library implements them for a delayed pipeline. None of them changes the optimizer:
- ErrorFeedback acts on the update: the base optimizer moves x_t to x_t - u_t and it adjusts the result;
- GradientErrorFeedback and dc_asgd_ act on the delayed gradient before the base optimizer sees it;
- predict_weights changes which weights the forward/backward reads.
Order inside one simulator step: read x_{t-d} (or its prediction) -> gradient -> DC-ASGD ->
gradient-level EF -> clipping and the base optimizer (U_t) -> update-level EF.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class ErrorFeedback:
    """Update-level Error Feedback: x_{t+1} = x_t - u_t - lam * (u_t - u_{t-1}), with u_{-1} := 0.

    u_t is measured as (x before the base step) - (x after it), so it includes the LR schedule,
    weight decay and clipping, exactly the "U_t" of the spec. The buffer u_{t-1} is one tensor per
    parameter and needs no communication (each stage/shard owns its parameters' buffers).

    The buffer is refreshed on every step that takes an update, synchronous ones included, so that
    the first delayed step after a synchronous start corrects against the real previous update.
    The correction itself is applied only to delayed parameters (`delayed[i]`); with lam == 0 the
    parameters are never touched, so the result is bit-identical to plain delayed training, and there is no
    buffer at all: u_{t-1} is read only by the correction, and a zero copy of the stage's masters would be memory
    for nothing (a full fp32 copy of the stage under mixed precision). A checkpoint of a lam == 0 run therefore
    holds no u_{t-1}; a run resumed from it with lam > 0 starts EF from u_{t-1} := 0, as from step 0.
    """

    def __init__(self, params: Sequence[Tensor], lam: float):
        if lam < 0:
            raise ValueError(f"staleness.ef_lambda={lam} must be >= 0")
        self.lam = lam
        self.params = list(params)
        self.prev_update = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params] if lam else []

    @torch.no_grad()
    def apply(self, before: Sequence[Tensor], delayed: Sequence[bool]) -> None:
        """Call right after the base optimizer step; `before[i]` holds x_t of `params[i]`."""
        if self.lam == 0.0:
            return
        # One parameter at a time: a whole new set of u_t next to u_{t-1} would be a second EF buffer at the
        # update's peak (the memory plan counts one). Per element the same subtractions as before.
        for i, (p, x, is_delayed) in enumerate(zip(self.params, before, delayed, strict=True)):
            u = x - p  # u_t = x_t - (x_t - u_t)
            if is_delayed:
                p.sub_(u - self.prev_update[i], alpha=self.lam)
            self.prev_update[i] = u


class GradientErrorFeedback:
    """Gradient-level Error Feedback, the ablation that diverges (paper, App. A.10):

        g~_t = g_t + lam * (g_t - g_{t-1}),   g_{-1} := 0,

    applied to the delayed gradient before the base optimizer (and its clipping) sees it. g_{t-1} is
    the previous step's gradient as computed (before this correction; after DC-ASGD when both are
    on), one buffer per parameter. As ErrorFeedback it is refreshed on every step that takes an
    update (synchronous ones included) and corrects only delayed parameters; a skipped (non-finite)
    step leaves the buffer alone. lam == 0 never touches a gradient: plain delayed training, bit for bit.
    """

    def __init__(self, params: Sequence[Tensor], lam: float):
        if lam < 0:
            raise ValueError(f"staleness.grad_ef_lambda={lam} must be >= 0")
        self.lam = lam
        self.params = list(params)
        # Only when on: at lam == 0 g_{t-1} is never read, and a zero copy of the stage would be memory the plan
        # does not count (asyncpp.core.memory; it was 0.86 GB of smollm2_360m's stage 0).
        self.prev_grad = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params] if lam else []
        self._pending: dict[int, Tensor] = {}  # index -> g_t (uncorrected) of the step being taken

    @torch.no_grad()
    def apply(self, grads: Sequence[Tensor | None], delayed: Sequence[bool], only: Sequence[bool] | None = None) -> None:
        """Correct `grads[i]` (the gradient of params[i]) in place; commit() once the step is known to be finite.

        `only[i]` False leaves grads[i] for a later call of the same step (a pipeline's last stage corrects the
        tied embedding's gradient once its all-reduce with the first stage has arrived)."""
        if self.lam == 0.0:
            return
        for i, (g, g_prev, is_delayed) in enumerate(zip(grads, self.prev_grad, delayed)):
            if g is None or (only is not None and not only[i]):
                continue
            self._pending[i] = g.clone()
            if is_delayed:
                g.add_(g - g_prev, alpha=self.lam)

    def commit(self) -> None:
        for i, g in self._pending.items():
            self.prev_grad[i] = g
        self._pending = {}

    def discard(self) -> None:
        """A skipped (non-finite) step leaves g_{t-1} as it was."""
        self._pending = {}


@torch.no_grad()
def dc_asgd_(
    grads: Sequence[Tensor | None], current: Sequence[Tensor], read: Sequence[Tensor], delayed: Sequence[bool],
    lam: float, only: Sequence[bool] | None = None,
) -> None:
    """DC-ASGD Taylor compensation (Zheng et al. 2017, with their diagonal approximation of the Hessian
    lam * g * g), in place on `grads[i]`:

        g~ = g + lam * g * g * (x_t - x_read)

    x_read is the version the gradient was computed on: x_{t-d} for delay d (x_{t-1} in 2BW; for d > 1
    the compensation spans all d steps, which is what the Taylor expansion around x_read needs), or
    the predicted weights when weight prediction is on. Only delayed parameters (and, with `only`, only
    those marked); lam == 0 is a no-op.
    """
    if lam == 0.0:
        return
    for i, (g, x, x_read, is_delayed) in enumerate(zip(grads, current, read, delayed)):
        if g is not None and is_delayed and (only is None or only[i]):
            g.add_(g * g * (x - x_read), alpha=lam)


@torch.no_grad()
def predict_weights(stale: Tensor, older: Tensor, delay: int, out: Tensor | None = None) -> Tensor:
    """SAPipe-style weight prediction: x^ = x_{t-d} + d * (x_{t-d} - x_{t-d-1}).

    The newest weights a stage holds when minibatch b_t starts are x_{t-d}; the update being applied
    meanwhile is unknown, so the last one it knows, x_{t-d} - x_{t-d-1} (everything that step applied:
    base update, weight decay, Error Feedback), is extrapolated d steps ahead to guess x_t, the weights
    b_t's gradient will be applied to. Versions before x_0 are x_0, so the first prediction is x_0."""
    return torch.add(stale, stale - older, alpha=delay, out=out)
