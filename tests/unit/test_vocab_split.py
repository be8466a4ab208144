"""The vocabulary-parallel head's cost model (asyncpp/core/vocab_split.py): the collectives' closed forms, the
water-filled shards, the joint choice of layers and shards against brute force, unequal shards where layers do
not divide, and the communication term really counted."""

from __future__ import annotations

import itertools

import pytest

from asyncpp.core.layer_costs import FLOP_RATE, layer_costs
from asyncpp.core.vocab_split import (
    LINKS,
    Link,
    comm_per_token,
    plan_vocab_split,
    shard_rows,
    vocab_comm_time,
)
from model_zoo import get_model_config

SEQ = 4096


def compositions(n: int, parts: int):
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        yield [b - a for a, b in itertools.pairwise(bounds)]


def paper(name: str):
    return get_model_config(name), layer_costs(get_model_config(name), SEQ, 1, "cuda")


def test_comm_time_is_the_bus_bandwidth_forms():
    # 4096 tokens x 1024 hidden x 2 bytes = 8 MiB broadcast and reduced once each over the link; the statistics
    # are 4 + 8 bytes per token all-reduced (2 (P-1)/P of them cross each link); 4 collectives' latency.
    link = Link("test", 1e9, 1e-5)
    c = vocab_comm_time(4096, 1024, 4, link)
    assert c.broadcast == pytest.approx(4096 * 1024 * 2 / 1e9 + 1e-5)
    assert c.gradient == pytest.approx(c.broadcast)
    assert c.statistics == pytest.approx(1.5 * 4096 * 12 / 1e9 + 2e-5)
    assert c.total == pytest.approx(c.broadcast + c.statistics + c.gradient)
    assert vocab_comm_time(4096, 1024, 1, link).total == 0.0  # one stage: nothing to exchange
    with pytest.raises(ValueError, match="bandwidth"):
        vocab_comm_time(4096, 1024, 4, Link("dead", 0.0, 0.0))
    # In the cost model's unit: seconds x the device's FLOP rate, per token.
    assert comm_per_token(c, 4096, "cuda") == pytest.approx(c.total * FLOP_RATE["cuda"] / 4096)


@pytest.mark.parametrize("body", [[1.0, 1.0, 1.0], [3.0, 1.0, 2.0, 0.5], [10.0, 0.0], [0.2, 0.3, 5.0, 0.1]])
def test_shards_fill_like_water(body):
    """Rows sum to the vocabulary in whole granules (the remainder on the last stage), and every stage that gets
    rows ends within one granule's cost of the common level, which no stage without rows is below."""
    vocab, granule, head = 10_000, 16, 4.0
    rows = shard_rows(body, head, vocab, granule)
    assert sum(rows) == vocab
    assert all(r % granule == 0 for r in rows[:-1]) and (rows[-1] - vocab % granule) % granule == 0
    cost = [b + r / vocab * head for b, r in zip(body, rows)]
    filled = [c for c, r in zip(cost, rows) if r > 0]
    level = max(filled)
    assert level - min(filled) <= 2 * granule / vocab * head + 1e-12
    assert all(c >= level - 2 * granule / vocab * head for c, r in zip(cost, rows) if r == 0)
    # The ideal is reached whenever no stage's own work exceeds it.
    ideal = (sum(body) + head) / len(body)
    if max(body) <= ideal:
        assert level == pytest.approx(ideal, abs=granule / vocab * head)


@pytest.mark.parametrize("name,P", [("tiny_hybrid", 2), ("tiny_hybrid", 3), ("moe_2b", 3), ("hybrid_moe_10b", 4)])
def test_joint_choice_is_the_best_split_and_shards(name, P):
    """Layers and shards chosen together against brute force over every split (each with its water-filled
    shards): the slowest stage is no slower than the best one, up to the shards' rounding: whole granules of 128
    rows move a stage by at most one granule's share of the head (the exact water level is a lower bound for
    every split's rounded shards)."""
    model = get_model_config(name)
    costs = layer_costs(model, 512, 1, "cuda")
    plan = plan_vocab_split(costs, P, model.vocab_size)
    best = min(max(plan_vocab_split(costs, P, model.vocab_size, sizes=s).compute)
               for s in compositions(len(costs.layers), P))
    assert max(plan.compute) <= best + 128 / model.vocab_size * costs.head_vocab
    assert sum(plan.compute) == pytest.approx(sum(costs.layers) + costs.embedding + costs.head, rel=1e-12)


def test_unequal_shards_help_where_layers_do_not_divide():
    """hybrid_moe_10b at P=16: 24 layers leave 8 stages with 2 layers and 8 with 1. Equal shards leave the
    2-layer stages the slowest; the jointly sized shards move the vocabulary to the 1-layer stages and come within
    a few percent of the ideal, which equal shards miss by a fifth (the issue's 0.80 bound)."""
    model, costs = paper("hybrid_moe_10b")
    unequal = plan_vocab_split(costs, 16, model.vocab_size)
    equal = plan_vocab_split(costs, 16, model.vocab_size, equal_shards=True)
    assert len(set(unequal.shards)) > 1 and len(set(equal.shards)) == 1
    by_layers = {k: [r for s, r in zip(unequal.sizes, unequal.shards) if s == k] for k in set(unequal.sizes)}
    assert min(by_layers[1]) > max(by_layers[2])  # a stage with fewer layers takes more of the vocabulary
    ideal = (sum(costs.layers) + costs.embedding + costs.head) / 16
    assert max(unequal.compute) < 0.99 * max(equal.compute)
    assert ideal / max(unequal.compute) > 0.95 and ideal / max(equal.compute) < 0.85


def test_communication_is_counted_and_hidden_only_up_to_the_link():
    """The slowest stage grows as the bandwidth drops under "exposed"; under "hidden" it is the compute until the
    link time exceeds it."""
    model, costs = paper("moe_2b")
    tokens = SEQ

    def slowest(bandwidth: float, overlap: str) -> float:
        comm = vocab_comm_time(tokens, model.hidden_size, 8, Link("x", bandwidth, 0.0))
        plan = plan_vocab_split(costs, 8, model.vocab_size, comm=comm_per_token(comm, tokens, "cuda"),
                                overlap=overlap)
        return max(plan.stage_costs)

    compute = max(plan_vocab_split(costs, 8, model.vocab_size).compute)
    exposed = [slowest(b, "exposed") for b in (1e15, LINKS["nvlink"].bandwidth, LINKS["ib"].bandwidth, 5e9)]
    assert exposed[0] == pytest.approx(compute, rel=1e-3)
    assert all(a < b for a, b in itertools.pairwise(exposed))
    assert slowest(LINKS["ib"].bandwidth, "hidden") == pytest.approx(compute)
    assert slowest(1e8, "hidden") > compute  # a slow enough link bounds the stage even when overlapped
    with pytest.raises(ValueError, match="overlap"):
        plan_vocab_split(costs, 8, model.vocab_size, overlap="sometimes")
