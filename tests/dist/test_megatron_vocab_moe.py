"""A megatron-core MoE GPTModel with its output layer spread over the pipeline stages (VocabSpreadStage,
VocabPipeline2BW) and its experts over EP=2 with megatron's all-to-all dispatcher equals the one-step-delayed rule
on the unsplit GPTModel (DelayedUpdateSimulator in one process): losses, grad norms, every weight.

The workers, the reference and the checks are test_megatron_core's (tests/dist/megatron_core_workers.py); its
tolerance derivation covers this case: the spread head's per-shard logits and gathered softmax statistics, and the
dispatcher's other token order inside each expert, are the two float-order changes, ~1e-7 relative per step each,
below RTOL = 1e-5 after 6 steps (worst weight errors here: 7.6e-6 at EP=2, 8.4e-6 tied with the embedding
sharded, both in a router weight, whose 4 x 32 matrix Muon orthogonalises; the plain-head PP2 x DP2 x EP2 alltoall
case of test_megatron_core has 5.8e-6). The router aux loss: megatron's MoEAuxLossAutoScaler scale is 1 per
microbatch here (the reduction divides b_t's summed gradient by m, the simulator's convention), where plain
Pipeline2BW sets 1/m (it divides the loss by m first); with 1/m here the EP=2 case's losses miss RTOL from step 2 on
(tried), so the match shows the scale.

The eight-rank case (DP=4 x EP=2, the expert-data-parallel sum) derives its own weight bound: its Muon updates of
MoE weights (a 4 x 32 router, experts that see a few tokens: gradients with small singular values, which Muon's
orthogonalisation amplifies) make even the reference differ from itself by ~7e-6 when only the order of its
microbatch sum is reversed (`rounding_floor`, computed in the test, one reference run more). The pipeline makes four
float-order changes of that kind, so its weights are checked at max(RTOL, 4 x floor); the losses and grad norms stay
at RTOL.

Cost (warm fork server, load ~10 on 2 cores): the four-rank case 2 s reference + 9 s pipeline (default tier); the
two-rank case 3 s + 4 s (slow: the default suite's budget; it adds the tied sharded embedding and the checkpoint).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import replace

import pytest
import torch

from tests.dist import test_megatron_core
from tests.dist.harness import run_ranks
from tests.dist.megatron_core_workers import LAYERS, MOE, Case, reference_rank
from tests.dist.test_megatron_core import (
    RTOL,
    check_equals_reference,
    check_megatron_log,
    check_megatron_ran,
    check_vocab_checkpoint_loads_unsplit,
    check_vocab_head_evaluates,
    check_vocab_head_ran,
    run_cases,
    run_example,
)
from tests.dist.test_megatron_router_bias import check_router_bias_equals_reference
from tests.dist.test_pipeline_equivalence import relative_error

pytestmark = [pytest.mark.dist, pytest.mark.equivalence]

CASES = {
    # two ranks (slow): MoE (alltoall at EP=1) with the head and the input embedding spread, tied
    "two": Case("pp2_moe_alltoall_vocab_head_and_embedding_tied", moe=True, dispatcher="alltoall", vocab=True,
                vocab_embedding=True, tied=True),
    # four ranks (the default tier): PP=2 x DP=2, the DP ranks also EP=2, a drain mid-run
    "four": Case("pp2_dp2_ep2_moe_alltoall_vocab_head", dp=2, ep=2, moe=True, dispatcher="alltoall", vocab=True,
                 drain_after=3),
    # eight ranks, DP=4 x EP=2: each expert on two DP replicas, reduced over megatron's expert-data-parallel group
    # (size 2; at DP=2 x EP=2 it has size 1, and at EP=1 megatron marks experts allreduce=True, reduced as dense
    # weights over DP), with the allgather dispatcher
    "eight": Case("pp2_dp4_ep2_moe_allgather_vocab_head", dp=4, ep=2, moe=True, vocab=True),
}
EXPERTS = "mlp.experts.local_experts."
indexed_prefix = test_megatron_core.indexed_prefix  # the fixture (a small indexed dataset), shared


def run_case(case: Case) -> tuple[list[dict], dict]:
    """The case's ranks (what each reported) and its single-process reference."""
    refs, runs = run_cases([case], timeout_per_case=240.0)
    return runs[case.name], refs[case.name]


def check_experts_sharded(ranks: list[dict], ref: dict) -> None:
    """EP=2 really split the experts: each rank trained exactly its EP rank's half of every layer's experts (global
    indices ep_rank * E/2 + i, at the unsplit model's shapes), the two EP ranks of a stage together every expert
    once, and the experts moved from their initial weights."""
    case = Case(**ranks[0]["case"])
    per_rank = MOE["num_moe_experts"] // case.ep
    for stage in range(case.pp):
        held = []
        for r in (r for r in ranks if r["stage"] == stage):
            experts = {n for n in r["params"] if EXPERTS in n}
            indices = {int(n.split(EXPERTS)[1].split(".")[0]) for n in experts}
            assert indices == set(range(r["ep_rank"] * per_rank, (r["ep_rank"] + 1) * per_rank)), (r["ep_rank"], indices)
            for name in experts:
                assert tuple(r["params"][name][0].shape) == tuple(ref["params"][name].shape), name
                assert relative_error(r["params"][name][0], ref["init"][name]) > 1e-3, name
            held += sorted(experts)
        assert len(held) == len(set(held)) == len({n for n in ref["params"] if EXPERTS in n and
                                                   int(n.split(".")[2]) // (LAYERS // case.pp) == stage})


def rounding_floor(case: Case) -> float:
    """The reference's own distance, in its worst weight, from the same reference with each step's microbatches
    summed in reverse order (Case.reversed_sums: one float-order change, the same mathematics)."""
    runs = run_ranks(reference_rank, 1, [dataclasses.asdict(replace(case, name=n, reversed_sums=r))
                                         for n, r in (("forward", False), ("reversed", True))])[0]
    return max(relative_error(runs["reversed"]["params"][n], runs["forward"]["params"][n])
               for n in runs["forward"]["params"])


def check_moe_with_the_spread_head(ranks: list[dict], ref: dict, weights_rtol: float = RTOL) -> None:
    """Equal to the simulator on the unsplit GPTModel; megatron's MoELayer ran with its dispatcher in
    every layer; in each DP replica every stage trained its own rows (and moved them), and evaluation through the
    spread head equals the final unsplit model's."""
    case = Case(**ranks[0]["case"])
    check_equals_reference(ranks, ref, weights_rtol)
    check_megatron_ran(ranks, tp=1)
    for dp_rank in range(case.dp):  # each replica's pipeline spread the head over its own stages
        check_vocab_head_ran([r for r in ranks if r["dp_rank"] == dp_rank])
        check_vocab_head_evaluates([r for r in ranks if r["dp_rank"] == dp_rank], ref)


@pytest.mark.slow  # the default suite's budget (about 7 s here): the EP=2 case below is the default one
def test_moe_alltoall_with_the_spread_head_and_embedding_equals_delayed_reference():
    """PP=2 MoE (megatron's alltoall dispatcher), the output layer and the tied input embedding spread over both
    stages; the stages' checkpoints assembled load into the unsplit GPTModel equal to the reference's."""
    ranks, ref = run_case(CASES["two"])
    check_moe_with_the_spread_head(ranks, ref)
    check_vocab_checkpoint_loads_unsplit(ranks, ref)


def test_moe_alltoall_ep2_with_the_spread_head_equals_delayed_reference():
    """PP=2 x DP=2 x EP=2 MoE, megatron's alltoall dispatcher over EP, the output layer spread over both stages of
    each replica, a drain mid-run; the experts are EP-sharded."""
    case = CASES["four"]
    ranks, ref = run_case(case)
    assert sorted((r["stage"], r["dp_rank"], r["ep_rank"]) for r in ranks) == \
        [(s, d, d) for s in range(case.pp) for d in range(case.dp)]
    check_moe_with_the_spread_head(ranks, ref)
    check_experts_sharded(ranks, ref)


@pytest.mark.slow  # eight processes importing megatron-core on two cores
def test_moe_expert_data_parallel_with_the_spread_head_equals_delayed_reference():
    """PP=2 x DP=4 x EP=2 MoE (megatron's allgather dispatcher), the output layer spread over each replica's stages:
    the two replicas of an EP rank read their own microbatches, so only the sum over the expert-data-parallel
    group keeps their experts equal to the reference's; both end with the same experts, bit for bit, their EP
    rank's half."""
    case = CASES["eight"]
    ranks, ref = run_case(case)
    # The weights' bound, from this case's own rounding floor (module docstring): the pipeline changes four float
    # orders, each of the size of one reversal of the reference's sum (the replicas' sum tree, the head's shards,
    # the stages' partial input gradients, the dispatcher's token order), so its worst weight stays within four
    # floors; without the expert-data-parallel sum the losses already miss RTOL by ~100x (tried).
    floor = rounding_floor(case)
    print(f"{case.name}: rounding floor {floor:.2e}")
    check_moe_with_the_spread_head(ranks, ref, weights_rtol=max(RTOL, 4 * floor))
    half = MOE["num_moe_experts"] // case.ep
    for stage, ep_rank in itertools.product(range(case.pp), range(case.ep)):
        replicas = [r["params"] for r in ranks if (r["stage"], r["ep_rank"]) == (stage, ep_rank)]
        experts = {n for n in replicas[0] if EXPERTS in n}
        assert len(replicas) == case.dp // case.ep and all(experts == {n for n in p if EXPERTS in n} for p in replicas)
        assert {int(n.split(EXPERTS)[1].split(".")[0]) for n in experts} == set(range(ep_rank * half,
                                                                                      (ep_rank + 1) * half))
        for name in experts:
            assert all(torch.equal(replicas[0][name][0], p[name][0]) for p in replicas), name


@pytest.mark.slow  # four processes importing megatron-core under torchrun: about 50 s on this box
def test_example_moe_alltoall_ep2_with_the_spread_head_under_torchrun(tmp_path, indexed_prefix):
    """examples/megatron_2bw.py --vocab-parallel-head with --num-experts 4 --expert-model-parallel-size 2
    --moe-token-dispatcher-type alltoall --pp 2 as a user runs it (tied, megatron's default; PP=2 x DP=2 x EP=2 on
    indexed data): the output layer spread over the two stages (the last stage's rows reported), megatron's alltoall
    dispatcher, training and evaluation through the spread head, Megatron's log."""
    log, stdout = run_example(tmp_path, 4, "--train-iters", "4", "--eval-interval", "2", "--pp", "2",
                              "--num-layers", "2", "--num-experts", "4", "--expert-model-parallel-size", "2",
                              "--moe-token-dispatcher-type", "alltoall", "--vocab-parallel-head",
                              "--data-path", str(indexed_prefix))
    assert log["dispatchers"] == ["MoEAlltoAllTokenDispatcher"]
    assert 0 < log["vocab_rows"][0] < log["vocab_size"] and log["vocab_rows"][1] == 64  # the last stage's rows only
    assert len(log["train"]) == 4 and log["applied_step"] == 3 and all(map(math.isfinite, log["train"]))
    assert list(log["valid"]) == ["2", "4"] and all(map(math.isfinite, log["valid"].values()))
    check_megatron_log(stdout, 4, 4 * 4 * 2)  # two data-parallel replicas


@pytest.mark.slow  # two processes: ~10-25 s on the loaded 2-core box
def test_moe_with_the_spread_head_router_bias_and_loss_scale_equals_delayed_reference():
    """The three merged at once (this session's m43a/m43b/m43c): MoE with the spread head, megatron's expert bias
    versioned (every version equal to the simulator's, and moved), and a static fp16 loss scale of 1024, under which
    the router aux losses must be back-propagated at the same scale as the head's loss (the reduction divides by
    m x scale: an aux loss left at scale 1 would be 1024 times too small)."""
    case = Case("pp2_moe_vocab_head_router_bias_loss_scale", moe=True, vocab=True, router_bias=True, loss_scale=1024.0)
    ranks, ref = run_case(case)
    check_moe_with_the_spread_head(ranks, ref)
    check_router_bias_equals_reference(ranks, ref)
