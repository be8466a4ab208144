"""The vocabulary shards (asyncpp/parallel/vocab_parallel.py), which need no process group: the shard table, the TP
split of a shard, and the input embedding sharded by the same rows. (The head's passes over the stages are tested by
tests/unit/test_vocab_head.py and against the simulator by tests/dist/test_vocab_parallel_pipeline.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncpp.parallel.vocab_parallel import VocabShard, embedding_partial, split_for_tp, vocab_shards


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


def test_embedding_partials_sum_to_the_unsplit_lookup_and_its_gradient_rows():
    """The input embedding sharded by the same rows: summing the shards' partial lookups is the unsplit lookup bit for
    bit (one nonzero per token), and each shard's weight gradient is its rows of the unsplit gradient bit for bit."""
    g = torch.Generator().manual_seed(1)
    V, h = 40, 6
    w = torch.randn(V, h, generator=g)
    ids = torch.randint(0, V, (3, 7), generator=g)
    ids[0, 0], ids[0, 1] = 0, V - 1
    upstream = torch.randn(3, 7, h, generator=g)
    full = w.clone().requires_grad_()
    want = F.embedding(ids, full)
    want.backward(upstream)
    shards = vocab_shards([9, 0, 25, 6], V)
    parts = []
    for shard in shards:
        piece = w[shard.start:shard.end].clone().requires_grad_()  # the shard's rows of the unsplit weight
        out = embedding_partial(ids, piece, shard)
        if shard.rows == 0:  # no rows: zeros, nothing to differentiate
            assert not out.requires_grad and not out.any()
        else:
            out.backward(upstream)
            assert torch.equal(piece.grad, full.grad[shard.start:shard.end])
        parts.append(out.detach())
    assert torch.equal(sum(parts), want.detach())
