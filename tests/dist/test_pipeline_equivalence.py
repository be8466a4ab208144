"""semantics.md, "What must hold" 1 and 2: a multi-process pipeline equals the single-process simulator.

Each case runs P gloo processes on CPU and compares losses, gradient norms and final weights (fp32,
relative 1e-5) with DelayedUpdateSimulator on the same seed, data and configuration.
"""

from __future__ import annotations

import math

import pytest
import torch

from model_zoo import get_model_config
from tests.dist.harness import run_ranks
from tests.dist.workers import make_config, pipeline_rank, pipeline_rank_late_after_update_start, reference_run

pytestmark = [pytest.mark.equivalence, pytest.mark.dist]


def run_pipeline(cfg) -> tuple[list[dict], dict]:
    results = run_ranks(pipeline_rank, cfg.parallel.pp * (cfg.parallel.dp or 1), cfg.to_dict())
    records = next(r["records"] for r in results if r["records"])
    params = {}
    for r in results:
        if r["dp"] == 0:
            params.update(r["params"])  # the tied head copy on the last stage lands under its own name
    return records, params, results


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||: semantics.md's "relative difference" of a weight tensor."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def assert_equivalent(cfg):
    records, params, results = run_pipeline(cfg)
    ref = reference_run(cfg)
    assert [r["step"] for r in records] == list(range(cfg.train.steps))
    for r, s in zip(records, ref["stats"]):
        assert r["loss"] == pytest.approx(s.loss, rel=1e-5), r["step"]
        assert r["grad_norm"] == pytest.approx(s.grad_norm, rel=1e-5), r["step"]
        assert r["update_norm"] == pytest.approx(s.update_norm, rel=1e-4), r["step"]
        assert r["skipped"] == s.skipped
    for name, p in params.items():
        ref_name = "embed.weight" if name == "lm_head.weight" and name not in ref["params"] else name
        assert relative_error(p, ref["params"][ref_name]) < 1e-5, (name, relative_error(p, ref["params"][ref_name]))
    assert set(ref["params"]) <= set(params)
    return records, ref, results


@pytest.mark.parametrize("schedule, optimizer, extra", [
    ("2bw", "muon", {}),
    ("2bw", "adamw", {"staleness": {"ef_lambda": 1.0}}),
    ("1f1b", "muon", {}),
    ("pipedream", "adamw", {}),
])
def test_two_stage_pipeline_equals_simulator(schedule, optimizer, extra):
    cfg = make_config(parallel={"pp": 2}, schedule={"name": schedule}, optimizer={"name": optimizer}, **extra)
    assert_equivalent(cfg)


def test_four_stage_2bw_hybrid_moe_with_sync_start_and_eval():
    cfg = make_config(
        model={"name": "tiny_hybrid"}, parallel={"pp": 4},
        train={"steps": 7, "num_microbatches": 4, "eval_every": 3},
        staleness={"ef_lambda": 1.0, "sync_start_steps": 2, "sync_cooldown_steps": 1},
    )
    records, ref, results = assert_equivalent(cfg)
    assert records[-1]["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)
    # Stronger than the contract: on CPU with one thread per process the floats are the same ones.
    assert [r["loss"] for r in records] == [s.loss for s in ref["stats"]]
    for r in results:
        for name, p in r["params"].items():
            assert torch.equal(p, ref["params"]["embed.weight" if name == "lm_head.weight" else name]), name


def test_tied_embedding_copies_stay_identical():
    cfg = make_config(parallel={"pp": 2}, schedule={"name": "2bw"})
    _, _, results = run_pipeline(cfg)
    first = next(r for r in results if r["stage"] == 0)["params"]["embed.weight"]
    last = next(r for r in results if r["stage"] == 1)["params"]["lm_head.weight"]
    assert torch.equal(first, last)


def test_data_parallel_two_replicas_equal_one_with_twice_the_microbatches():
    cfg = make_config(parallel={"pp": 2, "dp": 2}, schedule={"name": "2bw"}, train={"num_microbatches": 2})
    assert_equivalent(cfg)


def test_uneven_stage_split_with_pipedream_delays():
    """parallel.stage_layers moves layers between stages: PipeDream's per-stage delays follow it."""
    cfg = make_config(parallel={"pp": 2, "stage_layers": [3, 1]}, schedule={"name": "pipedream"},
                      train={"steps": 5})
    assert_equivalent(cfg)


@pytest.mark.parametrize("stage_layers", [[4, 0], pytest.param([0, 4], marks=pytest.mark.slow)])
def test_a_stage_without_layers_of_a_moe_model(stage_layers):
    """Issue 21: a stage with 0 layers (only the head, or only the embedding) of an MoE model failed in the
    gradient-norm all-reduce (the load statistics it carries had another length there). Any split is the
    same mathematics."""
    cfg = make_config(model={"name": "tiny_moe"}, parallel={"pp": 2, "stage_layers": stage_layers},
                      train={"steps": 4, "num_microbatches": 2})
    records, _, _ = assert_equivalent(cfg)
    assert any(k.startswith("moe/layer") for k in records[-1])


# ---- semantics.md 4: TP, EP and aux-loss-free balancing change nothing in the mathematics ----------

def assemble(results: list[dict]) -> dict[str, torch.Tensor]:
    """Full tensors from the ranks' pieces: TP shards concatenated along their tp_dim (tp rank order),
    then expert shards along dim 0 (ep rank order), from the first expert-data-parallel replica."""
    full = {}
    for stage in sorted({r["stage"] for r in results}):
        ranks = [r for r in results if r["stage"] == stage and r["dp"] == r["ep"]]  # edp index 0
        for name in ranks[0]["params"]:
            tp_dim, expert = ranks[0]["layouts"].get(name, (None, False))
            per_ep = []
            for ep in sorted({r["ep"] for r in ranks}) if expert else [0]:
                pieces = sorted((r for r in ranks if r["ep"] == ep), key=lambda r: r["tp"])
                parts = [r["params"][name] for r in pieces] if tp_dim is not None else [pieces[0]["params"][name]]
                per_ep.append(torch.cat(parts, dim=tp_dim) if tp_dim is not None else parts[0])
            full[name] = torch.cat(per_ep, dim=0) if expert else per_ep[0]
    return full


def assert_parallel_equivalent(cfg, rel: float = 1e-5, worker=pipeline_rank, *worker_args):
    world = cfg.parallel.pp * cfg.parallel.tp * (cfg.parallel.dp or 1)
    results = run_ranks(worker, world, cfg.to_dict(), *worker_args)
    records = next(r["records"] for r in results if r["records"])
    ref = reference_run(cfg)
    for r, s in zip(records, ref["stats"], strict=True):
        assert r["loss"] == pytest.approx(s.loss, rel=rel), r["step"]
        assert r["grad_norm"] == pytest.approx(s.grad_norm, rel=rel), r["step"]
    params = assemble(results)
    for name, p in params.items():
        ref_name = "embed.weight" if name == "lm_head.weight" and name not in ref["params"] else name
        assert p.shape == ref["params"][ref_name].shape, name
        assert relative_error(p, ref["params"][ref_name]) < 10 * rel, (name, relative_error(p, ref["params"][ref_name]))
    assert set(ref["params"]) <= set(params)
    return records, ref, results


@pytest.mark.parametrize("model", [pytest.param("tiny_moe", marks=pytest.mark.slow), "tiny_hybrid"])  # moe: EP tests
def test_tp2_x_pp2_2bw_equals_simulator(model):
    """Four ranks: two stages, each split over two TP ranks (heads, GDN heads, ffn/experts, vocab)."""
    cfg = make_config(model={"name": model}, parallel={"pp": 2, "tp": 2},
                      train={"steps": 4, "num_microbatches": 2}, staleness={"ef_lambda": 1.0})
    records, _, results = assert_parallel_equivalent(cfg)
    assert any(tp_dim is not None for r in results for tp_dim, _ in r["layouts"].values())


def test_ep2_2bw_equals_simulator():
    """EP=2 over DP=2: each rank holds half the experts and routes the other half's tokens by all-to-all;
    the reference simulates the two replicas as 2m microbatches in one process."""
    cfg = make_config(model={"name": "tiny_moe"}, parallel={"pp": 1, "ep": 2, "dp": 2},
                      train={"steps": 4, "num_microbatches": 2})
    _, _, results = assert_parallel_equivalent(cfg)
    assert any(expert for r in results for _, expert in r["layouts"].values())


def test_ep2_2bw_at_one_stage_with_the_norm_all_reduce_posted_at_different_actions():
    """Issue 30: 2BW at pp=1 with ep=2 hung in the expert dispatcher's count all-to-all. The norm all-reduce is
    posted at the first action boundary where the DP sum has arrived (reduction.progress), not the same action
    on every rank, and at pp=1 the norm group was the EP group itself (DeviceMesh's default group). Rank 0
    pauses after each UPDATE_START here, so the two ranks post it around different expert all-to-alls; with
    its own group (Mesh._norm_groups) the run equals the simulator, with the experts really split."""
    cfg = make_config(model={"name": "tiny_moe"}, parallel={"pp": 1, "ep": 2, "dp": 2}, optimizer={"name": "adamw"},
                      train={"steps": 4, "num_microbatches": 2, "timeout_s": 30.0})
    _, _, results = assert_parallel_equivalent(cfg, 1e-5, pipeline_rank_late_after_update_start, 0, 0.3)
    posted = [r["norm_posted_after_dispatches"] for r in results]
    assert sorted(posted[0]) == sorted(posted[1]) == list(range(4))
    assert any(posted[0][t] != posted[1][t] for t in range(4)), posted  # the interleaving really differed
    experts = get_model_config("tiny_moe").moe.num_experts
    for r in results:
        w = r["params"]["layers.0.mlp.w_gate"]
        assert r["layouts"]["layers.0.mlp.w_gate"] == (None, True)
        assert w.shape[0] == experts // 2, w.shape  # each EP rank holds half the experts


def test_aux_loss_free_bias_is_versioned_like_the_weights():
    """2 stages, 2BW, with the router bias on: microbatches of b_t must read the bias of x_{t-1} on
    every stage, exactly as the simulator does (a bias read at the wrong version changes the routing
    and therefore the losses)."""
    cfg = make_config(model={"name": "tiny_moe", "overrides": {"moe": {"bias_update_rate": 0.05}}},
                      parallel={"pp": 2}, train={"steps": 5})
    records, ref, _ = assert_equivalent(cfg)
    # Per-layer router loads of each step (both stages' layers, riding the norm all-reduce) are logged by
    # the last stage and equal the simulator's.
    for r, s in zip(records, ref["stats"]):
        layers = {k: v for k, v in r.items() if k.startswith("moe/layer")}
        assert sorted(layers) == [f"moe/layer{i}/load_max_over_mean" for i in range(4)], r
        for i in range(4):
            assert layers[f"moe/layer{i}/load_max_over_mean"] == pytest.approx(s.router_loads[i], rel=1e-9)
