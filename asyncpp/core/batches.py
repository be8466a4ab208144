"""How many microbatches each step runs, and where each step's samples start: the one home of the batch
size of every step (train.global_batch_size, train.batch_rampup) and of the data position.

Without a rampup every step runs m = train.num_microbatches microbatches per DP replica. With
`train.batch_rampup=[start, increment, samples]` (Megatron's `--rampup-batch-size`), step t's global batch is
Megatron's RampupBatchsizeNumMicroBatchesCalculator evaluated at the samples consumed before step t:

    per_increment = samples / ((global - start) / increment)                 (a float, as in Megatron)
    batch(c)      = global                                     if c > samples
                  = start + int(c / per_increment) * increment otherwise

so the batch grows by `increment` every `per_increment` samples until it reaches train.global_batch_size, and
m_t = batch(c_t) / (micro_batch_size x dp), c_t = sum_{s<t} batch_s. It is a pure function of the step, the
same on every rank and in the simulator. The float division is Megatron's own (IEEE doubles, the same on
every machine), kept so that a ramp steps up at exactly the sample Megatron's does.

The data position is cumulative: step t reads global microbatches [first(t), first(t) + m_t x dp), first(t)
= sum_{s<t} m_s x dp; replica r reads first(t) + r x m_t + j for j < m_t. With a constant m this is
(t x dp + r) x m + j, the index the runtime has always used (DP=2 with m equals DP=1 with 2m).

The learning-rate schedule stays a function of the step (asyncpp/optim/lr_schedule.py), not of consumed
samples as Megatron's is under a rampup: every other part of this project (warmup_fraction, the staleness
options' sync_start/cooldown steps, checkpoint.every, eval_every) counts steps, and the paper's recipes are
stated in steps. A ramp therefore sees the LR warm up over steps whose batches are smaller.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncpp.config import RunConfig, TrainConfig


def rampup_global_batch(consumed_samples: int, start: int, increment: int, samples: int, final: int) -> int:
    """The global batch size after `consumed_samples` samples: Megatron-LM's
    RampupBatchsizeNumMicroBatchesCalculator.update (megatron/core/num_microbatches_calculator.py), same
    arithmetic. Needs start < final, (final - start) % increment == 0 and samples >= 1 (config validation)."""
    if consumed_samples > samples:
        return final
    per_increment = samples / ((final - start) // increment)
    return start + int(consumed_samples / per_increment) * increment


@dataclass(frozen=True)
class _Piece:
    """Steps [step, next piece's step) all run `m` microbatches per replica; `first` is the global index of
    the first microbatch of `step`."""

    step: int
    m: int
    first: int


class BatchPlan:
    """m_t and the data position of every step of a run (see the module docstring). Immutable.

    Kept as pieces of constant m (one per ramp increment, then one to the end), so a million-step run costs
    nothing; every query is a bisect."""

    def __init__(self, steps: int, micro_batch_size: int, dp: int, num_microbatches: int,
                 rampup: tuple[int, int, int] | None = None):
        self.steps, self.micro_batch_size, self.dp = steps, micro_batch_size, dp
        per_microbatch = micro_batch_size * dp  # samples of one microbatch on every replica
        pieces: list[_Piece] = []
        t = first = 0
        if rampup is not None:
            start, increment, samples = rampup
            final = num_microbatches * per_microbatch
            consumed = 0
            while t < steps and consumed <= samples:  # past `samples` the batch is final for good
                m = rampup_global_batch(consumed, start, increment, samples, final) // per_microbatch
                if not pieces or pieces[-1].m != m:
                    pieces.append(_Piece(t, m, first))
                consumed += m * per_microbatch
                first += m * dp
                t += 1
        if t < steps and (not pieces or pieces[-1].m != num_microbatches):
            pieces.append(_Piece(t, num_microbatches, first))
        self._pieces = pieces or [_Piece(0, num_microbatches, 0)]
        self._starts = [p.step for p in self._pieces]

    @classmethod
    def of(cls, cfg: RunConfig, dp: int | None = None) -> BatchPlan:
        """The plan of a validated config; `dp` = the real number of replicas (a pipeline's mesh), else
        parallel.dp (a single process simulates that many)."""
        t: TrainConfig = cfg.train
        return cls(t.steps, t.micro_batch_size, dp or cfg.parallel.dp or 1, t.num_microbatches, t.batch_rampup)

    def _piece(self, step: int) -> _Piece:
        if not 0 <= step <= self.steps:
            raise IndexError(f"step {step} is outside the run's {self.steps} steps")
        return self._pieces[bisect.bisect_right(self._starts, step) - 1]

    def microbatches(self, step: int) -> int:
        """m_t: microbatches of step t on each DP replica."""
        return self._piece(step).m

    def first_microbatch(self, step: int) -> int:
        """Global index of step t's first microbatch: the microbatches of all replicas of steps < t."""
        p = self._piece(step)
        return p.first + (step - p.step) * p.m * self.dp

    def microbatch_index(self, step: int, replica: int, j: int) -> int:
        """Global index of microbatch j of DP replica `replica` at step t (what DataSource.train_microbatch reads)."""
        m = self.microbatches(step)
        if not (0 <= replica < self.dp and 0 <= j < m):
            raise IndexError(f"microbatch {j} of replica {replica} does not exist at step {step} (m={m}, dp={self.dp})")
        return self.first_microbatch(step) + replica * m + j

    def global_batch(self, step: int) -> int:
        """Sequences of step t over all replicas."""
        return self.microbatches(step) * self.micro_batch_size * self.dp

    def samples_before(self, step: int) -> int:
        """Sequences consumed by steps [0, step): the data position of a checkpoint at `step`."""
        return self.first_microbatch(step) * self.micro_batch_size

    def changes(self) -> list[int]:
        """The steps t > 0 at which m changes: a pipeline segment must start there (a drained stream runs
        one m)."""
        return [p.step for p in self._pieces[1:]]

    def constant(self, t0: int, t1: int) -> int:
        """m of steps [t0, t1), which must all run the same m (one pipeline segment)."""
        m = self.microbatches(t0)
        if bisect.bisect_right(self._starts, t1 - 1) != bisect.bisect_right(self._starts, t0):
            raise ValueError(f"steps [{t0}, {t1}) change their microbatch count (from m={m} at step {t0} to "
                             f"{self.microbatches(t1 - 1)} at step {t1 - 1}); a segment must be cut at "
                             f"{[c for c in self.changes() if t0 < c < t1]}")
        return m

    def describe(self) -> str:
        """m per replica over the run, for the start-up line: 'm=4' or 'm=1..4 (ramp until step 12)'."""
        if len(self._pieces) == 1:
            return f"m={self._pieces[0].m}"
        return f"m={self._pieces[0].m}..{self._pieces[-1].m} (batch rampup until step {self._pieces[-1].step})"
