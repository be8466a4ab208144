"""Bucketed asynchronous all-reduces of gradient lists (the DP reduction a stage starts when it has
finished b_t, waited for only in UPDATE: asyncpp/pipeline/engine.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

BUCKET_NUMEL = 1 << 22
"""DP all-reduce buckets: a gradient this large is reduced in place on its own; smaller ones are packed
into flat buckets of at most this many elements (the only copies, bounded by the small tensors)."""


@dataclass
class Bucket:
    """One asynchronous all-reduce of `tensors`: in place (one tensor) or through a flat copy."""

    tensors: list[Tensor]
    flat: Tensor | None
    work: object
    what: str

    @classmethod
    def start(cls, tensors: list[Tensor], group, what: str) -> Bucket:
        flat = None if len(tensors) == 1 and tensors[0].is_contiguous() else torch.cat([t.reshape(-1) for t in tensors])
        buffer = tensors[0] if flat is None else flat
        return cls(tensors, flat, dist.all_reduce(buffer, group=group, async_op=True), what)

    def finish(self, wait: Callable[[object, str], None]) -> None:
        wait(self.work, self.what)
        if self.flat is not None:
            pieces = torch.split(self.flat, [t.numel() for t in self.tensors])
            torch._foreach_copy_(self.tensors, [piece.view_as(t) for piece, t in zip(pieces, self.tensors)])


def start_buckets(tensors: Sequence[Tensor], group, what: str, cap: int = BUCKET_NUMEL) -> list[Bucket]:
    """Start the all-reduce of `tensors` over `group` in buckets (issue order = tensor order, the same on
    every member): large tensors alone and in place, small ones packed per dtype up to `cap` elements."""
    buckets: list[Bucket] = []
    packing: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        if t.numel() >= cap:
            buckets.append(Bucket.start([t], group, what))
            continue
        bucket = packing.setdefault(t.dtype, [])
        if bucket and sum(x.numel() for x in bucket) + t.numel() > cap:
            buckets.append(Bucket.start(bucket, group, what))
            bucket = packing[t.dtype] = []
        bucket.append(t)
    buckets.extend(Bucket.start(b, group, what) for b in packing.values() if b)
    return buckets


@dataclass
class OwnerBucket:
    """Tensors of one owner, moved together: a `reduce` to the owner (the distributed optimizer's
    gradient reduction, a reduce-scatter at whole-parameter granularity) or a `broadcast` from it (the
    owner's new weights into every replica's x_{t+1}). In place for one tensor, else through a flat copy."""

    tensors: list[Tensor]
    flat: Tensor | None
    owner: int
    work: object
    what: str
    receives: bool
    """Whether this rank's tensors take the result (the owner of a reduce; the others of a broadcast)."""

    @classmethod
    def start(cls, tensors: list[Tensor], owner: int, group, rank: int, kind: str, what: str) -> OwnerBucket:
        single = len(tensors) == 1 and tensors[0].is_contiguous()
        flat = None if single else torch.cat([t.reshape(-1) for t in tensors])
        buffer = tensors[0] if flat is None else flat
        if kind == "reduce":
            work = dist.reduce(buffer, group=group, group_dst=owner, async_op=True)
            receives = rank == owner
        elif kind == "broadcast":
            work = dist.broadcast(buffer, group=group, group_src=owner, async_op=True)
            receives = rank != owner
        else:
            raise ValueError(f"kind={kind!r} is not 'reduce' or 'broadcast'")
        return cls(tensors, flat, owner, work, what, receives)

    def finish(self, wait: Callable[[object, str], None]) -> None:
        wait(self.work, self.what)
        if self.flat is not None and self.receives:
            pieces = torch.split(self.flat, [t.numel() for t in self.tensors])
            torch._foreach_copy_(self.tensors, [piece.view_as(t) for piece, t in zip(pieces, self.tensors)])
        self.flat = None


def start_owner_buckets(tensors: Sequence[Tensor], owners: Sequence[int], group, rank: int, kind: str, what: str,
                        cap: int = BUCKET_NUMEL) -> list[OwnerBucket]:
    """Start `kind` ("reduce" to / "broadcast" from the owner) of every tensor over `group`, packed per
    (owner, dtype) into buckets of at most `cap` elements, large tensors alone and in place. Issue order:
    by owner, then tensor order: the same on every member (the owners are the same plan everywhere)."""
    buckets: list[OwnerBucket] = []
    for owner in sorted(set(owners)):
        mine = [t for t, o in zip(tensors, owners) if o == owner]
        for run in _pack(mine, cap):
            buckets.append(OwnerBucket.start(run, owner, group, rank, kind, what))
    return buckets


def _pack(tensors: Sequence[Tensor], cap: int) -> list[list[Tensor]]:
    """Consecutive runs of one dtype and at most `cap` elements; a tensor of `cap` or more alone."""
    runs: list[list[Tensor]] = []
    current: list[Tensor] = []
    for t in tensors:
        if t.numel() >= cap:
            runs.append([t])
            continue
        if current and (current[0].dtype != t.dtype or sum(x.numel() for x in current) + t.numel() > cap):
            runs.append(current)
            current = []
        current.append(t)
    return runs + ([current] if current else [])
