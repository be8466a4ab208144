"""A megatron-core GPTModel's vocabulary over the pipeline stages (asyncpp/pipeline/megatron_vocab.py): the cost
model's shards equal asyncpp's own pipeline's for the same model, and a checkpoint saved as rows per stage loads
into the unsplit GPTModel.

The megatron models are built in one gloo process (tests/dist/megatron_vocab_workers.py): moe_2b on the meta
device, the tiny checkpoint model on the CPU."""

from __future__ import annotations

import pytest
import torch

from asyncpp.core.layer_costs import layer_costs
from asyncpp.core.vocab_split import run_vocab_split
from asyncpp.job import compose, resolve
from tests.dist.harness import run_ranks
from tests.dist.megatron_vocab_workers import (
    EMBEDDING,
    HEAD,
    VOCAB,
    spread_rank,
    spread_stage_rank,
    vocab_groups_rank,
    vocab_rank,
)

pytestmark = [pytest.mark.dist]

P = 8
CHECKPOINTS = [(2, False, True), (4, True, True), (4, False, False)]
"""(P, tied, embedding sharded): both ends of P, tied and untied, the embedding sharded and whole."""


def moe_2b_run(embedding: str):
    """asyncpp's own run of moe_2b at P=8 with the head spread, at megatron's layer split (2 layers a stage)."""
    return resolve(compose(["+experiment=paper/moe_2b", "data=default", f"parallel.pp={P}", "parallel.ep=1",
                            "parallel.dp=1", "parallel.head=vocab", f"parallel.embedding={embedding}",
                            f"parallel.stage_layers=[{','.join(['2'] * P)}]"]))


@pytest.fixture(scope="module")
def megatron():
    """Every megatron model of the module, built in one process (one spawn and one megatron import for all)."""
    cfg, _ = moe_2b_run("first")
    t = cfg.train
    moe_2b = (P, t.seq_len, t.micro_batch_size, str(t.device).split(":")[0])
    return run_ranks(vocab_rank, 1, CHECKPOINTS, moe_2b)[0]


def test_moe_2b_as_a_megatron_gpt_model_gets_asyncpps_shards_at_p8(megatron):
    """moe_2b built as megatron-core GPTModel stages (P=8, meta device): the front-end reads the same model (same
    layer costs), megatron builds the same 2 layers per stage, and every stage derives asyncpp's own split: the
    same rows per stage and the same per-stage compute, head whole-vocabulary (`first`) and sharded (`vocab`)."""
    cfg, model = moe_2b_run("first")
    t = cfg.train
    device = str(t.device).split(":")[0]
    got = megatron["moe_2b"]
    assert got["built_layers"] == [2] * P and got["megatron_layers"] == (2,) * P
    assert layer_costs(got["model"], t.seq_len, t.micro_batch_size, device) == \
        layer_costs(model, t.seq_len, t.micro_batch_size, device)
    for embedding in ("first", "vocab"):
        cfg, model = moe_2b_run(embedding)
        own = run_vocab_split(cfg, model)
        for stage in got["splits"]:
            theirs = stage[embedding == "vocab"]
            assert (theirs.sizes, theirs.shards) == (own.sizes, own.shards)
            assert theirs.compute == pytest.approx(own.compute, rel=1e-12)
        # the share of the ideal (total / P over the slowest stage) the spread head reaches
        print(f"moe_2b P={P} embedding={embedding}: shards {own.shards}, "
              f"ideal share {sum(own.compute) / P / max(own.compute):.4f}")
    assert sum(own.shards) == model.vocab_size and min(own.shards) > 0



@pytest.mark.parametrize("case", range(len(CHECKPOINTS)))
def test_stage_checkpoints_load_into_the_unsplit_gpt_model(megatron, case):
    """Every stage's rows (head and/or embedding, by the cost model's shards) and its layers, saved per stage and
    assembled by offset, load strictly into an unsplit GPTModel, where every tensor equals the stage's it came from;
    the rows saved had the shards' shapes (a tied model: embedding rows only)."""
    pp, tied, embedding = CHECKPOINTS[case]
    got = megatron["checkpoints"][case]
    assert got["missing"] == got["unexpected"] == []
    assert sorted(got["loaded"]) == sorted(got["truth"])
    for name, value in got["truth"].items():
        assert torch.equal(got["loaded"][name], value), name
    assert (HEAD in got["loaded"]) != tied and sum(got["shards"]) == VOCAB and len(got["shards"]) == pp
    start = 0
    for s, (rows, shapes) in enumerate(zip(got["shards"], got["shapes"])):
        want = {} if tied else {HEAD: (start, (rows, 32))}
        if embedding:
            want[EMBEDDING] = (start, (rows, 32))
        elif s == 0:
            want[EMBEDDING] = (0, (VOCAB, 32))
        assert shapes == want
        start += rows


def test_an_incomplete_checkpoint_and_wrong_rows_are_refused(megatron):
    got = megatron["refusals"]
    assert "embedding.word_embeddings.weight: the stages' rows cover [0, " in got["missing_stage"]
    assert "of a vocabulary of 96" in got["missing_stage"]
    assert "has 1 rows; its shard has" in got["wrong_rows"]


SPREAD = [(False, False), (False, True), (True, True), (True, False)]
"""(tied, embedding sharded) on two real pipeline ranks."""


@pytest.mark.parametrize("pp", [2, 4])
def test_rows_spread_over_megatron_stages_and_saved_load_into_the_unsplit_model(pp):
    """On P megatron pipeline ranks (each stage its own random init): spread_rows gives every stage its shard of the
    last stage's output_layer and, sharded, of the first stage's word embeddings (a tied model: of the first
    stage's embedding, which megatron copied to the last); the stage checkpoints assembled by offset load strictly
    into an unsplit GPTModel, whose every tensor is the stage's that owned it."""
    results = run_ranks(spread_rank, pp, SPREAD, timeout=300.0 * pp / 2)  # P ranks importing megatron on 2 cores
    for case, (tied, embedding) in enumerate(SPREAD):
        stages = [r[case] for r in results]
        first, last = stages[0], stages[-1]
        shards = first["shards"]
        assert sum(shards) == VOCAB and all(s["shards"] == shards for s in stages)
        assert first["missing"] == first["unexpected"] == []
        loaded = first["loaded"]
        table = first["own"][EMBEDDING]
        assert torch.equal(loaded[EMBEDDING], table)
        if tied:
            assert HEAD not in loaded and torch.equal(last["own"][EMBEDDING], table)  # megatron's tied copy
        else:
            assert torch.equal(loaded[HEAD], last["own"][HEAD])
            assert not torch.equal(last["own"][HEAD][:8], table[:8])  # two inits: a row from the wrong one shows
        layers = {n for s in stages for n in s["own"] if n.startswith("decoder.")}
        assert layers == {n for n in loaded if n.startswith("decoder.")}
        for s in stages:
            for name in s["own"]:
                if name.startswith("decoder."):
                    assert torch.equal(loaded[name], s["own"][name]), name
        start = 0
        for s, rows in zip(stages, shards):
            spread = {EMBEDDING: (rows, 32)} if tied or embedding else {}
            if not tied:
                spread[HEAD] = (rows, 32)
            assert s["spread"] == spread
            saved = {} if tied else {HEAD: (start, (rows, 32))}
            if embedding:
                saved[EMBEDDING] = (start, (rows, 32))
            elif s is first:
                saved[EMBEDDING] = (0, (VOCAB, 32))
            assert s["rows"] == saved
            start += rows


VOCAB_GROUP_LAYOUTS = [(4, 1), (2, 2)]
"""(pp, tp) on four megatron ranks: four stages; two stages of two TP ranks (the statistics' group then spans a
replica's stages and TP ranks, the others one TP rank's stages)."""


def test_vocab_head_groups_over_megatrons_pipelines_are_asyncpps():
    """Mesh.from_megatron(vocab_head=True, vocab_embedding=True): the head's and the sharded embedding's groups over
    megatron's pipelines hold the same ranks as asyncpp's own mesh of the layout makes, each a communicator of its
    own beside megatron's groups (which the mesh keeps), and the tied-embedding group spans every stage (the plain
    front-end's is megatron's, first and last stage only). Each carries an all-reduce."""
    results = run_ranks(vocab_groups_rank, 4, VOCAB_GROUP_LAYOUTS, timeout=300.0)
    for i, (pp, tp) in enumerate(VOCAB_GROUP_LAYOUTS):
        for r in (result[i] for result in results):
            assert r["ranks"] == r["own_ranks"], (pp, tp, r)
            assert set(r["ranks"]) == {"embedding", "hidden", "stats", "grad", "embed", "embed_grad"}
            pipeline = [s * tp + r["tp_rank"] for s in range(pp)]  # megatron's order tp-cp-ep-dp-pp, dp = 1
            assert r["ranks"]["stats"] == list(range(4))
            for name in ("embedding", "hidden", "grad", "embed", "embed_grad"):
                assert r["ranks"][name] == pipeline, (name, r)
            assert r["megatron_groups_kept"] and r["new_communicators"]
            ends = r["stage"] in (0, pp - 1)
            assert r["plain_embedding_ranks"] == ([pipeline[0], pipeline[-1]] if ends else [])
            assert r["sums"] == {n: float(sum(ranks)) for n, ranks in r["ranks"].items()}


STAGE_CASES = [(False, False), (False, True), (True, True), (True, False)]
"""(tied, embedding sharded)."""


def test_a_spread_stage_trains_its_rows_and_ends_at_the_final_norm():
    """VocabSpreadStage on 2 megatron ranks: each stage trains its rows ([shard, hidden]) and neither megatron's whole
    output_layer nor, when sharded, its whole word embeddings (frozen; a whole embedding trains on the first stage
    as before); the last stage returns the normed
    hidden states [s, b, h], and those times every stage's rows, in stage order, are megatron's own logits of the
    same input. Tolerance: the same products over hidden=32, split by output column (BLAS may block the two
    matmuls differently): fp32 rounding of a 32-term dot product, well under 1e-5 relative."""
    results = run_ranks(spread_stage_rank, 2, STAGE_CASES, timeout=300.0)
    for case, (tied, embedding) in enumerate(STAGE_CASES):
        first, last = (r[case] for r in results)
        for stage, r in enumerate((first, last)):
            shard = (r["shards"][stage], 32)
            # a tied model's first stage with its table whole: its head rows are the table's own (no copy)
            own_rows = not (tied and not embedding and stage == 0)
            assert r["trainable"].get("output_layer_rows") == (shard if own_rows else None)
            assert ("embedding_rows" in r["trainable"]) == (embedding and not tied)
            assert r["tied_rows_shared"] == (tied and embedding)
            assert f"module.{HEAD}" not in r["trainable"]  # megatron's whole head: the last stage's, frozen
            assert (f"module.{EMBEDDING}" in r["trainable"]) == (stage == 0 and not embedding)  # a whole table trains
            whole = {0: [EMBEDDING] if embedding else [], 1: [HEAD]}[stage]
            assert r["frozen"] == whole
            assert r["rows"] == {**({} if tied else {HEAD: shard}), **({EMBEDDING: shard} if embedding else {})}
        assert last["shape"] == (16, 2, 32)
        assert last["logits"].shape == last["spread"].shape == (2, 16, VOCAB)
        assert torch.allclose(last["spread"], last["logits"], rtol=1e-5, atol=1e-6), (
            tied, embedding, float((last["spread"] - last["logits"]).abs().max()))
        assert torch.equal(first["spread"], last["spread"])
