"""Executes one stage's schedule: forward/backward on tagged weight versions, p2p, updates.

The schedule (asyncpp/schedules) decides the order; this file owns autograd, communication and
where each asynchronous handle is waited for:

- FORWARD/BACKWARD switch the parameters to the action's weight version first (weights.py).
- UPDATE_START(t) takes b_t's gradient and *starts* its reductions (reduction.GradientReduction: the DP
  sum, the tied-embedding sum, the all-reduce of [||g||^2, ||Δx_{t-2}||^2] over the stages and the TP/EP
  shards), none of which blocks; the later phases start at the first action boundary where their inputs
  are ready, in step order.
- UPDATE(t) completes whatever is left and waits for the norm only when x_{t+1} is needed, then clips,
  skips non-finite steps consistently on every stage, runs the optimizer into the buffer of x_{t+1}, and
  applies Error Feedback. In 2BW the wait falls m-(P-1-s) >= 1 microbatches after the start, so the DP
  and the cross-stage reductions cost no bubble.
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
from asyncpp.optim.clip import diff_sq_norm
from asyncpp.parallel.mesh import Mesh
from asyncpp.parallel.sharding import REPLICATED, ParamSharding
from asyncpp.pipeline.head import HeadComm, HeadHelper, unpack
from asyncpp.pipeline.p2p import StageComm
from asyncpp.pipeline.reduction import GradientReduction, ShardedGradientReduction
from asyncpp.pipeline.sharded import StageShards
from asyncpp.pipeline.stopping import ActionStream, receives_ahead
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
    update_finite: bool = True
    """False: a finite gradient gave a non-finite update; x_t was kept (the executor stops every rank)."""
    router_loads: list[float] = field(default_factory=list)
    """Per layer of the model: busiest expert / mean load of this step (0 for non-MoE layers)."""


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
        distributed_optimizer: bool = False,
        head_comm: HeadComm | None = None,
        head_helper: HeadHelper | None = None,
    ):
        """`distributed_optimizer` (with DP > 1): this rank owns, steps and keeps the state of only its share of
        the parameters (pipeline/sharded.py); the DP reduction goes to the owners and x_{t+1} is broadcast.
        `head_comm` (parallel.head_split=tokens, on the last stage and the helper) and `head_helper` (on the
        helper): pipeline/head.py. The last stage's forward_fn then returns (its loss share, the hidden states
        of the helper's tokens)."""
        self.module = module
        self.mesh = mesh
        self.comm = comm
        self.optimizer = optimizer
        self.versions = versions
        self.params = versions.params  # the module's: gradients accumulate here
        self.masters = versions.masters  # the optimizer's: updated in place
        versions.retarget(optimizer)
        self.forward_fn = forward_fn
        self.head_comm, self.head_helper = head_comm, head_helper
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
        self.timer = stage_timer(mesh.pp_rank, mesh.device)  # perf_counter on CPU, CUDA events on CUDA
        self.shards = None
        if distributed_optimizer and mesh.dims.dp > 1:
            if corrections.dc_lambda or corrections.grad_ef_lambda:
                raise ValueError("parallel.distributed_optimizer=true does not support the gradient corrections "
                                 "(staleness.dc_lambda, staleness.grad_ef_lambda); set them to 0 or turn it off")
            self.shards = StageShards(mesh, optimizer, self.masters, expert=self.expert_mask, tied=self.tied_mask,
                                      wait=self._wait, timer=self.timer)
        owned = self.shards.select(self.masters) if self.shards else self.masters
        if self.shards:
            self.shards.shard_masters(versions)  # bf16: the other owners' fp32 masters are dropped here
        # The step's mathematics after the gradient, shared with the simulator (asyncpp.core.update),
        # on the parameters this rank updates (all of them without the distributed optimizer).
        self.rule = UpdateRule(optimizer, owned, grad_clip=grad_clip, lr_multiplier=lr_multiplier,
                               corrections=corrections, balancing=self.balancing,
                               raise_on_nonfinite_update=False)  # every rank must stop together: stopping.py
        self.error_feedback = self.rule.error_feedback
        self._read_version: dict[int, int] = {}  # step -> the weight version its forwards/backwards read
        self.inflight: dict[tuple[int, int], tuple[Tensor | None, Tensor]] = {}
        self.losses: dict[int, list[Tensor]] = {}
        self.records: dict[int, StepRecord] = {}
        # ||Δx_t||^2 of this stage's applied updates, waiting to ride along with a later step's
        # gradient-norm all-reduce (no extra collective). Lag 2: in 2BW the last stage starts the
        # reduction of b_{t+1} before it applies x_{t+1}, but always after it applied x_t.
        self._update_sq: dict[int, float] = {}
        common = {"grad_scale": grad_scale, "tied_mask": self.tied_mask, "layouts": self.layouts,
                  "count_in_norm": self.count_in_norm, "correct": self._correct,
                  "take_update_sq": self._take_update_sq, "wait": self._wait, "load_stats": self.load_stats}
        self.reduction = (ShardedGradientReduction(mesh, ownership=self.shards.ownership, **common) if self.shards
                          else GradientReduction(mesh, **common))

    def rescale(self, grad_scale: float) -> None:
        """A new gradient scale (1/m of a new segment, under a batch rampup). Only between segments: a pending
        reduction would mix the two scales."""
        if self.reduction.pending:
            raise RuntimeError(f"the gradient scale changes while steps {sorted(self.reduction.pending)} are still "
                               "being reduced; change it only at a drained segment boundary")
        self.grad_scale = self.reduction.grad_scale = grad_scale

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
    def run(self, actions: Iterable[Action] | ActionStream) -> Iterator[tuple[Op, int]]:
        """Run the actions in order, yielding (op, t) after each UPDATE_START(t) and UPDATE(t): the caller
        posts and reads the stop agreement there, and collects what is complete (control stays with the
        caller; nothing is called back). Given an ActionStream, the caller may cut it at an UPDATE's yield (a
        stop, stopping.py); `stream.fixed` tells it how much is executed or posted."""
        handlers = {Op.FORWARD: self._forward, Op.BACKWARD: self._backward, Op.HEAD: self._head,
                    Op.UPDATE_START: self._update_start, Op.UPDATE: self._update}
        stream = actions if isinstance(actions, ActionStream) else ActionStream(actions)
        scan, posted = 0, -1  # the next action to consider for a receive; the last compute action posted
        i = 0
        while i < len(stream.actions):
            todo, action = stream.actions, stream.actions[i]
            self.comm.poll()
            self._progress()
            scan = min(scan, stream.fixed)  # after a cut, its tail past the fixed prefix is new: rescan it
            scan, newly = receives_ahead(todo, i, scan, posted)
            for k in newly:
                self._post_receive(todo[k])
                posted = k
            stream.fixed = max(i + 1, posted + 1)
            handlers[action.op](action)
            i += 1
            if action.op in (Op.UPDATE_START, Op.UPDATE):
                yield action.op, action.step

    def execute(self, actions: Iterable[Action]) -> None:
        """Run the actions in order."""
        for _ in self.run(actions):
            pass

    def _post_receive(self, a: Action) -> None:
        if a.op is Op.FORWARD and not self.mesh.is_first_stage:
            self.comm.post_recv_forward()
        elif a.op is Op.BACKWARD and not self.mesh.is_last_stage:
            self.comm.post_recv_backward()
        elif a.op is Op.HEAD:
            self.head_comm.post_recv_forward()
        if a.op is Op.BACKWARD and self._splits_head:
            self.head_comm.post_recv_backward()

    @property
    def _splits_head(self) -> bool:
        """The last stage of a head split: its forward sends the helper's share, its backward receives it."""
        return self.head_comm is not None and self.mesh.is_last_stage

    def _forward(self, a: Action) -> None:
        x = None
        if not self.mesh.is_first_stage:
            x = self.comm.recv_forward(f"the input activation of {a}").requires_grad_()
        if self.shards and a.version == self.versions.newest:
            self.versions.sync()  # the broadcast of x_{t+1}: its wait is an event of its own, not forward time
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
        if self._splits_head:  # (own loss share, the helper's hidden states): the loss is complete at B
            self.head_comm.send_hidden(out[1], a.step)
        elif self.mesh.is_last_stage:
            self.losses.setdefault(a.step, []).append(out.detach())
        else:
            self.comm.send_forward(out, a.step)
        self.inflight[(a.step, a.microbatch)] = (x, out)
        self.timer.add(a, start, self.timer.now())

    def _backward(self, a: Action) -> None:
        x, out = self.inflight.pop((a.step, a.microbatch))
        grad = None if self.mesh.is_last_stage else self.comm.recv_backward(f"the output gradient of {a}")
        message = self.head_comm.recv_backward(f"the head's gradient of {a}") if self._splits_head else None
        start = self.timer.now()
        self._use(a)
        if message is not None:
            self._backward_split_head(a, out, message)
        else:
            backward_through(out, grad)
        sent = x.grad if x is not None else None
        if x is not None:
            self.comm.send_backward(sent, a.step)
            self.comm.release(x)  # the graph that read it is gone; its .grad is in the send's hands
        if grad is not None and grad is not sent:  # a stage without layers may pass `grad` itself on
            self.comm.release(grad)
        self.timer.add(a, start, self.timer.now())

    def _backward_split_head(self, a: Action, out: tuple[Tensor, Tensor], message: Tensor) -> None:
        """The last stage's loss of (t, j) is its own share plus the helper's; both shares back-propagate."""
        own_loss, shared = out
        grad, helper_loss = unpack(message, self.head_comm.split, shared.dtype)
        self.losses.setdefault(a.step, []).append(own_loss.detach() + helper_loss)
        torch.autograd.backward((own_loss, shared), (None, grad))
        self.head_comm.release(message)

    def _head(self, a: Action) -> None:
        """The helper's HEAD(t, j): the head and loss of its token share on (t, j)'s version (pipeline/head.py)."""
        hidden = self.head_comm.recv_forward(f"the head's hidden states of {a}")
        start = self.timer.now()
        self._use(a)
        self.head_helper.run(a.step, a.microbatch, hidden)
        self.timer.add(a, start, self.timer.now())

    def _use(self, a: Action) -> None:
        """Point the module at the version `a` reads (its weight prediction for delayed steps, if on)."""
        self.versions.use(a.version, predicted=self.is_delayed(a.step))

    def _update_start(self, a: Action) -> None:
        start = self.timer.now()
        grads = self.versions.take_grads()  # in the masters' dtype (fp32 sums under bf16 compute)
        if self.head_helper is not None:  # the head weight's part of b_t that the HEADs kept apart
            self.head_helper.add_into(a.step, grads, self.params)
        self.reduction.start(a.step, grads, self._router_loads(a.step))
        self.timer.add(a, start, self.timer.now())

    def _progress(self) -> None:
        """Advance what is in flight without blocking: the reductions, and a completed broadcast of x_{t+1}.
        The reduction work done here (b_t's scaling, corrections and norm, deferred until its all-reduce has
        arrived) is UPDATE_START(t)'s, so it is timed as U0: left untimed it would count as bubble."""
        start = self.timer.now()
        advanced = self.reduction.progress()
        if advanced:
            self.timer.add(Action(Op.UPDATE_START, advanced[-1]), start, self.timer.now())
        if self.shards and self.versions.filling and self.shards.broadcast_done():
            self.versions.sync()

    def per_parameter(self, values: list) -> list:
        """A list over the parameters the rule updates, spread over every parameter (None: another owner's)."""
        return self.shards.aligned(values) if self.shards else values

    def _take_update_sq(self, step: int) -> float | None:
        return self._update_sq.pop(step, None)

    def _router_loads(self, step: int) -> list[Tensor]:
        """This rank's expert loads of b_step, as float so they ride the DP gradient all-reduce."""
        if self.balancing is None:
            return []
        return [load.float() for load in self.balancing.pop_loads(step)]

    def _update(self, a: Action) -> None:
        wait_start = self.timer.now()
        pending = self.reduction.finish(a.step)
        self._retire_sends(a.step)
        start = self.timer.now()
        grad_sq, update_sq, *loads = pending.reduction.tolist()
        if pending.norm_of_step is not None:
            self._record(pending.norm_of_step).update_norm = math.sqrt(update_sq)
        self._read_version.pop(a.step, None)
        record = self._record(a.step)
        record.grad_norm, record.router_loads = math.sqrt(grad_sq), loads
        x_t = self.versions.begin_update(a.step)
        grads, delayed = pending.grads, self._delayed(a.step)
        counted = self.reduction.count_in_norm  # the distributed optimizer's: owned tensors only
        if self.shards:
            grads, x_t, delayed = self.shards.select(grads), self.shards.select(x_t), self.shards.select(delayed)
            counted = self.shards.select(counted)
        outcome = self.rule.apply(a.step, grads, record.grad_norm, x_t, delayed, pending.loads)
        record.lr, record.skipped, record.update_finite = outcome.lr, outcome.skipped, outcome.update_finite
        # Chunk by chunk (clip.diff_sq_norm), not a second copy of the stage; the simulator's fp64 sum order.
        self._update_sq[a.step] = 0.0 if outcome.skipped else diff_sq_norm(
            [q for q, c in zip(self.rule.masters, counted) if c], [x for x, c in zip(x_t, counted) if c])
        if self.shards:  # x_{t+1} of the other owners' parameters: waited for at its first read
            self.versions.fill_newest_later(self.shards.start_broadcast(a, self.versions.newest_buffer()))
        self.versions.recycle(pending.grads)  # the next step but one accumulates into them
        self.timer.add(a, start, self.timer.now())
        self.timer.add(a, wait_start, start, kind="idle")  # dropped if shorter than timer.MIN_IDLE_S

    def _retire_sends(self, step: int) -> None:
        """Free the sends of steps <= step: the norm all-reduce that `reduction.finish(step)` completed spans
        every stage, which proves they were received (StageComm.retire)."""
        self.comm.retire(step)
        if self.head_comm is not None:
            self.head_comm.retire(step)

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
        if self.head_comm is not None:
            self.head_comm.flush()
        steps = sorted(self._update_sq)  # the same steps on every stage: each stage ran every UPDATE
        if not steps:
            return
        reduction = self.reduction.all_reduce_norms([self._update_sq.pop(t) for t in steps],
                                                    "the final update-norm all-reduce")
        for t, sq in zip(steps, reduction):
            self._record(t).update_norm = math.sqrt(sq)

    def step_loss(self, step: int) -> float:
        """Mean loss of b_t over microbatches and DP replicas (last stage only)."""
        losses = self.losses.pop(step)
        total = torch.stack(losses).double().sum().reshape(1)
        if self.mesh.dims.dp > 1:
            self._wait(dist.all_reduce(total, group=self.mesh.dp_group, async_op=True), "the loss all-reduce")
        return float(total) / (len(losses) * self.mesh.dims.dp)
