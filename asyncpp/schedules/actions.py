"""The vocabulary of a pipeline schedule: what one stage does, in order, as plain data.

A schedule is a list[Action] for one stage. It says nothing about processes or autograd; the engine
derives the communication from it (a FORWARD at stage s > 0 receives its input from s-1 and, unless s
is last, sends its output to s+1; a BACKWARD mirrors that). Because schedules are data, their
invariants (no deadlock, one version per microbatch, version count) are checked without processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Op(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"
    UPDATE_START = "U0"
    """The stage finished its part of b_t: start the global reductions (DP, tied embedding, norm)."""
    UPDATE = "U"
    """Wait for those reductions and write x_{t+1}; placed just before the first use of x_{t+1}."""
    VOCAB_FORWARD = "S"
    """A vocabulary-parallel head (asyncpp/parallel/vocab_parallel.py), on every stage: the logits of the stage's
    vocabulary shard for microbatch (t, j) and their softmax statistics. Its input (the last stage's normed hidden
    states) is broadcast from the last stage's FORWARD of (t, j); the statistics are all-reduced over the stages."""
    VOCAB_BACKWARD = "T"
    """The shard's loss gradient, weight gradient and partial input gradient of (t, j), on every stage: it needs
    every stage's VOCAB_FORWARD of (t, j) (the all-reduced statistics); the partial input gradients are reduced
    onto the last stage, whose BACKWARD of (t, j) needs every stage's VOCAB_BACKWARD."""
    EMBED_FORWARD = "E"
    """A sharded input embedding (parallel.embedding=vocab), on every stage: the lookup of microbatch (t, j)'s tokens
    that fall in the stage's rows (zeros for the others), on (t, j)'s version; the partials are reduced onto the
    first stage, whose FORWARD of (t, j) needs every stage's EMBED_FORWARD."""
    EMBED_BACKWARD = "G"
    """The stage's rows' embedding gradient of (t, j), on every stage: it needs the first stage's BACKWARD of (t, j)
    (the embedding output's gradient, broadcast from there), and joins b_t's gradient before the stage's reductions
    of step t start (UPDATE(t) on any stage needs every stage's last EMBED_BACKWARD of step t)."""


@dataclass(frozen=True, order=True)
class Action:
    op: Op
    step: int
    """t: the minibatch b_t this action belongs to (for updates: the step whose gradient is applied)."""
    microbatch: int = -1
    """Index within b_t for FORWARD/BACKWARD/VOCAB_*/EMBED_*; -1 for updates."""
    version: int = -1
    """FORWARD/BACKWARD/VOCAB_*/EMBED_*: the weight version x_v they run on. UPDATE: the version it produces
    (t+1)."""

    def __str__(self) -> str:
        if self.op in MICROBATCH_OPS:
            return f"{self.op.value}{self.step}.{self.microbatch}@v{self.version}"
        return f"{self.op.value}{self.step}"


MICROBATCH_OPS = (Op.FORWARD, Op.BACKWARD, Op.VOCAB_FORWARD, Op.VOCAB_BACKWARD, Op.EMBED_FORWARD,
                  Op.EMBED_BACKWARD)
"""The actions of one microbatch (t, j), on a weight version; the others (UPDATE_START, UPDATE) are per step."""
