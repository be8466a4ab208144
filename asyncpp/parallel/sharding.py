"""How each parameter of a parallelized model is laid out: the one contract shared by the TP/EP
plans (which produce it), the engine (gradient reductions and norms), the optimizers (a Muon that
orthogonalizes the full matrix) and the dry run (per-rank memory).

Parameters not named in a plan are replicated on every rank of the stage's TP and DP groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class ParamSharding:
    tp_dim: int | None = None
    """The dim along which the parameter is split over the TP group (None: replicated over TP)."""
    expert: bool = False
    """An expert weight split over the EP group along dim 0: each rank holds E/ep experts. Its gradient
    already sums the tokens of every EP rank (the all-to-all brought them), so it is all-reduced over
    the expert-data-parallel group (dp / ep ranks) only, instead of over DP."""
    tp_grad_reduce: bool = False
    """Replicated over TP, but each TP rank's gradient is partial (e.g. a norm under sequence
    parallelism): the engine all-reduces it over TP before anything else reads it."""

    @property
    def is_tp_sharded(self) -> bool:
        return self.tp_dim is not None


ShardingPlan = dict[str, ParamSharding]
"""Full-model parameter name ("layers.3.mixer.q_proj.weight") -> its layout."""

REPLICATED = ParamSharding()


def layout_of(plan: ShardingPlan, name: str) -> ParamSharding:
    return plan.get(name, REPLICATED)


def global_view(layout: ParamSharding, device_mesh, tp: int, ep: int):
    """A function wrapping a local piece as the global tensor it is part of (a DTensor over the
    ("ep", "tp") dims of `device_mesh` that shard it, sharing storage), or None when the rank holds
    the whole tensor. For checkpoints: DCP then reads and writes by global offsets."""
    from torch.distributed.tensor import DTensor, Shard

    dims, placements = [], []
    if layout.expert and ep > 1:
        dims.append("ep"), placements.append(Shard(0))
    if layout.is_tp_sharded and tp > 1:
        dims.append("tp"), placements.append(Shard(layout.tp_dim))
    if not dims:
        return None
    sub = device_mesh[tuple(dims)] if len(dims) > 1 else device_mesh[dims[0]]
    return lambda t: DTensor.from_local(t, sub, placements, run_check=False)


def rows_view(shards: Sequence[tuple[int, int]], index: int, num_rows: int, group):
    """A function wrapping this rank's rows of a [num_rows, ...] tensor, rows shards[index] = (start, rows) of the
    ranks of `group` in group order, as the global tensor it is part of, for DCP to save and load by global offsets
    (a vocabulary-parallel head's rows: unequal, so no DTensor placement describes them). A ShardedTensor, built
    from the known layout without a collective. Like global_view's DTensor it shares the local storage."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    ranks = dist.get_process_group_ranks(group)

    def wrap(t: Tensor):
        tail = list(t.shape[1:])
        metas = [ShardMetadata([start, *[0] * len(tail)], [rows, *tail], f"rank:{r}/{t.device}")
                 for r, (start, rows) in zip(ranks, shards)]
        meta = ShardedTensorMetadata(metas, torch.Size([num_rows, *tail]), TensorProperties(dtype=t.dtype))
        return ShardedTensor._init_from_local_shards_and_global_metadata([Shard(t, metas[index])], meta,
                                                                       process_group=group)

    return wrap
