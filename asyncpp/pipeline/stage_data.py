"""What a stage reads of the data: the tokens of a microbatch of the run's BatchPlan, and its validation batches."""

from __future__ import annotations

import torch
from torch import Tensor

from asyncpp.core.batches import BatchPlan
from asyncpp.core.records import DataSource
from asyncpp.core.transfer import to_device


class StageData:
    """One rank's view of the data: microbatch j of step t is the BatchPlan's global microbatch of this DP replica
    (DP=2 with m equals DP=1 with 2m: asyncpp/core/batches.py), a [B, T+1] block whose first T ids are the inputs
    and whose last T are the labels."""

    def __init__(self, source: DataSource, batches: BatchPlan, dp_rank: int, device: torch.device | str,
                 seq_len: int):
        self.source, self.batches, self.dp_rank, self.device, self.seq_len = source, batches, dp_rank, device, seq_len

    def tokens(self, step: int, microbatch: int) -> Tensor:
        index = self.batches.microbatch_index(step, self.dp_rank, microbatch)
        return to_device(self.source.train_microbatch(index), self.device)  # CUDA: pinned, no host sync

    def inputs(self, step: int, microbatch: int) -> Tensor:
        """The input token ids of (step, microbatch): every stage's rows of a sharded embedding look them up."""
        return self.tokens(step, microbatch)[:, :-1]

    def labels(self, step: int, microbatch: int) -> Tensor:
        """The next-token ids of (step, microbatch): every stage's rows of a vocabulary-parallel head need them."""
        return self.tokens(step, microbatch)[:, 1:]

    def evaluation_batch(self, batch: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        """A validation batch's input ids and labels on this rank's device; (None, None) on a stage that only relays
        activations (val_batches gave it None)."""
        if batch is None:
            return None, None
        batch = to_device(batch, self.device)
        return batch[:, :-1], batch[:, 1:]

    def tokens_in(self, step: int) -> int:
        """The tokens step `step` trains on, over every DP replica."""
        return self.batches.global_batch(step) * self.seq_len

    def val_batches(self, count: int, reads: bool) -> list[Tensor | None]:
        """The `count` validation batches; a stage that does not read them (`reads` False: a middle stage that only
        relays activations) gets as many Nones."""
        val = self.source.val_batches() if reads else [None] * count
        if len(val) != count:  # every stage must relay the same count
            raise ValueError(f"the data source gave {len(val)} validation batches, train.eval_batches={count}")
        return val
