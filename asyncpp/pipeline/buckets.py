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
