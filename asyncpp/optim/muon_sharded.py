"""Where Muon's Newton-Schulz runs and how the results get back: a deterministic work plan over a
data-parallel group, and its execution with the collectives overlapped with compute.

Work unit: one matrix (a 2-D parameter, or one slice of a stacked [E, m, n] expert weight), costed
m*n*min(m, n) (NS's matmul flops up to a constant). Units of one (M, N, gather_dim, dtype) class form
buckets of about `bucket_numel` elements (the unit of communication; a multiple of the group size in
matrices, at least one per rank). Buckets are handed out in decreasing unit cost, each split evenly
over the ranks with the remainder going to the least-loaded ones (ties: lowest rank), and every
rank's units in a bucket are a contiguous range, so its results are one block of the gathered tensor. The plan
depends only on the job list, which every rank of a DP group holds identically (same parameters,
same reduced gradients), so no rank needs to ask another. A rank runs NS on its share of a bucket in
batched calls: the whole share on accelerators, cache-sized chunks on CPU (orthogonal.chunk_matrices).

Collectives per step, all async and waited for only before the results are used:
- TP ("gather" mode, TP-sharded matrices): one all-gather of the owned units' shards per bucket,
  all started before any NS runs, so they overlap the NS of the buckets that need none;
- DP: one all-gather of every bucket's results (padded to the largest rank share), started right
  after that bucket's NS so it overlaps the next bucket's NS.
Both carry NS's compute dtype (bf16 on the fast path): casting is exact, so casting before or after
a gather gives the same bits.

Invariant the caller keeps: every rank of a group steps the same parameters (those with p.grad) in
the same order; a rank that skipped one would issue different collectives and the step would hang.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from asyncpp.optim.orthogonal import Workspace, chunk_matrices, default_bucket_numel

__all__ = ["Bucket", "MatrixJob", "orthogonalize_sharded", "plan_buckets"]

Group = dist.ProcessGroup


def _all_gather(output: Tensor, input: Tensor, *, group: Group, async_op: bool):
    """Newer torch renamed all_gather_into_tensor (now deprecated) to all_gather_single; same semantics. Looked
    up at each call, not bound at import, so a wrapper of torch.distributed (the NCCL-order recorder,
    tests/nccl/recorder.py) sees these gathers too."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


Piece = tuple[int, int, int]  # (job index, first matrix, one past the last) of the job's flattened batch
Result = tuple[int, int, int, Tensor]  # a piece and its NS result rows [stop - first, m_loc, n_loc]
# (job, first, stop, out) -> NS input [stop - first, m_loc, n_loc], written into `out` when one is given
Source = Callable[[int, int, int, Tensor | None], Tensor]
Prepare = Callable[[int, int, int], None]  # (job, first, stop): the momentum step of those matrices


@dataclass(frozen=True)
class MatrixJob:
    """One parameter's NS work. `shape` is what NS sees, [..., M, N]: the full matrix when this rank's
    TP shard along the matrix dim `gather_dim` (-2 or -1) must be gathered first, else the local
    tensor. `expert` picks the expert-data-parallel group instead of the data-parallel one."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    gather_dim: int | None = None
    expert: bool = False

    @property
    def count(self) -> int:
        return math.prod(self.shape[:-2])

    @property
    def cost(self) -> int:
        m, n = self.shape[-2:]
        return m * n * min(m, n)


@dataclass
class Bucket:
    """Matrices of one class, gathered together. `pieces` lists the bucket's matrices in order; rank r
    orthogonalises bucket matrices [offsets[r], offsets[r] + counts[r])."""

    matrix: tuple[int, int]
    gather_dim: int | None
    cost: int
    pieces: list[Piece]
    counts: list[int] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(stop - start for _, start, stop in self.pieces)

    @property
    def offsets(self) -> list[int]:
        return [0, *itertools.accumulate(self.counts[:-1])]

    def owned(self, rank: int) -> list[Piece]:
        """The pieces (or parts of pieces) that `rank` orthogonalises, in bucket order."""
        lo = sum(self.counts[:rank])  # not offsets[rank]: O(rank), where the whole list is O(world)
        return self._within(lo, lo + self.counts[rank])

    def owned_by_others(self, rank: int) -> list[Piece]:
        """The pieces every rank but `rank` orthogonalises, in bucket order: one pass, where asking each
        rank's owned() in turn is O(world^2) per bucket (minutes at dry_run=16384)."""
        lo = sum(self.counts[:rank])
        return self._within(0, lo) + self._within(lo + self.counts[rank], self.size)

    def _within(self, lo: int, hi: int) -> list[Piece]:
        out, pos = [], 0
        for job, start, stop in self.pieces:
            a, b = max(lo, pos), min(hi, pos + stop - start)
            if a < b:
                out.append((job, start + a - pos, start + b - pos))
            pos += stop - start
        return out


def _assign(size: int, cost: int, load: list[int]) -> list[int]:
    """Split `size` units of `cost` as evenly as possible (counts differ by at most one, so a gather
    pads at most one matrix per rank); the extra units go to the least-loaded ranks (ties: the lowest),
    which keeps the total load balanced to within one unit. Updates `load`."""
    world = len(load)
    counts = [size // world] * world
    for r in sorted(range(world), key=lambda r: (load[r], r))[: size % world]:
        counts[r] += 1
    for r, c in enumerate(counts):
        load[r] += c * cost
    return counts


@functools.lru_cache(maxsize=16)
def plan_buckets(jobs: tuple[tuple[int, MatrixJob], ...], world: int, bucket_numel: int) -> list[Bucket]:
    """Buckets of (index, job) pairs for a group of `world` ranks, in execution order (costliest first).

    Integer costs and a fixed tie-break make the plan a pure function of the job list: every rank
    computes the same one. Cached (the same parameters step every step); callers must not modify
    the returned buckets."""
    classes: dict[tuple, list[tuple[int, MatrixJob]]] = defaultdict(list)
    for index, job in jobs:
        classes[(job.shape[-2:], job.gather_dim, job.dtype)].append((index, job))
    buckets = []
    for (matrix, gather_dim, _), members in classes.items():
        # A multiple of the group size (>= one matrix per rank): every rank gets an equal share.
        cap = max(1, bucket_numel // (matrix[0] * matrix[1]) // world) * world
        cost = members[0][1].cost
        every = [(index, 0, job.count) for index, job in members]
        buckets += [Bucket(matrix, gather_dim, cost, pieces) for pieces in _split(every, cap)]
    buckets.sort(key=lambda b: -b.cost)  # stable: equal costs keep parameter order
    load = [0] * world
    for b in buckets:
        b.counts = _assign(b.size, b.cost, load)
    return buckets


def _size_rank(group: Group | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _split(pieces: list[Piece], size: int) -> list[list[Piece]]:
    """The pieces' matrices, in order, cut into consecutive runs of at most `size` matrices."""
    runs, current, filled = [], [], 0
    for job, start, stop in pieces:
        while start < stop:
            take = min(stop - start, size - filled)
            current.append((job, start, start + take))
            start, filled = start + take, filled + take
            if filled == size:
                runs.append(current)
                current, filled = [], 0
    return runs + ([current] if current else [])


def _read(source: Source, pieces: list[Piece], dtype: torch.dtype | None = None, out: Tensor | None = None) -> Tensor:
    """The pieces' NS inputs as one [k, m, n] tensor: written into `out` (scratch) when given, else
    new (cast to `dtype` when given: a TP gather's send buffer)."""
    if out is not None:
        pos = 0
        for job, a, b in pieces:
            source(job, a, b, out[pos : pos + b - a])
            pos += b - a
        return out
    parts = [source(job, a, b, None) for job, a, b in pieces]
    if dtype is not None:
        parts = [p.to(dtype) for p in parts]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _with_rows(pieces: list[Piece], rows: Tensor) -> list[Result]:
    """Pair each piece with its rows of `rows` (the pieces' results, in order)."""
    out, pos = [], 0
    for job, a, b in pieces:
        out.append((job, a, b, rows[pos : pos + b - a]))
        pos += b - a
    return out


@dataclass
class _TPGather:
    """A TP all-gather in flight: `out` [tp * k, m_loc, n_loc] becomes the full [k, M, N]."""

    work: dist.Work
    out: Tensor
    k: int
    gather_dim: int
    tp: int

    def full(self) -> Tensor:
        self.work.wait()
        m, n = self.out.shape[-2:]
        x = self.out.view(self.tp, self.k, m, n)
        if self.gather_dim == -2:  # shard t holds rows t*m .. (t+1)*m
            return x.permute(1, 0, 2, 3).reshape(self.k, self.tp * m, n)
        return x.permute(1, 2, 0, 3).reshape(self.k, m, self.tp * n)


def _start_tp_gather(local: Tensor, gather_dim: int, group: Group) -> _TPGather:
    tp = dist.get_world_size(group)
    local = local.contiguous()
    out = local.new_empty((tp * local.shape[0], *local.shape[1:]))
    work = _all_gather(out, local, group=group, async_op=True)
    return _TPGather(work, out, local.shape[0], gather_dim, tp)


def _tp_slice(full: Tensor, gather_dim: int, group: Group) -> Tensor:
    """This TP rank's shard of a full [k, M, N] result (the inverse of _TPGather.full)."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    return full.chunk(tp, dim=gather_dim)[rank]


@dataclass
class _DPGather:
    """A bucket's results gathered over its DP group: `send` holds this rank's share (then padding)."""

    bucket: Bucket
    send: Tensor
    out: Tensor | None = None
    work: dist.Work | None = None

    def start(self, group: Group) -> None:
        self.out = self.send.new_empty((len(self.bucket.counts) * self.send.shape[0], *self.send.shape[1:]))
        self.work = _all_gather(self.out, self.send, group=group, async_op=True)

    def results(self) -> list[Result]:
        self.work.wait()
        counts, rows = self.bucket.counts, self.out
        if min(counts) != max(counts):  # drop each rank's padding
            per_rank = rows.view(len(counts), max(counts), *rows.shape[1:])
            rows = torch.cat([per_rank[r, :c] for r, c in enumerate(counts) if c])
        return _with_rows(self.bucket.pieces, rows)


def _compute(mine: list[Piece], prepare: Prepare, source: Source, ns: Callable[[Tensor], Tensor], chunk: int,
             tp_in: _TPGather | None, tp_group: Group | None, gather_dim: int | None,
             scratch: Callable[[int], Tensor] | None, sink: Callable[[int, list[Piece], Tensor], None]) -> None:
    """NS of this rank's pieces of a bucket, `chunk` matrices per call (each run's momentum step right
    before its NS input is read, unless a TP gather already read it; the input assembled in
    scratch(k) when given); each call's rows go to sink(position in `mine`'s matrices, pieces, rows)
    right away, while they are still in cache (and before scratch is reused)."""
    full = tp_in.full() if tp_in is not None else None
    pos = 0
    for run in _split(mine, chunk):
        k = sum(b - a for _, a, b in run)
        if full is None:
            for piece in run:
                prepare(*piece)
            x = _read(source, run, out=scratch(k) if scratch is not None else None)
        rows = ns(full[pos : pos + k] if full is not None else x)
        if gather_dim is not None:
            rows = _tp_slice(rows, gather_dim, tp_group)
        sink(pos, run, rows)
        pos += k


def orthogonalize_sharded(
    jobs: Sequence[MatrixJob],
    prepare: Prepare,
    source: Source,
    ns: Callable[[Tensor], Tensor],
    consume: Callable[[int, int, int, Tensor], None],
    *,
    device: torch.device,
    compute_dtype: torch.dtype | None = None,
    dp_group: Group | None = None,
    expert_dp_group: Group | None = None,
    tp_group: Group | None = None,
    bucket_numel: int | None = None,
    workspace: Workspace | None = None,
) -> None:
    """ns applied to every matrix of every job, sharded over the DP groups; consume(job, a, b, rows) is
    called for each job's matrices exactly once, rows [b - a, m_loc, n_loc] being this rank's part of
    the result (its TP shard for gather jobs) in `compute_dtype` (None: each job's own dtype): results
    computed here as soon as NS returns them, gathered ones once their gather completes.

    `prepare(job, a, b)` is called exactly once for every matrix on every rank (the momentum step:
    owned matrices right before `source` reads them, the others while their results are in flight);
    `source(job, a, b)` gives the NS input of matrices a:b of the job's flattened local batch; `ns`
    maps [k, M, N] to its orthogonalisation in the compute dtype. Dense jobs are shared out over
    `dp_group`, expert jobs over `expert_dp_group` (None: this rank alone). `bucket_numel` None:
    orthogonal.default_bucket_numel. With a `workspace` (CPU) the NS
    inputs are assembled in its "ns_in" buffer, and `ns` and `consume` may use it too."""
    planned: list[tuple[Bucket, Group | None]] = []
    for expert, group in ((False, dp_group), (True, expert_dp_group)):
        members = tuple((i, job) for i, job in enumerate(jobs) if job.expert == expert)
        # Buckets are the unit of communication and, on accelerators, of NS batching: they also bound
        # the transient memory of a step (a stage's whole class of expert matrices would not fit).
        world = _size_rank(group)[0]
        planned += [(b, group) for b in plan_buckets(members, world, bucket_numel or default_bucket_numel(device))]
    tp = _size_rank(tp_group)[0]
    # Start every TP gather first: their transfer overlaps the NS of the buckets that need none.
    tp_in = {}
    for i, (bucket, group) in enumerate(planned):
        mine = bucket.owned(_size_rank(group)[1])
        if bucket.gather_dim is not None and mine:
            for piece in mine:
                prepare(*piece)
            dtype = compute_dtype or jobs[mine[0][0]].dtype
            tp_in[i] = _start_tp_gather(_read(source, mine, dtype=dtype), bucket.gather_dim, tp_group)
    gathers = []
    for i, (bucket, group) in enumerate(planned):
        world, rank = _size_rank(group)
        chunk = chunk_matrices(device, *bucket.matrix)
        scratch = None
        if workspace is not None and bucket.gather_dim is None:
            dtype = jobs[bucket.pieces[0][0]].dtype
            scratch = partial(_scratch, workspace, bucket.matrix, dtype, device)
        compute = partial(_compute, bucket.owned(rank), prepare, source, ns, chunk, tp_in.get(i), tp_group,
                          bucket.gather_dim, scratch)
        if world == 1:
            compute(partial(_consume_now, consume))
            continue
        send = _send_buffer(bucket, rank, tp, compute_dtype or jobs[bucket.pieces[0][0]].dtype, device)
        compute(partial(_copy_to_send, send))
        gathers.append(_DPGather(bucket, send))
        gathers[-1].start(group)
        for piece in bucket.owned_by_others(rank):  # the matrices others orthogonalise still need their momentum step
            prepare(*piece)
    for gather in gathers:
        for result in gather.results():
            consume(*result)


def _scratch(workspace: Workspace, matrix: tuple[int, int], dtype: torch.dtype, device: torch.device, k: int) -> Tensor:
    return workspace.get("ns_in", (k, *matrix), dtype, device)


def _consume_now(consume: Callable[[int, int, int, Tensor], None], pos: int, run: list[Piece], rows: Tensor) -> None:
    """A rank alone: the caller applies each result while it is still in cache."""
    for result in _with_rows(run, rows):
        consume(*result)


def _copy_to_send(send: Tensor, pos: int, run: list[Piece], rows: Tensor) -> None:
    """A shared bucket: this rank's results go out with the gather and are applied when it completes."""
    send[pos : pos + rows.shape[0]].copy_(rows)


def _send_buffer(bucket: Bucket, rank: int, tp: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """[max(counts), m_loc, n_loc]: every rank sends as many matrices (the gather needs equal sizes),
    its own first; the padding is zeroed so nothing uninitialised crosses the wire (and is never read)."""
    local = list(bucket.matrix)
    if bucket.gather_dim is not None:
        local[bucket.gather_dim] //= tp
    send = torch.empty((max(bucket.counts), *local), dtype=dtype, device=device)
    send[bucket.counts[rank] :].zero_()
    return send
