"""The vocabulary-parallel head's pieces that need no process group: the shard table, the TP split of a shard, a
shard's rows of the unsplit weight, and the one-rank head (the plain head and loss, bit for bit)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncpp.parallel.vocab_parallel import (
    VocabParallelHead,
    VocabShard,
    shard_rows_of,
    split_for_tp,
    vocab_parallel_loss,
    vocab_shards,
)


def test_shards_are_consecutive_and_cover_the_vocabulary():
    assert vocab_shards([3, 0, 5], 8) == [VocabShard(0, 3), VocabShard(3, 0), VocabShard(3, 5)]
    with pytest.raises(ValueError, match="sum to the vocabulary size 9"):
        vocab_shards([3, 5], 9)
    with pytest.raises(ValueError, match="non-negative"):
        vocab_shards([9, -1], 8)


def test_tp_splits_a_stage_shard_into_near_equal_consecutive_pieces():
    assert split_for_tp(VocabShard(10, 7), 2) == [VocabShard(10, 4), VocabShard(14, 3)]
    assert split_for_tp(VocabShard(10, 7), 1) == [VocabShard(10, 7)]
    with pytest.raises(ValueError, match="tp=0"):
        split_for_tp(VocabShard(0, 4), 0)


def test_a_shard_is_its_rows_of_the_unsplit_weight():
    w = torch.arange(12.0).reshape(6, 2)
    assert torch.equal(shard_rows_of(w, VocabShard(2, 3)), w[2:5])
    with pytest.raises(ValueError, match="exceed the head's 6 rows"):
        shard_rows_of(w, VocabShard(4, 3))


def test_one_rank_head_is_the_plain_head_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    w, h = torch.randn(50, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    targets = torch.randint(0, 50, (2, 5), generator=g)
    head = VocabParallelHead(w.clone(), VocabShard(0, 50), 50, None)
    want = F.cross_entropy(F.linear(h, w).float().reshape(-1, 50), targets.reshape(-1))
    assert torch.equal(head(h, targets), want)
    with pytest.raises(ValueError, match="from row 0"):
        vocab_parallel_loss(h, w[:10], targets, VocabShard(5, 10), None)
    with pytest.raises(ValueError, match="VocabShard says 20"):
        vocab_parallel_loss(h, w[:10], targets, VocabShard(0, 20), None)
