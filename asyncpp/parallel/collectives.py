"""Autograd-aware collectives over an explicit process group: the conjugate pairs TP and EP plans
are built from (Megatron's "f" and "g" operators, written as small autograd Functions).

Why our own and not torch.distributed.nn.functional: its all_reduce's backward all-reduces the
gradient again, which is right for a sum but wrong for the "reduce the forward, pass the gradient
through" operator a row-parallel linear needs; the pairs below state their backward explicitly.

Every function is the identity when the group has a single rank, so a plan applied with TP=1
changes nothing, bit for bit.

Every collective here (and the expert dispatcher's, and tp.py's) runs inside `bounded(op, group)`: the
group's own timeout bounds it (Mesh sets every group it builds to the job's, train.timeout_s:
`bound_group`), and a failure (the timeout, a dead peer's broken connection) becomes a CollectiveTimeout
naming this rank's stage, the group and the operation. Why the group's timeout and not async_op=True and a
timed Work.wait: on NCCL a timed wait blocks the CPU until the GPU has run the collective, for every TP
all-reduce of every layer; the group's timeout is what torch's NCCL watchdog enforces on stream-ordered
work, and on gloo it bounds each op by itself. The autograd Functions are unchanged: only the raised error is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from asyncpp.parallel import flight

Group = dist.ProcessGroup


class CollectiveTimeout(RuntimeError):
    """A rank waited longer than train.timeout_s for a collective or a neighbour (or a peer's connection
    broke); the message names this rank's stage, the group and the operation."""


@dataclass(frozen=True)
class GroupBound:
    """What a collective's error says about its group: this rank (`where`: "stage 0 (rank 1)"), the roles the
    group plays in the job, its ranks, and the timeout it was given."""

    where: str
    name: str
    timeout_s: float


_BOUNDS: dict[str, GroupBound] = {}
"""group_name -> its bound, for the groups of this process's Mesh (process groups are process-wide objects
in torch's own registry; this only adds their description)."""


def bound_group(group: Group, *, where: str, name: str, timeout_s: float) -> None:
    """Give `group` a timeout of `timeout_s` (its every op: gloo raises, NCCL's watchdog aborts) and the
    description a CollectiveTimeout on it prints."""
    group.set_timeout(timedelta(seconds=timeout_s))
    _BOUNDS[group.group_name] = GroupBound(where, name, timeout_s)


def describe(group: Group) -> GroupBound:
    """The group's bound; one a Mesh did not build is named by its ranks (its timeout is torch's default)."""
    known = _BOUNDS.get(group.group_name)
    if known is not None:
        return known
    return GroupBound(f"rank {dist.get_rank()}", f"the group of ranks {dist.get_process_group_ranks(group)}",
                      float("nan"))


def timeout_message(where: str, what: str, timeout_s: float, cause: str) -> str:
    """The one wording of every "gave up waiting" error (collectives here, pipeline/p2p.py's waits). It also writes
    this rank's flight record (flight.py: its recent ops, the pending ones first) and names the file."""
    message = (f"{where} gave up waiting for {what} (train.timeout_s={timeout_s}): {cause}. The rank it waits for "
               "probably died or hangs; check that rank's log.")
    evidence = flight.dump(message, where, {name: b.name for name, b in _BOUNDS.items()})
    return f"{message} This rank's recent communication ops {evidence}." if evidence else message


@contextlib.contextmanager
def bounded(op: str, group: Group) -> Iterator[None]:
    """Run a collective `op` ("the expert all-to-all of the token counts") on `group`; a backend error (its
    timeout, a dead peer) is re-raised as a CollectiveTimeout naming the stage, the group and `op`."""
    try:
        with flight.about(op):
            yield
    except RuntimeError as e:  # DistBackendError and gloo's errors are RuntimeErrors
        if isinstance(e, CollectiveTimeout):
            raise
        b = describe(group)
        raise CollectiveTimeout(timeout_message(b.where, f"{op} on {b.name}", b.timeout_s, str(e))) from e


def group_size(group: Group | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: Tensor, group: Group, op: str) -> Tensor:
    x = x.contiguous()
    with bounded(op, group):
        dist.all_reduce(x, group=group)
    return x


def _all_gather(x: Tensor, dim: int, group: Group) -> Tensor:
    """Concatenate every rank's x along `dim` (rank order)."""
    n = dist.get_world_size(group)
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    with bounded(f"a tensor-parallel all-gather along dim {dim}", group):
        dist.all_gather_into_tensor(out, x, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: Tensor, dim: int, group: Group) -> Tensor:
    """Sum over ranks, then keep this rank's slice along `dim` (which must divide evenly)."""
    n = dist.get_world_size(group)
    x = x.movedim(dim, 0).contiguous()
    if x.shape[0] % n:
        raise ValueError(f"reduce-scatter along dim {dim}: size {x.shape[0]} is not divisible by the group size {n}")
    out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    with bounded(f"a tensor-parallel reduce-scatter along dim {dim}", group):
        dist.reduce_scatter_tensor(out, x, group=group)
    return out.movedim(0, dim)


def _local_slice(x: Tensor, dim: int, group: Group) -> Tensor:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(n, dim=dim)[r].contiguous()


class _CopyTo(torch.autograd.Function):
    """Forward: identity (the input is already replicated). Backward: all-reduce (each rank's
    gradient is a partial sum over the shards it fed)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return _all_reduce(grad.clone(), ctx.group, "the tensor-parallel all-reduce of a region input's gradient "
                                                    "(copy_to's backward)"), None


class _ReduceFrom(torch.autograd.Function):
    """Forward: all-reduce partial results. Backward: identity (the gradient is replicated)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:  # type: ignore[override]
        return _all_reduce(x.clone(), group, "the tensor-parallel all-reduce of a region's partial outputs "
                                             "(reduce_from)")

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return grad, None


class _GatherFrom(torch.autograd.Function):
    """Forward: all-gather shards along `dim`. Backward: keep this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: Group) -> Tensor:  # type: ignore[override]
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return _local_slice(grad, ctx.dim, ctx.group), None, None


class _ScatterTo(torch.autograd.Function):
    """Forward: keep this rank's slice along `dim`. Backward: all-gather the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: Group) -> Tensor:  # type: ignore[override]
        ctx.dim, ctx.group = dim, group
        return _local_slice(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    """Sequence parallelism's exit from a TP region. Forward: reduce-scatter along `dim`.
    Backward: all-gather."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: Group) -> Tensor:  # type: ignore[override]
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherForRegion(torch.autograd.Function):
    """Sequence parallelism's entry into a TP region. Forward: all-gather along `dim`.
    Backward: reduce-scatter (each rank's gradient is partial over the shards it fed)."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: Group) -> Tensor:  # type: ignore[override]
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    """Variable-size all-to-all along dim 0; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group: Group, what: str) -> Tensor:  # type: ignore[override]
        ctx.out_splits, ctx.in_splits, ctx.group, ctx.what = out_splits, in_splits, group, what
        return _all_to_all(x, out_splits, in_splits, group, what)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        back = _all_to_all(grad, ctx.in_splits, ctx.out_splits, ctx.group, f"the backward of {ctx.what}")
        return back, None, None, None, None


def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: Group, what: str) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    with bounded(what, group):
        dist.all_to_all_single(out, x, output_split_sizes=list(out_splits), input_split_sizes=list(in_splits),
                               group=group)
    return out


def copy_to(x: Tensor, group: Group | None) -> Tensor:
    """Enter a tensor-parallel region with a replicated input (column-parallel input)."""
    return x if group_size(group) == 1 else _CopyTo.apply(x, group)


def reduce_from(x: Tensor, group: Group | None) -> Tensor:
    """Leave a tensor-parallel region by summing partial outputs (row-parallel output)."""
    return x if group_size(group) == 1 else _ReduceFrom.apply(x, group)


def gather_from(x: Tensor, dim: int, group: Group | None) -> Tensor:
    """Concatenate shards along `dim`; the gradient of each shard goes back to its owner."""
    return x if group_size(group) == 1 else _GatherFrom.apply(x, dim, group)


def scatter_to(x: Tensor, dim: int, group: Group | None) -> Tensor:
    """Keep this rank's chunk of a replicated tensor along `dim`."""
    return x if group_size(group) == 1 else _ScatterTo.apply(x, dim, group)


def reduce_scatter(x: Tensor, dim: int, group: Group | None) -> Tensor:
    """Sum partial outputs and keep this rank's chunk along `dim` (sequence-parallel exit)."""
    return x if group_size(group) == 1 else _ReduceScatter.apply(x, dim, group)


def gather_for_region(x: Tensor, dim: int, group: Group | None) -> Tensor:
    """All-gather a sequence-sharded input into a TP region (sequence-parallel entry)."""
    return x if group_size(group) == 1 else _GatherForRegion.apply(x, dim, group)


def all_to_all(x: Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group: Group | None,
               what: str = "an all-to-all") -> Tensor:
    """Rows in_splits[r] of x go to rank r; rows out_splits[r] of the result came from rank r. `what` names
    it in a CollectiveTimeout (its backward as "the backward of <what>")."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group, what)
