"""The spread head under tensor parallelism: a megatron-core GPTModel at PP=2 x TP=2 (with and without sequence
parallelism) whose output layer is spread over the stages and, within each stage, split over its TP ranks
(VocabSpreadStage / VocabPipeline2BW: megatron_vocab.rows_of_rank), equals the delayed simulator on the unsplit
GPTModel: losses, grad norms, every weight, at the front-end's RTOL (its derivation: test_megatron_core.py's module
docstring; here the head's logits are also split over the TP ranks, the same per-shard statistics merged over four
holders instead of two, and the last stage's input gradient is summed over TP by megatron's own region functions).

It also checks that the mechanism ran: each (stage, TP rank) trained its own consecutive rows (the stage's shard
split equally over its TP ranks, covering the vocabulary once), ran S on every microbatch with logits of its rows'
width and moved them; megatron's whole output_layer (its TP piece) stayed frozen; under SP the norms' partial
gradients were all-reduced over TP; the evaluation through the drained pipeline equals the unsplit model's loss.
Tied + TP and a sharded embedding + TP are refused, as asyncpp's own pipeline refuses them.
"""

from __future__ import annotations

import math

import pytest

from asyncpp.pipeline.megatron_vocab import check_spread_tp
from tests.dist.megatron_core_workers import VOCAB, Case
from tests.dist.test_megatron_core import (
    RTOL,
    check_corrections_acted,
    check_equals_reference,
    check_megatron_log,
    check_megatron_ran,
    check_sequence_parallel_reduced,
    indexed_prefix,  # noqa: F401
    run_cases,  # indexed_prefix: the fixture (a data.preprocess output)
    run_example,
)

pytestmark = [pytest.mark.dist, pytest.mark.equivalence]

CASES = [Case("tp2_sp_vocab_head", tp=2, sp=True, vocab=True, drain_after=3),
         Case("tp2_vocab_head_ef", tp=2, vocab=True, ef_lambda=1.0)]


@pytest.fixture(scope="module")
def runs():
    return run_cases(CASES, timeout_per_case=240.0)


def check_rows_per_tp_rank(ranks: list[dict], ref: dict) -> None:
    case = Case(**ranks[0]["case"])
    ordered = sorted(ranks, key=lambda r: (r["stage"], r["tp_rank"]))
    vocab = [r["evidence"]["vocab"] for r in ordered]
    rows = [v["rows"][0] for v in vocab]
    assert [v["start"] for v in vocab] == [sum(rows[:i]) for i in range(len(rows))], vocab
    assert sum(rows) == VOCAB and min(rows) > 0
    for s in range(case.pp):  # a stage's rows split equally over its TP ranks (the shards are multiples of TP)
        assert len({n for r, n in zip(ordered, rows) if r["stage"] == s}) == 1, rows
    assert len(set(rows)) > 1, rows  # the cost model's shards differ between the stages: not an even split
    for v in vocab:
        assert v["passes"] == case.steps * case.num_microbatches and v["widths"] == [v["rows"][0]], v
        assert v["rows_moved"]
    assert [v["output_layer_untouched"] for v in vocab] == [None] * case.tp * (case.pp - 1) + [True] * case.tp
    for r in ranks:  # the evaluation: every TP rank of the last stage reports the unsplit model's loss
        assert (r["eval"] is not None) == (r["stage"] == case.pp - 1)
        if r["eval"] is not None:
            assert r["eval"] == pytest.approx(ref["eval"], rel=RTOL)


@pytest.mark.slow  # four processes importing megatron-core, two cases: about 60 s at load 7 on this box
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_spread_head_with_tp_equals_delayed_reference(runs, name):
    references, pipelines = runs
    case, ref, ranks = next(c for c in CASES if c.name == name), references[name], pipelines[name]
    check_equals_reference(ranks, ref)
    check_megatron_ran(ranks, tp=case.tp)
    check_corrections_acted(ranks, ref)
    check_rows_per_tp_rank(ranks, ref)
    if case.sp:
        check_sequence_parallel_reduced(ranks)


def test_spread_head_with_tp_refuses_tied_and_sharded_embedding():
    """As asyncpp's own pipeline (config/parallel.py _check_vocab_head): a tied model and a sharded embedding are
    refused with TP > 1, by name and reason (spread_rows checks it first, before any collective)."""
    with pytest.raises(NotImplementedError, match="share_embeddings_and_output_weights=True.*across TP ranks"):
        check_spread_tp(2, tied=True, embedding=False)
    with pytest.raises(NotImplementedError, match="embedding=True.*keep the embedding whole"):
        check_spread_tp(2, tied=False, embedding=True)
    check_spread_tp(2, tied=False, embedding=False)
    check_spread_tp(1, tied=True, embedding=True)


@pytest.mark.slow  # four processes under torchrun: about 60-120 s on this box
def test_example_tp2_sp_vocab_parallel_head_under_torchrun(tmp_path, indexed_prefix):  # noqa: F811
    """examples/megatron_2bw.py --tp 2 --sequence-parallel --vocab-parallel-head --pp 2 as a user runs it, on an
    indexed dataset (the tokenizer's 8192 rows padded to a multiple of 128 x TP): training, evaluation and a checkpoint
    through the spread head split over TP, Megatron's log."""
    log, stdout = run_example(tmp_path, 4, "--train-iters", "4", "--eval-interval", "2", "--num-layers", "2",
                              "--tp", "2", "--sequence-parallel", "--vocab-parallel-head",
                              "--untie-embeddings-and-output-weights", "--data-path", str(indexed_prefix),
                              "--save", str(tmp_path / "ckpt"))
    assert log["sequence_parallel"] and log["vocab_size"] == 8192
    rows, start = log["vocab_rows"][0], log["vocab_start"]  # the last stage's first TP rank: half its stage's rows
    assert 0 < rows < 8192 // 2 and start == 8192 - 2 * rows and log["vocab_rows"][1] == 64
    assert len(log["train"]) == 4 and log["applied_step"] == 3 and all(map(math.isfinite, log["train"]))
    assert list(log["valid"]) == ["2", "4"] and all(map(math.isfinite, log["valid"].values()))
    assert log["saved"] == [str(tmp_path / "ckpt" / "step_00000004")]
    check_megatron_log(stdout, 4, 4 * 4)
