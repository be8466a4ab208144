"""TP=2 equals TP=1 (semantics.md, "TP ... change nothing in the mathematics"): two gloo ranks each
hold a tensor-parallel model and the single-process reference built from the same seed; the loss,
every gradient (against the matching slice), the weights after one step and the next loss agree
to fp32 reduction order. One spawn runs every case (tests/dist/tp_workers.py)."""

from __future__ import annotations

import pytest

from tests.dist.harness import run_ranks
from tests.dist.tp_workers import RTOL, tp_rank

pytestmark = pytest.mark.equivalence

DENSE_HYBRID = {"model": "tiny_hybrid", "overrides": {"moe": None, "ffn_hidden_size": 384}}
CASES = {
    "dense_tied": {"kind": "equivalence", "model": "tiny_dense", "optim": "sgd"},
    "dense_untied_sp": {"kind": "equivalence", "model": "tiny_dense", "overrides": {"tie_embeddings": False},
                        "sp": True, "optim": "adamw"},
    "hybrid": {"kind": "equivalence", **DENSE_HYBRID, "optim": "adamw"},
    "hybrid_sp": {"kind": "equivalence", **DENSE_HYBRID, "sp": True, "optim": "sgd"},
    "moe": {"kind": "equivalence", "model": "tiny_moe", "optim": "adamw"},
    "hybrid_moe_sp": {"kind": "equivalence", "model": "tiny_hybrid", "sp": True, "optim": "sgd"},
    # The Qwen3-Next options: per-head q/k norms (replicated, partial gradients), the gate split like q,
    # partial rotary, FLA's l2norm; under SP the gate reads the gathered input like q.
    "qwen3_next_options_sp": {"kind": "equivalence", "model": "tiny_hybrid", "sp": True, "optim": "adamw",
                              "overrides": {"qk_norm": True, "attn_output_gate": True, "partial_rotary_factor": 0.25,
                                            "gdn": {"fla_l2norm": True}}},
    "pruned_tied": {"kind": "pruned", "model": "tiny_dense"},
    "pruned_hybrid_sp": {"kind": "pruned", **DENSE_HYBRID, "sp": True},
}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(tp_rank, 2, CASES, timeout=240)


@pytest.mark.parametrize("name", list(CASES))
def test_tp2_matches_single_process(results: list[dict], name: str) -> None:
    for rank, per_rank in enumerate(results):
        r = per_rank[name]
        assert r["errors"] == [], f"rank {rank}: {r['errors']}"
        assert r.get("unknown_plan_names", []) == [], f"rank {rank}: plan names not in the model"
        assert r.get("meta_errors", []) == [], f"rank {rank}: {r['meta_errors']}"
        for tp_loss, ref_loss in r["losses"]:
            assert tp_loss == pytest.approx(ref_loss, rel=RTOL), f"rank {rank}: {r['losses']}"
    if CASES[name]["kind"] == "equivalence":
        assert len(results[0][name]["losses"]) == 3  # before and after the optimizer step, a deepcopy


def test_tied_embedding_stays_tied(results: list[dict]) -> None:
    assert all(r["dense_tied"]["tied"] for r in results)


def test_vocab_parallel_cross_entropy(results: list[dict]) -> None:
    for per_rank in results:
        for dtype, r in per_rank["cross_entropy"].items():
            assert r["loss"][0] == pytest.approx(r["loss"][1], rel=RTOL), dtype
            assert r["grad_dtype"] == dtype
            assert r["grad_err"] <= 1e-5 * r["grad_scale"] + (1e-2 * r["grad_scale"] if "bfloat16" in dtype else 0)


def test_plan_layouts(results: list[dict]) -> None:
    """What the engine and optimizers are told: per-head GDN tensors split, its shared o_norm and (under
    sequence parallelism) every norm replicated with a partial gradient."""
    hybrid, sp = results[0]["hybrid"]["plan"], results[0]["hybrid_sp"]["plan"]
    gdn = {n.removeprefix("layers.0.mixer."): v for n, v in hybrid.items() if n.startswith("layers.0.mixer.")}
    assert gdn == {**{n: (0, False) for n in (
        "q_proj.weight", "k_proj.weight", "v_proj.weight", "g_proj.weight", "a_proj.weight", "b_proj.weight",
        "conv_q.weight", "conv_k.weight", "conv_v.weight", "A_log", "dt_bias")},
        "o_proj.weight": (1, False), "o_norm.weight": (None, True)}
    assert hybrid["embed.weight"] == hybrid["lm_head.weight"] == (0, False)
    assert "norm.weight" not in hybrid and "layers.3.mlp_norm.weight" not in hybrid
    assert sp["norm.weight"] == sp["layers.3.mlp_norm.weight"] == sp["layers.0.mixer_norm.weight"] == (None, True)


def test_plan_layouts_of_the_attention_options(results: list[dict]) -> None:
    """The output gate is split by head like q; the q/k norms' [head_dim] weights are replicated and their
    gradients (each rank's heads only) summed over TP."""
    plan = results[0]["qwen3_next_options_sp"]["plan"]
    attn = {n.removeprefix("layers.3.mixer."): v for n, v in plan.items() if n.startswith("layers.3.mixer.")}
    assert attn == {"q_proj.weight": (0, False), "k_proj.weight": (0, False), "v_proj.weight": (0, False),
                    "gate_proj.weight": (0, False), "o_proj.weight": (1, False),
                    "q_norm.weight": (None, True), "k_norm.weight": (None, True)}
