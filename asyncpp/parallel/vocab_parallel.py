"""A vocabulary-parallel LM head and its cross entropy over any process group, with shards of any widths: the
building block of the head spread over the pipeline stages (Yeung et al., 2024; sized by
asyncpp.core.vocab_split), composable with TP by splitting each stage's shard again over its TP ranks.

The flow of one microbatch, over the head's group (every rank holding a shard, in vocabulary order):
1. the rank that ran the final norm broadcasts the normed hidden states [mb, seq, hidden] (`broadcast_hidden`);
2. every rank computes its shard's logits and joins the cross entropy of asyncpp.parallel.tp (two all-reduces:
   the max, then the target logit and the sum of exponentials; the shards' starts may be anything), which
   returns the microbatch's mean loss on every rank;
3. backward is local: each rank gets its shard's weight gradient and its partial input gradient
   softmax_shard @ W_shard, which `reduce_input_grad` sums onto the rank that continues the backward.

Each shard is the rows [start, start + rows) of the unsplit head weight, so a layout with the head split is
initialized from exactly the unsplit weights (`shard_rows_of`), and its gradient is those rows of the unsplit
gradient (up to floating-point reduction order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from asyncpp.parallel.collectives import Group, bounded, group_size
from asyncpp.parallel.tp import _Shared, group_rank, vocab_parallel_cross_entropy


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


def shard_rows_of(weight: Tensor, shard: VocabShard) -> Tensor:
    """This shard's rows of the unsplit [vocab, hidden] head weight (a contiguous copy)."""
    if shard.end > weight.shape[0]:
        raise ValueError(f"shard rows [{shard.start}, {shard.end}) exceed the head's {weight.shape[0]} rows")
    return weight[shard.start:shard.end].clone(memory_format=torch.contiguous_format)


def vocab_parallel_loss(hidden: Tensor, weight: Tensor, targets: Tensor, shard: VocabShard, group: Group | None,
                        *, ignore_index: int = -100) -> Tensor:
    """Mean fp32 cross entropy of the head over the whole vocabulary, from this rank's shard: hidden [B, T, h]
    (the same on every rank of `group`), weight [shard.rows, h] (rows [shard.start, shard.end) of the unsplit
    head), targets [B, T] full-vocabulary ids. Returns the same loss on every rank. Its backward leaves this
    shard's weight gradient in `weight.grad` and this rank's partial input gradient in `hidden.grad`; the sum of
    the partials over `group` is the unsplit head's input gradient (reduce_input_grad)."""
    if weight.shape[0] != shard.rows:
        raise ValueError(f"the head shard has {weight.shape[0]} rows, but its VocabShard says {shard.rows}")
    logits = F.linear(hidden, weight)  # [B, T, shard.rows]: this shard's columns of the logits
    if group_size(group) == 1:
        if shard.start != 0:
            raise ValueError(f"a one-rank head must hold the whole vocabulary from row 0, not from {shard.start}")
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=ignore_index)
    return vocab_parallel_cross_entropy(logits, targets, group, ignore_index=ignore_index, vocab_start=shard.start)


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


def broadcast_hidden(hidden: Tensor | None, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str,
                     src: int, group: Group) -> Tensor:
    """The normed hidden states of `src` (a global rank) on every rank of `group`: `hidden` on src, a received
    buffer of `shape` elsewhere. Blocking; detached (each rank's head graph starts here)."""
    if dist.get_rank() == src:
        out = hidden.detach().contiguous()
    else:
        out = torch.empty(tuple(shape), dtype=dtype, device=device)
    with bounded(f"the vocabulary-parallel head's broadcast of the hidden states from rank {src}", group):
        dist.broadcast(out, src=src, group=group)
    return out


def reduce_input_grad(grad: Tensor, dst: int, group: Group) -> Tensor | None:
    """The sum over `group` of the ranks' partial input gradients, on `dst` (a global rank); None elsewhere.
    Blocking. Reduces a copy: a reduce may use a non-root rank's buffer as scratch, and `grad` stays the
    rank's own part."""
    grad = grad.clone(memory_format=torch.contiguous_format)
    with bounded(f"the vocabulary-parallel head's reduce of the input gradient to rank {dst}", group):
        dist.reduce(grad, dst=dst, group=group)
    return grad if dist.get_rank() == dst else None


class VocabParallelHead(nn.Module):
    """A head shard as a module: its parameter is named `weight` (so a checkpoint key can stay the unsplit head's,
    with the shard's rows recorded next to it) and `forward(hidden, targets)` returns the microbatch's loss."""

    def __init__(self, weight: Tensor, shard: VocabShard, vocab_size: int, group: Group | None) -> None:
        super().__init__()
        if shard.end > vocab_size:
            raise ValueError(f"shard rows [{shard.start}, {shard.end}) exceed the vocabulary {vocab_size}")
        self.weight = nn.Parameter(weight)
        self.shard, self.vocab_size = shard, vocab_size
        self._group = _Shared(group=group)  # a deepcopy of the model keeps the group (tp.py)

    @property
    def group(self) -> Group | None:
        return self._group.bound["group"]

    @property
    def rank(self) -> int:
        return group_rank(self.group)

    def forward(self, hidden: Tensor, targets: Tensor) -> Tensor:
        return vocab_parallel_loss(hidden, self.weight, targets, self.shard, self.group)

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.weight.shape[1]}, rows [{self.shard.start}, {self.shard.end})"
