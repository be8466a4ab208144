"""parallel.head=vocab: the LM head's vocabulary spread over every pipeline stage (pipeline/vocab_head.py) equals
the single-process simulator of the unsplit model, under 2BW and 1F1B, P = 2 and 4, tied and untied, with DP, the
distributed optimizer, Error Feedback with a synchronous start, evaluation and bf16.

Tolerances. In fp32 the pipeline's head differs from the unsplit one only by the order of fp32 sums: the softmax's
sum of exponentials (per shard, then over the shards), the loss's log-sum-exp assembled from the gathered
statistics, the input gradient (P partial products summed by the reduce) and, tied, the embedding rows' gradient
(the head rows' part and the lookup's part summed in another order). Each is within a few u = 2^-24 of the sum of
its terms' magnitudes, the same size as the reduction-order differences the other layouts' equivalence tests bound:
semantics.md's 1e-5 on losses, gradient norms and weights holds, with the amplification over 6 steps bounded so:
- AdamW (the embedding and the head also under "muon") turns a gradient difference dg into at most lr / eps * dg
  per entry (tests/dist/tp_workers._step_lipschitz). At eps = 1e-8 that is 2e6: an entry whose gradient is near
  zero moves by O(lr) on rounding alone, which no reduction order bounds; so AdamW runs at the TP tests' eps = 1e-4
  (ADAMW_EPS), an amplification of lr / eps = 200, while real entries still move by ~lr: the weights differ by at
  most 200 d per step, d ~ 1e-7 the relative size of the reordered sums here.
- Muon's Newton-Schulz divides the momentum by its Frobenius norm and raises a small singular value by up to
  a = 3.4445 per iteration, so its 5 iterations amplify a relative input difference d by at most a^5 = 490,
  against an output of norm sqrt(128) = 11 (orthogonalized, 128 wide): at most 45 d of the update per step. The
  weights it moves are dominated by their 6 updates (o_proj starts at 0.9 in norm, an update is ~0.5), so they
  differ by at most 6 * 0.5 / 0.9 * 45 d = 150 d = 1.5e-5 if every difference fell on the smallest singular
  directions; it spreads over all of them, so the expected size is several times smaller.
Measured on this CPU: losses 8e-8, weights 5.5e-6 (Muon, o_proj).

bf16 is compared with the unsplit model whose head is evaluated in the pipeline's row blocks by the same functions
(`head_in_vocab_blocks`): in bf16 every 1e-7 difference of an fp32 intermediate flips the rounding of a few bf16
elements (measured: 1 of 8192 entries of the step's first input gradient, 3.4e-5 of its norm), and Muon with bf16
weights carries such flips to ~3e-2 of a weight in 3 steps (the size test_distributed_optimizer reports for a bf16
reordering); that is a property of bf16, not of the split. Evaluated in blocks, the two sides run the same kernels
on the same values, and what is left is the fp32 order of the reduce (exact at P=2: one addition).
"""

from __future__ import annotations

import pytest
import torch

from asyncpp.core.partition import vocab_shards_of
from asyncpp.parallel.vocab_parallel import VocabShard, split_for_tp, vocab_shards
from asyncpp.pipeline.vocab_head import logits_gradient, mean_loss, shard_statistics_
from model_zoo import get_model_config
from tests.dist.harness import run_ranks
from tests.dist.test_pipeline_equivalence import relative_error
from tests.dist.tp_workers import ADAMW_EPS
from tests.dist.workers import make_config, pipeline_rank, reference_run

pytestmark = [pytest.mark.equivalence, pytest.mark.dist]

UNTIED = {"name": "tiny_dense", "overrides": {"tie_embeddings": False}}


class _HeadInBlocks(torch.autograd.Function):
    """The unsplit head's mean cross entropy, computed shard by shard with the pipeline's functions."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, shards):
        flat, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        logits = [torch.nn.functional.linear(flat, weight[s.start:s.end]).float() for s in shards]
        stats = [shard_statistics_(x, targets, s) for x, s in zip(logits, shards)]  # logits: now exp(l - max)
        top, total, loss = mean_loss(torch.cat(stats))
        ctx.save_for_backward(flat, weight, targets, top, total, *logits, *stats)
        ctx.shards, ctx.shape = shards, hidden.shape
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        flat, weight, targets, top, total, *saved = ctx.saved_tensors
        exps, stats = saved[:len(ctx.shards)], saved[len(ctx.shards):]
        d_weight, d_hidden = torch.zeros_like(weight), None
        for x, st, s in zip(exps, stats, ctx.shards):
            g = logits_gradient(x, st, targets, s, top, total).to(flat.dtype)
            d_weight[s.start:s.end] = g.t() @ flat
            part = g.float() @ weight[s.start:s.end].float()
            d_hidden = part if d_hidden is None else d_hidden + part
        assert float(grad_out) == 1.0  # the simulator back-propagates each microbatch's loss as it is
        return d_hidden.to(flat.dtype).reshape(ctx.shape), d_weight, None, None


def head_in_vocab_blocks(shards: list[VocabShard]):
    def loss_fn(model, tokens):
        h = model.embed_tokens(tokens[:, :-1])
        for layer in model.layers:
            h = layer(h)
        return _HeadInBlocks.apply(model.norm(h), model.lm_head.weight, tokens[:, 1:], shards)

    return loss_fn


def assert_vocab_equivalent(cfg, world: int, loss_fn=None, rel: float = 1e-5) -> tuple[list[dict], list[dict], dict]:
    results = run_ranks(pipeline_rank, world, cfg.to_dict())
    records = next(r for r in results if r["records"])["records"]
    ref = reference_run(cfg, loss_fn) if loss_fn is not None else reference_run(cfg)
    assert [r["step"] for r in records] == list(range(cfg.train.steps))
    for r, s in zip(records, ref["stats"]):
        assert r["loss"] == pytest.approx(s.loss, rel=rel), r["step"]
        assert r["grad_norm"] == pytest.approx(s.grad_norm, rel=rel), r["step"]
    if cfg.train.eval_every:
        assert records[-1]["val_loss"] == pytest.approx(ref["val_loss"], rel=rel)
    tied = "lm_head.weight" not in ref["params"]
    head = ref["params"]["embed.weight" if tied else "lm_head.weight"]
    model_cfg = get_model_config(cfg.model.name, **(cfg.model.overrides or {}))
    shards = vocab_shards(vocab_shards_of(cfg.validate(model_cfg), model_cfg), model_cfg.vocab_size)
    m = cfg.validate(model_cfg).train.num_microbatches
    tp = cfg.parallel.tp
    for r in results:
        v, shard = r["vocab"], split_for_tp(shards[r["stage"]], tp)[r["tp"]]  # this TP rank's piece of its stage's
        # The vocabulary really is split: this stage's rows, the width of every logits block it computed, one S
        # per microbatch, and no stage holding the whole head.
        assert (v["start"], v["rows"]) == (shard.start, shard.rows), r["stage"]
        assert v["widths"] == [shard.rows] and v["passes"] == cfg.train.steps * m, (r["stage"], v)
        for name, p in r["params"].items():
            if name == "lm_head.weight":
                assert p.shape == (shard.rows, model_cfg.hidden_size) and p.shape[0] < model_cfg.vocab_size
                want = head[shard.start:shard.end]
            elif name == "embed.weight" and r.get("embedding") is not None:  # parallel.embedding=vocab: the same rows
                assert p.shape == (shard.rows, model_cfg.hidden_size) and p.shape[0] < model_cfg.vocab_size
                want = ref["params"][name][shard.start:shard.end]
            else:
                want = ref["params"][name]
                tp_dim, expert = r["layouts"].get(name, (None, False))
                if expert and cfg.parallel.ep > 1:  # this rank's experts
                    want = want.chunk(cfg.parallel.ep, dim=0)[r["ep"]]
                if tp_dim is not None and tp > 1:  # this rank's TP slice of the reference
                    want = want.chunk(tp, dim=tp_dim)[r["tp"]]
            err = relative_error(p, want)
            assert err < rel, (r["stage"], name, err)
    if tied and results[0].get("embedding") is None:  # every stage's head rows are rows of the one tied weight: one
        embed = next(r for r in results if r["stage"] == 0 and r["dp"] == 0)["params"]["embed.weight"]
        for r in results:
            if r["stage"] > 0:
                s = shards[r["stage"]]
                assert torch.equal(r["params"]["lm_head.weight"], embed[s.start:s.end]), r["stage"]
    return results, records, ref


def test_vocab_head_two_stages_untied_2bw_with_eval() -> None:
    """With the head's passes placed with one S of slack (parallel.vocab_placement=[2, 1]: T(i) after the stage's
    S(i + 1)): two passes held at once on every stage."""
    cfg = make_config(model=UNTIED, parallel={"pp": 2, "head": "vocab", "vocab_placement": [2, 1]},
                      train={"eval_every": 3}, optimizer={"eps": ADAMW_EPS})
    results, _, _ = assert_vocab_equivalent(cfg, 2)
    assert "lm_head.weight" in next(r for r in results if r["stage"] == 0)["params"]
    assert {r["vocab"]["held_peak"] for r in results} == {2}


@pytest.mark.slow  # the default suite's 12-minute budget (2026-11-26); a smaller case of the same mechanism stays default
def test_vocab_head_four_stages_tied_2bw_error_feedback_sync_start() -> None:
    """Tied: the first stage's head rows are its embedding's; the others' are reduced with it over the pipeline."""
    cfg = make_config(parallel={"pp": 4, "head": "vocab", "stage_layers": [1, 1, 1, 1]},
                      staleness={"ef_lambda": 1.0, "sync_start_steps": 2}, optimizer={"eps": ADAMW_EPS})
    results, _, _ = assert_vocab_equivalent(cfg, 4)
    assert "lm_head.weight" not in next(r for r in results if r["stage"] == 0)["params"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule, optimizer", [("1f1b", "muon"), ("2bw", "adamw")])
def test_vocab_head_four_stages_untied(schedule: str, optimizer: str) -> None:
    cfg = make_config(model=UNTIED, parallel={"pp": 4, "head": "vocab", "stage_layers": [1, 1, 1, 1]},
                      schedule={"name": schedule}, optimizer={"name": optimizer, "eps": ADAMW_EPS})
    assert_vocab_equivalent(cfg, 4)


@pytest.mark.slow
def test_vocab_head_data_parallel_distributed_optimizer_1f1b() -> None:
    """pp=2 x dp=2, tied, the distributed optimizer: DP reduces the head rows' gradients like any other."""
    cfg = make_config(parallel={"pp": 2, "dp": 2, "head": "vocab", "distributed_optimizer": True},
                      schedule={"name": "1f1b"}, optimizer={"eps": ADAMW_EPS})
    results, _, _ = assert_vocab_equivalent(cfg, 4)
    assert sorted((r["stage"], r["dp"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.slow
def test_vocab_head_data_parallel_2bw_error_feedback_sync_start() -> None:
    cfg = make_config(model=UNTIED, parallel={"pp": 2, "dp": 2, "head": "vocab", "distributed_optimizer": True},
                      staleness={"ef_lambda": 1.0, "sync_start_steps": 2}, optimizer={"eps": ADAMW_EPS})
    assert_vocab_equivalent(cfg, 4)


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_vocab_head_with_tensor_parallelism(sequence_parallel: bool) -> None:
    """pp=2 x tp=2: each stage's rows split again over its TP ranks (four pieces of the vocabulary); under sequence
    parallelism the last stage gathers the sequence before the broadcast, and the gather's backward sums the TP
    ranks' partial input gradients."""
    cfg = make_config(model=UNTIED, parallel={"pp": 2, "tp": 2, "head": "vocab", "sequence_parallel": sequence_parallel},
                      train={"eval_every": 3}, optimizer={"eps": ADAMW_EPS})
    results, _, _ = assert_vocab_equivalent(cfg, 4)
    assert sorted((r["stage"], r["tp"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.slow
def test_vocab_head_bf16_equals_the_head_in_blocks() -> None:
    """bf16 compute, fp32 masters (module docstring: the reference evaluates the head in the pipeline's blocks)."""
    cfg = make_config(model=UNTIED, parallel={"pp": 2, "head": "vocab"}, train={"precision": "bf16"},
                      optimizer={"eps": ADAMW_EPS})
    model_cfg = get_model_config("tiny_dense", tie_embeddings=False)
    shards = vocab_shards(vocab_shards_of(cfg.validate(model_cfg), model_cfg), model_cfg.vocab_size)
    assert_vocab_equivalent(cfg, 2, head_in_vocab_blocks(shards))


@pytest.mark.slow
@pytest.mark.parametrize("sections", [
    {"staleness": {"weight_prediction": True}},
    {"staleness": {"dc_lambda": 0.1}},
    {"staleness": {"grad_ef_lambda": 0.5}},
    {"train": {"recompute": "full"}, "schedule": {"name": "sync"}},
    {"model": {"name": "tiny_moe"}},
    {"model": {"name": "tiny_moe"}, "parallel": {"pp": 2, "head": "vocab", "dp": 2, "ep": 2}},
], ids=["weight-prediction", "dc-asgd", "gradient-ef", "recompute-sync", "moe", "moe-ep2"])
def test_vocab_head_with_every_staleness_correction_recompute_and_moe(sections) -> None:
    """Each head shard is a weight like any other: versioned, delayed and corrected by the same rule; the experts
    (split over EP in the paper layouts) do not touch it."""
    sections = {"parallel": {"pp": 2, "head": "vocab"}, "optimizer": {"eps": ADAMW_EPS}, **sections}
    p = sections["parallel"]
    assert_vocab_equivalent(make_config(**sections), p["pp"] * (p.get("dp") or 1))
