"""Adapts a token stream to the trainer's DataSource: microbatch i is a pure function of (seed, i).

A pure function of the global microbatch index is what makes resume exact and lets several pipeline
stages or DP ranks read the same data independently (no iterator state to carry around).
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from data.default import TokenWindows, load_token_splits, validation_batches


class DefaultDataSource:
    """The embedded corpus, split into train/validation windows of seq_len + 1 tokens."""

    def __init__(
        self,
        *,
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        eval_batches: int,
        val_fraction: float = 0.02,
        cache_dir: str | None = None,
    ):
        splits = load_token_splits(val_fraction=val_fraction, cache_dir=Path(cache_dir) if cache_dir else None)
        self.vocab_size = splits.vocab_size
        self._train = TokenWindows(splits.train, seq_len, micro_batch_size, seed)
        self._val = validation_batches(splits.val, seq_len, micro_batch_size, eval_batches)

    def train_microbatch(self, index: int) -> Tensor:
        return self._train.batch(index)

    def val_batches(self) -> list[Tensor]:
        return self._val
