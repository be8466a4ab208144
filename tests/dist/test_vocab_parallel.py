"""The vocabulary-parallel head with unequal shards over a process group (asyncpp/parallel/vocab_parallel.py)
equals the unsplit head + F.cross_entropy in one process: the loss on every rank, each shard's weight gradient,
and the input gradient after the reduce, within the bound derived from the data in tests/dist/vocab_workers.py
(fp32 rounding, first order, both computations). Each case also checks that the vocabulary really is split:
unequal shard widths, each rank's weight and gradient of its own width, and a partial input gradient that is
not yet the whole one. One spawn of 4 gloo ranks runs every case."""

from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.vocab_workers import vocab_rank

pytestmark = [pytest.mark.equivalence, pytest.mark.dist]

CASES = {
    # A group that leaves rank 0 out (any group, not only WORLD), the last stage holding the widest shard.
    "pp3_subgroup": {"ranks": [1, 2, 3], "shards": [40, 89, 171], "vocab": 300, "hidden": 24, "seed": 1,
                     "hot_rows": slice(0, 40), "last": 3},
    # A stage whose layers already fill its time holds no rows (the cost model can say so) but joins the
    # collectives; the dominating rows on another shard.
    "pp4_empty_shard": {"ranks": [0, 1, 2, 3], "shards": [0, 120, 100, 80], "vocab": 300, "hidden": 16, "seed": 2,
                        "hot_rows": slice(150, 200), "last": 3},
    # Composition with TP: 2 stages' shards [110, 190] each split over 2 TP ranks -> [55, 55, 95, 95], the head's
    # group the 4 ranks in (stage, tp rank) order.
    "pp2_tp2": {"ranks": [0, 1, 2, 3], "shards": [110, 190], "tp": 2, "vocab": 300, "hidden": 32, "seed": 3,
                "hot_rows": slice(200, 260), "last": 3},
    # bf16 weights and hidden states (the mixed-precision compute dtype): logits and gradients in bf16, the cross
    # entropy in fp32, the partial input gradients reduced in bf16.
    "pp4_bf16": {"ranks": [0, 1, 2, 3], "shards": [70, 30, 120, 80], "vocab": 300, "hidden": 16, "seed": 4,
                 "hot_rows": slice(100, 130), "last": 3, "dtype": torch.bfloat16},
}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(vocab_rank, 4, CASES, timeout=240)


def members(results: list[dict], name: str) -> list[dict]:
    out = [r[name] for r in results if r[name] is not None]
    assert [r["rank"] for r in out] == CASES[name]["ranks"]
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_loss_matches_the_unsplit_head_on_every_rank(results, name):
    for r in members(results, name):
        err, bound = abs(r["loss"] - r["ref_loss"]), r["bounds"]["loss"]
        print(f"{name} rank {r['rank']}: loss {r['loss']:.9g} vs {r['ref_loss']:.9g}, |diff| {err:.3g} <= {bound:.3g}")
        assert err <= bound


@pytest.mark.parametrize("name", list(CASES))
def test_each_shard_gets_its_rows_of_the_weight_gradient(results, name):
    for r in members(results, name):
        a, b = r["rows"]
        assert r["dW"].shape == r["ref_dW"].shape == (b - a, CASES[name]["hidden"])
        err = (r["dW"] - r["ref_dW"]).abs()
        bound = r["bounds"]["dW"][a:b]
        print(f"{name} rank {r['rank']}: rows [{a}, {b}) dW max |diff| {err.max().item() if b > a else 0:.3g}, "
              f"max bound {bound.max().item() if b > a else 0:.3g}")
        assert bool((err <= bound).all())


@pytest.mark.parametrize("name", list(CASES))
def test_input_gradient_summed_onto_the_last_stage(results, name):
    ranks = members(results, name)
    last = [r for r in ranks if r["rank"] == CASES[name]["last"]]
    assert len(last) == 1 and all(r["dH"] is None for r in ranks if r["rank"] != CASES[name]["last"])
    r = last[0]
    err, bound = (r["dH"] - r["ref_dH"]).abs(), r["bounds"]["dH"]
    print(f"{name}: dH max |diff| {err.max().item():.3g}, max bound {bound.max().item():.3g}")
    assert bool((err <= bound).all())
    # No rank's own part is the whole gradient: the reduce was needed (the mechanism ran).
    for other in ranks:
        assert not torch.allclose(other["partial_dH"], r["ref_dH"], rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("name", list(CASES))
def test_the_vocabulary_really_is_split_into_unequal_shards(results, name):
    ranks = members(results, name)
    widths = ranks[0]["widths"]
    assert len(set(widths)) > 1 and sum(widths) == CASES[name]["vocab"] and len(widths) == len(ranks)
    starts = 0
    for r, w in zip(ranks, widths):
        assert r["rows"] == (starts, starts + w) and r["weight_rows"] == w == r["dW"].shape[0]
        starts += w
    if name == "pp2_tp2":
        assert widths == [55, 55, 95, 95]
    assert {r["dtype"] for r in ranks} == {str(CASES[name].get("dtype", torch.float32))}
