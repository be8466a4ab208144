"""Executes one stage's schedule: forward/backward on tagged weight versions, p2p, updates.

The schedule (asyncpp/schedules) decides the order; this file owns autograd, communication and
where each asynchronous handle is waited for:

- FORWARD/BACKWARD switch the parameters to the action's weight version first (weights.py).
- UPDATE_START(t) takes b_t's gradient and *starts* its reductions, none of which blocks: the DP
  all-reduce (bucketed, in place for large tensors), then, once that has completed, the
  tied-embedding all-reduce (first/last stage) and the all-reduce of [||g||^2, ||Δx_{t-1}||^2] over
  the stages and the TP/EP shards (mesh.norm_group; replicas are counted once). The later phases
  are started at the first action boundary where their inputs are ready (`_progress`), in step order.
- UPDATE(t) completes whatever phase is left and waits for the norm only when x_{t+1} is needed,
  then clips, skips non-finite steps consistently on every stage, runs the optimizer into the buffer
  of x_{t+1}, and applies Error Feedback. In 2BW the wait falls m-(P-1-s) >= 1 microbatches after
  the start, so the DP and the cross-stage reductions cost no bubble.
- Receives are posted one compute action ahead of their use (p2p.StageComm), and every wait goes
  through the comm: timed on CPU, stream-ordered and watched from the host on CUDA.

The gradient of a step is (sum of microbatch gradients) * grad_scale, like the simulator's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from asyncpp.core.balancing import RouterBiasVersions, RouterLoadStats
from asyncpp.core.update import NO_CORRECTIONS, Corrections, UpdateRule
from asyncpp.optim.clip import grad_sq_norm
from asyncpp.parallel.mesh import Mesh
from asyncpp.parallel.sharding import REPLICATED, ParamSharding
from asyncpp.pipeline.buckets import Bucket, start_buckets
from asyncpp.pipeline.p2p import StageComm
from asyncpp.pipeline.timer import stage_timer
from asyncpp.pipeline.weights import WeightVersions
from asyncpp.schedules.actions import Action, Op

ForwardFn = Callable[[int, int, "Tensor | None"], Tensor]
"""forward_fn(step, microbatch, input_activation_or_None) -> output activation, or the scalar loss
on the last stage. It runs on whatever weight version the engine has switched the module to."""


def backward_through(output: Tensor, grad: Tensor | None) -> None:
    """Backward from a (possibly deallocated) output. Skips autograd's shape check on purpose:
    the output's values were freed after it was sent (p2p.StageComm.send_forward), only its graph
    node is left, exactly as Megatron's custom_backward does."""
    if grad is None:
        output.backward()
        return
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad,), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True,
    )


@dataclass
class StepRecord:
    step: int
    loss: float = math.nan
    grad_norm: float = math.nan
    update_norm: float = math.nan
    lr: float = math.nan
    skipped: bool = False
    router_loads: list[float] = field(default_factory=list)
    """Per layer of the model: busiest expert / mean load of this step (0 for non-MoE layers)."""


@dataclass
class _PendingUpdate:
    grads: list[Tensor]
    reduction: Tensor | None
    """[||g||^2, ||Δx||^2, loads...], all-reduced over mesh.norm_group; None until phase "started"."""
    work: object | None
    norm_of_step: int | None
    """The earlier step whose ||Δx||^2 rides along in `reduction` (None if nothing rides)."""
    tied_work: object | None = None
    """The last stage's tied-embedding all-reduce, waited for only in UPDATE."""
    loads: list[Tensor] = field(default_factory=list)
    """b_t's expert loads per balanced router, summed over DP (aux-loss-free balancing)."""
    step: int = -1
    buckets: list[Bucket] = field(default_factory=list)
    """The DP / expert-DP all-reduces in flight (phase "dp")."""
    phase: str = "dp"
    """"dp" (DP buckets in flight) -> "tied" (tied all-reduce started) -> "started" (norm all-reduce started)."""


class StageEngine:
    def __init__(
        self,
        *,
        module: nn.Module,
        mesh: Mesh,
        comm: StageComm,
        optimizer,
        versions: WeightVersions,
        forward_fn: ForwardFn,
        grad_scale: float,
        grad_clip: float = 0.0,
        corrections: Corrections = NO_CORRECTIONS,
        lr_multiplier: Callable[[int], float] | None = None,
        is_delayed: Callable[[int], bool] = lambda t: True,
        tied: Iterable[nn.Parameter] = (),
        tied_is_delayed: Callable[[int], bool] | None = None,
        layouts: Sequence[ParamSharding] | None = None,
        balancing: RouterBiasVersions | None = None,
        load_stats: RouterLoadStats | None = None,
    ):
        self.module = module
        self.mesh = mesh
        self.comm = comm
        self.optimizer = optimizer
        self.versions = versions
        self.params = versions.params  # the module's: gradients accumulate here
        self.masters = versions.masters  # the optimizer's: updated in place
        versions.retarget(optimizer)
        self.forward_fn = forward_fn
        self.grad_scale = grad_scale
        self.is_delayed = is_delayed
        # A tied weight's corrections follow its owner, the first stage (the simulator's view of the
        # parameter); its copy here may be read at another delay (original PipeDream's last stage).
        self.tied_is_delayed = tied_is_delayed or is_delayed
        tied_ids = {id(p) for p in tied}
        self.tied_mask = [id(p) in tied_ids for p in self.params]
        self.layouts = list(layouts) if layouts is not None else [REPLICATED] * len(self.params)
        if len(self.layouts) != len(self.params):
            raise ValueError(f"{len(self.layouts)} parameter layouts for {len(self.params)} parameters")
        self.expert_mask = [lay.expert for lay in self.layouts]
        self.balancing = balancing if balancing else None
        self.load_stats = load_stats if load_stats else None
        self.count_in_norm = [self._counted(t, lay) for t, lay in zip(self.tied_mask, self.layouts)]
        # The step's mathematics after the gradient, shared with the simulator (asyncpp.core.update).
        self.rule = UpdateRule(optimizer, self.masters, grad_clip=grad_clip, lr_multiplier=lr_multiplier,
                               corrections=corrections, balancing=self.balancing)
        self.error_feedback = self.rule.error_feedback
        self._read_version: dict[int, int] = {}  # step -> the weight version its forwards/backwards read
        self.inflight: dict[tuple[int, int], tuple[Tensor | None, Tensor]] = {}
        self.losses: dict[int, list[Tensor]] = {}
        self.pending: dict[int, _PendingUpdate] = {}
        self.records: dict[int, StepRecord] = {}
        # ||Δx_t||^2 of this stage's applied updates, waiting to ride along with a later step's
        # gradient-norm all-reduce (no extra collective). Lag 2: in 2BW the last stage starts the
        # reduction of b_{t+1} before it applies x_{t+1}, but always after it applied x_t.
        self._update_sq: dict[int, float] = {}
        self.timer = stage_timer(mesh.pp_rank, mesh.device)  # perf_counter on CPU, CUDA events on CUDA

    def _counted(self, tied: bool, layout: ParamSharding) -> bool:
        """Whether this rank's copy enters the global norms (all-reduced over mesh.norm_group): every
        tensor is counted exactly once. The tied weight on the first stage; a TP-replicated tensor on
        TP rank 0; a tensor replicated over the EP group (everything but experts) on EP rank 0."""
        if tied and not self.mesh.is_first_stage:
            return False
        if not layout.is_tp_sharded and self.mesh.tp_rank != 0:
            return False
        return layout.expert or self.mesh.ep_rank == 0

    # ---- actions -------------------------------------------------------------------------
    def run(self, actions: Iterable[Action]) -> Iterator[int]:
        """Run the actions in order, yielding t after each UPDATE(t): the caller collects what is complete
        (control stays with the caller; nothing is called back)."""
        handlers = {Op.FORWARD: self._forward, Op.BACKWARD: self._backward,
                    Op.UPDATE_START: self._update_start, Op.UPDATE: self._update}
        actions = list(actions)
        compute = [i for i, a in enumerate(actions) if a.op in (Op.FORWARD, Op.BACKWARD)]
        ahead = 0  # index into `compute` of the next compute action whose receive is not posted yet
        for i, action in enumerate(actions):
            self.comm.poll()
            self._progress_pending()
            # Post the receive of every compute action up to the first one after this action: one
            # compute action ahead, in the order they are consumed (each direction is FIFO on its own
            # communicator, so a receive posted early never blocks anything else).
            while ahead < len(compute) and (ahead == 0 or compute[ahead - 1] <= i):
                self._post_receive(actions[compute[ahead]])
                ahead += 1
            handlers[action.op](action)
            if action.op == Op.UPDATE:
                yield action.step

    def execute(self, actions: Iterable[Action]) -> None:
        """Run the actions in order."""
        for _ in self.run(actions):
            pass

    def _post_receive(self, a: Action) -> None:
        if a.op is Op.FORWARD and not self.mesh.is_first_stage:
            self.comm.post_recv_forward()
        elif a.op is Op.BACKWARD and not self.mesh.is_last_stage:
            self.comm.post_recv_backward()

    def _forward(self, a: Action) -> None:
        x = None
        if not self.mesh.is_first_stage:
            x = self.comm.recv_forward(f"the input activation of {a}").requires_grad_()
        start = self.timer.now()
        self._use(a)
        self._read_version[a.step] = a.version
        if self.balancing is not None:
            self.balancing.use(a.version)
        out = self.forward_fn(a.step, a.microbatch, x)
        if self.balancing is not None:
            self.balancing.record(a.step)
        if self.load_stats is not None:
            self.load_stats.record(a.step)
        if self.mesh.is_last_stage:
            self.losses.setdefault(a.step, []).append(out.detach())
        else:
            self.comm.send_forward(out)
        self.inflight[(a.step, a.microbatch)] = (x, out)
        self.timer.add(a, start, self.timer.now())

    def _backward(self, a: Action) -> None:
        x, out = self.inflight.pop((a.step, a.microbatch))
        grad = None if self.mesh.is_last_stage else self.comm.recv_backward(f"the output gradient of {a}")
        start = self.timer.now()
        self._use(a)
        backward_through(out, grad)
        sent = x.grad if x is not None else None
        if x is not None:
            self.comm.send_backward(sent)
            self.comm.release(x)  # the graph that read it is gone; its .grad is in the send's hands
        if grad is not None and grad is not sent:  # a stage without layers may pass `grad` itself on
            self.comm.release(grad)
        self.timer.add(a, start, self.timer.now())

    def _use(self, a: Action) -> None:
        """Point the module at the version `a` reads (its weight prediction for delayed steps, if on)."""
        self.versions.use(a.version, predicted=self.is_delayed(a.step))

    def _update_start(self, a: Action) -> None:
        start = self.timer.now()
        grads = self.versions.take_grads()  # in the masters' dtype (fp32 sums under bf16 compute)
        # Sum over microbatches, replicas and the tied pair first, scale once at the end: the
        # simulator's order of floating-point operations.
        loads = self._router_loads(a.step)
        self._reduce_partial_tp(grads)
        pending = _PendingUpdate(grads, None, None, None, loads=loads, step=a.step,
                                 buckets=self._start_data_parallel(grads, loads))
        self.pending[a.step] = pending
        self._progress_pending()
        self.timer.add(a, start, self.timer.now())

    def _progress_pending(self) -> None:
        """Advance the pending steps' reductions without blocking, oldest first: a step's norm
        all-reduce is never started before an older step's (one order on every member of norm_group)."""
        for t in sorted(self.pending):
            if not self._progress(self.pending[t], block=False):
                return

    def _take_pending(self, step: int) -> _PendingUpdate:
        """UPDATE(step)'s pending reductions, every phase started (blocking for what is left)."""
        pending = self.pending.pop(step)
        self._progress(pending, block=True)
        return pending

    def _progress(self, p: _PendingUpdate, block: bool) -> bool:
        """dp -> tied -> started (see the module docstring); True once the norm all-reduce has started.
        Without `block`, a phase advances only when the handles it needs have completed."""
        if p.phase == "dp":
            if not block and not all(b.work.is_completed() for b in p.buckets):
                return False
            for b in p.buckets:
                b.finish(self._wait)
            p.buckets = []
            p.tied_work = self._start_tied(p.grads)
            p.phase = "tied"
        if p.phase == "tied":
            if p.tied_work is not None and self.mesh.is_first_stage:
                # The first stage counts the tied weight in the global norm, so it needs the sum first.
                if not block and not p.tied_work.is_completed():
                    return False
                self._wait(p.tied_work, f"the tied-embedding gradient all-reduce of step {p.step} with the last stage")
                p.tied_work = None
            self._start_norm(p)
            p.phase = "started"
        return True

    def _start_norm(self, p: _PendingUpdate) -> None:
        """Scale b_t's gradient and start the all-reduce of [||g||^2, ||Δx_{t-2}||^2, loads]."""
        grads = p.grads
        # The last stage's tied part may still be in flight: it is scaled in UPDATE, after the wait.
        in_flight = [t and p.tied_work is not None for t in self.tied_mask]
        torch._foreach_mul_([g for g, f in zip(grads, in_flight) if not f], self.grad_scale / self.mesh.dims.dp)
        self._correct(p.step, grads, only=[not f for f in in_flight])
        grad_sq = grad_sq_norm([g for g, c in zip(grads, self.count_in_norm) if c])
        lagged = p.step - 2
        update_sq = self._update_sq.pop(lagged, None)
        reduction = torch.tensor([grad_sq, update_sq or 0.0], dtype=torch.float64, device=self.mesh.device)
        if self.load_stats is not None:  # router loads ride along: one slot per layer of the model
            reduction = torch.cat([reduction, self.load_stats.vector(p.step, self.mesh.device)])
        p.reduction, p.norm_of_step = reduction, lagged if update_sq is not None else None
        if self.mesh.norm_group_size > 1:
            p.work = dist.all_reduce(reduction, group=self.mesh.norm_group, async_op=True)

    def _reduce_partial_tp(self, grads: list[Tensor]) -> None:
        """Tensors replicated over TP whose gradient each TP rank holds only in part (a norm under
        sequence parallelism) are summed over TP first, so every TP rank applies the same update."""
        partial = [g for g, lay in zip(grads, self.layouts) if lay.tp_grad_reduce]
        if partial and self.mesh.dims.tp > 1:
            self._all_reduce_flat(partial, self.mesh.tp_group, "the tensor-parallel gradient all-reduce")

    def _router_loads(self, step: int) -> list[Tensor]:
        """This rank's expert loads of b_step, as float so they ride the DP gradient all-reduce."""
        if self.balancing is None:
            return []
        return [load.float() for load in self.balancing.pop_loads(step)]

    def _start_data_parallel(self, grads: list[Tensor], loads: Sequence[Tensor] = ()) -> list[Bucket]:
        """Start the sum over the replicas of each tensor: DP for dense tensors; for experts the edp group
        only, because the all-to-all already summed the tokens of the EP group into their gradients.
        Router loads (per-rank token counts) are summed over all of DP, in the same all-reduce."""
        dense = [g for g, e in zip(grads, self.expert_mask) if not e] + list(loads)
        experts = [g for g, e in zip(grads, self.expert_mask) if e]
        buckets = []
        if dense and self.mesh.dims.dp > 1:
            buckets += start_buckets(dense, self.mesh.dp_group, "the data-parallel gradient all-reduce")
        if experts and self.mesh.dims.edp > 1:
            buckets += start_buckets(experts, self.mesh.edp_group, "the expert-data-parallel gradient all-reduce")
        return buckets

    def _all_reduce_flat(self, grads: list[Tensor], group, what: str) -> None:
        """A blocking bucketed all-reduce (the TP partial sums, small)."""
        for bucket in start_buckets(grads, group, what):
            bucket.finish(self._wait)

    def _start_tied(self, grads: list[Tensor]):
        """semantics.md: the tied weight's gradient is the sum of the first and last stage's parts.
        Started here, when this stage finished b_t; returns the handle (None if nothing is tied)."""
        group = self.mesh.embedding_group
        tied = [g for g, t in zip(grads, self.tied_mask) if t]
        if group is None or not tied:
            return None
        if len(tied) != 1:
            raise RuntimeError(f"expected one tied embedding/head weight per stage, found {len(tied)}")
        return dist.all_reduce(tied[0], group=group, async_op=True)

    def _update(self, a: Action) -> None:
        pending = self._take_pending(a.step)
        wait_start = self.timer.now()
        if pending.work is not None:
            self._wait(pending.work, f"the cross-stage gradient-norm all-reduce of step {a.step}")
        if pending.tied_work is not None:
            self._wait(pending.tied_work, f"the tied-embedding gradient all-reduce of step {a.step}")
            tied = [g for g, t in zip(pending.grads, self.tied_mask) if t]
            torch._foreach_mul_(tied, self.grad_scale / self.mesh.dims.dp)
            self._correct(a.step, pending.grads, only=self.tied_mask)  # the tied part was deferred in UPDATE_START
        start = self.timer.now()
        grad_sq, update_sq, *loads = pending.reduction.tolist()
        if pending.norm_of_step is not None:
            self._record(pending.norm_of_step).update_norm = math.sqrt(update_sq)
        self._read_version.pop(a.step, None)
        record = self._record(a.step)
        record.grad_norm, record.router_loads = math.sqrt(grad_sq), loads
        x_t = self.versions.begin_update(a.step)
        outcome = self.rule.apply(a.step, pending.grads, record.grad_norm, x_t, self._delayed(a.step), pending.loads)
        record.lr, record.skipped = outcome.lr, outcome.skipped
        with torch.no_grad():  # one difference at a time, not a second copy of the stage (same fp64 sum order)
            self._update_sq[a.step] = 0.0 if outcome.skipped else sum(
                grad_sq_norm([q - x]) for q, x, c in zip(self.masters, x_t, self.count_in_norm) if c)
        self.versions.recycle(pending.grads)  # the next step but one accumulates into them
        self.timer.add(a, start, self.timer.now())
        self.timer.add(a, wait_start, start, kind="idle")  # dropped if shorter than timer.MIN_IDLE_S

    def _correct(self, step: int, grads: list[Tensor], only: list[bool]) -> None:
        """DC-ASGD and gradient-level EF on the gradients marked in `only` (before their norm is taken).
        x_t is the newest version: the schedule applies UPDATE(t-1) before UPDATE_START(t) (schedules/build.py)."""
        if not self.rule.corrects_gradients:
            return
        if self.versions.newest != step:
            raise RuntimeError(f"gradient corrections of step {step} need x_{step}, but the newest version is "
                               f"{self.versions.newest}: the schedule placed UPDATE({step - 1}) too late")
        x_read = self.versions.read_tensors(self._read_version[step], predicted=self.is_delayed(step))
        x_t = [q.detach() for q in self.masters]
        self.rule.correct(grads, self._delayed(step), x_t, x_read, only=only)

    def _delayed(self, step: int) -> list[bool]:
        """Per parameter: whether step's corrections apply to it (its delay at this step is > 0)."""
        own, tied = self.is_delayed(step), self.tied_is_delayed(step)
        return [tied if is_tied else own for is_tied in self.tied_mask]

    def _wait(self, work, what: str) -> None:
        self.comm.wait(work, what)

    def _record(self, step: int) -> StepRecord:
        return self.records.setdefault(step, StepRecord(step))

    # ---- end of a run / drain --------------------------------------------------------------
    def finish(self) -> None:
        """Complete outstanding sends and reduce the last update's norm (all stages call this)."""
        self.comm.flush()
        steps = sorted(self._update_sq)  # the same steps on every stage: each stage ran every UPDATE
        if not steps:
            return
        reduction = torch.tensor([self._update_sq.pop(t) for t in steps], dtype=torch.float64,
                                 device=self.mesh.device)
        if self.mesh.norm_group_size > 1:
            self._wait(dist.all_reduce(reduction, group=self.mesh.norm_group, async_op=True),
                       "the final update-norm all-reduce")
        for t, sq in zip(steps, reduction.tolist()):
            self._record(t).update_norm = math.sqrt(sq)

    def step_loss(self, step: int) -> float:
        """Mean loss of b_t over microbatches and DP replicas (last stage only)."""
        losses = self.losses.pop(step)
        total = torch.stack(losses).double().sum().reshape(1)
        if self.mesh.dims.dp > 1:
            self._wait(dist.all_reduce(total, group=self.mesh.dp_group, async_op=True), "the loss all-reduce")
        return float(total) / (len(losses) * self.mesh.dims.dp)
