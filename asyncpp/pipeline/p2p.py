"""Activation and gradient exchange between neighbouring pipeline stages, correct under NCCL's rules.

Each link (s, s+1) has two 2-rank groups (Mesh.links): activations travel s -> s+1 on one, gradients
s+1 -> s on the other. On each, one end only sends and the other only receives, in the order the
schedule produces and consumes them (FIFO per direction, asyncpp/schedules/invariants.py), so NCCL's
"the ops of a pair run in issue order on one stream" cannot deadlock; docs/nccl.md has the argument
and the replay tier (tests/nccl/) that checks it against the ops real runs issue.

- Sends are asynchronous (isend) and never waited for on the critical path: `poll` frees the sent
  activation once the transfer reports completion, and `retire(t)` frees every send of steps <= t at
  UPDATE(t), when the step's cross-stage norm all-reduce proves their receivers have consumed them.
  The second is needed because gloo's send handle reports completion only inside `wait()`
  (`is_completed()` stays False after the peer has received): relying on `poll` alone kept every sent
  activation of a segment alive until its drain, and RSS grew with run length. Every send is checked
  against the agreed buffer (shape, dtype) first: NCCL would corrupt data or hang on a mismatch where
  gloo only sometimes errors.
- Receives can be posted ahead of use (`post_recv_forward/backward`, the engine posts one action
  ahead); `recv_forward/backward` take the oldest posted one of that direction (or post it now) and
  wait for it. Shapes are fixed up front, so no shape handshake is needed.
- Waits: on CPU (gloo) a timed `Work.wait`, which blocks the thread. On CUDA a stream-ordered
  `Work.wait()` (the compute stream waits, the CPU goes on), with hang detection by a host-side
  `Watchdog` thread so it does not serialize the GPU. Both fail with "stage N (rank R) gave up
  waiting for X".
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from asyncpp.parallel import flight
from asyncpp.parallel.collectives import CollectiveTimeout, timeout_message
from asyncpp.parallel.mesh import Mesh


class PipelineTimeout(CollectiveTimeout):
    """A rank waited too long for a neighbour or a collective (or the peer's connection broke)."""


class P2PMismatch(ValueError):
    """A send whose shape or dtype differs from the buffer the receiving stage posted."""


def _timeout_message(mesh: Mesh, what: str, timeout_s: float, cause: str) -> str:
    return timeout_message(f"stage {mesh.pp_rank} (rank {mesh.rank})", what, timeout_s, cause)


@contextlib.contextmanager
def naming_the_peer(mesh: Mesh, what: str, timeout_s: float) -> Iterator[None]:
    """Turn a raw backend error (gloo's "Connection reset by peer" when a peer died, an NCCL error) raised
    while posting an op or in a blocking collective into a PipelineTimeout that names this stage and `what`."""
    try:
        with flight.about(what):
            yield
    except RuntimeError as e:  # DistBackendError and gloo's errors are RuntimeErrors
        if isinstance(e, CollectiveTimeout):  # already names its stage and what it waited for
            raise
        raise PipelineTimeout(_timeout_message(mesh, what, timeout_s, str(e))) from e


def wait_for(work: dist.Work, timeout_s: float, mesh: Mesh, what: str) -> None:
    """work.wait() that turns a hang or a dead peer into an error naming this stage and `what` (blocks
    the calling thread: the CPU/gloo path)."""
    flight.note_wait(work, what)
    try:
        work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise PipelineTimeout(_timeout_message(mesh, what, timeout_s, str(e))) from e


class Watchdog:
    """Host-side hang detection for stream-ordered waits (CUDA): a daemon thread polls the handles the
    compute stream waits on; one that is not complete after `timeout_s` becomes a PipelineTimeout,
    printed at once and raised in the training thread at its next `check()` (every action). A training
    thread stuck in a device synchronization is released by torch's own NCCL watchdog, whose timeout
    is the same train.timeout_s (init_distributed), after our message names what hung."""

    def __init__(self, mesh: Mesh, timeout_s: float, period_s: float | None = None):
        self.mesh, self.timeout_s = mesh, timeout_s
        self.period_s = period_s if period_s is not None else min(1.0, timeout_s / 10)
        self._watched: list[tuple[float, dist.Work, str]] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.error: PipelineTimeout | None = None

    def watch(self, work: dist.Work, what: str) -> None:
        with self._lock:
            self._watched.append((time.monotonic() + self.timeout_s, work, what))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="asyncpp-watchdog", daemon=True)
            self._thread.start()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def scan(self) -> None:
        """One pass: drop completed handles, turn the first expired one into `error`."""
        now = time.monotonic()
        with self._lock:
            self._watched = [(d, w, what) for d, w, what in self._watched if not w.is_completed()]
            expired = next(((d, what) for d, _, what in self._watched if d <= now), None)
        if expired is not None and self.error is None:
            self.error = PipelineTimeout(_timeout_message(self.mesh, expired[1], self.timeout_s,
                                                          "not complete on the device"))
            print(str(self.error), file=sys.stderr, flush=True)

    def _run(self) -> None:
        while self.error is None:
            time.sleep(self.period_s)
            self.scan()


class StageComm:
    """A stage's links to its neighbours: asynchronous sends retired at UPDATE(t), receives posted ahead, and every
    wait of the stage, timed and named (the module docstring)."""

    def __init__(self, mesh: Mesh, shape: tuple[int, ...], dtype: torch.dtype, timeout_s: float = 300.0):
        self.timeout_s = timeout_s
        self.mesh = mesh
        self.shape = shape
        self.dtype = dtype
        self.prev = mesh.global_rank(mesh.pp_rank - 1) if not mesh.is_first_stage else None
        self.next = mesh.global_rank(mesh.pp_rank + 1) if not mesh.is_last_stage else None
        self.links = mesh.links  # one group per direction between each pair of neighbours (Mesh._build_links)
        # One switch for the GPU path: stream-ordered waits watched from the host (see the docstring).
        self.stream_waits = mesh.device.type == "cuda"
        self.watchdog = Watchdog(mesh, timeout_s) if self.stream_waits else None
        # (work, payload, output-to-free or None, step or None) of sends in flight, oldest first; the payload
        # must stay alive until its send completes. The step is the training step the send belongs to
        # (`retire`); None for an evaluation's sends, which `flush` waits for.
        self._pending: deque[tuple[dist.Work, Tensor, Tensor | None, int | None]] = deque()
        # Receives posted ahead of use, per direction, oldest first: (work, buffer, src rank).
        self._posted: dict[str, deque[tuple[dist.Work, Tensor, int]]] = {"forward": deque(), "backward": deque()}
        # Receive buffers handed back by the engine once nothing reads them (`release`), reused by the next
        # receive: a stage allocates at most its peak of in-flight receives, once, instead of one buffer per
        # microbatch (a fresh 0.25-256 MB block per receive fragments the host heap, and RSS grows with run
        # length). `_owned` maps the id of each buffer this comm made to a weak reference to it, so nothing else
        # enters the pool: a buffer handed out and never released (an evaluation's) dies and its id is reused by
        # another object, which the id alone would let in.
        self._free: list[Tensor] = []
        self._owned: dict[int, weakref.ref] = {}

    # ---- waiting ------------------------------------------------------------------------------
    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for a p2p op or a collective: stream-ordered on CUDA (watched), timed on CPU."""
        if self.stream_waits:
            flight.note_wait(work, what)
            work.wait()
            self.watchdog.watch(work, what)
        else:
            wait_for(work, self.timeout_s, self.mesh, what)

    # ---- receiving ----------------------------------------------------------------------------
    def _buffer(self) -> Tensor:
        if self._free:
            return self._free.pop()
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.mesh.device)
        self._owned[id(buf)] = weakref.ref(buf)
        return buf

    def release(self, received: Tensor) -> None:
        """Hand a received tensor back once nothing reads it any more (the engine: an input activation after
        its microbatch's backward, an output gradient after the backward it fed). Its `.grad` is dropped
        (a send of it holds its own reference until it completes); tensors this comm did not allocate
        (a host-staged copy, an evaluation's activation) are left alone."""
        owned = self._owned.get(id(received))
        if owned is None or owned() is not received:
            return
        received.grad = None
        received.requires_grad_(False)
        self._free.append(received)

    def _arrived(self, buf: Tensor) -> Tensor:
        """The received buffer as the stage uses it (a host-staged subclass moves it to the device)."""
        return buf

    def _post(self, direction: str) -> None:
        src, group = ((self.prev, self.links.recv_forward) if direction == "forward"
                      else (self.next, self.links.recv_backward))
        buf = self._buffer()
        with naming_the_peer(self.mesh, f"the next {direction} receive from rank {src} (posting it)", self.timeout_s):
            work = dist.irecv(buf, src=src, group=group)
        self._posted[direction].append((work, buf, src))

    def post_recv_forward(self) -> None:
        """Post the receive of the next activation now; `recv_forward` picks it up (FIFO)."""
        self._post("forward")

    def post_recv_backward(self) -> None:
        self._post("backward")

    def _take(self, direction: str, what: str) -> Tensor:
        if not self._posted[direction]:
            self._post(direction)
        work, buf, src = self._posted[direction].popleft()
        self.wait(work, f"{what} from rank {src}")
        return self._arrived(buf)

    def recv_forward(self, what: str = "an activation") -> Tensor:
        """The activation of the previous stage (waits until it arrives)."""
        return self._take("forward", what)

    def recv_backward(self, what: str = "an output gradient") -> Tensor:
        """The gradient of this stage's output, from the next stage."""
        return self._take("backward", what)

    # ---- sending ------------------------------------------------------------------------------
    def _payload(self, tensor: Tensor) -> Tensor:
        return tensor.detach().contiguous()

    def _check(self, tensor: Tensor, what: str, dst: int) -> None:
        if tuple(tensor.shape) != tuple(self.shape) or tensor.dtype != self.dtype:
            raise P2PMismatch(
                f"stage {self.mesh.pp_rank} (rank {self.mesh.rank}) would send {what} of shape {list(tensor.shape)} "
                f"and dtype {tensor.dtype} to rank {dst}, which receives into a buffer of shape {list(self.shape)} "
                f"and dtype {self.dtype}. On NCCL this corrupts data or hangs. Make the stage's output match the "
                "pipeline buffer: the compute dtype (train.precision / pipeline_dtype) and [micro_batch_size, "
                "seq_len (/ tp under sequence parallelism), hidden_size]"
            )

    def _send(self, tensor: Tensor, dst: int, group, what: str, free_after: bool, step: int | None) -> None:
        self._check(tensor, what, dst)
        payload = self._payload(tensor)
        of_step = f" of step {step}" if step is not None else ""
        with naming_the_peer(self.mesh, f"{what}{of_step} to rank {dst} (posting the send)", self.timeout_s):
            work = dist.isend(payload, dst=dst, group=group)
        self._pending.append((work, payload, tensor if free_after else None, step))

    def send_forward(self, output: Tensor, step: int | None = None, free_after: bool = True) -> None:
        """Send the output activation of training step `step` (None: an evaluation's); its storage is
        released once the send has completed (`poll`, `retire`, `flush`).

        Only the data is freed: the autograd graph hanging off `output` stays, and the engine's
        backward does not need the output's values (see engine.backward_through). `free_after`=False: the
        output is the stage's own input (a stage without layers), which its backward still needs whole.
        """
        self._send(output, self.next, self.links.send_forward, "an activation", free_after=free_after, step=step)

    def send_backward(self, input_grad: Tensor, step: int | None = None) -> None:
        self._send(input_grad, self.prev, self.links.send_backward, "an input gradient", free_after=False,
                   step=step)

    # ---- bookkeeping --------------------------------------------------------------------------
    def poll(self) -> None:
        """Release what completed sends no longer need; raise a hang the watchdog found."""
        if self.watchdog is not None:
            self.watchdog.check()
        while self._pending and self._pending[0][0].is_completed():
            self._release(*self._pending.popleft()[:3])

    def retire(self, step: int) -> None:
        """Release every send of steps <= `step`: the engine calls it at UPDATE(step), once the step's
        cross-stage gradient-norm all-reduce has completed. By then every stage of the pipeline has run
        UPDATE_START(step), so every FORWARD, BACKWARD and HEAD of steps <= step on every stage is done, and
        each of them consumed its input: each of these sends has been received, and waiting for it returns
        at once. (Waiting before that proof could deadlock: a gloo send completes only when the receiver has
        posted its receive.) Sends are kept in issue order, but steps interleave (2BW's forwards of t+1 run
        before UPDATE(t)): later sends stay pending."""
        keep: deque = deque()
        while self._pending:
            work, payload, owner, sent_step = self._pending.popleft()
            if sent_step is None or sent_step > step:
                keep.append((work, payload, owner, sent_step))
                continue
            self.wait(work, f"a send of step {sent_step} to a neighbouring stage (received by now)")
            self._release(work, payload, owner)
        self._pending = keep

    def flush(self) -> None:
        """Wait for every send in flight (before exit or a drain). Every posted receive must have been
        consumed by then: a drained pipeline has nothing in flight."""
        posted = {d: len(q) for d, q in self._posted.items() if q}
        if posted:
            raise RuntimeError(f"stage {self.mesh.pp_rank}: receives posted but never used at a drain: {posted}")
        while self._pending:
            work, payload, owner, _ = self._pending.popleft()
            self.wait(work, "a send to a neighbouring stage to complete")
            self._release(work, payload, owner)

    @staticmethod
    def _release(work, payload: Tensor, owner: Tensor | None) -> None:
        if owner is not None:
            # Megatron's deallocate_output_tensor: keep the graph node, drop the values.
            owner.data = torch.empty((1,), dtype=owner.dtype, device=owner.device)
