"""Executes one stage's schedule: forward/backward on tagged weight versions, p2p, updates.

The schedule (asyncpp/schedules) decides the order; this file owns autograd, communication and
where each asynchronous handle is waited for:

- FORWARD/BACKWARD switch the parameters to the action's weight version first (weights.py).
- UPDATE_START(t) hands b_t's gradient to the stage's update (update.StageUpdate), which *starts* its
  reductions (the DP sum, the tied-embedding sum, the all-reduce of [||g||^2, ||Δx_{t-2}||^2] over the stages
  and the TP/EP shards), none of which blocks; the later phases start at the first action boundary where
  their inputs are ready (`progress`), in step order.
- UPDATE(t) completes whatever is left, waiting for the norm only when x_{t+1} is needed, then the update
  applies the rule into the buffer of x_{t+1}. In 2BW the wait falls m-(P-1-s) >= 1 microbatches after the
  start, so the DP and the cross-stage reductions cost no bubble.
- Receives are posted one compute action ahead of their use (p2p.StageComm), and every wait goes
  through the comm: timed on CPU, stream-ordered and watched from the host on CUDA.

The gradient of a step is (sum of microbatch gradients) * grad_scale, like the simulator's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from asyncpp.parallel.mesh import Mesh
from asyncpp.pipeline.p2p import StageComm
from asyncpp.pipeline.parts import PartAction, StageEntry, StageExit, StagePart
from asyncpp.pipeline.stopping import ActionStream, receives_ahead
from asyncpp.pipeline.timer import StageTimer
from asyncpp.pipeline.update import StageUpdate, StepRecord
from asyncpp.schedules.actions import Action, Op

P = TypeVar("P")
_STAGE_OPS = (Op.FORWARD, Op.BACKWARD, Op.UPDATE_START, Op.UPDATE)

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


class ActionObserver(Protocol):
    """Told of every action's boundaries (analysis/traced.py books ops and bytes to the action running)."""

    def begin(self, a: Action) -> None: ...

    def end(self, a: Action) -> None: ...


class NoObserver:
    def begin(self, a: Action) -> None:
        pass

    def end(self, a: Action) -> None:
        pass


class StageEngine:
    """One stage's 2BW: it runs the stage's actions in order. FORWARD and BACKWARD run the layers on the action's
    weight version between the stage's two ends (its entry gives the input and takes its gradient back, its exit
    takes the output and gives back its gradient: parts.py); UPDATE_START(t) hands b_t's gradient to the stage's
    update and UPDATE(t) applies it (update.StageUpdate). Any other action belongs to one of the stage's parts
    (a vocabulary-parallel head's S and T, a sharded embedding's E and G) and runs through one table."""

    def __init__(self, *, module: nn.Module, mesh: Mesh, comm: StageComm, update: StageUpdate,
                 forward_fn: ForwardFn, timer: StageTimer, entry: StageEntry, exit: StageExit,
                 parts: Sequence[StagePart] = ()):
        """`update` is the stage's update (its weight versions, reductions and rule: update.py); `entry` and `exit`
        the stage's ends, `parts` what it is built with besides its layers (parts.py: an end may be a part too).
        `forward_fn` gets the entry's input (None: the first stage's layers read the tokens) and returns what the
        exit takes (the scalar loss of a whole head, the last stage's hidden states for a vocabulary-parallel one)."""
        self.module, self.mesh, self.comm, self.update = module, mesh, comm, update
        self.versions = update.versions
        self.forward_fn = forward_fn
        self.timer = timer  # perf_counter on CPU, CUDA events on CUDA
        self.entry, self.exit, self.parts = entry, exit, list(parts)
        self.observer: ActionObserver = NoObserver()
        self._part_actions: dict[Op, tuple[StagePart, PartAction]] = {}
        for part in self.parts:
            for op, run in part.actions().items():
                if op in self._part_actions or op in _STAGE_OPS:
                    raise ValueError(f"two owners of the {op} actions: {type(part).__name__} and "
                                     f"{type(self._part_actions[op][0]).__name__ if op in self._part_actions else 'the engine'}")
                self._part_actions[op] = (part, run)
        # A part's share of b_t complete at UPDATE_START(t) joins then; one with a gradient op at its step's last.
        self._at_start = [p for p in self.parts if p.gradient_op is None]
        self._gradient_ops = {p.gradient_op for p in self.parts if p.gradient_op is not None}
        self._deferred: dict[int, list[Tensor]] = {}  # step -> its gradient, waiting for the step's last gradient op
        self._last_g: dict[int, int] = {}  # step -> index of its last gradient op in `_last_g_of` (the list indexed)
        self._last_g_of: tuple[list[Action], int] | None = None
        self._stream: ActionStream | None = None
        self._index = 0
        self.current: Action | None = None
        """The action running now (None between segments): what a failure report names (parallel/failfast.py)."""
        self.inflight: dict[tuple[int, int], tuple[Tensor | None, Tensor]] = {}
        self.losses: dict[int, list[Tensor]] = {}

    def part(self, kind: type[P]) -> P | None:
        """The stage's part of class `kind`, if it was built with one (the caller names it, the engine does not)."""
        return next((p for p in self.parts if isinstance(p, kind)), None)

    @property
    def records(self) -> dict[int, StepRecord]:
        return self.update.records

    # ---- actions -------------------------------------------------------------------------
    def run(self, actions: Iterable[Action] | ActionStream) -> Iterator[tuple[Op, int]]:
        """Run the actions in order, yielding (op, t) after each UPDATE_START(t) and UPDATE(t): the caller
        posts and reads the stop agreement there, and collects what is complete (control stays with the
        caller; nothing is called back). Given an ActionStream, the caller may cut it at an UPDATE's yield (a
        stop, stopping.py); `stream.fixed` tells it how much is executed or posted."""
        handlers = {Op.FORWARD: self._forward, Op.BACKWARD: self._backward,
                    Op.UPDATE_START: self._update_start, Op.UPDATE: self._update}
        stream = actions if isinstance(actions, ActionStream) else ActionStream(actions)
        self._stream = stream
        scan, posted = 0, -1  # the next action to consider for a receive; the last compute action posted
        i = 0
        while i < len(stream.actions):
            todo, action = stream.actions, stream.actions[i]
            self.comm.poll()
            for part in self.parts:
                part.poll()
            self._progress()
            scan = min(scan, stream.fixed)  # after a cut, its tail past the fixed prefix is new: rescan it
            scan, newly = receives_ahead(todo, i, scan, posted)
            for k in newly:
                self._post_receive(todo[k])
                posted = k
            stream.fixed = max(i + 1, posted + 1)
            self._index = i
            self.current = action
            self.observer.begin(action)
            try:
                handlers.get(action.op, self._part_action)(action)
            finally:
                self.observer.end(action)
            i += 1
            if action.op in (Op.UPDATE_START, Op.UPDATE):
                yield action.op, action.step

    def execute(self, actions: Iterable[Action]) -> None:
        """Run the actions in order."""
        for _ in self.run(actions):
            pass

    def _post_receive(self, a: Action) -> None:
        """Post the receive of a compute action (FORWARD or BACKWARD: stopping.receives_ahead) at the end it reads."""
        if a.op is Op.FORWARD:
            self.entry.post_input(a)
        else:
            self.exit.post_output_grad(a)

    def _forward(self, a: Action) -> None:
        x = self.entry.input(a)
        if self.update.shards and a.version == self.versions.newest:
            self.versions.sync()  # the broadcast of x_{t+1}: its wait is an event of its own, not forward time
        start = self.timer.now()
        self._use(a)
        self.update.note_read(a.step, a.version)
        balancing, load_stats = self.update.balancing, self.update.load_stats
        if balancing is not None:
            balancing.use(a.version)
        out = self.forward_fn(a.step, a.microbatch, x)
        if balancing is not None:
            balancing.record(a.step)
        if load_stats is not None:
            load_stats.record(a.step)
        self._keep_loss(a.step, self.exit.output(a, out, is_input=out is x))
        self.inflight[(a.step, a.microbatch)] = (x, out)
        self.timer.add(a, start, self.timer.now())

    def _backward(self, a: Action) -> None:
        x, out = self.inflight.pop((a.step, a.microbatch))
        grad = self.exit.output_grad(a)
        start = self.timer.now()
        self._use(a)
        backward_through(out, grad)
        sent = self.entry.send_input_grad(a, x)
        if grad is not None and grad is not sent:  # a stage without layers may pass `grad` itself on
            self.comm.release(grad)  # (a no-op for the head's reduced gradient: the comm did not allocate it)
        self.timer.add(a, start, self.timer.now())

    def _keep_loss(self, step: int, loss: Tensor | None) -> None:
        if loss is not None:  # the microbatch's loss, when this stage reports it
            self.losses.setdefault(step, []).append(loss)

    def _part_action(self, a: Action) -> None:
        """An action of one of the stage's parts (parts.PartAction): what it reads first, then its timed compute.
        The step's last gradient op of a part completes b_t's gradient on a stage past its UPDATE_START(t) and
        starts its reductions (_start_reductions)."""
        _, action = self._part_actions[a.op]
        ready = action.ready(a)
        start = self.timer.now()
        if action.switches_version:
            self._use(a)
        self._keep_loss(a.step, action.run(a, ready))
        if a.op in self._gradient_ops and a.step in self._deferred and not self._gradient_pending(a.step):
            self._start_reductions()
        self.timer.add(a, start, self.timer.now())

    def _gradient_pending(self, step: int) -> bool:
        """Whether a gradient op of `step` is still ahead of the running action in the stream."""
        actions = self._stream.actions
        # A new segment's or a cut stream's list: index its gradient ops again. Holding the list itself (not its id,
        # which a later segment's list could reuse once this one is freed) keeps the index tied to it.
        if self._last_g_of is None or self._last_g_of[0] is not actions or self._last_g_of[1] != len(actions):
            self._last_g = {x.step: k for k, x in enumerate(actions) if x.op in self._gradient_ops}
            self._last_g_of = (actions, len(actions))
        return self._last_g.get(step, -1) > self._index

    def _start_reductions(self) -> None:
        """Start the deferred steps' reductions whose gradient ops have all run, in step order (one order of the
        norm all-reduces on every stage: a later step never starts before an earlier one)."""
        for step in sorted(self._deferred):
            if self._gradient_pending(step):
                break
            grads = self._deferred.pop(step)
            for part in self.parts:
                if part.gradient_op is not None:
                    part.add_into(step, grads, self.versions.params)
            self.update.start(step, grads)

    def _use(self, a: Action) -> None:
        """Point the module at the version `a` reads (its weight prediction for delayed steps, if on)."""
        self.versions.use(a.version, predicted=self.update.is_delayed(a.step))

    def _update_start(self, a: Action) -> None:
        start = self.timer.now()
        grads = self.versions.take_grads()  # in the masters' dtype (fp32 sums under bf16 compute)
        for part in self._at_start:  # the parts' shares complete now (the head rows' part that the Ts kept apart)
            part.add_into(a.step, grads, self.versions.params)
        self._deferred[a.step] = grads  # the others' once their step's last gradient op has run
        self._start_reductions()
        self.timer.add(a, start, self.timer.now())

    def _progress(self) -> None:
        """Advance what is in flight without blocking (update.StageUpdate.progress). The reduction work done
        here (b_t's scaling, corrections and norm, deferred until its all-reduce has arrived) is
        UPDATE_START(t)'s, so it is timed as U0: left untimed it would count as bubble."""
        start = self.timer.now()
        advanced = self.update.progress()
        if advanced:
            self.timer.add(Action(Op.UPDATE_START, advanced[-1]), start, self.timer.now())

    def _update(self, a: Action) -> None:
        wait_start = self.timer.now()
        self.update.complete(a.step)
        self._retire_sends(a.step)
        start = self.timer.now()
        self.update.apply(a)
        self.timer.add(a, start, self.timer.now())
        self.timer.add(a, wait_start, start, kind="idle")  # dropped if shorter than timer.MIN_IDLE_S

    def _retire_sends(self, step: int) -> None:
        """Free the sends of steps <= step: the norm all-reduce that `reduction.finish(step)` completed spans
        every stage, which proves they were received (StageComm.retire)."""
        self.comm.retire(step)
        for part in self.parts:
            part.retire(step)

    # ---- end of a run / drain --------------------------------------------------------------
    def finish(self) -> None:
        """Complete outstanding sends and reduce the last update's norm (all stages call this)."""
        self.current = None
        self.comm.flush()
        if self._deferred:
            raise RuntimeError(f"stage {self.mesh.pp_rank}: steps {sorted(self._deferred)} still wait for their "
                               "parts' gradients at a drain")
        for part in self.parts:
            part.flush()
        self.update.drain()

    def take_record(self, step: int) -> StepRecord:
        """The update's record of `step`, handed over once: the executor reports it, and then it is gone."""
        return self.update.records.pop(step)

    def restore_record(self, record: StepRecord) -> None:
        """A checkpoint's newest applied record, put back into a fresh engine: the resumed Megatron front-end
        reports it until its next update (megatron_checkpoint.py)."""
        self.update.records[record.step] = record

    def take_losses(self, step: int) -> list[Tensor]:
        """b_t's microbatch losses, handed over once ([] where none are held): the Megatron front-end with a
        spread head reports them as Megatron's lm loss."""
        return self.losses.pop(step, [])

    def drop_losses(self) -> None:
        """Forget the microbatch losses no one will ask step_loss for (the Megatron front-end reports its
        losses through loss_func, so they would pile up over an unbounded run)."""
        self.losses.clear()

    def step_loss(self, step: int) -> float:
        """Mean loss of b_t over microbatches and DP replicas (last stage only)."""
        losses = self.losses.pop(step)
        total = torch.stack(losses).double().sum().reshape(1)
        if self.mesh.dims.dp > 1:
            self.comm.wait(dist.all_reduce(total, group=self.mesh.dp_group, async_op=True), "the loss all-reduce")
        return float(total) / (len(losses) * self.mesh.dims.dp)
