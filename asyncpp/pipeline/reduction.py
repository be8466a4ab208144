"""The reductions of one step's gradient on a pipeline stage, started when the stage finished b_t and
completed only when UPDATE(t) needs them (asyncpp/pipeline/engine.py).

Three phases per step, each started at the first action boundary where its inputs are ready, in step
order (progress()), and completed in finish(step):
- "dp": the sum over the replicas (DP for dense tensors, the expert-DP group for experts), bucketed and
  asynchronous (buckets.py); router loads ride along;
- "tied": the tied-embedding all-reduce between the first and the last stage (semantics.md);
- "started": the all-reduce of [||g||^2, ||Δx_{t-2}||^2, loads...] over the norm group (stages and TP/EP
  shards; every tensor counted once), whose result the clip and the skip decision need.

A step's norm all-reduce is never started before an older step's: one order on every member of the group.
The gradient of a step is (sum over microbatches, replicas and the tied pair) * grad_scale / dp: the
simulator's order of floating-point operations (sum first, scale once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from asyncpp.core.balancing import RouterLoadStats
from asyncpp.optim.clip import grad_sq_sum
from asyncpp.parallel.mesh import Mesh
from asyncpp.parallel.sharding import ParamSharding
from asyncpp.pipeline.buckets import Bucket, start_buckets, start_owner_buckets

Wait = Callable[[object, str], None]
Correct = Callable[[int, list[Tensor], list[bool]], None]
"""correct(step, grads, only): the gradient corrections (DC-ASGD, gradient EF) of the tensors marked in `only`."""


@dataclass
class PendingReduction:
    """One step's reductions in flight (or complete, after GradientReduction.finish)."""

    step: int
    grads: list[Tensor]
    """Per parameter of the stage; reduced and scaled once finish() returned (None: not this rank's)."""
    loads: list[Tensor] = field(default_factory=list)
    """b_t's expert loads per balanced router, summed over DP (aux-loss-free balancing)."""
    buckets: list[Bucket] = field(default_factory=list)
    """The DP / expert-DP reductions in flight (phase "dp")."""
    tied_work: object | None = None
    """The tied-embedding all-reduce; the last stage waits for it only in finish()."""
    reduction: Tensor | None = None
    """[||g||^2, ||Δx||^2, loads...], all-reduced over the norm group; None until phase "started"."""
    work: object | None = None
    norm_of_step: int | None = None
    """The earlier step whose ||Δx||^2 rides along in `reduction` (None if nothing rides)."""
    phase: str = "dp"
    """"dp" (DP buckets in flight) -> "tied" (tied all-reduce started) -> "started" (norm all-reduce started)."""


class RowsOfTied:
    """parallel.head=vocab with a tied embedding: a stage's head rows are rows [row0, row0 + rows) of the tied
    weight, whose gradient is the sum of the first stage's embedding gradient (all rows) and every stage's head
    rows. Each stage all-reduces the whole [vocab, h] shape over the pipeline, its rows in place and zeros
    elsewhere, and takes its rows of the sum back once it completes (wait); quacks like the all-reduce's Work.
    The buffer costs each stage the tied weight's size for the time of one reduction."""

    def __init__(self, grad: Tensor, row0: int, vocab: int, group):
        self.grad, self.row0 = grad, row0
        self.buffer = grad.new_zeros((vocab, *grad.shape[1:]))
        self.rows.copy_(grad)
        self.work = dist.all_reduce(self.buffer, group=group, async_op=True)

    @property
    def rows(self) -> Tensor:
        return self.buffer.narrow(0, self.row0, self.grad.shape[0])

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, *timeout) -> bool:
        done = self.work.wait(*timeout)
        self.grad.copy_(self.rows)
        return done


class GradientReduction:
    """start(step, grads, loads) / progress() / finish(step) -> the reduced gradient and the norm vector.

    `tied_mask`, `expert_mask` and `count_in_norm` are per parameter of the stage; `take_update_sq(step)`
    hands over this stage's ||Δx_step||^2 (None if it has none waiting), which rides along with a later
    step's norm all-reduce so the update norm costs no collective of its own."""

    def __init__(self, mesh: Mesh, *, grad_scale: float, tied_mask: Sequence[bool], layouts: Sequence[ParamSharding],
                 count_in_norm: Sequence[bool], correct: Correct, take_update_sq: Callable[[int], Tensor | None],
                 wait: Wait, load_stats: RouterLoadStats | None = None, tied_rows: tuple[int, int] | None = None):
        """`tied_rows` (row0, vocab): this stage's tied tensor is those rows of the tied weight (RowsOfTied)."""
        self.mesh = mesh
        self.tied_rows = tied_rows
        self.grad_scale = grad_scale
        self.tied_mask = list(tied_mask)
        self.layouts = list(layouts)
        self.expert_mask = [lay.expert for lay in self.layouts]
        self.count_in_norm = list(count_in_norm)
        self.correct = correct
        self.take_update_sq = take_update_sq
        self.wait = wait
        self.load_stats = load_stats
        self.pending: dict[int, PendingReduction] = {}

    @property
    def norm_group(self):
        return self.mesh.norm_group

    @property
    def norm_group_size(self) -> int:
        return self.mesh.norm_group_size

    # ---- the three calls ---------------------------------------------------------------------
    def start(self, step: int, grads: list[Tensor], loads: list[Tensor]) -> None:
        """b_step's gradient (sums over microbatches, in the masters' dtype): start its reductions."""
        self._reduce_partial_tp(grads)
        pending = PendingReduction(step, grads, loads=loads)
        pending.buckets = self._start_data_parallel(pending)
        self.pending[step] = pending
        self.progress()

    def progress(self) -> list[int]:
        """Advance the pending steps' reductions without blocking, oldest first. Returns the steps whose
        reduction moved on a phase here, i.e. did work on this thread (scaling, corrections, the norm)."""
        advanced = []
        for t in sorted(self.pending):
            p = self.pending[t]
            before = p.phase
            started = self._progress(p, block=False)
            if p.phase != before:
                advanced.append(t)
            if not started:
                break
        return advanced

    def finish(self, step: int) -> PendingReduction:
        """Complete step's reductions (blocking for what is left): its gradient reduced and scaled (the tied
        part corrected), its norm vector all-reduced."""
        p = self.pending.pop(step)
        self._progress(p, block=True)
        if p.work is not None:
            self.wait(p.work, f"the cross-stage gradient-norm all-reduce of step {step}")
            p.work = None
        if p.tied_work is not None:
            self.wait(p.tied_work, f"the tied-embedding gradient all-reduce of step {step}")
            p.tied_work = None
            tied = [g for g, t in zip(p.grads, self.tied_mask) if t]
            torch._foreach_mul_(tied, self.grad_scale / self.mesh.dims.dp)
            self.correct(step, p.grads, self.tied_mask)  # the tied part was deferred in _start_norm
        return p

    # ---- phases ------------------------------------------------------------------------------
    def _progress(self, p: PendingReduction, block: bool) -> bool:
        """dp -> tied -> started; True once the norm all-reduce has started. Without `block`, a phase
        advances only when the handles it needs have completed."""
        if p.phase == "dp":
            if not block and not all(b.work.is_completed() for b in p.buckets):
                return False
            for b in p.buckets:
                b.finish(self.wait)
            p.buckets = []
            p.tied_work = self._start_tied(p.grads)
            p.phase = "tied"
        if p.phase == "tied":
            if p.tied_work is not None and self.mesh.is_first_stage:
                # The first stage counts the tied weight in the global norm, so it needs the sum first.
                if not block and not p.tied_work.is_completed():
                    return False
                self.wait(p.tied_work, f"the tied-embedding gradient all-reduce of step {p.step} with the last stage")
                p.tied_work = None
            self._start_norm(p)
            p.phase = "started"
        return True

    def _start_data_parallel(self, p: PendingReduction) -> list[Bucket]:
        """Start the sum over the replicas of each tensor: DP for dense tensors; for experts the edp group
        only, because the all-to-all already summed the tokens of the EP group into their gradients.
        Router loads (per-rank token counts) are summed over all of DP, in the same all-reduce."""
        dense = [g for g, e in zip(p.grads, self.expert_mask) if not e] + list(p.loads)
        experts = [g for g, e in zip(p.grads, self.expert_mask) if e]
        buckets = []
        if dense and self.mesh.dims.dp > 1:
            buckets += start_buckets(dense, self.mesh.dp_group, "the data-parallel gradient all-reduce")
        if experts and self.mesh.dims.edp > 1:
            buckets += start_buckets(experts, self.mesh.edp_group, "the expert-data-parallel gradient all-reduce")
        return buckets

    def _start_tied(self, grads: list[Tensor | None]):
        """semantics.md: the tied weight's gradient is the sum of the first and last stage's parts.
        Started once the DP sum is complete; returns the handle (None if nothing is tied)."""
        group = self.mesh.embedding_group
        tied = [g for g, t in zip(grads, self.tied_mask) if t]
        if group is None or not tied:
            return None
        if len(tied) != 1:
            raise RuntimeError(f"expected one tied embedding/head weight per stage, found {len(tied)}")
        if self.tied_rows is not None:
            return RowsOfTied(tied[0], *self.tied_rows, group)
        return dist.all_reduce(tied[0], group=group, async_op=True)

    def _start_norm(self, p: PendingReduction) -> None:
        """Scale b_t's gradient and start the all-reduce of [||g||^2, ||Δx_{t-2}||^2, loads]."""
        grads = p.grads
        # The last stage's tied part may still be in flight: it is scaled in finish(), after the wait.
        present = [g is not None and not (t and p.tied_work is not None) for g, t in zip(grads, self.tied_mask)]
        scaled = [g for g, f in zip(grads, present) if f]
        if scaled:  # none on a layer-less stage whose only tensor is its tied head rows, still in flight (issue 44)
            torch._foreach_mul_(scaled, self.grad_scale / self.mesh.dims.dp)
        self.correct(p.step, grads, present)
        # Both squared norms stay on the device as fp64 0-dim tensors (the values a float() and a
        # torch.tensor([...]) would round-trip exactly): no host read here, the update's .tolist() is the one.
        grad_sq = grad_sq_sum([g for g, c in zip(grads, self.count_in_norm) if c and g is not None], self.mesh.device)
        lagged = p.step - 2
        update_sq = self.take_update_sq(lagged)
        reduction = torch.stack([grad_sq, update_sq if update_sq is not None else torch.zeros_like(grad_sq)])
        if self.load_stats is not None:  # router loads ride along: one slot per layer of the model
            reduction = torch.cat([reduction, self._load_vector(p.step)])
        p.reduction, p.norm_of_step = reduction, lagged if update_sq is not None else None
        if self.norm_group_size > 1:
            p.work = dist.all_reduce(reduction, group=self.norm_group, async_op=True)

    def _load_vector(self, step: int) -> Tensor:
        return self.load_stats.vector(step, self.mesh.device)

    def _reduce_partial_tp(self, grads: list[Tensor]) -> None:
        """Tensors replicated over TP whose gradient each TP rank holds only in part (a norm under
        sequence parallelism) are summed over TP first, so every TP rank applies the same update."""
        partial = [g for g, lay in zip(grads, self.layouts) if lay.tp_grad_reduce]
        if partial and self.mesh.dims.tp > 1:
            for bucket in start_buckets(partial, self.mesh.tp_group, "the tensor-parallel gradient all-reduce"):
                bucket.finish(self.wait)

    def all_reduce_norms(self, values: list[Tensor], what: str) -> list[float]:
        """Sum per-rank fp64 0-dim tensors over the norm group (blocking): the last updates' norms at a drain."""
        reduction = torch.stack(values)
        if self.norm_group_size > 1:
            self.wait(dist.all_reduce(reduction, group=self.norm_group, async_op=True), what)
        return reduction.tolist()


class ShardedGradientReduction(GradientReduction):
    """The distributed optimizer's reduction (parallel.distributed_optimizer=true): the "dp" phase reduces
    each sharded tensor to its owner only (asyncpp/optim/distributed.py: whole parameters, so this is a
    reduce-scatter at parameter granularity), at the same start and wait points as the all-reduce; a
    rank's gradient is then None for every tensor it does not own. Replicated tensors (a tied
    embedding) and the router loads are still all-reduced.

    The norm: every rank now holds a distinct piece of the gradient, so [||g_owned||^2, ...] is summed over
    the whole job (`mesh.replica_norm_group`, a group of its own) instead of over the norm group of one
    replica; each tensor is still counted exactly once, so the norm is the same number up to the order of
    the fp32/fp64 sums."""

    def __init__(self, mesh: Mesh, *, ownership, **kwargs):
        super().__init__(mesh, **kwargs)
        self.ownership = ownership
        self.sharded = [ownership.sharded(i) for i in range(len(ownership.owners))]
        self.count_in_norm = [self._counted(i, c) for i, c in enumerate(self.count_in_norm)]

    def _counted(self, i: int, counted: bool) -> bool:
        """A sharded tensor on its owner (TP-replicated ones on TP rank 0); ownership over DP already
        spans the EP ranks, so the EP-rank-0 rule of the replicated case does not apply. A replicated
        tensor as before, on DP rank 0 only (the sum now runs over the replicas too)."""
        if not self.sharded[i]:
            return counted and self.mesh.dp_rank == 0
        if not self.ownership.owned(i):
            return False
        return self.layouts[i].is_tp_sharded or self.mesh.tp_rank == 0

    @property
    def norm_group(self):
        return self.mesh.replica_norm_group

    @property
    def norm_group_size(self) -> int:
        return self.mesh.dims.world_size

    def _start_data_parallel(self, p: PendingReduction) -> list:
        buckets: list = []
        replicated = [g for g, s in zip(p.grads, self.sharded) if not s] + list(p.loads)
        if replicated and self.mesh.dims.dp > 1:
            buckets += start_buckets(replicated, self.mesh.dp_group, "the data-parallel gradient all-reduce")
        o = self.ownership
        for expert, group, size, rank in ((False, self.mesh.dp_group, self.mesh.dims.dp, o.dp_rank),
                                          (True, self.mesh.edp_group, self.mesh.dims.edp, o.edp_rank)):
            idx = [i for i, s in enumerate(self.sharded) if s and o.expert[i] == expert]
            if idx and size > 1:
                kind = "expert-data-parallel" if expert else "data-parallel"
                buckets += start_owner_buckets([p.grads[i] for i in idx], [o.owners[i] for i in idx], group, rank,
                                               "reduce", f"the {kind} gradient reduce to the owners")
        return buckets

    def _progress(self, p: PendingReduction, block: bool) -> bool:
        if p.phase == "dp" and (block or all(b.work.is_completed() for b in p.buckets)):
            for b in p.buckets:
                b.finish(self.wait)
            p.buckets = []
            # Not this rank's to update: drop the (partially reduced) gradient now, its memory with it.
            p.grads = [g if self.ownership.owned(i) else None for i, g in enumerate(p.grads)]
        return super()._progress(p, block)

    def _load_vector(self, step: int) -> Tensor:
        """The loads are the same on every replica's counting rank: one replica contributes them."""
        v = super()._load_vector(step)
        return v if self.mesh.dp_rank == 0 else torch.zeros_like(v)
