"""parallel.embedding=vocab: the input embedding sharded by the vocabulary-parallel head's rows. Its passes as schedule
actions (E and G on every stage, asyncpp/schedules), placed by costmodel.place_embedding_passes and checked by the
invariants (one version per microbatch across the shards, E before the first stage's F, G after its B and before
the stage's UPDATE, the collectives in one order, no deadlock with the reductions waiting for the last G), and under
2BW within a hair of the bubble of the same schedule without them; the stage build (rows, tied); the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asyncpp.config import ConfigError
from asyncpp.core.layer_costs import layer_costs
from asyncpp.core.partition import embedding_sharded
from asyncpp.core.vocab_split import plan_vocab_split, run_vocab_split, vocab_op_costs, vocab_pipeline
from asyncpp.parallel.vocab_parallel import VocabShard, embedding_partial
from asyncpp.pipeline.build import build_stage, stage_spec_of
from asyncpp.pipeline.executor import segment_actions
from asyncpp.pipeline.stage import tied_parameters, vocab_rows
from asyncpp.pipeline.stopping import ActionStream, stop_lookahead
from asyncpp.schedules import ScheduleError
from asyncpp.schedules.actions import Op
from asyncpp.schedules.costmodel import VocabPlacement, simulate
from asyncpp.schedules.invariants import (
    check_collective_order,
    check_fifo,
    check_schedules,
    execution_order,
    has_sharded_embedding,
    max_versions_for,
)
from model_zoo import build_model, get_model_config
from tests.unit.test_stop_midsegment import fixed_at_update
from tests.unit.test_vocab_head import check


def lists_of(schedule: str, P: int, m: int, steps: int, embedding: bool = True):
    model = get_model_config("moe_2b")
    split = plan_vocab_split(layer_costs(model, 4096, 1, "cuda"), P, model.vocab_size, embedding=embedding)
    delays = [1 if schedule == "2bw" else 0] * steps
    return split, vocab_pipeline(schedule, m, delays, split, VocabPlacement(1))


@pytest.mark.parametrize("schedule", ["2bw", "1f1b", "sync"])
@pytest.mark.parametrize("P,m", [(2, 2), (2, 8), (4, 4), (4, 16)])
def test_placed_schedules_pass_every_invariant(schedule, P, m):
    """One E and one G per microbatch on every stage, in one order; the UPDATEs an E pulls up still follow their
    UPDATE_START and the step's Gs, within the kind's weight-version bound; deadlock-free with the reduce before the
    first stage's F and the broadcast after its B."""
    steps = 4
    _, lists = lists_of(schedule, P, m, steps)
    assert has_sharded_embedding(lists)
    check_schedules(lists, m, [max_versions_for(schedule, s, P) for s in range(P)], num_steps=steps)
    for actions in lists:
        for op in (Op.EMBED_FORWARD, Op.EMBED_BACKWARD):
            assert sum(a.op is op for a in actions) == m * steps


@pytest.mark.parametrize("P", [2, 4, pytest.param(8, marks=pytest.mark.slow)])  # P=8: 14 s
def test_2bw_adds_no_bubble(P):
    """moe_2b at seq 4096, m = 4P (the paper's setting), the CUDA cost table: the E and G passes fill time the stages
    would otherwise wait. The steady-state idle share stays within 0.2% of the same schedule without them (measured:
    0.0000 / 0.0005 / 0.0017 against 0.0002 / 0.0001 / 0.0006 at P = 2 / 4 / 8: the rows' rounding to 128 leaves
    that much imbalance), and the step grows only by the work the stages add, the per-token lookup each runs
    ((P-1) x 2h elementwise per token, 0.02-0.2%)."""
    m, steps = 4 * P, 8
    out = {}
    for embedding in (False, True):
        split, lists = lists_of("2bw", P, m, steps, embedding)
        tl = simulate(lists, vocab_op_costs(split), collective_updates=True)
        out[embedding] = (tl.step_time(), tl.bubble_fraction(steady=True))
    assert out[True][1] <= out[False][1] + 2e-3, out
    assert out[True][0] <= out[False][0] * 1.003, out


def test_the_checker_refuses_an_embedding_pass_out_of_place():
    _, lists = lists_of("2bw", 2, 4, 3)
    first = lists[0]
    e = next(i for i, a in enumerate(first) if a.op is Op.EMBED_FORWARD and a.step == 1)
    f = next(i for i, a in enumerate(first) if a.op is Op.FORWARD and (a.step, a.microbatch) == (first[e].step,
                                                                                                   first[e].microbatch))
    late = first[:e] + first[e + 1:f + 1] + [first[e]] + first[f + 1:]  # E after its F
    with pytest.raises(ScheduleError, match="E1.0 must run before F1.0"):
        check_schedules([late, lists[1]], 4, 2, num_steps=3)
    wrong = [dataclasses.replace(a, version=a.version + 1) if a.op is Op.EMBED_BACKWARD and a.step == 2 else a
             for a in first]
    with pytest.raises(ScheduleError):
        check_schedules([wrong, lists[1]], 4, 2, num_steps=3)
    missing = [a for a in lists[1] if not (a.op is Op.EMBED_FORWARD and a.step == 2 and a.microbatch == 3)]
    with pytest.raises(ScheduleError, match="EMBED_FORWARD must run once per microbatch"):
        check_schedules([first, missing], 4, 2, num_steps=3)


def test_the_stages_hold_the_head_rows_of_the_embedding():
    """Each stage's embed.weight is its head rows [rows, h], initialized as those rows of the unsplit embedding; tied,
    the head's rows are the same parameter (no lm_head, no cross-stage tied tensor)."""
    for tied in (False, True):
        cfg, model_cfg = check(["model=tiny_dense", f"+model.overrides.tie_embeddings={str(tied).lower()}",
                                "parallel.pp=2", "parallel.head=vocab", "parallel.embedding=vocab"])
        assert embedding_sharded(cfg, model_cfg)
        reference = build_model(model_cfg, seed=cfg.seed).embed.weight.detach()
        for stage in (0, 1):
            spec = stage_spec_of(cfg, model_cfg, stage)
            built = build_stage(model_cfg, spec, "cpu", cfg.seed).model
            w = built.embed.weight
            assert w.shape == (spec.embed.rows, model_cfg.hidden_size) and spec.embed == spec.vocab
            assert torch.equal(w.detach(), reference[spec.embed.start:spec.embed.end])
            assert tied_parameters(built, spec) == []
            head, row0 = vocab_rows(built, spec)
            assert (head is w and row0 == 0) if tied else (head is built.lm_head.weight and "lm_head.weight" in
                                                           dict(built.named_parameters()))


def test_the_partial_lookups_sum_to_the_unsplit_lookup():
    weight = torch.randn(10, 4)
    ids = torch.tensor([[0, 3, 9, 5, 3]])
    shards = [VocabShard(0, 4), VocabShard(4, 0), VocabShard(4, 6)]
    total = sum(embedding_partial(ids, weight[s.start:s.end], s) for s in shards)
    assert torch.equal(total, torch.nn.functional.embedding(ids, weight))


@pytest.mark.parametrize("overrides, must_contain", [
    (["model=tiny_dense", "parallel.pp=2", "parallel.head=last", "parallel.embedding=vocab"],
     ["parallel.embedding=vocab", "parallel.head=last", "parallel.head=vocab"]),
    (["model=tiny_dense", "+model.overrides.tie_embeddings=false", "parallel.pp=2", "parallel.tp=2",
      "parallel.head=vocab", "parallel.embedding=vocab"], ["parallel.embedding=vocab", "parallel.tp=2",
                                                           "parallel.embedding=first"]),
    (["parallel.embedding=sideways"], ["parallel.embedding='sideways'", "'first', 'vocab'"]),
    # One stage (head=auto resolves to last there): the embedding would stay whole without a word.
    (["model=tiny_dense", "parallel.pp=1", "parallel.head=auto", "parallel.embedding=vocab"],
     ["parallel.embedding=vocab", "parallel.pp=1", "parallel.embedding=first"]),
])
def test_refusals_name_the_field_and_the_fix(overrides, must_contain):
    with pytest.raises(ConfigError) as e:
        check(overrides)
    for text in must_contain:
        assert text in str(e.value), (text, str(e.value))


def test_the_run_split_costs_the_embedding_with_the_rows():
    """run_vocab_split with the embedding sharded: every stage's E and G cost in its compute, the first stage's body
    without the embedding, the rows still summing to the vocabulary."""
    cfg, model_cfg = check(["model=tiny_dense", "parallel.pp=2", "parallel.head=vocab", "parallel.embedding=vocab"])
    split = run_vocab_split(cfg, model_cfg)
    assert len(split.embed) == 2 and all(e > 0 for e in split.embed) and sum(split.shards) == model_cfg.vocab_size
    whole = run_vocab_split(cfg.replace(parallel=dataclasses.replace(cfg.parallel, embedding="first")), model_cfg)
    assert whole.embed == () and sum(whole.compute) < sum(split.compute)  # each stage looks up every token


@pytest.mark.parametrize("placement", [VocabPlacement(1), VocabPlacement(1, 1)])
@pytest.mark.parametrize("schedule", ["2bw", "1f1b"])
@pytest.mark.parametrize("P,m", [(2, 2), (3, 4)])
def test_a_stop_mid_segment_cuts_the_embedding_passes_cleanly(schedule, P, m, placement):
    """stopping.py: a rank learns of a stop at UPDATE(t) and continues with what the [t0, s) stream has left. With
    the E and G actions (and the UPDATEs they pull up) the executed prefix still belongs to the shorter stream, and
    the stages' streams together stay deadlock-free, FIFO and in one collective order per communicator. With the
    head's slack too (a T after the next S, but not where the shorter stream ends)."""
    cfg, model_cfg = check(["model=tiny_dense", f"parallel.pp={P}", "parallel.head=vocab", "parallel.embedding=vocab",
                            f"schedule={schedule}", f"train.num_microbatches={m}"])
    split = run_vocab_split(cfg, model_cfg)
    steps, lookahead = 7, stop_lookahead(schedule, P)
    delays = [0] + [1 if schedule == "2bw" else 0] * (steps - 1)  # a synchronous first step, as sync start gives
    for t in range(steps - lookahead):
        s = t + lookahead
        streams = []
        for stage in range(P):
            stream = ActionStream(segment_actions(schedule, stage, P, m, delays, 0, steps, vocab=(split, placement)))
            stream.fixed = fixed_at_update(stream.actions, t)
            shorter = segment_actions(schedule, stage, P, m, delays, 0, s, vocab=(split, placement))
            stream.cut(shorter)
            assert sorted(stream.actions, key=repr) == sorted(shorter, key=repr)
            streams.append(stream.actions)
        execution_order(streams)
        check_fifo(streams)
        check_collective_order(streams, (Op.VOCAB_FORWARD, Op.VOCAB_BACKWARD, Op.EMBED_FORWARD, Op.EMBED_BACKWARD))
