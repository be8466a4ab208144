"""One case of the covering matrix as real gloo pipelines, against the single-process simulator, with every
rank's torch.distributed ops recorded and replayed under NCCL's ordering rules (tests/nccl/replay.py).

A case with `resume` runs twice, as a user would: a stop requested at step 0 on rank 0 (StopFlag's test hook,
as tests/dist/test_stop_midsegment.py) is agreed by every rank, checkpointed where it lands, and the same
command resumes from that checkpoint (checkpoint.resume=auto); the two runs' records together, and the
resumed run's final weights, must equal one uninterrupted simulator run.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch

from asyncpp.config import RunConfig
from asyncpp.core.partition import embedding_sharded, vocab_shards_of
from asyncpp.parallel.vocab_parallel import VocabShard, split_for_tp, vocab_shards
from model_zoo import get_model_config
from tests.dist.harness import run_ranks
from tests.dist.test_pipeline_equivalence import assemble, relative_error
from tests.dist.test_stop_midsegment import stopped_rank
from tests.dist.test_vocab_parallel_embedding import assert_embedding_split
from tests.dist.test_vocab_parallel_pipeline import head_in_vocab_blocks
from tests.dist.workers import pipeline_rank, reference_run
from tests.matrix.space import container, world
from tests.nccl.recorder import record
from tests.nccl.replay import MODES, replay

# fp32: the equivalence tier's tolerances (tests/dist/test_pipeline_equivalence.py): loss and gradient norm
# relative 1e-5, each weight tensor 1e-4.
FP32_REL, FP32_WEIGHT_REL = 1e-5, 1e-4
# bf16: a layout that sums in another order changes bf16 roundings. With DP only the fp32 gradient sums are
# reordered, which moves a master across a bf16 rounding boundary now and then (tests/dist/
# test_distributed_optimizer.py: 2^-8 on losses, 2^-7 on weights); with TP the forward and backward round more
# often (each partial output and partial input gradient is rounded to bf16 before the all-reduce sums it, as in
# Megatron), every element by up to half an ulp, and the steps carry that noise on like any rounding noise
# (Muon's Newton-Schulz amplifies it). Its scale N is the simulator's own: how far the bf16 simulator lands from
# the fp32 one on the same case (per tensor; per step, the largest so far, since the noise grows with the
# steps). A TP layout has up to 3x the simulator's rounding events on a path, so its own noise is up to
# sqrt(3) N and its expected distance from the bf16 simulator sqrt(1 + 3) N = 2N; the bound is twice that,
# 4N (a statistical bound: the matrix's first full run measured one case, pipedream + Muon + TP=2 + SP, at
# 3.1N on step 3's gradient norm). A wrong version or a lost gradient moves the weights by a whole update, far
# above it; the exactness of every layout's logic is the fp32 cases' job.
BF16_REL, BF16_WEIGHT_REL, BF16_NOISE_FACTOR = 2.0 ** -8, 2.0 ** -7, 4.0
# fp32 with a vocabulary-parallel head, over the stages (parallel.head=vocab) or over the TP ranks (every tp > 1
# layout: Megatron's vocab-parallel cross entropy): the head's sums run in another order (per shard, then over the
# shards), a rounding noise like bf16's at 2^-24. Most cases carry it at a few u, inside FP32_REL; a case that
# amplifies rounding cannot meet FP32_REL against any evaluation order: measured (2026-11-26) on the matrix's Muon +
# weight prediction + P=4 case, the simulator itself with its head evaluated in the pipeline's vocabulary row blocks
# lands 1.3e-9 from the whole-head simulator at step 0 and 1.7e-5 at step 3's gradient norm, where the pipeline is
# 3.7e-5 away (2.2 N). So N, the scale, is the simulator's own distance between those two evaluations
# (head_order_noise), and the bound is max(FP32_REL, 4N): the same statistical argument as bf16's above (the
# pipeline's reordering is noise of the same scale, independent of the blocks' one; TP reorders two more sums of
# the same kind, the row-parallel outputs and the column-parallel input gradients, so about sqrt(3) N of its own).
# A wrong version or a lost gradient is far above it. The amplifier of the TP case (2026-11-29, the random case
# pipedream + Muon + ef_lambda=1 + TP=2 + rampup, fp32 twin): the rampup's first steps run one microbatch (32
# tokens, a gradient of rank <= 32 in 128-wide matrices), whose null space Muon's Newton-Schulz lifts by up to
# a^5 = 490 and Error Feedback at lambda=1 carries at twice the step; the simulator with its head in the 2 TP blocks
# lands 6.0e-6 from itself at step 2's gradient norm, the pipeline 1.35e-5 (2.3 N) (the simulator with every
# nn.Linear evaluated in TP=2's halves: 6.4e-6, and 6.7e-5 on the pipeline's worst weight, layers.3.mlp.down_proj, at
# 1.28e-4); with AdamW, ef_lambda=0, no rampup or TP=1 the same case's pipeline is within 1e-6 (TP=1: bit for
# bit). Both noise scales cost one or two more simulator runs: run_case measures them only for an error past the
# plain bound.
STOP_REQUESTED_AT = 0


def matrix_rank(rank: int, cfg_dict: dict, stop_at: int | None) -> dict:
    """tests/dist/workers.pipeline_rank (or, with `stop_at`, a stop requested by rank 0 at that step), with every
    torch.distributed op this rank issues recorded for the NCCL replay."""
    with record() as recorder:
        out = pipeline_rank(rank, cfg_dict) if stop_at is None else stopped_rank(rank, cfg_dict, 0, stop_at)
    return {**out, "nccl_log": recorder.log}


def assert_no_nccl_deadlock(results: list[dict], what: str) -> None:
    logs = {rank: r["nccl_log"] for rank, r in enumerate(results)}
    assert all(logs.values()), "a rank recorded nothing: the recorder is not installed"
    for mode in MODES:
        outcome = replay(logs, mode)
        assert outcome.ok, f"{what}\n{outcome.summary()}"


def bf16_noise(cfg: RunConfig, ref: dict) -> dict:
    """How far the bf16 simulator lands from the fp32 simulator on this case: per step the largest |loss| and
    |grad norm| difference so far, per weight tensor the relative error (BF16_NOISE_FACTOR above)."""
    return simulator_distance(ref, reference_run(cfg.replace(train=dataclasses.replace(cfg.train, precision="fp32"))))


def simulator_distance(run: dict, other: dict) -> dict:
    """How far one simulator run lands from another of the same case: per step the largest |loss| and |grad norm|
    difference so far (the noise grows with the steps), per weight tensor `run`'s relative error against `other`'s."""
    pairs = list(zip(run["stats"], other["stats"], strict=True))
    return {"loss": list(itertools.accumulate((abs(a.loss - b.loss) for a, b in pairs), max)),
            "grad_norm": list(itertools.accumulate((abs(a.grad_norm - b.grad_norm) for a, b in pairs), max)),
            "params": {n: relative_error(p.float(), other["params"][n]) for n, p in run["params"].items()}}


def head_blocks(cfg: RunConfig) -> list[VocabShard] | None:
    """The vocabulary row blocks the pipeline's head sums its softmax over: each stage's rows under a vocabulary-
    parallel head (parallel.head=vocab, or auto resolved to it), else the whole vocabulary, split again over the TP
    ranks (the head's group holds it in (stage, tp rank) order); None where that is one block, the whole head's
    order."""
    model_cfg = get_model_config(cfg.model.name, **(cfg.model.overrides or {}))
    rows = vocab_shards_of(cfg.validate(model_cfg), model_cfg)
    stages = vocab_shards(rows if rows is not None else [model_cfg.vocab_size], model_cfg.vocab_size)
    blocks = [b for s in stages for b in split_for_tp(s, cfg.parallel.tp) if b.rows]  # a row-less stage sums nothing
    return blocks if len(blocks) > 1 else None


def head_order_noise(cfg: RunConfig, ref: dict) -> dict | None:
    """fp32, a vocabulary-parallel head in effect (over the stages or the TP ranks): how far the simulator with its
    head evaluated in the pipeline's vocabulary row blocks (head_blocks) lands from the whole-head simulator `ref`
    (the structure of bf16_noise); None without it."""
    blocks = head_blocks(cfg)
    return None if blocks is None else simulator_distance(reference_run(cfg, head_in_vocab_blocks(blocks)), ref)


def writer_records(results: list[dict]) -> list[dict]:
    return next((r["records"] for r in results if r["records"]), [])


def by_offset(pieces: list[tuple[int, torch.Tensor]], vocab: int) -> torch.Tensor:
    """The whole [vocab, h] tensor from row pieces (start, rows) put at their offsets; a NaN sentinel catches rows
    that no piece supplied."""
    whole = None
    for start, piece in pieces:
        whole = torch.full((vocab, piece.shape[1]), float("nan"), dtype=piece.dtype) if whole is None else whole
        whole[start:start + piece.shape[0]] = piece
    assert whole is not None and not whole.isnan().any(), "some rows of the vocabulary are on no stage"
    return whole


def vocab_parallel_weights(cfg: RunConfig, results: list[dict]) -> dict[str, torch.Tensor]:
    """The weights whose vocabulary rows are spread over the stages, whole, after checking they really were split.

    parallel.head=vocab (or auto resolved to it): the LM head from every stage's rows by their offsets. Each rank's
    piece (its TP rank's part of its stage's rows) is the plan's (the whole head only where the plan gives one stage
    every row), every logits block it computed had its piece's width, and (tied) every later stage's rows are the
    first stage's embedding rows bit for bit (one weight, one update).
    parallel.embedding=vocab in effect as well: the input embedding from every stage's rows by their offsets, each
    rank's embedding checked to be split (tests/dist/test_vocab_parallel_embedding.assert_embedding_split: its rows,
    the head's, one E and one G per S it ran, tied: no lm_head of its own, its head rows are these rows).
    Empty when the head is not vocabulary-parallel (then no rank may have run a shard of the head or the embedding)."""
    model_cfg = get_model_config(cfg.model.name, **(cfg.model.overrides or {}))
    resolved = cfg.validate(model_cfg)
    rows = vocab_shards_of(resolved, model_cfg)
    if rows is None:
        assert all(r["vocab"] is None and r["embedding"] is None for r in results), \
            "a vocabulary shard ran with the head on the last stage"
        return {}
    vocab, tp, sharded = model_cfg.vocab_size, cfg.parallel.tp, embedding_sharded(resolved, model_cfg)
    shards = vocab_shards(rows, vocab)
    replica = [r for r in results if r["dp"] == r["ep"]]  # edp index 0, as assemble()
    first_embed = next(r for r in replica if r["stage"] == 0)["params"]["embed.weight"]
    heads, embeds = [], []
    for r in replica:
        v, stage = r["vocab"], shards[r["stage"]]
        # the plan's rows (every row on one stage where the plan says so: the cost model's split of pp=2 with
        # stage_layers=[4,0] leaves the first stage none)
        assert v is not None and v["rows"] * tp == stage.rows, (r["stage"], v)
        assert v["widths"] == [v["rows"]] and v["passes"] > 0, (r["stage"], v)
        if sharded:
            embeds.append((v["start"], assert_embedding_split(r, stage, model_cfg, v["passes"])))
        else:
            assert r["embedding"] is None, (r["stage"], r["embedding"])
        piece = r["params"].get("lm_head.weight")
        if piece is None and sharded:  # tied and sharded: the head rows are the embedding rows above, one tensor
            continue
        if piece is None:  # a tied first stage: its rows are its embedding's own
            piece = first_embed[v["start"]:v["start"] + v["rows"]]
        elif model_cfg.tie_embeddings:
            assert torch.equal(piece, first_embed[v["start"]:v["start"] + v["rows"]]), r["stage"]
        assert piece.shape[0] == v["rows"], (r["stage"], piece.shape)
        heads.append((v["start"], piece))
    return {**({"lm_head.weight": by_offset(heads, vocab)} if heads else {}),
            **({"embed.weight": by_offset(embeds, vocab)} if sharded else {})}


def layers_of_stage(results: list[dict]) -> list[int]:
    """How many transformer layers each stage really held (the layer indices of its weights' names)."""
    held: dict[int, set[int]] = {}
    for r in results:
        held.setdefault(r["stage"], set()).update(int(n.split(".")[1]) for n in r["params"] if n.startswith("layers."))
    return [len(held[s]) for s in sorted(held)]


def run_case(case: dict, tmp_path) -> dict:
    """Run `case` (accepted by the validator) and assert it equals the simulator; returns what it measured."""
    cfg = RunConfig.from_dict(container(case, str(tmp_path / "checkpoints")))
    n, steps = world(case), cfg.train.steps
    if case["resume"]:
        part = run_ranks(matrix_rank, n, cfg.to_dict(), STOP_REQUESTED_AT)
        assert_no_nccl_deadlock(part, "the run that stops")
        stopped = {r["summary"]["stopped_at"] for r in part}
        assert len(stopped) == 1 and 0 < min(stopped) < steps, stopped  # agreed, and really mid-run
        stop = stopped.pop()
        records = writer_records(part)
        assert [r["step"] for r in records] == list(range(stop))
        results = run_ranks(matrix_rank, n, cfg.to_dict(), None)  # the same command: resumes from the stop
        assert_no_nccl_deadlock(results, "the resumed run")
        records = records + writer_records(results)
    else:
        stop = None
        results = run_ranks(matrix_rank, n, cfg.to_dict(), None)
        assert_no_nccl_deadlock(results, "the run")
        records = writer_records(results)
    assert [r["step"] for r in records] == list(range(steps))
    ref = reference_run(cfg)
    bf16 = case["precision"] == "bf16"
    noise = functools.cache(lambda: bf16_noise(cfg, ref) if bf16 else head_order_noise(cfg, ref))
    rel, weight_rel = (BF16_REL, BF16_WEIGHT_REL) if bf16 else (FP32_REL, FP32_WEIGHT_REL)

    def bound(plain: float, err: float, what: str, which) -> float:
        """`plain`, or for an error past it max(plain, 4N), N = noise()[what][which] if the case has a noise scale."""
        return plain if err <= plain or noise() is None else max(plain, BF16_NOISE_FACTOR * noise()[what][which])

    for t, (r, s) in enumerate(zip(records, ref["stats"], strict=True)):
        for key in ("loss", "grad_norm"):
            got, want = r[key], getattr(s, key)
            limit = bound(rel * abs(want), abs(got - want), key, t)
            assert abs(got - want) <= limit, (key, t, got, want, limit)
    vocab_weights = vocab_parallel_weights(cfg, results)
    # assemble() knows whole tensors and TP/EP slices; the vocabulary-parallel rows are by offset
    params = {**assemble(results), **vocab_weights}
    worst = (0.0, 0.0, "")
    for name, p in params.items():
        ref_name = "embed.weight" if name == "lm_head.weight" and name not in ref["params"] else name
        assert p.shape == ref["params"][ref_name].shape, name
        err = relative_error(p, ref["params"][ref_name])
        limit = bound(weight_rel, err, "params", ref_name)
        assert err < limit, (name, err, limit)
        worst = max(worst, (err, limit, name))
    assert set(ref["params"]) <= set(params)
    return {"stopped_at": stop, "worst_weight_error": worst,  # (error, its bound, the tensor)
            "vocab_rows": [r["vocab"]["rows"] for r in results if r["dp"] == 0] if results[0]["vocab"] else None,
            "embedding_sharded": "embed.weight" in vocab_weights,
            "layers_of_stage": layers_of_stage(results),
            "ops": sum(len(r["nccl_log"]) for r in results)}
