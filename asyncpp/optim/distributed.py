"""The distributed optimizer's ownership plan (parallel.distributed_optimizer=true; Megatron's
--use-distributed-optimizer, ZeRO-1): which data-parallel rank updates which parameter.

One scheme for every optimizer: whole parameters are owned. Muon, NorMuon and SOAP need whole matrices
(and Muon batches whole expert stacks), so a flat element-range shard would not do for them; AdamW and
Lion would accept one, but one scheme keeps one code path and one checkpoint format. The owner of a
parameter holds its optimizer state and its Error-Feedback buffer, receives its reduced gradient, steps it
and sends the result to the other replicas (asyncpp/pipeline/reduction.py, weights.py).

Balance, as Moonlight's and Dion's distributed Muon: a matrix stepped by a matrix optimizer costs its
Newton-Schulz flops (muon_sharded.MatrixJob.cost, per matrix of a stack); every other parameter its element
count. Greedy longest-processing-time: costliest first, each to the least-loaded rank (ties: the lowest),
separately for the matrix-optimizer and the elementwise parameters, so both the NS time and the
optimizer-state bytes are balanced. The plan is a pure function of the local shapes, which every rank of
a DP group (and of a TP group: shards have equal shapes) holds identically, so no rank needs to ask.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from asyncpp.optim.build import AnyOptimizer
from asyncpp.optim.muon_sharded import MatrixJob

REPLICATED_OWNER = -1
"""Owner of a parameter every replica updates itself (the tied embedding: its gradient is summed with
another stage's, which the DP-sharded path would have to route through its owner on both stages)."""


def assign_owners(costs: Sequence[int], world: int) -> list[int]:
    """Owner rank in [0, world) of each cost: longest processing time first, least-loaded rank, ties to
    the lowest rank and, among equal costs, the earlier index (deterministic)."""
    if world < 1:
        raise ValueError(f"a data-parallel group of {world} ranks")
    load = [0] * world
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += costs[i]
    return owners


def param_cost(p: Tensor, matrix: bool) -> int:
    """Newton-Schulz flops (up to a constant) of a matrix-optimizer parameter, else its element count."""
    if matrix and p.ndim >= 2:
        job = MatrixJob(tuple(p.shape), p.dtype)
        return job.count * job.cost
    return p.numel()


@dataclass(frozen=True)
class Ownership:
    """Per parameter of a stage: the rank of its group that owns it (REPLICATED_OWNER: every rank) and
    whether that group is the expert-data-parallel one (expert stacks) or the data-parallel one."""

    owners: tuple[int, ...]
    expert: tuple[bool, ...]
    dp_rank: int
    edp_rank: int

    def owned(self, i: int) -> bool:
        """Whether this rank updates parameter i."""
        owner = self.owners[i]
        return owner == REPLICATED_OWNER or owner == (self.edp_rank if self.expert[i] else self.dp_rank)

    @property
    def mask(self) -> list[bool]:
        return [self.owned(i) for i in range(len(self.owners))]

    def sharded(self, i: int) -> bool:
        return self.owners[i] != REPLICATED_OWNER


def plan_ownership(params: Sequence[Tensor], *, matrix: Sequence[bool], expert: Sequence[bool],
                   replicated: Sequence[bool], dp: int, edp: int, dp_rank: int, edp_rank: int) -> Ownership:
    """Owners of a stage's parameters: dense ones over the `dp` ranks, expert stacks over the `edp` ranks
    (the ranks holding the same experts), `replicated` ones on every rank; balanced as the module says."""
    owners = [REPLICATED_OWNER] * len(params)
    for is_expert, world in ((False, dp), (True, edp)):
        for is_matrix in (True, False):
            idx = [i for i in range(len(params))
                   if expert[i] == is_expert and matrix[i] == is_matrix and not replicated[i]]
            for i, r in zip(idx, assign_owners([param_cost(params[i], is_matrix) for i in idx], world)):
                owners[i] = r
    return Ownership(tuple(owners), tuple(bool(e) for e in expert), dp_rank, edp_rank)


def restrict_to_owned(optimizer: AnyOptimizer, owned: Sequence[Tensor]) -> None:
    """Make a freshly built optimizer (an OptimizerSet or a torch optimizer) step only `owned` parameters,
    so only they get state. Muon's own DP sharding of Newton-Schulz is switched off: ownership already
    shares the work out, and the replicas now step different parameters (its DP collectives would hang)."""
    keep = {id(p) for p in owned}
    inner = getattr(optimizer, "optimizers", None)
    for opt in inner.values() if isinstance(inner, dict) else [optimizer]:
        if any(opt.state.values()):
            raise RuntimeError("restrict_to_owned() needs an optimizer that has not stepped yet")
        for group in opt.param_groups:
            mask = [id(p) in keep for p in group["params"]]
            for key in ("params", "tp_dims", "experts"):  # the layout lists are aligned with params
                if group.get(key) is not None:
                    group[key] = [v for v, m in zip(group[key], mask) if m]
        if hasattr(opt, "dp_group"):
            opt.dp_group = opt.expert_dp_group = None


def imbalance(owners: Sequence[int], costs: Sequence[int], world: int) -> float:
    """max / mean load of a plan (1.0 = perfect), for tests and the dry run."""
    load = [0] * world
    for r, c in zip(owners, costs):
        load[r] += c
    mean = sum(load) / world
    return max(load) / mean if mean else math.nan
