"""Expert and tensor parallelism of the MoE layer change nothing in the mathematics (semantics.md, item 4).

Two gloo ranks run every case in one spawn; the parent recomputes the single-process reference from
the same seeds. EP: tokens differ per rank; the reference runs the full layer on each rank's tokens
(with aux_loss_coef = 0 literally on their concatenation: the Switch loss is per microbatch, so with it
on, EP=2 means "each rank's batch is a microbatch", as DP does). TP: identical tokens on both ranks.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from model_zoo import build_model, get_model_config
from tests.dist.ep_workers import (
    Case,
    all_cases,
    build_layer,
    model_tokens,
    run_layer,
    run_model,
    tokens,
    tp_ep_case,
)
from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.equivalence, pytest.mark.dist]

EXPERT = ("w_gate", "w_up", "w_down")
SKEWED = {"top_k": 1, "normalize_topk": False, "bias_update_rate": 1e-3}
EMPTY_3 = (0.0, 0.0, 0.0, -10.0, 0.0, 0.0, 0.0, 0.0)  # the bias leaves expert 3 without a token
CASES = [
    Case("ep", "ep", (24, 40)),
    Case("ep_concat_no_aux", "ep", (24, 40), moe={"aux_loss_coef": 0.0}),
    # Every token of rank 1 goes to expert 2, which lives on rank 0; nobody uses expert 3.
    Case("ep_skewed", "ep", (16, 24), moe=SKEWED, crowd_expert=2, bias=EMPTY_3),
    Case("tp", "tp", (32, 32), moe={"aux_loss_coef": 0.5}),
    Case("tp_skewed", "tp", (32, 32), moe=SKEWED, crowd_expert=5, bias=EMPTY_3),
]
BY_NAME = {c.name: c for c in CASES}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(all_cases, 2, CASES, timeout=240)


def assert_rel(got: Tensor, want: Tensor, what: str, tol: float = 1e-5) -> None:
    err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    assert got.shape == want.shape and err < tol, f"{what}: relative error {err:.2e} (shapes {got.shape} vs {want.shape})"


def ep_reference(case: Case) -> list[dict[str, Tensor]]:
    """Per rank: the single-process layer's output, input gradient and load on that rank's tokens;
    the "grad/..." entries of rank 0 hold the parameter gradients summed over both ranks' tokens."""
    ref = build_layer(case)
    inputs = [tokens(case, r, ref) for r in range(2)]
    if case.moe.get("aux_loss_coef", 1.0) == 0.0:
        whole = run_layer(ref, torch.cat([x for x, _ in inputs]), torch.cat([g for _, g in inputs]))
        n0 = inputs[0][0].shape[0]
        per_rank = [{"out": whole["out"][s], "grad/x": whole["grad/x"][s]} for s in (slice(0, n0), slice(n0, None))]
        return [{**per_rank[0], **_grads(whole)}, per_rank[1]]
    results = []
    for x, g in inputs:
        ref.zero_grad(set_to_none=True)
        results.append(run_layer(ref, x, g))
    results[0].update({k: v + results[1][k] for k, v in _grads(results[0]).items()})
    return results


def _grads(result: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v for k, v in result.items() if k.startswith("grad/") and k != "grad/x"}


@pytest.mark.parametrize("name", ["ep", "ep_concat_no_aux", "ep_skewed"])
def test_ep2_equals_single_process(ranks: list[dict], name: str) -> None:
    case = BY_NAME[name]
    ref = ep_reference(case)
    got = [ranks[r][name] for r in range(2)]
    n_local = 8 // 2
    for r in range(2):
        assert_rel(got[r]["out"], ref[r]["out"], f"rank {r} output")
        assert_rel(got[r]["grad/x"], ref[r]["grad/x"], f"rank {r} input gradient")
        for w in EXPERT:  # each rank's experts saw both ranks' tokens
            assert_rel(got[r][f"grad/{w}"], ref[0][f"grad/{w}"][r * n_local:(r + 1) * n_local], f"rank {r} {w}")
    for key in _grads(ref[0]):
        if key.removeprefix("grad/") not in EXPERT:  # replicated: data-parallel over the EP ranks
            assert_rel(got[0][key] + got[1][key], ref[0][key], f"{key} summed over ranks")


def test_skewed_routing_really_is_skewed(ranks: list[dict]) -> None:
    """The uneven case does what it claims: rank 1 sends everything to expert 2; expert 3 gets nothing."""
    ep, tp = ranks[1]["ep_skewed"]["load"], ranks[0]["tp_skewed"]["load"]
    assert ep[2] == ep.sum() == 24 and ranks[0]["ep_skewed"]["load"][3] == 0 and ep[3] == 0
    assert tp[5] == tp.sum() == 32 and tp[3] == 0


@pytest.mark.parametrize("name", ["tp", "tp_skewed"])
def test_tp2_equals_single_process(ranks: list[dict], name: str) -> None:
    case = BY_NAME[name]
    ref_layer = build_layer(case)
    ref = run_layer(ref_layer, *tokens(case, 0, ref_layer))
    shards = {"grad/w_gate": 1, "grad/w_up": 1, "grad/w_down": 2, "grad/shared_expert.gate_proj.weight": 0,
              "grad/shared_expert.up_proj.weight": 0, "grad/shared_expert.down_proj.weight": 1}
    for r in range(2):
        got = ranks[r][name]
        assert_rel(got["out"], ref["out"], f"rank {r} output")
        assert_rel(got["grad/x"], ref["grad/x"], f"rank {r} input gradient")
        # Replicated and complete on every rank: neither partial nor counted twice.
        assert_rel(got["grad/router.weight"], ref["grad/router.weight"], f"rank {r} router gradient")
        assert_rel(got["grad/shared_gate.weight"], ref["grad/shared_gate.weight"], f"rank {r} shared gate")
        for key, dim in shards.items():
            assert_rel(got[key], ref[key].chunk(2, dim=dim)[r], f"rank {r} {key}")


def test_tiny_moe_model_ep2_equals_single_process(ranks: list[dict]) -> None:
    torch.manual_seed(0)
    model = build_model(get_model_config("tiny_moe"))
    ref = []
    for r in range(2):
        model.zero_grad(set_to_none=True)
        ref.append(run_model(model, model_tokens(r)))
    got = [ranks[r]["model"] for r in range(2)]
    for r in range(2):
        assert_rel(got[r]["loss"], ref[r]["loss"], f"rank {r} loss")
    for key, want in ref[0].items():
        if not key.startswith("grad/"):
            continue
        want = want + ref[1][key]
        if key.rsplit(".", 1)[-1] in EXPERT:
            for r in range(2):
                assert_rel(got[r][key], want[r * 4:(r + 1) * 4], f"rank {r} {key}")
        else:
            assert_rel(got[0][key] + got[1][key], want, f"{key} summed over ranks")


def test_tp2_x_ep2_equals_single_process() -> None:
    """Both at once on 4 ranks: the EP all-to-all runs between ranks of one TP coordinate."""
    case = Case("tp_ep", "ep", (24, 40), crowd_expert=6)
    got = run_ranks(tp_ep_case, 4, case, timeout=240)
    ref = ep_reference(case)
    tp_dim = {"w_gate": 1, "w_up": 1, "w_down": 2, "shared_expert.gate_proj.weight": 0,
              "shared_expert.up_proj.weight": 0, "shared_expert.down_proj.weight": 1}
    for rank, res in enumerate(got):
        ep_rank, tp_rank = divmod(rank, 2)
        assert_rel(res["out"], ref[ep_rank]["out"], f"rank {rank} output")
        assert_rel(res["grad/x"], ref[ep_rank]["grad/x"], f"rank {rank} input gradient")
        for w in EXPERT:
            want = ref[0][f"grad/{w}"][ep_rank * 4:(ep_rank + 1) * 4].chunk(2, dim=tp_dim[w])[tp_rank]
            assert_rel(res[f"grad/{w}"], want, f"rank {rank} {w}")
    for key in _grads(ref[0]):
        name = key.removeprefix("grad/")
        if name in EXPERT:
            continue
        for tp_rank in range(2):  # summed over the EP ranks of one TP coordinate
            total = got[tp_rank][key] + got[2 + tp_rank][key]
            want = ref[0][key].chunk(2, dim=tp_dim[name])[tp_rank] if name in tp_dim else ref[0][key]
            assert_rel(total, want, f"{key} of TP rank {tp_rank} summed over EP")
