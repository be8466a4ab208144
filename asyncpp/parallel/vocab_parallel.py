"""The vocabulary shards of a head spread over the pipeline stages (Yeung et al., 2024; sized by
asyncpp.core.vocab_split; run by asyncpp/pipeline/vocab_head.py): each shard is the rows [start, start + rows) of
the unsplit head, consecutive in stage order, split again over a stage's TP ranks; and a sharded input embedding's
lookup of one shard's rows (asyncpp/pipeline/vocab_embedding.py).

Each shard is the rows of the unsplit head weight, so a layout with the head split is initialized from exactly the
unsplit weights (model_zoo/init.py keys them by the full head's name and their offset), and its gradient is those
rows of the unsplit gradient (up to floating-point reduction order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class VocabShard:
    """One rank's rows of the vocabulary: [start, start + rows)."""

    start: int
    rows: int

    @property
    def end(self) -> int:
        return self.start + self.rows


def vocab_shards(rows: Sequence[int], vocab: int) -> list[VocabShard]:
    """Consecutive shards of the given widths (one per rank of the head's group, in group-rank order); they must
    cover the vocabulary exactly."""
    if any(r < 0 for r in rows) or sum(rows) != vocab:
        raise ValueError(f"vocabulary shards {list(rows)} must be non-negative and sum to the vocabulary size {vocab}")
    out, start = [], 0
    for r in rows:
        out.append(VocabShard(start, r))
        start += r
    return out


def split_for_tp(shard: VocabShard, tp: int) -> list[VocabShard]:
    """A stage's shard split again over its `tp` tensor-parallel ranks: near-equal consecutive pieces (the
    first ones one row wider), so the head's group of P x tp ranks holds the vocabulary in (stage, tp rank)
    order."""
    if tp < 1:
        raise ValueError(f"tp={tp} must be >= 1")
    base, extra = divmod(shard.rows, tp)
    widths = [base + (r < extra) for r in range(tp)]
    out, start = [], shard.start
    for w in widths:
        out.append(VocabShard(start, w))
        start += w
    return out


def embedding_partial(ids: Tensor, weight: Tensor, shard: VocabShard) -> Tensor:
    """This shard's part of the input embedding: the rows of the tokens in [shard.start, shard.end), zeros for the
    others ([B, T, h]). Each token's row lives on exactly one shard, so the sum of the partials over the shards (a
    reduce onto the first stage) is the unsplit lookup exactly, and the backward of a partial (the embedding's output
    gradient broadcast back from the first stage) gives the shard its rows of the unsplit weight gradient. With the
    head sharded by the same rows, a tied embedding's two shards sit on one stage (no first-last tied all-reduce)."""
    if weight.shape[0] != shard.rows:
        raise ValueError(f"the embedding shard has {weight.shape[0]} rows, but its VocabShard says {shard.rows}")
    outside = (ids < shard.start) | (ids >= shard.end)
    local = (ids - shard.start).masked_fill(outside, 0)
    if shard.rows == 0:
        return weight.new_zeros((*ids.shape, weight.shape[1]))
    # masked_fill also zeroes the gradient the masked tokens would send to row 0 of the shard (as tp.py's lookup).
    return F.embedding(local, weight).masked_fill(outside.unsqueeze(-1), 0.0)
