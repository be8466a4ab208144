"""parallel.stage_layers=auto: the cost model of a layer kind, the embedding and the head, the split that
minimizes the slowest stage, and the split suggested from measured busy times."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from asyncpp.config import ConfigError, RunConfig
from asyncpp.core.layer_costs import layer_costs
from asyncpp.core.layer_split import balanced_split, default_split
from asyncpp.core.partition import stage_balance, stage_split, suggest_split
from model_zoo import get_model_config

PAPER_MODELS = ("smollm2_135m", "smollm2_360m", "moe_2b", "hybrid_moe_10b")
AUTO_SPLITS = {  # what auto picks at seq 4096 x micro batch 1 on CUDA (printed by the test below)
    ("smollm2_135m", 4): [8, 8, 9, 5], ("smollm2_135m", 8): [4, 4, 4, 4, 4, 5, 4, 1],
    ("smollm2_360m", 4): [8, 9, 9, 6], ("smollm2_360m", 8): [4, 4, 4, 4, 4, 5, 5, 2],
    ("moe_2b", 4): [5, 5, 5, 1], ("moe_2b", 8): [2, 2, 2, 2, 2, 2, 3, 1],
    ("hybrid_moe_10b", 4): [7, 8, 8, 1], ("hybrid_moe_10b", 8): [3, 3, 3, 3, 3, 4, 4, 1],
}


def compositions(n: int, parts: int, least: int = 1):
    """Every split of n layers into `parts` contiguous stages of at least `least` layers."""
    for cuts in itertools.combinations(range(least, n - least + 1), parts - 1):
        bounds = (0, *cuts, n)
        sizes = [b - a for a, b in itertools.pairwise(bounds)]
        if min(sizes) >= least:
            yield sizes


@pytest.mark.parametrize("name", PAPER_MODELS)
@pytest.mark.parametrize("P", [4, 8])
def test_auto_split_of_each_paper_model(name, P):
    """The split auto picks at seq 4096 x micro batch 1 (the paper's shape): the recorded one, valid, no slower
    than the near-even one under the cost model, and the head's stage lighter than the others in layers."""
    costs = layer_costs(get_model_config(name), 4096, 1, "cuda")
    split = balanced_split(costs, P)
    even = default_split(len(costs.layers), P)
    print(f"{name} P={P}: auto {split} (slowest {max(costs.stage_costs(split)):.3g}), "
          f"even {even} (slowest {max(costs.stage_costs(even)):.3g})")
    assert split == AUTO_SPLITS[(name, P)]
    assert sum(split) == len(costs.layers) and len(split) == P and min(split) >= 1
    assert max(costs.stage_costs(split)) <= max(costs.stage_costs(even))
    assert split[-1] < max(split)  # the head and the loss cost more than a layer at a 128k or 49k vocabulary


@pytest.mark.parametrize("name,P", [("smollm2_135m", 4), ("hybrid_moe_10b", 4), ("tiny_hybrid", 2),
                                    ("moe_2b", 3)])
@pytest.mark.parametrize("seq", [128, 4096])
def test_balanced_split_is_the_best_contiguous_split(name, P, seq):
    """The dynamic programme against brute force over every split with at least one layer per stage."""
    costs = layer_costs(get_model_config(name), seq, 2, "cpu")
    best = min(max(costs.stage_costs(s)) for s in compositions(len(costs.layers), P))
    assert max(costs.stage_costs(balanced_split(costs, P))) == pytest.approx(best, rel=1e-12)


def test_tiny_dense_head_costs_about_six_blocks_and_auto_moves_layers_off_the_last_stage():
    """The issue's measurement: the 8192-wide head and the fp32 cross entropy cost about six blocks of
    tiny_dense at micro batch 4 x 128 on a CPU. auto then gives the last stage one layer."""
    costs = layer_costs(get_model_config("tiny_dense"), 128, 4, "cpu")
    assert 4 < costs.head / costs.layers[0] < 8
    assert balanced_split(costs, 2) == [3, 1]


def test_which_mixer_is_dearer_depends_on_the_sequence_length():
    """Attention's score work grows with T, Gated DeltaNet's with its chunk: short sequences make GDN
    the dearer layer of the hybrid, long ones attention."""
    model = get_model_config("hybrid_moe_10b")
    kinds = model.layer_types
    for seq, dearer in ((256, "gdn"), (8192, "attn")):
        costs = layer_costs(model, seq, 1, "cuda")
        by_kind = {k: c for k, c in zip(kinds, costs.layers)}
        cheaper = "attn" if dearer == "gdn" else "gdn"
        assert by_kind[dearer] > by_kind[cheaper], (seq, by_kind)


def test_suggestion_from_measured_busy_time_recovers_the_balanced_split():
    """Busy times generated from known per-layer, embedding and head times: the suggestion refits them
    and returns the split those times balance."""
    weights = [1.0] * 8
    layer_s, embed_s, head_s = 0.5, 0.1, 2.6

    def busy(sizes):
        out = [layer_s * s for s in sizes]
        out[0] += embed_s
        out[-1] += head_s
        return out

    for sizes in ([2, 2, 2, 2], [4, 4], [3, 2, 2, 1]):
        truth = SimpleNamespace(layers=tuple(layer_s * w for w in weights), embedding=embed_s, head=head_s)
        expected = balanced_split(truth, len(sizes))  # duck-typed LayerCosts
        assert suggest_split(sizes, busy(sizes), weights) == expected


def test_stage_balance_names_the_imbalance_and_the_fix():
    report = stage_balance([2, 2], [3.0, 8.0], [1.0] * 4)
    assert report["suggested_stage_layers"] == [3, 1]
    assert "parallel.stage_layers=[3, 1]" in report["stage_balance"]
    balanced = stage_balance([3, 1], [5.0, 5.2], [1.0] * 4)
    assert "suggested_stage_layers" not in balanced and "imbalanced" not in balanced["stage_balance"]


def test_stage_balance_of_more_stages_than_layers_keeps_the_layout():
    """pp=6 with stage_layers=[1,1,1,1,0,0] (issue 44): the end-of-run report of an imbalanced run raised "4 layers
    cannot give 6 stages 1 layer(s) each" after the last step; no split gives every stage a layer, so none is
    suggested (the run's own layout stands), and the report still names the imbalance."""
    report = stage_balance([1, 1, 1, 1, 0, 0], [2.0, 1.0, 1.0, 1.0, 0.3, 0.4], [1.0] * 4)
    assert report["busy_max_over_mean"] > 1.1 and "suggested_stage_layers" not in report
    assert report["stage_layers"] == [1, 1, 1, 1, 0, 0]
    assert suggest_split([2, 2, 0, 0], [2.0, 2.0, 0.3, 0.4], [1.0] * 4) == [1, 1, 1, 1]  # pp == layers: suggested


def _config(stage_layers, pp=2, **train) -> RunConfig:
    return RunConfig.from_dict({"model": {"name": "tiny_dense"}, "parallel": {"pp": pp, "stage_layers": stage_layers},
                                "train": {"micro_batch_size": 4, "seq_len": 128, **train}})


def test_stage_split_resolves_auto_explicit_and_unset():
    model = get_model_config("tiny_dense")
    assert stage_split(_config("auto"), model) == [3, 1]
    assert stage_split(_config([1, 3]), model) == [1, 3]
    assert stage_split(_config(None), model) == [2, 2]
    assert stage_split(_config("auto", pp=4), model) == [1, 1, 1, 1]


def test_config_accepts_auto_and_names_the_field_otherwise():
    model = get_model_config("tiny_dense")
    _config("auto").validate(model)
    with pytest.raises(ConfigError, match="parallel.stage_layers"):
        _config("even")
    with pytest.raises(ConfigError, match=r"parallel.stage_layers=\[1, 1\].*or be auto"):
        _config([1, 1]).validate(model)
