"""Rank functions for test_expert_parallel.py (importable, so spawned processes can unpickle them).

Every case builds the same MoE (same seed) on every rank and in the parent, which recomputes the
single-process reference from the same case description: tokens(case, rank, layer) is the one
source of inputs on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from asyncpp.parallel.experts import parallelize_moe
from model_zoo import MoE, MoEConfig, build_model, get_model_config

HIDDEN = 128
TINY_MOE = {"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 128, "shared_expert_ffn_hidden_size": 128,
                "aux_loss_coef": 0.01}


@dataclass(frozen=True)
class Case:
    name: str
    mode: str
    """"ep": tokens differ per rank, experts split over the 2 ranks; "tp": tokens identical, ffn dims split."""
    tokens: tuple[int, int]
    """Tokens on rank 0 and rank 1 (tp cases use rank 0's tokens on both)."""
    moe: dict = field(default_factory=dict)
    """MoEConfig fields changed from TINY_MOE."""
    crowd_expert: int | None = None
    """Rank 1's tokens (every rank's under tp) are steered so all of them pick this expert first."""
    bias: tuple[float, ...] | None = None
    """expert_bias to set (needs bias_update_rate > 0): a large negative entry leaves that expert empty."""


def build_layer(case: Case) -> MoE:
    torch.manual_seed(0)
    moe = MoE(HIDDEN, MoEConfig(**{**TINY_MOE, **case.moe}))
    moe.init_weights(0.1, 0.1)
    if case.bias is not None:
        moe.expert_bias.copy_(torch.tensor(case.bias))
    return moe


def tokens(case: Case, rank: int, layer: MoE) -> tuple[Tensor, Tensor]:
    """(x [n, d], upstream gradient [n, d]) of `rank` for `case`."""
    crowded = case.crowd_expert is not None and (case.mode == "tp" or rank == 1)
    rank = 0 if case.mode == "tp" else rank
    g = torch.Generator().manual_seed(100 + rank)
    n = case.tokens[rank]
    x = torch.randn(n, HIDDEN, generator=g)
    if crowded:
        # A token aligned with one router row picks that expert with probability ~1.
        w = layer.router.weight.detach()
        x = 0.1 * x + 20.0 * w[case.crowd_expert] / w.norm()
    return x, torch.randn(n, HIDDEN, generator=g)


def run_layer(layer: MoE, x: Tensor, upstream: Tensor) -> dict[str, Tensor]:
    """Forward + backward with a given upstream gradient; returns the output and every gradient."""
    x = x.detach().clone().requires_grad_()
    out = layer(x)
    out.backward(upstream)
    grads = {f"grad/{n}": p.grad.clone() for n, p in layer.named_parameters()}
    return {"out": out.detach(), "grad/x": x.grad.clone(), "load": layer.last_expert_load.clone(), **grads}


def layer_case(rank: int, case: Case) -> dict[str, Tensor]:
    layer = build_layer(case)
    world = dist.group.WORLD
    parallelize_moe(layer, world if case.mode == "tp" else None, world if case.mode == "ep" else None)
    return run_layer(layer, *tokens(case, rank, layer))


def model_tokens(rank: int) -> Tensor:
    """[2, 17] token ids of `rank` (16 inputs + shifted targets); ranks get different data."""
    return torch.randint(0, 8192, (2, 17), generator=torch.Generator().manual_seed(7 + rank))


def run_model(model: torch.nn.Module, ids: Tensor) -> dict[str, Tensor]:
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
    loss.backward()
    return {"loss": loss.detach(), **{f"grad/{n}": p.grad.clone() for n, p in model.named_parameters()}}


def model_case(rank: int) -> dict[str, Tensor]:
    """The whole tiny_moe model with every MoE layer expert-parallel over the 2 ranks."""
    torch.manual_seed(0)
    model = build_model(get_model_config("tiny_moe"))
    for moe in model.moe_layers():
        parallelize_moe(moe, None, dist.group.WORLD)
    return run_model(model, model_tokens(rank))


def all_cases(rank: int, cases: list[Case]) -> dict[str, dict[str, Tensor]]:
    """One spawn for every case: starting processes costs more than the layers."""
    results = {case.name: layer_case(rank, case) for case in cases}
    results["model"] = model_case(rank)
    return results


def tp_ep_case(rank: int, case: Case) -> dict[str, Tensor]:
    """4 ranks = 2 EP x 2 TP: rank = 2 * ep_rank + tp_rank; the TP pair of an EP rank shares its tokens."""
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    ep_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep_rank, tp_rank = divmod(rank, 2)
    layer = build_layer(case)
    parallelize_moe(layer, tp_groups[ep_rank], ep_groups[tp_rank])
    return run_layer(layer, *tokens(case, ep_rank, layer))
