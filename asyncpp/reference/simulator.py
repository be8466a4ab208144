"""Single-process simulator of every schedule's mathematics: the reference the pipeline must equal.

    x_{t+1} = x_t - U_t( g(x_{t-d}; b_t) ),   x_{-k} := x_0,

with d = 0 (sync, GPipe, 1F1B), d = 1 (PipeDream-2BW) or d = P-1-s per stage s (original PipeDream),
d = 0 during synchronous start/cooldown, and optionally the staleness corrections of
asyncpp.core.staleness on top (update-level Error Feedback; and, simulator only: gradient-level EF,
DC-ASGD, weight prediction). Optional diagnostics compare each K-th step's update with the fresh one.

Written by hand (not a library) because this *is* the contract of the project: the multi-process
engine is tested against it. It is deliberately simple: past versions are whole clones of the
parameters, and a step swaps the stale version into the live parameters for forward/backward, then
swaps x_t back before the optimizer runs.

Mixed precision (compute_dtype=bf16, train.precision=bf16) uses the pieces of asyncpp.pipeline.weights, so the
floats are the pipeline's: the module's parameters and the past versions are bf16, the optimizer steps
fp32 masters (x_t), and each microbatch's bf16 gradient is summed in fp32 (GradSums). With
compute_dtype None or fp32, `masters` *are* the parameters and nothing changes.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from copy import deepcopy
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from asyncpp.core.balancing import RouterBiasVersions, RouterLoadStats, balanced_routers
from asyncpp.core.loss import LossFn, lm_loss
from asyncpp.core.masters import GradSums, is_mixed, make_masters, retarget
from asyncpp.core.records import StepResult
from asyncpp.core.staleness import predict_weights
from asyncpp.core.stateful import load_in_place
from asyncpp.core.update import Corrections, UpdateRule
from asyncpp.optim.build import AnyOptimizer
from asyncpp.optim.clip import clip_, diff_sq_norm, grad_sq_norm
from asyncpp.schedules.registry import buffers_for_delay


@dataclass
class TiedUse:
    """A second use of a shared parameter (`module.attr is param`) that reads it at `delay`."""

    module: nn.Module
    attr: str
    param: nn.Parameter
    delay: int


class VersionHistory:
    """x_t and the past versions the delays read, as the simulator keeps them (Stateful, core/stateful.py): x_t is
    the optimizer's `masters` (fp32 under mixed precision; the parameters themselves otherwise), `past[k]` holds
    x_{t-1-k} in the parameters' (compute) dtype, like the pipeline's buffers."""

    def __init__(self, params: list[nn.Parameter], masters: list[Tensor], num_past: int):
        self.params, self.masters = params, masters
        self.past: deque[list[Tensor]] = deque(maxlen=num_past or None)

    def state_dict(self) -> dict[str, list[Tensor]]:
        """{str(age): x_{t-age}}: the masters (age 0) and every past version held."""
        out = {"0": [q.detach() for q in self.masters]}
        out.update({str(age + 1): version for age, version in enumerate(self.past)})
        return out

    def load_state_dict(self, state: dict[str, Sequence[Tensor]]) -> None:
        """Take `state`'s versions (in place already for state_dict()'s tensors); the parameters then hold x_t."""
        mine = self.state_dict()
        for age, tensors in state.items():
            load_in_place(mine[age], tensors)
        self.sync_params()

    def expect(self, newest: int) -> list[int]:
        """Before a load of a checkpoint of step `newest`: fresh past versions, as many as the run holds by then
        (x_{-k} := x_0 is never stored); returns the ages the load must fill."""
        held = min(newest, self.past.maxlen or 0)
        self.past.clear()
        for _ in range(held):
            self.past.append([torch.empty_like(p) for p in self.params])
        return list(range(held + 1))

    def copied(self) -> dict[int, list[bool]] | None:
        """One process holds every tensor it saves: no copies of another rank's masters."""
        return None

    @torch.no_grad()
    def sync_params(self) -> None:
        """Mixed precision: the parameters (bf16) take the masters' values x_t (no-op otherwise)."""
        if self.masters is not self.params:
            torch._foreach_copy_(self.params, [q.detach() for q in self.masters])


class DelayedUpdateSimulator:
    """Applies each step's gradient to newer weights than the ones it was computed on.

    `delays[i]` is the steady-state delay of `params[i]` (see asyncpp.schedules.registry.stage_delay);
    `sync_step(t)` says whether step t is synchronous (delay 0 for every parameter).

    Corrections (each off by default, and then bit-identical to plain delayed training; each acts only
    on parameters whose delay at that step is > 0; order within a step as in asyncpp.core.staleness):
    - ef_lambda: update-level Error Feedback, x_{t+1} = x_t - u_t - lam (u_t - u_{t-1});
    - grad_ef_lambda: gradient-level EF, the base optimizer sees g_t + lam (g_t - g_{t-1});
    - dc_lambda: DC-ASGD, the base optimizer sees g + lam * g * g * (x_t - x_read), x_read being the
      weights the gradient was computed on (x_{t-d});
    - weight_prediction: the forward/backward of b_t reads x^ = x_{t-d} + d (x_{t-d} - x_{t-d-1}) instead
      of x_{t-d} (asyncpp.core.staleness.predict_weights); x_read is then x^.
    diagnostics_every=K > 0: at steps t with t % K == 0 the fresh update U_t(g(x_t; b_t)) is computed
    first, through a deep copy of the optimizer (same state, lr and clipping), and not applied; weights,
    optimizer state and RNG are restored, so the trajectory is bit-identical with diagnostics on or off.
    routers: the model's bias-balanced routers in core/balancing.py's interface (default: balanced_routers(model);
    a megatron GPTModel's: pipeline/megatron_balancing.megatron_balanced_routers).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: AnyOptimizer,
        delays: Sequence[int],
        *,
        loss_fn: LossFn = lm_loss,
        grad_clip: float = 0.0,
        ef_lambda: float = 0.0,
        lr_multiplier: Callable[[int], float] | None = None,
        sync_step: Callable[[int], bool] = lambda t: False,
        tied_use: TiedUse | None = None,
        grad_ef_lambda: float = 0.0,
        dc_lambda: float = 0.0,
        weight_prediction: bool = False,
        diagnostics_every: int = 0,
        compute_dtype: torch.dtype | None = None,
        routers: dict[str, Any] | None = None,
    ):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.balancing = RouterBiasVersions(balanced_routers(model) if routers is None else routers,
                                            max(delays, default=0) + 1)
        self.load_stats = RouterLoadStats.of(model)
        index = {n: i for i, (n, p) in enumerate((n, p) for n, p in model.named_parameters() if p.requires_grad)}
        # A router's bias is read at the delay of its own weights (PipeDream: its stage's delay).
        self._router_param = [index[f"{name}.router.weight"] for name in self.balancing.names]
        if len(delays) != len(self.params):
            raise ValueError(f"got {len(delays)} delays for {len(self.params)} parameters")
        self.optimizer = optimizer
        # What the optimizer and every correction act on: fp32 masters under mixed precision (the
        # parameters are cast to compute_dtype here), else the parameters themselves.
        self.mixed = is_mixed(compute_dtype)
        self.masters = make_masters(self.params, compute_dtype) if self.mixed else self.params
        self.grad_sums = GradSums(self.params) if self.mixed else None
        if self.mixed:
            retarget(optimizer, self.params, self.masters)
        self.delays = list(delays)
        self.loss_fn = loss_fn
        self.lr_multiplier = lr_multiplier
        self.sync_step = sync_step
        self.tied_use = tied_use
        # The step's mathematics after the gradient, shared with the pipeline engine (asyncpp.core.update).
        self.rule = UpdateRule(optimizer, self.masters, grad_clip=grad_clip, lr_multiplier=lr_multiplier,
                               corrections=Corrections(ef_lambda, grad_ef_lambda, dc_lambda),
                               balancing=self.balancing)
        self.error_feedback = self.rule.error_feedback
        self.grad_error_feedback = self.rule.grad_error_feedback
        self.grad_clip = grad_clip
        if diagnostics_every < 0:
            raise ValueError(f"staleness.diagnostics_every={diagnostics_every} must be >= 0 (0 = off)")
        self.weight_prediction = weight_prediction
        self.diagnostics_every = diagnostics_every
        self.max_delay = max(self.delays, default=0)
        # history[k] holds x_{t-1-k}: the past versions of the registry's rule (x_t itself is the model).
        past = buffers_for_delay(self.max_delay, weight_prediction=weight_prediction) - 1
        self.versions = VersionHistory(self.params, self.masters, past)
        self.history: deque[list[Tensor]] = self.versions.past

    @property
    def num_past_versions(self) -> int:
        """How many past versions (x_{t-1}, x_{t-2}, ...) the simulator keeps (what a checkpoint must hold)."""
        return self.history.maxlen or 0

    def delays_at(self, step: int) -> list[int]:
        return [0] * len(self.params) if self.sync_step(step) else self.delays

    def _version(self, delay: int, current: list[Tensor]) -> list[Tensor]:
        """x_{t-delay}; versions older than x_0 are x_0 (pipeline warm-up)."""
        if delay == 0 or not self.history:
            return current
        return self.history[min(delay, len(self.history)) - 1]

    def _read(self, delay: int, current: list[Tensor], index: int) -> Tensor:
        """The weights of params[index] a computation at `delay` reads: x_t, x_{t-delay}, or with weight
        prediction x_{t-d} + d (x_{t-d} - x_{t-d-1})."""
        if delay == 0:
            return current[index]
        stale = self._version(delay, current)[index]
        if not self.weight_prediction:
            return stale
        return predict_weights(stale, self._version(delay + 1, current)[index], delay)

    @torch.no_grad()
    def _load(self, delays: list[int], reads: list[Tensor]) -> None:
        for p, d, x in zip(self.params, delays, reads):
            if d:
                p.copy_(x)

    @torch.no_grad()
    def _restore(self, delays: list[int], current: list[Tensor]) -> None:
        for p, d, x in zip(self.params, delays, current):
            if d:
                p.copy_(x)

    def _accumulate(self, microbatches: Sequence[Tensor], step: int | None = None) -> float:
        """Sum the microbatch gradients (the caller divides by m): the mean-loss gradient of b_t.

        Summing first (instead of scaling each loss by 1/m) lets auxiliary losses that a model
        attaches inside its graph (MoE balancing) keep their own coefficient; the pipeline engine
        uses the same convention so both produce the same floats.
        """
        total = 0.0
        for tokens in microbatches:
            loss = self.loss_fn(self.model, tokens)
            if step is not None:  # the step's own forwards (not the diagnostics' fresh one)
                self.load_stats.record(step)
            loss.backward()
            total += loss.item()
        if self.grad_sums is not None:  # mixed precision: the fp32 sums become the masters' gradients
            for q, g in zip(self.masters, self.grad_sums.pop()):
                q.grad = g
        return total / len(microbatches)

    def sync_params(self) -> None:
        """Mixed precision: the parameters (bf16) take the masters' values x_t (no-op otherwise)."""
        self.versions.sync_params()

    def _stored(self, version: list[Tensor]) -> list[Tensor]:
        """A past version as kept in `history`: in the parameters' (compute) dtype, like the pipeline's buffers."""
        return [x.to(p.dtype) for x, p in zip(version, self.params)]

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
        version = self._read(delay, current, index)
        copy = nn.Parameter(version.detach().to(use.param.dtype, copy=True))
        sums = GradSums([copy]) if self.mixed else None
        setattr(use.module, use.attr, copy)
        try:
            yield
        finally:
            setattr(use.module, use.attr, use.param)
        grad = sums.pop()[0] if sums is not None else copy.grad
        target = self.masters[index]  # the parameter itself unless mixed precision
        if grad is not None:
            target.grad = grad if target.grad is None else target.grad + grad

    def _take_grads(self) -> list[Tensor | None]:
        """The step's gradient per master, handed to the update rule (the masters' .grad is cleared)."""
        grads = [q.grad for q in self.masters]
        for q in self.masters:
            q.grad = None
        return grads

    def _clip(self) -> tuple[float, bool]:
        grads = [q.grad for q in self.masters if q.grad is not None]
        norm = math.sqrt(grad_sq_norm(grads))
        clip_(grads, self.grad_clip, norm)
        return norm, bool(grads) and math.isfinite(norm)

    def step(self, step: int, microbatches: Sequence[Tensor]) -> StepResult:
        """One optimizer step t consuming minibatch b_t = `microbatches` (its step_time_s includes the diagnostics'
        fresh update on diagnostics steps)."""
        started = time.perf_counter()
        delays = self.delays_at(step)
        delayed = [d > 0 for d in delays]
        current = [q.detach().clone() for q in self.masters]  # x_t (fp32 under mixed precision)
        diagnose = self.diagnostics_every > 0 and step % self.diagnostics_every == 0
        if diagnose:
            self.balancing.use(step)
        fresh = self._fresh_update(step, microbatches, current) if diagnose else None
        self.balancing.discard()
        reads = [self._read(d, current, i) for i, d in enumerate(delays)]
        self._load(delays, reads)
        self.balancing.use([step - delays[i] for i in self._router_param])
        self.optimizer.zero_grad(set_to_none=True)
        with self._tied_second_use(step, current):
            loss = self._accumulate(microbatches, step)
        if self.balancing:
            self.balancing.record(step)
        self._average(len(microbatches))
        self._restore(delays, current)
        grads = self._take_grads()
        self.rule.correct(grads, delayed, current, reads)
        grad_norm = math.sqrt(grad_sq_norm([g for g in grads if g is not None]))
        loads = self.balancing.pop_loads(step) if self.balancing else ()
        outcome = self.rule.apply(step, grads, grad_norm, current, delayed, loads)
        lr, finite = outcome.lr, not outcome.skipped
        update_norm = math.sqrt(diff_sq_norm(self.masters, current))
        cosine, rel_error = self._compare(current, fresh) if fresh is not None and finite else (None, None)
        self.sync_params()
        if self.max_delay:
            self.history.appendleft(self._stored(current))
        tokens = sum(int(mb[:, 1:].numel()) for mb in microbatches)
        loads = self.load_stats.vector(step, torch.device("cpu")).tolist() if self.load_stats else []
        return StepResult(step, loss, grad_norm, update_norm, lr, not finite, tokens, time.perf_counter() - started,
                          loads, cosine, rel_error)

    def _average(self, num_microbatches: int) -> None:
        grads = [q.grad for q in self.masters if q.grad is not None]
        torch._foreach_mul_(grads, 1.0 / num_microbatches)

    def _fresh_update(self, step: int, microbatches: Sequence[Tensor], current: list[Tensor]) -> list[Tensor] | None:
        """U_t(g(x_t; b_t)) through a deep copy of the optimizer (same state, lr, clipping), not applied.

        Runs before the delayed forward/backward, so whatever a forward records for logging (MoE
        router statistics) is the real step's. Weights, gradients and RNG state are left as found;
        the real optimizer is never touched. None if the fresh gradient is not finite."""
        shadow = deepcopy(self.optimizer, memo={id(q): q for q in self.masters})
        shadow.zero_grad(set_to_none=True)
        cuda = sorted({p.device.index or 0 for p in self.params if p.device.type == "cuda"})
        with torch.random.fork_rng(devices=cuda):
            self._accumulate(microbatches)
        self._average(len(microbatches))
        _, finite = self._clip()
        fresh = None
        if finite:
            if self.lr_multiplier is not None:
                shadow.set_lr_multiplier(self.lr_multiplier(step))
            shadow.step()
            with torch.no_grad():
                fresh = [x - q for x, q in zip(current, self.masters)]
        shadow.zero_grad(set_to_none=True)
        with torch.no_grad():
            for q, x in zip(self.masters, current):
                q.copy_(x)
        return fresh

    @torch.no_grad()
    def _compare(self, current: list[Tensor], fresh: list[Tensor]) -> tuple[float, float]:
        """(cosine, relative error) of the applied update x_t - x_{t+1} against `fresh`, in fp64."""
        dot = applied_sq = fresh_sq = diff_sq = torch.zeros((), dtype=torch.float64)
        for x, p, f in zip(current, self.masters, fresh):
            a, f = (x - p).double(), f.double()
            dot = dot + (a * f).sum()
            applied_sq = applied_sq + (a * a).sum()
            fresh_sq = fresh_sq + (f * f).sum()
            diff_sq = diff_sq + (a - f).pow(2).sum()
        dot, applied_sq, fresh_sq, diff_sq = (float(v) for v in (dot, applied_sq, fresh_sq, diff_sq))
        cosine = dot / math.sqrt(applied_sq * fresh_sq) if applied_sq > 0 and fresh_sq > 0 else math.nan
        rel_error = math.sqrt(diff_sq) / math.sqrt(fresh_sq) if fresh_sq > 0 else math.nan
        return cosine, rel_error
