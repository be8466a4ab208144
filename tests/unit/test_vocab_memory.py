"""The memory plan of parallel.head=vocab (asyncpp/pipeline/memory.py, core/memory.py's vocab items): every stage
counts its head rows with their real shapes, its fp32 [N, rows] logits held from S to T, the hidden-state
broadcast buffers, the fp32 partial input gradients and the extra warm-up forwards, each read off the placed
schedule the engine runs (core/vocab_split.vocab_pipeline); the last stage no longer counts the whole head, its
[N, V] log-softmax nor the loss backward's [N, V] scratch."""

from __future__ import annotations

import pytest
import torch

from asyncpp import job
from asyncpp.config import RunConfig
from asyncpp.core.memory import activation_bytes, vocab_held
from asyncpp.core.partition import vocab_shards_of
from asyncpp.core.vocab_split import run_vocab_split, vocab_placement
from asyncpp.pipeline.memory import vocab_actions
from asyncpp.schedules.actions import Op
from asyncpp.schedules.invariants import peak_in_flight
from model_zoo import get_model_config

M, MB, SEQ = 8, 2, 32
N = MB * SEQ  # tokens per microbatch


def vocab_cfg(pp: int, kind: str) -> RunConfig:
    return RunConfig.from_dict({"model": {"name": "tiny_dense"}, "parallel": {"pp": pp, "head": "vocab"},
                                "schedule": {"name": kind},
                                "train": {"num_microbatches": M, "micro_batch_size": MB, "seq_len": SEQ}})


def live_between(actions, opens, closes) -> int:
    """Most (step, microbatch) keys opened by an action in `opens` and not yet closed by one in `closes`."""
    live, peak = set(), 0
    for a in actions:
        if a.op in opens:
            live.add((a.step, a.microbatch))
        elif a.op in closes:
            live.discard((a.step, a.microbatch))
        peak = max(peak, len(live))
    return peak


@pytest.mark.parametrize("kind", ["2bw", "1f1b"])
@pytest.mark.parametrize("pp", [2, 4])
def test_held_buffers_follow_the_placed_schedule(pp, kind):
    model = get_model_config("tiny_dense")
    cfg = vocab_cfg(pp, kind)
    warmup = vocab_placement(kind, M, run_vocab_split(cfg, model)).warmup
    assert warmup >= 1  # the placement needs extra warm-up forwards here: the count below must include them
    for s in range(pp):
        actions = vocab_actions(cfg, model, s, pp)
        last = s == pp - 1
        assert any(a.op is Op.VOCAB_FORWARD for a in actions) and any(a.op is Op.VOCAB_BACKWARD for a in actions)
        # The warm-up: P - s microbatches in flight on 1F1B/2BW, `warmup` more with the head's S and T placed.
        assert peak_in_flight(actions) == min(M, pp - s + warmup)
        held = vocab_held(actions, last)
        assert held.passes == live_between(actions, {Op.VOCAB_FORWARD}, {Op.VOCAB_BACKWARD}) >= 1
        # A step's partial input gradients (stages but the last) and the last stage's sent hidden states wait
        # for UPDATE(t), which 2BW places before the first forward on x_{t+1} (two steps of microbatches
        # outstanding) and 1F1B at the end of its step (one).
        steps_held = 2 if kind == "2bw" else 1
        assert (held.hidden if last else held.input_grads) == steps_held * M
        # The other direction: received hidden states from S to T; the last stage's reduce until its B.
        if last:
            assert held.input_grads == live_between(actions, {Op.VOCAB_BACKWARD}, {Op.BACKWARD}) >= 1
        else:
            assert held.hidden == held.passes
        assert held.accumulators == steps_held  # 2BW: T of b_{t+1} runs before UPDATE_START(t)


def dry(overrides: list[str], tmp_path) -> list[dict]:
    cfg, model_cfg = job.resolve(job.compose(overrides + ["logging=disabled", f"out_dir={tmp_path}"]))
    return job.run_dry(cfg, model_cfg, echo=lambda line: None), cfg, model_cfg


def items(report: dict) -> dict[str, int]:
    return {i["name"]: i["bytes"] for i in report["memory"]["items"]}


def item(report: dict, prefix: str) -> tuple[str, int]:
    (found,) = [(n, b) for n, b in items(report).items() if n.startswith(prefix)]
    return found


def test_dry_run_of_a_two_stage_vocab_layout_counts_the_head_rows_and_its_buffers(tmp_path):
    base = ["model=tiny_dense", "+model.overrides.tie_embeddings=false", "parallel.pp=2", "dry_run=2",
            f"train.num_microbatches={M}", f"train.micro_batch_size={MB}", f"train.seq_len={SEQ}"]
    vocab, cfg, model = dry(base + ["parallel.head=vocab"], tmp_path / "vocab")
    last, _, _ = dry(base + ["parallel.head=last", "parallel.stage_layers=[2,2]"], tmp_path / "last")
    shards = vocab_shards_of(cfg, model)
    assert run_vocab_split(cfg, model).sizes == (2, 2)  # the same layers as the head=last run's
    V, h = model.vocab_size, model.hidden_size
    assert sum(shards) == V and all(0 < r < V for r in shards)  # really split
    warmup = vocab_placement(cfg.schedule.name, M, run_vocab_split(cfg, model)).warmup
    for s, (r, rows) in enumerate(zip(vocab, shards)):
        assert r["shards"]["lm_head.weight"]["shape"] == [rows, h]  # built on meta with the real shard shape
        held = vocab_held(vocab_actions(cfg, model, s, 2), s == 1)
        name, nbytes = item(r, "vocab head: fp32 logits")
        assert f"[{N}, {rows}]" in name and nbytes == held.passes * (4 * N * rows + 8 * N + 4 * 3 * 2 * N)
        name, nbytes = item(r, "vocab head: hidden-state broadcast buffers")
        assert f"[{N}, {h}] fp32" in name and nbytes == held.hidden * 4 * N * h
        name, nbytes = item(r, "vocab head: fp32 partial input gradients")
        assert nbytes == held.input_grads * 4 * N * h > 0
        name, nbytes = item(r, "vocab head: fp32 shard gradient accumulators")
        assert f"[{rows}, {h}]" in name and nbytes == held.accumulators * 4 * rows * h
        assert item(r, "activations")[0] == f"activations ({2 - s + warmup} microbatches in flight)"
    # The last stage: its rows instead of the whole head; no [N, V] log-softmax and no loss backward scratch.
    assert last[1]["shards"]["lm_head.weight"]["shape"] == [V, h] and "lm_head.weight" not in last[0]["shards"]
    assert vocab[1]["params"] - last[1]["params"] == (shards[1] - V) * h
    assert vocab[0]["params"] - last[0]["params"] == shards[0] * h
    assert not any(n.startswith("loss backward scratch") for n in items(vocab[1]))
    assert any(n.startswith("loss backward scratch") for n in items(last[1]))
    layers = range(2, 4)
    per_mb = {head: activation_bytes(model, layers, dtype=torch.float32, micro_batch_size=MB, seq_len=SEQ,
                                     first=False, last=True, head=head) for head in (True, False)}
    assert per_mb[True] - per_mb[False] == (4 * V + 8) * N  # the fp32 log-softmax and the labels
    in_flight = {"vocab": 1 + warmup, "last": 1}
    assert item(vocab[1], "activations")[1] == per_mb[False] * in_flight["vocab"]
    assert item(last[1], "activations")[1] == per_mb[True] * in_flight["last"]


def test_dry_run_of_a_tied_vocab_layout_counts_the_first_stage_rows_in_its_embedding(tmp_path):
    """Tied: the first stage's head rows are rows of its embedding (no parameter of their own), the later stages'
    are lm_head.weight of their rows; each stage's logits are [N, its rows]."""
    reports, cfg, model = dry(["model=tiny_dense", "parallel.pp=2", "dry_run=2", "parallel.head=vocab",
                               f"train.num_microbatches={M}", f"train.micro_batch_size={MB}",
                               f"train.seq_len={SEQ}"], tmp_path)
    assert model.tie_embeddings
    shards, V, h = vocab_shards_of(cfg, model), model.vocab_size, model.hidden_size
    assert "lm_head.weight" not in reports[0]["shards"] and reports[0]["shards"]["embed.weight"]["shape"] == [V, h]
    assert reports[1]["shards"]["lm_head.weight"]["shape"] == [shards[1], h]
    for r, rows in zip(reports, shards):
        assert f"[{N}, {rows}]" in item(r, "vocab head: fp32 logits")[0]
