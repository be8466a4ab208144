"""The update rule of semantics.md, written once for both executors (the simulator and the pipeline stage).

A step t turns the gradient of b_t, computed on x_{t-d}, into x_{t+1}:

    correct()   DC-ASGD (g += lam_dc g*g (x_t - x_read)), then gradient-level EF (g += lam (g - g_{t-1}))
    (norm)      the global L2 norm of the corrected gradient: the caller's part, because only the caller knows
                where the pieces live (one process sums them; a pipeline all-reduces over stages and shards)
    apply()     LR schedule; skip if the norm is not finite (x_{t+1} = x_t, the version still advances);
                else clip, the base optimizer's step, update-level Error Feedback; the router-bias update.
                If the update itself came out non-finite (a finite gradient, e.g. optimizer.lr=1e30 overflowing),
                x_{t+1} = x_t is restored and the step is refused: NonFiniteUpdate (see UpdateRule.apply)

Megatron's optimizer has the same split (prepare the gradients, take the global norm, step with ready
gradients), which is also what lets a pipeline start the norm's all-reduce at UPDATE_START and wait for it only
at UPDATE. Every correction acts only on parameters whose delay at this step is > 0, and each is off (and then
bit-identical to plain delayed training) at coefficient 0.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from asyncpp.config import RunConfig
from asyncpp.core.balancing import RouterBiasVersions
from asyncpp.core.staleness import ErrorFeedback, GradientErrorFeedback, dc_asgd_
from asyncpp.core.stateful import load_in_place
from asyncpp.optim.build import AnyOptimizer
from asyncpp.optim.clip import clip_
from asyncpp.optim.lr_schedule import lr_multiplier


@dataclass(frozen=True)
class Corrections:
    """The staleness corrections' coefficients (asyncpp.config.StalenessConfig's subset the rule applies)."""

    ef_lambda: float = 0.0
    grad_ef_lambda: float = 0.0
    dc_lambda: float = 0.0

    def __post_init__(self) -> None:
        for name in ("ef_lambda", "grad_ef_lambda", "dc_lambda"):
            if getattr(self, name) < 0:
                raise ValueError(f"staleness.{name}={getattr(self, name)} must be >= 0 (0 turns it off)")

    @classmethod
    def of(cls, staleness) -> Corrections:
        return cls(staleness.ef_lambda, staleness.grad_ef_lambda, staleness.dc_lambda)


NO_CORRECTIONS = Corrections()


class NonFiniteUpdate(FloatingPointError):
    """A finite gradient gave a non-finite x_{t+1}. Restored to x_t, but the optimizer's state has moved, so the
    run cannot go on exactly: it stops, with no checkpoint after the last good one."""

    def __init__(self, step: int, where: str = ""):
        super().__init__(f"step {step}: the update was not finite{where} although the gradient was; x_{{t+1}} was "
                         "not applied and nothing after the last checkpoint is saved. Lower optimizer.lr (or "
                         "raise optimizer eps) and rerun: the run resumes from its last checkpoint")
        self.step = step


@dataclass(frozen=True)
class UpdateOutcome:
    lr: float
    skipped: bool
    """The norm was not finite: nothing was applied (x_{t+1} = x_t) and no correction buffer moved."""
    update_finite: bool = True
    """False: the update came out non-finite and x_t was restored (only with raise_on_nonfinite_update=False)."""


def lr_multiplier_for(cfg: RunConfig) -> Callable[[int], float]:
    """step -> LR multiplier of cfg.optimizer.schedule over cfg.train.steps (one closure for both executors)."""
    s = cfg.optimizer.schedule
    return functools.partial(lr_multiplier, total_steps=cfg.train.steps, warmup_steps=s.warmup_for(cfg.train.steps),
                             kind=s.kind,
                             min_lr_ratio=s.min_lr_ratio, decay_fraction=s.decay_fraction)


class UpdateRule:
    """Owns the optimizer step and every correction's state for one set of master weights.

    `masters` are what the optimizer steps (fp32 masters under mixed precision, else the weights themselves);
    gradients are handed in as a list aligned with them (None where a parameter got none).
    """

    def __init__(self, optimizer: AnyOptimizer, masters: Sequence[Tensor], *, grad_clip: float = 0.0,
                 lr_multiplier: Callable[[int], float] | None = None, corrections: Corrections = NO_CORRECTIONS,
                 balancing: RouterBiasVersions | None = None, raise_on_nonfinite_update: bool = True):
        """raise_on_nonfinite_update: raise NonFiniteUpdate at once (one process); False reports it in the
        outcome instead, for a pipeline, where every rank must stop at the same point (the caller agrees)."""
        self.optimizer = optimizer
        self.raise_on_nonfinite_update = raise_on_nonfinite_update
        self.masters = list(masters)
        self.grad_clip = grad_clip
        self.lr_multiplier = lr_multiplier
        self.corrections = corrections
        self.error_feedback = ErrorFeedback(self.masters, corrections.ef_lambda)
        self.grad_error_feedback = GradientErrorFeedback(self.masters, corrections.grad_ef_lambda)
        self.balancing = balancing if balancing else None

    # ---- Stateful (torch.distributed.checkpoint.stateful): the rule's part of a checkpoint --------------
    def state_dict(self) -> dict[str, list[Tensor]]:
        """The per-parameter state a checkpoint must hold besides weights and optimizer, by its key prefix
        (asyncpp/train/checkpoint/state.py StageState.buffers), aligned with `masters`: u_{t-1} when update-level
        EF is on, g_{t-1} when gradient-level EF is on (off, neither buffer exists). The rule's own tensors: a load
        writes them in place."""
        out = {}
        if self.corrections.ef_lambda:
            out["ef"] = self.error_feedback.prev_update
        if self.corrections.grad_ef_lambda:
            out["gef"] = self.grad_error_feedback.prev_grad
        return out

    def load_state_dict(self, state: dict[str, Sequence[Tensor | None]]) -> None:
        """Take `state`'s buffers (a no-op for the tensors state_dict() gave, which a load filled in place)."""
        for key, mine in self.state_dict().items():
            load_in_place(mine, state.get(key, ()))

    @property
    def corrects_gradients(self) -> bool:
        """Whether correct() changes anything (the caller may skip gathering x_t and x_read otherwise)."""
        return bool(self.corrections.dc_lambda or self.corrections.grad_ef_lambda)

    def correct(self, grads: Sequence[Tensor | None], delayed: Sequence[bool], x_t: Sequence[Tensor] = (),
                x_read: Sequence[Tensor] = (), only: Sequence[bool] | None = None) -> None:
        """DC-ASGD, then gradient-level EF, in place on the step's gradient, before its norm is taken.

        x_t: the weights the update will be applied to; x_read: the ones the gradient was computed on (needed
        only with DC-ASGD). `only[i]` False defers grads[i] to a later call of the same step."""
        dc_asgd_(grads, x_t, x_read, delayed, self.corrections.dc_lambda, only)
        self.grad_error_feedback.apply(grads, delayed, only)

    def apply(self, step: int, grads: Sequence[Tensor | None], grad_norm: float, x_t: Sequence[Tensor],
              delayed: Sequence[bool], loads: Sequence[Tensor] = ()) -> UpdateOutcome:
        """x_{t+1} from the corrected gradient and its global norm, in place on the masters.

        x_t: the masters' values before this step (read-only; Error Feedback measures u_t against them).
        loads: b_t's expert loads per balanced router (aux-loss-free balancing), summed over DP."""
        # No gradient at all is a skip, except for an empty list: a distributed-optimizer rank that owns
        # none of its stage's parameters still takes the step every other rank takes.
        finite = math.isfinite(grad_norm) and (not grads or any(g is not None for g in grads))
        if self.lr_multiplier is not None:
            self.optimizer.set_lr_multiplier(self.lr_multiplier(step))
        lr = float(self.optimizer.param_groups[0]["lr"])
        update_finite = True
        if finite:
            self._step(grads, grad_norm, x_t, delayed)
            update_finite = self._restore_if_not_finite(x_t)
            if not update_finite and self.raise_on_nonfinite_update:
                raise NonFiniteUpdate(step)
        else:
            self.grad_error_feedback.discard()
        if self.balancing is not None:
            self.balancing.update(step, loads, apply=finite and update_finite)
        return UpdateOutcome(lr, not (finite and update_finite), update_finite)

    @torch.no_grad()
    def _restore_if_not_finite(self, x_t: Sequence[Tensor]) -> bool:
        """Whether x_{t+1} is finite; if not, the masters go back to x_t (never apply a non-finite state).
        One host sync per step (the update already syncs for the norm)."""
        if not self.masters:
            return True
        if bool(torch.stack([torch.isfinite(q).all() for q in self.masters]).all()):
            return True
        for q, x in zip(self.masters, x_t):
            q.copy_(x)
        return False

    def _step(self, grads: Sequence[Tensor | None], grad_norm: float, x_t: Sequence[Tensor],
              delayed: Sequence[bool]) -> None:
        clip_([g for g in grads if g is not None], self.grad_clip, grad_norm)
        for q, g in zip(self.masters, grads):
            q.grad = g
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.error_feedback.apply(x_t, delayed)
        self.grad_error_feedback.commit()
