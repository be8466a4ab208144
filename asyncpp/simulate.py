"""Single-process simulator of every schedule's mathematics: the reference the pipeline must equal.

    x_{t+1} = x_t - U_t( g(x_{t-d}; b_t) ),   x_{-k} := x_0,

with d = 0 (sync, GPipe, 1F1B), d = 1 (PipeDream-2BW) or d = P-1-s per stage s (original PipeDream),
d = 0 during synchronous start/cooldown, and optionally update-level Error Feedback on top.

Written by hand (not a library) because this *is* the contract of the project: the multi-process
engine is tested against it. It is deliberately simple: past versions are whole clones of the
parameters, and a step swaps the stale version into the live parameters for forward/backward, then
swaps x_t back before the optimizer runs.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from asyncpp.optim.clip import clip_, grad_sq_norm
from asyncpp.optim.staleness import ErrorFeedback

LossFn = Callable[[nn.Module, Tensor], Tensor]


@dataclass
class TiedUse:
    """A second use of a shared parameter (`module.attr is param`) that reads it at `delay`."""

    module: nn.Module
    attr: str
    param: nn.Parameter
    delay: int


@dataclass
class StepStats:
    loss: float
    """Mean training loss of the step's microbatches (computed on the stale weights)."""
    grad_norm: float
    """Global L2 norm of the (delayed) gradient before clipping."""
    update_norm: float
    """||x_{t+1} - x_t||, Error Feedback included."""
    lr: float
    skipped: bool
    """The gradient was not finite; x_{t+1} = x_t, the version counter still advanced."""
    tokens: int


def cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean next-token cross entropy in fp32. The one loss reduction of the project: the simulator
    and the pipeline's last stage both call it, so their losses are the same floats."""
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))


def lm_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    """Cross entropy of a whole model over a [B, T+1] token block."""
    return cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])


class DelayedUpdateSimulator:
    """Applies each step's gradient to newer weights than the ones it was computed on.

    `delays[i]` is the steady-state delay of `params[i]` (see asyncpp.semantics.stage_delay);
    `sync_step(t)` says whether step t is synchronous (delay 0 for every parameter).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer,
        delays: Sequence[int],
        *,
        loss_fn: LossFn = lm_loss,
        grad_clip: float = 0.0,
        ef_lambda: float = 0.0,
        lr_multiplier: Callable[[int], float] | None = None,
        sync_step: Callable[[int], bool] = lambda t: False,
        tied_use: "TiedUse | None" = None,
    ):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        if len(delays) != len(self.params):
            raise ValueError(f"got {len(delays)} delays for {len(self.params)} parameters")
        self.optimizer = optimizer
        self.delays = list(delays)
        self.loss_fn = loss_fn
        self.grad_clip = grad_clip
        self.lr_multiplier = lr_multiplier
        self.sync_step = sync_step
        self.tied_use = tied_use
        self.error_feedback = ErrorFeedback(self.params, ef_lambda)
        # history[k] holds x_{t-1-k}; only as many versions as the largest delay are kept.
        self.history: deque[list[Tensor]] = deque(maxlen=max(self.delays, default=0) or None)
        self.max_delay = max(self.delays, default=0)

    def delays_at(self, step: int) -> list[int]:
        return [0] * len(self.params) if self.sync_step(step) else self.delays

    def _version(self, delay: int, current: list[Tensor]) -> list[Tensor]:
        """x_{t-delay}; versions older than x_0 are x_0 (pipeline warm-up)."""
        if delay == 0 or not self.history:
            return current
        return self.history[min(delay, len(self.history)) - 1]

    @torch.no_grad()
    def _load(self, delays: list[int], current: list[Tensor]) -> None:
        for i, (p, d) in enumerate(zip(self.params, delays)):
            if d:
                p.copy_(self._version(d, current)[i])

    @torch.no_grad()
    def _restore(self, delays: list[int], current: list[Tensor]) -> None:
        for p, d, x in zip(self.params, delays, current):
            if d:
                p.copy_(x)

    def _accumulate(self, microbatches: Sequence[Tensor]) -> float:
        """Sum the microbatch gradients (the caller divides by m): the mean-loss gradient of b_t.

        Summing first (instead of scaling each loss by 1/m) lets auxiliary losses that a model
        attaches inside its graph (MoE balancing) keep their own coefficient; the pipeline engine
        uses the same convention so both produce the same floats.
        """
        total = 0.0
        for tokens in microbatches:
            loss = self.loss_fn(self.model, tokens)
            loss.backward()
            total += loss.item()
        return total / len(microbatches)

    @contextlib.contextmanager
    def _tied_second_use(self, step: int, current: list[Tensor]):
        """A tied weight split across stages: each stage holds a copy and reads it at its own delay.

        The second use (the LM head on the last stage) gets its own leaf tensor holding the version
        of its stage's delay (original PipeDream reads the two copies at different delays). Its
        summed gradient is added to the tied parameter's once, after all microbatches, which is
        exactly the pipeline's first/last-stage all-reduce (same floats, same order).
        """
        use = self.tied_use
        index = next((i for i, p in enumerate(self.params) if use and p is use.param), None)
        if use is None or index is None:
            yield
            return
        delay = 0 if self.sync_step(step) else use.delay
        version = self._version(delay, current)[index]
        copy = nn.Parameter(version.detach().clone())
        setattr(use.module, use.attr, copy)
        try:
            yield
        finally:
            setattr(use.module, use.attr, use.param)
        if copy.grad is not None:
            use.param.grad = copy.grad if use.param.grad is None else use.param.grad + copy.grad

    def _clip(self) -> tuple[float, bool]:
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = math.sqrt(grad_sq_norm(grads))
        clip_(grads, self.grad_clip, norm)
        return norm, bool(grads) and math.isfinite(norm)

    def step(self, step: int, microbatches: Sequence[Tensor]) -> StepStats:
        """One optimizer step t consuming minibatch b_t = `microbatches`."""
        delays = self.delays_at(step)
        current = [p.detach().clone() for p in self.params]  # x_t
        self._load(delays, current)
        self.optimizer.zero_grad(set_to_none=True)
        with self._tied_second_use(step, current):
            loss = self._accumulate(microbatches)
        grads = [p.grad for p in self.params if p.grad is not None]
        torch._foreach_mul_(grads, 1.0 / len(microbatches))
        self._restore(delays, current)

        grad_norm, finite = self._clip()
        if self.lr_multiplier is not None:
            self.optimizer.set_lr_multiplier(self.lr_multiplier(step))
        lr = float(self.optimizer.param_groups[0]["lr"])
        if finite:
            self.optimizer.step()
            self.error_feedback.apply(current, [d > 0 for d in delays])
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            update_norm = math.sqrt(grad_sq_norm([p - x for p, x in zip(self.params, current)]))
        if self.max_delay:
            self.history.appendleft(current)
        tokens = sum(int(mb[:, 1:].numel()) for mb in microbatches)
        return StepStats(loss, grad_norm, update_norm, lr, not finite, tokens)

    def state_dict(self) -> dict:
        """Everything besides model/optimizer that a resumed run needs: past versions and u_{t-1}."""
        return {
            "history": [[x.clone() for x in version] for version in self.history],
            "error_feedback": self.error_feedback.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.history.clear()
        for version in state["history"]:
            self.history.append([x.clone() for x in version])
        self.error_feedback.load_state_dict(state["error_feedback"])
