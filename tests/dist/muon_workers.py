"""What each rank runs in tests/dist/test_muon_distributed.py, and the single-process references.

Parameters and gradients are pure functions of a seed, so every rank (and the reference) builds the
same full tensors; a TP rank keeps its chunk along the parameter's tp_dim.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import asyncpp.optim.muon as muon_module
from asyncpp.optim import Muon

# (shape, tp_dim, expert): column-parallel ([out, in] split on out = dim 0) and row-parallel (dim 1)
# matrices, a square pair of each, a replicated matrix, a tall one, and stacked experts.
MIXED = [
    ((32, 24), None, False),
    ((32, 24), None, False),
    ((24, 40), None, False),
    ((48, 16), None, False),
    ((3, 24, 40), None, False),
    ((4, 16, 24), None, True),
]
TP_LAYOUT = [
    ((32, 24), 0, False),   # column-parallel: each rank holds 16 rows
    ((32, 24), 1, False),   # row-parallel: each rank holds 12 columns
    ((40, 40), 0, False),
    ((40, 40), 1, False),
    ((24, 40), None, False),  # replicated over TP
    ((4, 16, 24), 0, True),   # experts split over TP on dim 0: whole matrices, nothing to gather
    ((2, 32, 16), 2, False),  # a stack whose matrices are split along their columns
]
KW = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr": "match_rms_adamw"}


def full_tensors(layout: list, steps: int, seed: int = 0) -> tuple[list[Tensor], list[list[Tensor]]]:
    """(initial params, grads[step]) at full size, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(shape, generator=g) for shape, _, _ in layout]
    grads = [[torch.randn(shape, generator=g) for shape, _, _ in layout] for _ in range(steps)]
    return params, grads


def shard(x: Tensor, tp_dim: int | None, tp: int, rank: int) -> Tensor:
    return x.clone() if tp_dim is None or tp == 1 else x.chunk(tp, dim=tp_dim)[rank].clone()


def run_muon(params: list[Tensor], grads: list[list[Tensor]], group: dict[str, Any], **kw) -> tuple[list, list]:
    """Muon on copies of `params` for len(grads) steps; returns (final params, momentum buffers)."""
    ps = [nn.Parameter(p.clone()) for p in params]
    opt = Muon([{"params": ps, **group}], **{**KW, **kw})
    for step_grads in grads:
        for p, g in zip(ps, step_grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in ps], [opt.state[p]["momentum_buffer"] for p in ps]


@contextmanager
def count_ns_matrices() -> Iterator[list[int]]:
    """Count the matrices this rank's Muon orthogonalises (wraps the NS function Muon calls)."""
    seen = [0]
    inner = muon_module.orthogonalize

    def counting(G: Tensor, *args, **kwargs) -> Tensor:
        seen[0] += G.reshape(-1, *G.shape[-2:]).shape[0]
        return inner(G, *args, **kwargs)

    muon_module.orthogonalize = counting
    try:
        yield seen
    finally:
        muon_module.orthogonalize = inner


def dp_rank(rank: int, steps: int, compute_dtype: str | None) -> dict:
    """DP=2 (the whole world): every rank holds all parameters; experts shard over the same ranks."""
    params, grads = full_tensors(MIXED, steps)
    world = dist.group.WORLD
    layout = {"experts": [e for _, _, e in MIXED]}
    with count_ns_matrices() as seen:
        out, bufs = run_muon(params, grads, layout, compute_dtype=compute_dtype, dp_group=world,
                             expert_dp_group=world, bucket_numel=2 * 24 * 40)  # small buckets: several per class
    # Expert stacks with no expert-DP group: each rank orthogonalises its own, the dense ones are shared.
    local_experts, _ = run_muon(params, grads, layout, compute_dtype=compute_dtype, dp_group=world)
    return {"params": out, "bufs": bufs, "ns_matrices": seen[0], "params_local_experts": local_experts}


def tp_rank(rank: int, steps: int, compute_dtype: str | None) -> dict:
    """TP=2 (the whole world): "gather" and "block" mode on the same shards."""
    params, grads = full_tensors(TP_LAYOUT, steps)
    group = dist.group.WORLD
    dims = [d for _, d, _ in TP_LAYOUT]
    local = [shard(p, d, 2, rank) for p, d in zip(params, dims)]
    local_grads = [[shard(g, d, 2, rank) for g, d in zip(gs, dims)] for gs in grads]
    layout = {"tp_dims": dims, "experts": [e for _, _, e in TP_LAYOUT]}
    result = {}
    for mode in ("gather", "block"):
        out, bufs = run_muon(local, local_grads, layout, compute_dtype=compute_dtype, tp_group=group, tp_mode=mode)
        result[mode] = {"params": out, "bufs": bufs}
    return result


def two_rank_cases(rank: int, steps: int, dtypes: list[str | None]) -> dict:
    """Every 2-rank case in one spawn (starting processes is what costs): {(case, dtype): result}."""
    out = {}
    for dtype in dtypes:
        out[("dp", dtype)] = dp_rank(rank, steps, dtype)
        out[("tp", dtype)] = tp_rank(rank, steps, dtype)
    return out


def tp_dp_rank(rank: int, steps: int, compute_dtype: str | None) -> dict:
    """4 ranks as TP=2 x DP=2 (rank = dp * 2 + tp): TP gathers of the DP-owned matrices only."""
    params, grads = full_tensors(TP_LAYOUT, steps)
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp, dp = rank % 2, rank // 2
    dims = [d for _, d, _ in TP_LAYOUT]
    local = [shard(p, d, 2, tp) for p, d in zip(params, dims)]
    local_grads = [[shard(g, d, 2, tp) for g, d in zip(gs, dims)] for gs in grads]
    layout = {"tp_dims": dims, "experts": [e for _, _, e in TP_LAYOUT]}
    with count_ns_matrices() as seen:
        out, bufs = run_muon(local, local_grads, layout, compute_dtype=compute_dtype, tp_group=tp_groups[dp],
                             dp_group=dp_groups[tp], expert_dp_group=dp_groups[tp])
    return {"params": out, "bufs": bufs, "tp": tp, "dp": dp, "ns_matrices": seen[0]}
