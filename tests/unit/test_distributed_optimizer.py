"""The distributed optimizer's ownership plan (asyncpp/optim/distributed.py), without processes."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from asyncpp.optim import build_optimizer
from asyncpp.optim.distributed import (
    REPLICATED_OWNER,
    assign_owners,
    imbalance,
    param_cost,
    plan_ownership,
    restrict_to_owned,
)


def test_assign_owners_is_deterministic_and_balanced_within_the_largest_item():
    rng = random.Random(0)
    costs = [rng.randrange(1, 1000) for _ in range(50)]
    owners = assign_owners(costs, 4)
    assert owners == assign_owners(list(costs), 4)
    load = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(4)]
    # LPT: the most-loaded rank exceeds the least-loaded by at most one item.
    assert max(load) - min(load) <= max(costs)
    assert imbalance(owners, costs, 4) < 1.05


def test_assign_owners_one_rank_owns_everything():
    assert assign_owners([3, 1, 2], 1) == [0, 0, 0]
    with pytest.raises(ValueError, match="0 ranks"):
        assign_owners([1], 0)


def test_matrices_balance_by_newton_schulz_cost_not_bytes():
    big, small = torch.empty(64, 64), torch.empty(8, 512)  # same bytes, NS cost 64x vs 8x
    assert big.numel() == small.numel()
    assert param_cost(big, matrix=True) == 8 * param_cost(small, matrix=True)
    assert param_cost(big, matrix=False) == param_cost(small, matrix=False)
    stack = torch.empty(4, 8, 512)  # four expert matrices
    assert param_cost(stack, matrix=True) == 4 * param_cost(small, matrix=True)


def test_plan_shards_dense_over_dp_experts_over_edp_and_keeps_tied_replicated():
    params = [torch.empty(16, 16), torch.empty(16), torch.empty(4, 16, 16), torch.empty(4, 16, 16), torch.empty(32, 16)]
    kw = {"matrix": [True, False, True, True, False], "expert": [False, False, True, True, False],
          "replicated": [False, False, False, False, True], "dp": 4, "edp": 2}
    plans = [plan_ownership(params, dp_rank=r, edp_rank=r // 2, **kw) for r in range(4)]
    assert all(p.owners == plans[0].owners for p in plans)  # one plan, computed alike everywhere
    assert plans[0].owners[4] == REPLICATED_OWNER and all(p.owned(4) for p in plans)
    # every dense parameter has exactly one owner among the dp ranks
    for i in (0, 1):
        assert sum(p.owned(i) for p in plans) == 1
    # the two expert stacks go to the two edp ranks (equal cost: one each)
    assert sorted(plans[0].owners[2:4]) == [0, 1]


def test_restrict_to_owned_keeps_the_layout_lists_aligned_and_drops_muon_dp_sharding():
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8), nn.Linear(8, 4, bias=False))
    opt = build_optimizer(model, name="muon", lr=0.01, weight_decay=0.0)
    muon = opt.optimizers["muon"]
    muon.dp_group = object()  # as if built with a DP group
    keep = [model[0].weight, model[1].bias]
    restrict_to_owned(opt, keep)
    assert [p is model[0].weight for p in muon.param_groups[0]["params"]] == [True]
    assert len(muon.param_groups[0]["tp_dims"]) == len(muon.param_groups[0]["experts"]) == 1
    assert muon.dp_group is None and muon.expert_dp_group is None
    assert [p for g in opt.optimizers["adamw"].param_groups for p in g["params"]] == [model[1].bias]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    stepped = {id(p) for o in opt.optimizers.values() for p in o.state}
    assert stepped == {id(p) for p in keep}


def test_restrict_to_owned_refuses_a_stepped_optimizer():
    model = nn.Linear(4, 4)
    opt = build_optimizer(model, name="adamw", lr=0.01, weight_decay=0.0)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    with pytest.raises(RuntimeError, match="has not stepped"):
        restrict_to_owned(opt, [model.weight])


@pytest.mark.parametrize("name", ["adamw", "muon", "normuon", "soap", "lion"])
def test_an_optimizer_that_owns_nothing_still_steps(name):
    """A DP rank may own none of a small stage's parameters: its optimizer steps nothing, without error."""
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8))
    opt = build_optimizer(model, name=name, lr=0.01, weight_decay=0.0)
    restrict_to_owned(opt, [])
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
