"""parallel.embedding=vocab: the input embedding sharded by the vocabulary-parallel head's rows (pipeline/vocab_head.
VocabEmbedding, the E and G actions) equals the single-process simulator of the unsplit model.

Tolerances: test_vocab_parallel_pipeline.py's (semantics.md's 1e-5). The sharded lookup is exact (each token's row
lives on one stage, the reduce adds zeros to it); the rows' gradient is the unsplit lookup's backward restricted to
the rows, per microbatch in the weight's dtype, summed over the microbatches in fp32 apart from the layers' gradient
and added to it once (tied: the head rows' part and the lookup's part are summed in another order than autograd's),
so only the order of fp32 sums differs, as for the head.

Every case also checks that the embedding really is split: each stage's embed.weight is its rows [rows, h] (no stage
holds the whole table), its rows are the head's, every stage ran one E and one G per microbatch, and a tied model has
no cross-stage tied tensor (each stage's head rows are its embedding rows, one parameter)."""

from __future__ import annotations

import pytest
import torch

from asyncpp.core.partition import vocab_shards_of
from asyncpp.parallel.vocab_parallel import VocabShard, vocab_shards
from model_zoo import get_model_config
from tests.dist.test_vocab_parallel_pipeline import UNTIED, assert_vocab_equivalent, head_in_vocab_blocks
from tests.dist.tp_workers import ADAMW_EPS
from tests.dist.workers import make_config

pytestmark = [pytest.mark.equivalence, pytest.mark.dist]


def assert_embedding_equivalent(cfg, world: int, loss_fn=None) -> list[dict]:
    results, _, _ = assert_vocab_equivalent(cfg, world, loss_fn)  # every weight, the embedding's rows too, within 1e-5
    model_cfg = get_model_config(cfg.model.name, **(cfg.model.overrides or {}))
    resolved = cfg.validate(model_cfg)
    shards = vocab_shards(vocab_shards_of(resolved, model_cfg), model_cfg.vocab_size)
    m, steps = resolved.train.num_microbatches, cfg.train.steps
    for r in results:
        if r["dp"] > 0:  # the distributed optimizer's other replicas: the same rows and passes
            assert r["embedding"]["rows"] == shards[r["stage"]].rows
            continue
        assert_embedding_split(r, shards[r["stage"]], model_cfg, steps * m)
    return results


def assert_embedding_split(r: dict, shard: VocabShard, model_cfg, passes: int) -> torch.Tensor:
    """One rank of a parallel.embedding=vocab run (pipeline_rank's result `r`): its embedding really is split. Its
    embed.weight is its stage's rows [rows, h] (not the whole table), the same rows as its head's, it ran `passes` E
    and as many G (one of each per microbatch), and a tied model has no lm_head.weight of its own (each stage's head
    rows are its embedding rows, one parameter: no cross-stage tied tensor). Returns its embed.weight rows."""
    e = r["embedding"]
    assert e is not None, f"stage {r['stage']}: no sharded embedding ran"
    assert (e["start"], e["rows"]) == (shard.start, shard.rows) == (r["vocab"]["start"], r["vocab"]["rows"]), (
        r["stage"], e)
    assert e["lookups"] == e["gradients"] == passes > 0, (r["stage"], e, passes)
    embed = r["params"]["embed.weight"]
    assert embed.shape == (shard.rows, model_cfg.hidden_size) and shard.rows < model_cfg.vocab_size, (
        r["stage"], embed.shape)
    assert e["param_rows"] == shard.rows, (r["stage"], e)
    if model_cfg.tie_embeddings:  # one tensor: no lm_head of its own on any stage
        assert "lm_head.weight" not in r["params"], r["stage"]
    return embed


def test_sharded_embedding_two_stages_untied_2bw_with_eval() -> None:
    cfg = make_config(model=UNTIED, parallel={"pp": 2, "head": "vocab", "embedding": "vocab"},
                      train={"eval_every": 3}, optimizer={"eps": ADAMW_EPS})
    assert_embedding_equivalent(cfg, 2)


@pytest.mark.slow
def test_sharded_embedding_with_a_stage_of_zero_rows() -> None:
    """parallel.vocab_shards=[0, vocab/2, vocab/2]: the first stage holds no embedding or head rows (water filling gives
    a stage above the level none too). Its lookup is a constant zero, its G a zero [0, h] gradient (it crashed in autograd,
    issue 44, while the dry run accepted the layout); the run equals the simulator, and stage 0 still ran every E and
    G with its empty rows."""
    vocab = get_model_config("tiny_dense").vocab_size
    shards = [0, vocab // 2, vocab // 2]
    cfg = make_config(model=UNTIED, parallel={"pp": 3, "head": "vocab", "embedding": "vocab", "stage_layers": [2, 1, 1],
                                              "vocab_shards": shards}, optimizer={"eps": ADAMW_EPS})
    results = assert_embedding_equivalent(cfg, 3)
    assert [r["embedding"]["rows"] for r in sorted(results, key=lambda r: r["stage"])] == shards


@pytest.mark.slow
def test_sharded_embedding_two_stages_tied_1f1b() -> None:
    cfg = make_config(parallel={"pp": 2, "head": "vocab", "embedding": "vocab"}, schedule={"name": "1f1b"},
                      optimizer={"eps": ADAMW_EPS})
    assert_embedding_equivalent(cfg, 2)


@pytest.mark.slow
def test_sharded_embedding_four_stages_tied_2bw_error_feedback_sync_start() -> None:
    cfg = make_config(parallel={"pp": 4, "head": "vocab", "embedding": "vocab", "stage_layers": [1, 1, 1, 1]},
                      staleness={"ef_lambda": 1.0, "sync_start_steps": 2}, optimizer={"eps": ADAMW_EPS})
    assert_embedding_equivalent(cfg, 4)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, optimizer", [("1f1b", "muon"), ("2bw", "adamw")])
def test_sharded_embedding_four_stages_untied(schedule: str, optimizer: str) -> None:
    cfg = make_config(model=UNTIED, parallel={"pp": 4, "head": "vocab", "embedding": "vocab",
                                              "stage_layers": [1, 1, 1, 1]},
                      schedule={"name": schedule}, optimizer={"name": optimizer, "eps": ADAMW_EPS})
    assert_embedding_equivalent(cfg, 4)


@pytest.mark.slow
@pytest.mark.parametrize("model", [UNTIED, {"name": "tiny_dense"}], ids=["untied", "tied"])
def test_sharded_embedding_data_parallel_distributed_optimizer(model) -> None:
    """pp=2 x dp=2, the distributed optimizer (the paper layouts' setting): DP reduces the rows' gradients like any
    other, each replica's pipeline has its own E/G communicators."""
    cfg = make_config(model=model, parallel={"pp": 2, "dp": 2, "head": "vocab", "embedding": "vocab",
                                             "distributed_optimizer": True},
                      staleness={"ef_lambda": 1.0, "sync_start_steps": 2}, optimizer={"eps": ADAMW_EPS})
    results = assert_embedding_equivalent(cfg, 4)
    assert sorted((r["stage"], r["dp"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.slow
def test_sharded_embedding_moe_with_expert_parallelism() -> None:
    """tiny_moe at pp=2 x dp=2 x ep=2 (the paper layouts split the experts over EP): the experts do not touch it."""
    cfg = make_config(model={"name": "tiny_moe"}, parallel={"pp": 2, "dp": 2, "ep": 2, "head": "vocab",
                                                            "embedding": "vocab"}, optimizer={"eps": ADAMW_EPS})
    assert_embedding_equivalent(cfg, 4)


@pytest.mark.slow
def test_sharded_embedding_bf16_equals_the_head_in_blocks() -> None:
    """bf16 compute, fp32 masters, against the unsplit model whose head is evaluated in the pipeline's row blocks
    (test_vocab_parallel_pipeline.py's docstring). The lookup is exact in bf16 too, and each microbatch's rows'
    gradient is the same bf16 kernel's on the same values, summed in fp32 as the masters' gradient sums are."""
    cfg = make_config(model=UNTIED, parallel={"pp": 2, "head": "vocab", "embedding": "vocab"},
                      train={"precision": "bf16"}, optimizer={"eps": ADAMW_EPS})
    model_cfg = get_model_config("tiny_dense", tie_embeddings=False)
    shards = vocab_shards(vocab_shards_of(cfg.validate(model_cfg), model_cfg), model_cfg.vocab_size)
    assert_embedding_equivalent(cfg, 2, head_in_vocab_blocks(shards))


@pytest.mark.slow
@pytest.mark.parametrize("sections", [
    {"staleness": {"weight_prediction": True}},
    {"staleness": {"dc_lambda": 0.1}},
    {"staleness": {"grad_ef_lambda": 0.5}},
    {"train": {"recompute": "full"}, "schedule": {"name": "sync"}},
], ids=["weight-prediction", "dc-asgd", "gradient-ef", "recompute-sync"])
def test_sharded_embedding_with_every_staleness_correction_and_recompute(sections) -> None:
    """Each embedding shard is a weight like any other: its E reads the microbatch's (predicted) version, its rows'
    gradient is corrected with the rest of b_t's when the step's reductions start (at its last G)."""
    sections = {"parallel": {"pp": 2, "head": "vocab", "embedding": "vocab"}, "optimizer": {"eps": ADAMW_EPS},
                **sections}
    assert_embedding_equivalent(make_config(**sections), 2)
