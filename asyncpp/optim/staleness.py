"""Staleness corrections that act on the optimizer's update (semantics.md, "Staleness mitigations").

Written here rather than taken from a library: these corrections are the paper's contribution and no
library implements them. They wrap any base optimizer: the base optimizer moves x_t to x_t - u_t and
the correction adjusts the result, so Muon, AdamW, ... need no changes.
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
    parameters are never touched, so the result is bit-identical to plain delayed training.
    """

    def __init__(self, params: Sequence[Tensor], lam: float):
        if lam < 0:
            raise ValueError(f"staleness.ef_lambda={lam} must be >= 0")
        self.lam = lam
        self.params = list(params)
        self.prev_update = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]

    @torch.no_grad()
    def apply(self, before: Sequence[Tensor], delayed: Sequence[bool]) -> None:
        """Call right after the base optimizer step; `before[i]` holds x_t of `params[i]`."""
        updates = torch._foreach_sub(list(before), self.params)  # u_t = x_t - (x_t - u_t)
        if self.lam != 0.0:
            for p, u, u_prev, is_delayed in zip(self.params, updates, self.prev_update, delayed):
                if is_delayed:
                    p.sub_(u - u_prev, alpha=self.lam)
        self.prev_update = updates

    def state_dict(self) -> dict:
        return {"lam": self.lam, "prev_update": [u.clone() for u in self.prev_update]}

    def load_state_dict(self, state: dict) -> None:
        saved = state["prev_update"]
        if len(saved) != len(self.params):
            raise ValueError(
                f"Error-Feedback state has {len(saved)} buffers but the model has {len(self.params)} "
                "parameters; the checkpoint belongs to a different model or stage"
            )
        for dst, src in zip(self.prev_update, saved):
            dst.copy_(src)
