"""What a stage is built with besides its layers: its two ends and its parts (the engine runs them, engine.py).

A stage's layers read an input and give an output. Where the input comes from and where the output goes is the
stage's two ends:

- its **entry** (`StageEntry`): the link from stage s-1 (`UpstreamLink`), or on the first stage its embedding
  (`WholeEmbedding`: the layers look the tokens up themselves; or a sharded embedding, vocab_embedding.py);
- its **exit** (`StageExit`): the link to stage s+1 (`DownstreamLink`), or on the last stage its head
  (`WholeHead`: the layers end with the logits and the loss; or a vocabulary-parallel head, vocab_head.py).

A **part** (`StagePart`) is a piece of the stage with a life of its own over the schedule: the actions it owns (a
vocabulary-parallel head's S and T, a sharded embedding's E and G), run by the engine through one table; the
collectives it holds until they complete (`poll`), until UPDATE(t) proves every peer joined them (`retire`) or until
a drain (`flush`); and its share of the step's gradient, which joins b_t's gradient before the stage's reductions
start (`add_into`: at UPDATE_START(t), or once the step's last `gradient_op` has run when the part owns one).

The whole head and the whole embedding are parts too (with nothing to run), so the engine has no "no part" branch:
it loops over what it was built with.

An evaluation batch (forward only, on a drained pipeline: executor.PipelineExecutor.evaluate) runs through the same
pieces in this order, on every stage: each part's `evaluate_before` (a sharded embedding's lookup and its reduce),
the entry's `evaluation_input`, the layers, the exit's `evaluation_output`, then each part's `evaluate_after` (a
vocabulary-parallel head's broadcast and loss).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor, nn

from asyncpp.pipeline.p2p import StageComm
from asyncpp.schedules.actions import Action, Op

Wait = Callable[[object, str], None]


def nothing(a: Action) -> None:
    """An action step with nothing to do."""


@dataclass(frozen=True)
class PartAction:
    """How the engine runs one kind of a part's actions: `ready(a)` first, outside the timed compute (a wait on
    what the action reads, like a FORWARD's receive), then, timed, `run(a, ready's result)`, on a's weight version
    when `switches_version`. `run` returns the microbatch's loss when this stage reports it (else None)."""

    run: Callable[[Action, object], Tensor | None]
    ready: Callable[[Action], object] = nothing
    switches_version: bool = True


class StagePart(Protocol):
    """A piece of a stage with a life of its own over the schedule (see the module docstring)."""

    gradient_op: Op | None
    """The op whose last action of step t completes this part's share of b_t's gradient (None: complete at
    UPDATE_START(t))."""

    def actions(self) -> Mapping[Op, PartAction]:
        """The ops this part owns, and how each runs."""

    def add_into(self, step: int, grads: list[Tensor], params: list[nn.Parameter]) -> None:
        """Its share of b_step's gradient joins `grads` (the stage's, per parameter of `params`)."""

    def poll(self) -> None:
        """At every action boundary: free what has completed."""

    def retire(self, step: int) -> None:
        """At UPDATE(step): every peer has joined the collectives of steps <= step."""

    def flush(self) -> None:
        """At a drain: everything posted has been used; what is held completes."""

    reads_batches: bool
    """An evaluation needs the validation batches' tokens on this stage (a stage none of whose pieces does only
    relays activations)."""

    def evaluate_before(self, inputs: Tensor | None) -> None:
        """An evaluation batch's input ids, before the stage's layers run it."""

    def evaluate_after(self, labels: Tensor | None) -> float | None:
        """After the stage's layers and its exit ran the batch: its loss when this part reports it."""


class StageEntry(Protocol):
    """What gives the stage's layers their input, and takes its gradient back."""

    def post_input(self, a: Action) -> None:
        """One compute action ahead of FORWARD `a`: post the receive of its input."""

    def input(self, a: Action) -> Tensor | None:
        """FORWARD `a`'s input (requiring its gradient), or None: the layers read the tokens themselves."""

    def send_input_grad(self, a: Action, x: Tensor | None) -> Tensor | None:
        """After BACKWARD `a`: pass the input's gradient on; returns it (None without an input)."""

    def post_evaluation_input(self) -> None:
        """One evaluation batch ahead: post the receive of its input."""

    def evaluation_input(self, inputs: Tensor | None) -> Tensor:
        """An evaluation batch's input to the layers (the token ids themselves on a first stage that embeds them)."""


class StageExit(Protocol):
    """What takes the stage's output, and gives back its gradient."""

    def post_output_grad(self, a: Action) -> None:
        """One compute action ahead of BACKWARD `a`: post the receive of its output's gradient."""

    def output(self, a: Action, out: Tensor, is_input: bool) -> Tensor | None:
        """After FORWARD `a`: pass the output on; returns the microbatch's loss when it is this stage's.
        is_input: `out` is the stage's input itself (a stage without layers passes it on), which the input's
        backward still reads, so it must not be freed after a send."""

    def output_grad(self, a: Action) -> Tensor | None:
        """BACKWARD `a`'s output gradient (None: `out` is the scalar loss)."""

    def evaluation_output(self, out: Tensor) -> float | None:
        """After the layers ran an evaluation batch: pass `out` on; returns the batch's loss when it is this end's."""


class Part:
    """A part with nothing of its own: the defaults of every StagePart method."""

    gradient_op: Op | None = None
    reads_batches = False

    def actions(self) -> Mapping[Op, PartAction]:
        return {}

    def add_into(self, step: int, grads: list[Tensor], params: list[nn.Parameter]) -> None:
        pass

    def poll(self) -> None:
        pass

    def retire(self, step: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def evaluate_before(self, inputs: Tensor | None) -> None:
        pass

    def evaluate_after(self, labels: Tensor | None) -> float | None:
        return None


class WholeEmbedding(Part):
    """The first stage's entry when it holds the whole embedding: its layers look the tokens up (no input)."""

    reads_batches = True

    def post_input(self, a: Action) -> None:
        pass

    def input(self, a: Action) -> None:
        return None

    def send_input_grad(self, a: Action, x: Tensor | None) -> None:
        return None

    def post_evaluation_input(self) -> None:
        pass

    def evaluation_input(self, inputs: Tensor) -> Tensor:
        return inputs


class WholeHead(Part):
    """The last stage's exit when it holds the whole head: its forward ends with the microbatch's scalar loss."""

    reads_batches = True

    def post_output_grad(self, a: Action) -> None:
        pass

    def output(self, a: Action, out: Tensor, is_input: bool) -> Tensor:
        return out.detach()

    def output_grad(self, a: Action) -> None:
        return None

    def evaluation_output(self, out: Tensor) -> float:
        return out.item()


class UpstreamLink:
    """The entry of a stage past the first: the activation from stage s-1, its gradient sent back."""

    reads_batches = False

    def __init__(self, comm: StageComm):
        self.comm = comm

    def post_input(self, a: Action) -> None:
        self.comm.post_recv_forward()

    def input(self, a: Action) -> Tensor:
        return self.comm.recv_forward(f"the input activation of {a}").requires_grad_()

    def send_input_grad(self, a: Action, x: Tensor) -> Tensor:
        sent = x.grad
        self.comm.send_backward(sent, a.step)
        self.comm.release(x)  # the graph that read it is gone; its .grad is in the send's hands
        return sent

    def post_evaluation_input(self) -> None:
        self.comm.post_recv_forward()

    def evaluation_input(self, inputs: Tensor | None) -> Tensor:
        return self.comm.recv_forward("a validation activation")


class DownstreamLink:
    """The exit of a stage before the last: the activation to stage s+1, its gradient received back."""

    reads_batches = False

    def __init__(self, comm: StageComm):
        self.comm = comm

    def post_output_grad(self, a: Action) -> None:
        self.comm.post_recv_backward()

    def output(self, a: Action, out: Tensor, is_input: bool) -> None:
        self.comm.send_forward(out, a.step, free_after=not is_input)

    def output_grad(self, a: Action) -> Tensor:
        return self.comm.recv_backward(f"the output gradient of {a}")

    def evaluation_output(self, out: Tensor) -> None:
        self.comm.send_forward(out)


class HeldCollectives:
    """Buffers of asynchronous collectives their owner does not wait for (a broadcast's sender, a reduce's
    non-root): kept alive until complete (poll) or until UPDATE(step) (retire: every stage has joined them by
    then), and all waited for at a drain (flush). One lifecycle for every part's."""

    def __init__(self, wait: Wait, what: str):
        self.wait, self.what = wait, what
        self._held: list[tuple[int, Tensor, object]] = []  # (step, buffer, work)

    def add(self, step: int, buffer: Tensor, work) -> None:
        self._held.append((step, buffer, work))

    def steps(self) -> list[int]:
        """The steps of what is held, in the order it was added."""
        return [s for s, *_ in self._held]

    def poll(self) -> None:
        self._held = [h for h in self._held if not h[2].is_completed()]

    def retire(self, step: int) -> None:
        keep = []
        for s, buffer, work in self._held:
            if s <= step:
                self.wait(work, f"{self.what} of step {s}")
            else:
                keep.append((s, buffer, work))
        self._held = keep

    def flush(self) -> None:
        for s, _, work in self._held:
            self.wait(work, f"{self.what} of step {s}")
        self._held = []
