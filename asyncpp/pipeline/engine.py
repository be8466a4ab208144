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

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from asyncpp.parallel.mesh import Mesh
from asyncpp.pipeline.p2p import StageComm
from asyncpp.pipeline.stopping import ActionStream, receives_ahead
from asyncpp.pipeline.timer import StageTimer
from asyncpp.pipeline.update import StageUpdate, StepRecord
from asyncpp.pipeline.vocab_head import VocabEmbedding, VocabHead
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


class StageEngine:
    def __init__(self, *, module: nn.Module, mesh: Mesh, comm: StageComm, update: StageUpdate,
                 forward_fn: ForwardFn, timer: StageTimer, vocab_head: VocabHead | None = None,
                 embedding: VocabEmbedding | None = None):
        """`update` is the stage's update (its weight versions, reductions and rule: update.py);
        `vocab_head` (parallel.head=vocab, every stage): pipeline/vocab_head.py; the
        last stage's forward_fn then returns its normed hidden states. `embedding` (parallel.embedding=vocab, every
        stage): the E and G actions; the first stage's forward_fn then gets the summed embedding as its input."""
        self.module, self.mesh, self.comm, self.update = module, mesh, comm, update
        self.versions = update.versions
        self.forward_fn = forward_fn
        self.timer = timer  # perf_counter on CPU, CUDA events on CUDA
        self.vocab_head = vocab_head
        self.embedding = embedding
        self._deferred: dict[int, list[Tensor]] = {}  # step -> its gradient, waiting for the step's last G
        self._last_g: dict[int, int] = {}  # step -> index of its last G in `_last_g_of` (the list it indexed)
        self._last_g_of: tuple[list[Action], int] | None = None
        self._stream: ActionStream | None = None
        self._index = 0
        self.current: Action | None = None
        """The action running now (None between segments): what a failure report names (parallel/failfast.py)."""
        self.inflight: dict[tuple[int, int], tuple[Tensor | None, Tensor]] = {}
        self.losses: dict[int, list[Tensor]] = {}

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
                    Op.UPDATE_START: self._update_start, Op.UPDATE: self._update,
                    Op.VOCAB_FORWARD: self._vocab_forward, Op.VOCAB_BACKWARD: self._vocab_backward,
                    Op.EMBED_FORWARD: self._embed_forward, Op.EMBED_BACKWARD: self._embed_backward}
        stream = actions if isinstance(actions, ActionStream) else ActionStream(actions)
        self._stream = stream
        scan, posted = 0, -1  # the next action to consider for a receive; the last compute action posted
        i = 0
        while i < len(stream.actions):
            todo, action = stream.actions, stream.actions[i]
            self.comm.poll()
            if self.vocab_head is not None:
                self.vocab_head.poll()
            if self.embedding is not None:
                self.embedding.poll()
            self._progress()
            scan = min(scan, stream.fixed)  # after a cut, its tail past the fixed prefix is new: rescan it
            scan, newly = receives_ahead(todo, i, scan, posted)
            for k in newly:
                self._post_receive(todo[k])
                posted = k
            stream.fixed = max(i + 1, posted + 1)
            self._index = i
            self.current = action
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
        elif a.op is Op.VOCAB_FORWARD:
            self.vocab_head.post_hidden(a.step, a.microbatch)

    def _forward(self, a: Action) -> None:
        x = None
        if not self.mesh.is_first_stage:
            x = self.comm.recv_forward(f"the input activation of {a}").requires_grad_()
        elif self.embedding is not None:  # the sum of every stage's part of the lookup (E)
            x = self.embedding.input(a.step, a.microbatch, str(a)).requires_grad_()
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
        if self.vocab_head is not None and self.mesh.is_last_stage:  # the normed hidden states, to every S
            self.vocab_head.send_hidden(a.step, a.microbatch, out)
        elif self.mesh.is_last_stage:
            self.losses.setdefault(a.step, []).append(out.detach())
        else:  # a stage without layers passes its input on: freeing it would free the input its backward reads
            self.comm.send_forward(out, a.step, free_after=out is not x)
        self.inflight[(a.step, a.microbatch)] = (x, out)
        self.timer.add(a, start, self.timer.now())

    def _backward(self, a: Action) -> None:
        x, out = self.inflight.pop((a.step, a.microbatch))
        if not self.mesh.is_last_stage:
            grad = self.comm.recv_backward(f"the output gradient of {a}")
        elif self.vocab_head is not None:
            grad = self.vocab_head.input_grad(a.step, a.microbatch, str(a))
        else:
            grad = None
        start = self.timer.now()
        self._use(a)
        backward_through(out, grad)
        sent = x.grad if x is not None else None
        if x is not None and self.mesh.is_first_stage:  # a sharded embedding's input gradient, to every G
            self.embedding.send_grad(a.step, a.microbatch, sent)
        elif x is not None:
            self.comm.send_backward(sent, a.step)
            self.comm.release(x)  # the graph that read it is gone; its .grad is in the send's hands
        if grad is not None and grad is not sent:  # a stage without layers may pass `grad` itself on
            self.comm.release(grad)  # (a no-op for the head's reduced gradient: the comm did not allocate it)
        self.timer.add(a, start, self.timer.now())

    def _vocab_forward(self, a: Action) -> None:
        """S(t, j): this stage's logits and softmax statistics of (t, j) on its version (pipeline/vocab_head.py)."""
        if self.mesh.is_last_stage:
            hidden = self.inflight[(a.step, a.microbatch)][1]
        else:
            hidden = self.vocab_head.received_hidden(a.step, a.microbatch, str(a))
        start = self.timer.now()
        self._use(a)
        self.vocab_head.forward(a.step, a.microbatch, hidden)
        self.timer.add(a, start, self.timer.now())

    def _vocab_backward(self, a: Action) -> None:
        """T(t, j): the loss of (t, j), this shard's gradients, the reduce of the partial input gradient."""
        self.vocab_head.await_statistics(a.step, a.microbatch, str(a))
        start = self.timer.now()
        self._use(a)
        loss = self.vocab_head.backward(a.step, a.microbatch, str(a))
        if self.mesh.is_last_stage:
            self.losses.setdefault(a.step, []).append(loss)
        self.timer.add(a, start, self.timer.now())

    def _embed_forward(self, a: Action) -> None:
        """E(t, j): this stage's part of (t, j)'s embedding on its version, reduced onto the first stage."""
        start = self.timer.now()
        self._use(a)
        self.embedding.forward(a.step, a.microbatch)
        self.timer.add(a, start, self.timer.now())

    def _embed_backward(self, a: Action) -> None:
        """G(t, j): this stage's rows' embedding gradient of (t, j). The step's last G on a stage past its
        UPDATE_START(t) completes b_t's gradient there and starts its reductions (_start_reductions)."""
        start = self.timer.now()
        self.embedding.backward(a.step, a.microbatch, str(a))
        if a.step in self._deferred and not self._embedding_pending(a.step):
            self._start_reductions()
        self.timer.add(a, start, self.timer.now())

    def _embedding_pending(self, step: int) -> bool:
        """Whether a G of `step` is still ahead of the running action in the stream."""
        actions = self._stream.actions
        # A new segment's or a cut stream's list: index its Gs again. Holding the list itself (not its id, which a
        # later segment's list could reuse once this one is freed) keeps the index tied to it.
        if self._last_g_of is None or self._last_g_of[0] is not actions or self._last_g_of[1] != len(actions):
            self._last_g = {x.step: k for k, x in enumerate(actions) if x.op is Op.EMBED_BACKWARD}
            self._last_g_of = (actions, len(actions))
        return self._last_g.get(step, -1) > self._index

    def _start_reductions(self) -> None:
        """Start the deferred steps' reductions whose Gs have all run, in step order (one order of the norm
        all-reduces on every stage: a later step never starts before an earlier one)."""
        for step in sorted(self._deferred):
            if self._embedding_pending(step):
                break
            grads = self._deferred.pop(step)
            self.embedding.add_into(step, grads, self.versions.params)
            self.update.start(step, grads)

    def _use(self, a: Action) -> None:
        """Point the module at the version `a` reads (its weight prediction for delayed steps, if on)."""
        self.versions.use(a.version, predicted=self.update.is_delayed(a.step))

    def _update_start(self, a: Action) -> None:
        start = self.timer.now()
        grads = self.versions.take_grads()  # in the masters' dtype (fp32 sums under bf16 compute)
        if self.vocab_head is not None:  # the head rows' part of b_t that the Ts kept apart
            self.vocab_head.add_into(a.step, grads, self.versions.params)
        if self.embedding is not None:  # the embedding rows' part: complete once the step's last G has run
            self._deferred[a.step] = grads
            self._start_reductions()
        else:
            self.update.start(a.step, grads)
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
        if self.vocab_head is not None:
            self.vocab_head.retire(step)
        if self.embedding is not None:
            self.embedding.retire(step)

    # ---- end of a run / drain --------------------------------------------------------------
    def finish(self) -> None:
        """Complete outstanding sends and reduce the last update's norm (all stages call this)."""
        self.current = None
        self.comm.flush()
        if self.vocab_head is not None:
            self.vocab_head.flush()
        if self.embedding is not None:
            if self._deferred:
                raise RuntimeError(f"stage {self.mesh.pp_rank}: steps {sorted(self._deferred)} still wait for "
                                   "their embedding gradients at a drain")
            self.embedding.flush()
        self.update.drain()

    def take_record(self, step: int) -> StepRecord:
        """The update's record of `step`, handed over once: the executor reports it, and then it is gone."""
        return self.update.records.pop(step)

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
