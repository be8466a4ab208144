"""A vocabulary-parallel head, costed: the LM head's vocabulary sharded over all P pipeline stages, each stage's
shard sized together with its layers, and the communication it adds at a stated link bandwidth.

The mechanism (Yeung et al., 2024, "Balancing Pipeline Parallelism with Vocabulary Parallelism"): the last
stage applies the final norm and broadcasts the normed hidden states [mb, seq, hidden] to every stage; each
stage computes the logits of its vocabulary rows and their softmax statistics; the max, the sum of
exponentials and the target logit are all-reduced per token (asyncpp.parallel.vocab_parallel, two all-reduces:
the max, then the target logit and the sum together); each stage's backward gives its shard's weight gradient
and a partial input gradient, which are summed onto the last stage (a reduce). Per microbatch and stage:

    compute_s = layers_s + [s = 0] embedding + [s = P-1] final norm + v_s x head_vocab
    comm      = broadcast(N h a) + all_reduce(4 N) + all_reduce(8 N) + reduce(N h a)    (N tokens, a bytes)

With the input embedding sharded by the same rows (parallel.embedding=vocab), the first stage's embedding moves into
every stage's E and G actions (its per-token lookup on each, its table gradient with the rows), and comm gains a
reduce(N h a) of the partial lookups onto the first stage and a broadcast(N h a) of its input gradient.

Collective times are nccl-tests' bus-bandwidth forms: a (pipelined ring) broadcast or reduce moves the buffer
once over each rank's link, an all-reduce 2 (P-1)/P of it; plus a fixed latency per collective. Every stage
takes part in all four, so `comm` is the same on every stage.

How the communication meets the compute (`overlap`):
- "exposed": each stage's time is compute + comm. The collectives run on the compute stream, as the blocking
  building block does when the engine calls it inline; the pessimistic case.
- "hidden": each stage's time is max(compute, comm). The collectives run on a stream and link of their own
  and the head's passes of a microbatch are placed late enough that their chain (broadcast, logits, the
  statistics' all-reduce, the backward, the reduce) is finished by the time the last stage's backward needs
  the input gradient. asyncpp.schedules.costmodel.place_vocab_passes builds such a schedule (S and T actions,
  one or two more forwards of warm-up on every stage) and the event simulation confirms it: under 2BW the
  steady state has no bubble, and the throughput is bounded by each stage's compute and its link's occupancy.
  Not modelled: the collectives slowing the compute they overlap (shared SMs and memory bandwidth), and PP
  traffic sharing a NIC with DP's all-reduce.

The joint choice of the layer split and the shards (`plan_vocab_split`): for a given split with per-stage
costs A_s without the vocabulary, the best shards fill the stages like water, v_s = max(0, T - A_s) / head_vocab
with sum v_s = 1, and the slowest stage is max(T, max A_s). Since sum A_s is the same for every split, T is
the ideal (total / P) whenever no A_s exceeds it; so the split that minimizes max A_s (layer_split.balanced_split
with the head reduced to its final norm) is optimal for the pair. Exact up to the shards' rounding to `granule`
rows. Deterministic: every rank and the simulator agree without communicating.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from asyncpp.config import RunConfig
from asyncpp.core.layer_costs import FLOP_RATE, LayerCosts, layer_costs
from asyncpp.core.layer_split import balanced_split, stage_sizes
from asyncpp.schedules.actions import Action
from asyncpp.schedules.build import build_pipeline
from asyncpp.schedules.costmodel import (
    OpCosts,
    VocabPlacement,
    place_embedding_passes,
    place_vocab_passes,
    placed_vocab_pipeline,
    predict,
    steady_delays,
)


@dataclass(frozen=True)
class Link:
    """The pipeline ranks' interconnect as NCCL sees it: bus bandwidth (bytes/s) and latency per collective."""

    name: str
    bandwidth: float
    latency: float


LINKS = {
    # NVLink 4 inside an 8-GPU H100 node: nccl-tests all_reduce bus bandwidth ~360 GB/s at large messages.
    "nvlink": Link("nvlink", 360e9, 10e-6),
    # One 400 Gb/s InfiniBand NIC per GPU (pipeline stages on different nodes): ~50 GB/s, as bench/schedules.py.
    "ib": Link("ib", 50e9, 25e-6),
}
"""The two interconnect classes the cost model is stated at. A P=4 layout inside one node meets the first; a
layout with one stage per node (configs/parallel/hybrid_moe_10b_32gpu.yaml) the second."""

ACTIVATION_BYTES = 2
"""bf16 hidden states and input gradients on the wire (the mixed-precision default, docs/gpu.md)."""

OVERLAPS = ("exposed", "hidden")


@dataclass(frozen=True)
class VocabComm:
    """Seconds per microbatch of each collective the head adds, on every stage."""

    broadcast: float
    """The last stage's normed hidden states to every stage."""
    statistics: float
    """The all-reduces of the max, then of the target logit and the sum of exponentials (fp32, per token)."""
    gradient: float
    """The reduce of the head's partial input gradients onto the last stage."""
    embedding: float = 0.0
    """A sharded embedding (parallel.embedding=vocab): the reduce of the partial lookups onto the first stage and
    the broadcast of its input gradient back, [N, h] each."""

    @property
    def total(self) -> float:
        return self.broadcast + self.statistics + self.gradient + self.embedding


def vocab_comm_time(tokens: int, hidden: int, num_stages: int, link: Link,
                    activation_bytes: int = ACTIVATION_BYTES, embedding: bool = False) -> VocabComm:
    """The collectives of one microbatch of `tokens` tokens over `num_stages` pipeline ranks (none with one);
    `embedding`: with the input embedding sharded too."""
    if num_stages < 1 or link.bandwidth <= 0:
        raise ValueError(f"num_stages={num_stages} must be >= 1 and the {link.name} bandwidth {link.bandwidth} "
                         "bytes/s > 0")
    if num_stages == 1:
        return VocabComm(0.0, 0.0, 0.0)
    ring = 2 * (num_stages - 1) / num_stages
    hidden_bytes = tokens * hidden * activation_bytes
    broadcast = hidden_bytes / link.bandwidth + link.latency
    statistics = ring * tokens * 4 / link.bandwidth + ring * tokens * 8 / link.bandwidth + 2 * link.latency
    gradient = hidden_bytes / link.bandwidth + link.latency
    return VocabComm(broadcast, statistics, gradient, 2 * (hidden_bytes / link.bandwidth + link.latency) * embedding)


def comm_per_token(comm: VocabComm, tokens: int, device_type: str) -> float:
    """Communication seconds in the cost model's unit: FLOP-equivalents per token at the device's FLOP_RATE."""
    return comm.total * FLOP_RATE.get(device_type, FLOP_RATE["cpu"]) / tokens


@dataclass(frozen=True)
class VocabSplit:
    sizes: tuple[int, ...]
    """Layers per stage."""
    shards: tuple[int, ...]
    """Vocabulary rows per stage, in stage order (stage s holds rows [sum shards[:s], sum shards[:s+1]))."""
    compute: tuple[float, ...]
    """Each stage's compute, FLOP-equivalents per token: layers, embedding, final norm, its shard of the head."""
    head: tuple[float, ...]
    """The part of `compute` that is the stage's shard of the head (its S and T actions)."""
    comm: float
    """The head's communication per stage, FLOP-equivalents per token (see vocab_comm_time)."""
    overlap: str
    embed: tuple[float, ...] = ()
    """With a sharded embedding (parallel.embedding=vocab): the part of each stage's `compute` that is its E and G
    actions, the per-token lookup (every stage looks up every token, masked) and its rows' share of the dense table
    gradient; () when the embedding is whole on the first stage (its cost then in the first stage's body)."""
    embed_lookup: float = 0.0
    """Of that, each stage's E (the gather; G is the scatter-add and the table gradient)."""

    def _with_shards(self, shards: Sequence[int], costs: LayerCosts) -> VocabSplit:
        """The same split with the rows given by hand (parallel.vocab_shards)."""
        vocab = sum(shards)
        head = tuple(r / vocab * costs.head_vocab for r in shards)
        table = costs.embedding - costs.embedding_fixed
        embed = tuple(costs.embedding_fixed + r / vocab * table for r in shards) if self.embed else ()
        body = [c - h - e for c, h, e in zip(self.compute, self.head, self.embed or [0.0] * len(shards))]
        compute = tuple(b + h + e for b, h, e in zip(body, head, embed or [0.0] * len(shards)))
        return VocabSplit(self.sizes, tuple(shards), compute, head, self.comm, self.overlap, embed, self.embed_lookup)

    @property
    def stage_costs(self) -> list[float]:
        """Each stage's time per token under `overlap` (what the schedule simulator is given)."""
        if self.overlap == "hidden":
            return [max(c, self.comm) for c in self.compute]
        return [c + self.comm for c in self.compute]


def shard_rows(body: Sequence[float], head_vocab: float, vocab: int, granule: int = 128) -> list[int]:
    """Vocabulary rows per stage that equalize body_s + (rows_s / vocab) x head_vocab (water filling), in whole
    `granule`s (the last stage also takes the remainder below a granule). A stage whose body alone exceeds
    the level gets no rows."""
    if vocab < 1 or granule < 1:
        raise ValueError(f"vocab={vocab} and granule={granule} must be >= 1")
    n = len(body)
    units, rest = divmod(vocab, granule)
    if head_vocab <= 0:
        share = [1.0 / n] * n
    else:
        share = _water_fill([b / head_vocab for b in body])
    # Largest remainder: floor every stage's granules, then hand the leftovers to the stages that lost most;
    # ties to the later stage (deterministic).
    exact = [x * units for x in share]
    rows = [int(x) for x in exact]
    order = sorted(range(n), key=lambda s: (exact[s] - rows[s], s), reverse=True)
    for s in order[:units - sum(rows)]:
        rows[s] += 1
    out = [r * granule for r in rows]
    out[-1] += rest
    return out


def _water_fill(levels: Sequence[float]) -> list[float]:
    """x_s >= 0 with sum 1 minimizing max(levels_s + x_s): x_s = max(0, T - levels_s)."""
    ordered = sorted(levels)
    total, level = 0.0, 0.0
    for k, value in enumerate(ordered, start=1):
        total += value
        level = (total + 1.0) / k
        if k == len(ordered) or level <= ordered[k]:
            break
    return [max(0.0, level - v) for v in levels]


def plan_vocab_split(costs: LayerCosts, num_stages: int, vocab: int, *, comm: float = 0.0,
                     overlap: str = "exposed", sizes: Sequence[int] | None = None, equal_shards: bool = False,
                     granule: int = 128, embedding: bool = False) -> VocabSplit:
    """The layer split (given, or the one that minimizes the slowest stage without the head's vocabulary
    part) and each stage's vocabulary rows (water filling; `equal_shards`: vocab / P each, the comparison
    point). `comm`: the head's communication per stage in FLOP-equivalents per token (comm_per_token);
    it is the same on every stage, so it moves no row. `embedding`: the input embedding sharded by the same rows
    (parallel.embedding=vocab): its per-token lookup on every stage, its table gradient split with the rows, so a
    row costs the head's and the table's part together."""
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap={overlap!r}; choose one of {OVERLAPS}")
    body_costs = LayerCosts(costs.layers, 0.0 if embedding else costs.embedding, costs.head_fixed)
    if sizes is None:
        sizes = balanced_split(body_costs, num_stages)
    body = body_costs.stage_costs(list(sizes))
    table = costs.embedding - costs.embedding_fixed if embedding else 0.0
    lookup = [costs.embedding_fixed if embedding else 0.0] * num_stages
    if equal_shards:
        base, extra = divmod(vocab, num_stages)
        shards = [base + (s < extra) for s in range(num_stages)]
    else:
        shards = shard_rows([b + x for b, x in zip(body, lookup)], costs.head_vocab + table, vocab, granule)
    head = tuple(r / vocab * costs.head_vocab for r in shards)
    embed = tuple(x + r / vocab * table for x, r in zip(lookup, shards)) if embedding else ()
    compute = tuple(b + h + e for b, h, e in zip(body, head, embed or [0.0] * num_stages))
    return VocabSplit(tuple(sizes), tuple(shards), compute, head, comm, overlap, embed,
                      costs.embedding_fixed / 2 if embedding else 0.0)


def shard_granule(vocab: int, num_stages: int, tp: int = 1) -> int:
    """Rows per granule of the shards: 128 (a tensor-core tile) once the vocabulary is large enough that a granule
    is a small part of a stage's share, else 1 (the tiny test models); a multiple of tp, whose ranks split each
    stage's rows in equal chunks."""
    return math.lcm(128 if vocab >= 128 * 16 * num_stages else 1, tp)


def run_vocab_split(cfg: RunConfig, model) -> VocabSplit:
    """parallel.head=vocab resolved for `model` under run config `cfg`: the layer split (explicit, or `auto`'s
    chosen together with the shards) and every stage's rows (explicit parallel.vocab_shards, or the cost model's
    water filling at cfg.train's work shape). Deterministic: every rank derives the same."""
    p, t = cfg.parallel, cfg.train
    device_type = str(t.device).split(":")[0]
    costs = layer_costs(model, t.seq_len, t.micro_batch_size, device_type)
    sizes = None if p.stage_layers == "auto" else stage_sizes(model.num_layers, p.pp, p.stage_layers)
    embedding = getattr(p, "embedding", "first") == "vocab"
    split = plan_vocab_split(costs, p.pp, model.vocab_size, sizes=sizes,
                             granule=shard_granule(model.vocab_size, p.pp, p.tp), embedding=embedding)
    shards = p.vocab_shards
    if shards is None:
        return split
    return plan_vocab_split(costs, p.pp, model.vocab_size, sizes=split.sizes, embedding=embedding,
                            equal_shards=True)._with_shards(shards, costs)


def vocab_op_costs(split: VocabSplit) -> OpCosts:
    """The schedule's action costs of a vocabulary-parallel split (backward = 2 x forward, as everywhere in the
    cost model): the body's F and B, the shard's S and T, and with a sharded embedding its E (the gather) and G (the
    scatter-add and the rows' table gradient). The collectives are left out: they only move the placement where
    they are slow, and the engine runs them asynchronously."""
    embed = split.embed or (0.0,) * len(split.shards)
    body = [c - h - e for c, h, e in zip(split.compute, split.head, embed)]
    return OpCosts(forward=[b / 3 for b in body], backward=[2 * b / 3 for b in body],
                   vocab_forward=[h / 3 for h in split.head], vocab_backward=[2 * h / 3 for h in split.head],
                   embed_forward=split.embed_lookup, embed_backward=[e - split.embed_lookup for e in embed])


@cache
def vocab_placement(kind: str, num_microbatches: int, split: VocabSplit) -> VocabPlacement:
    """The warm-up and slack the head's passes are placed with (costmodel.VOCAB_PLACEMENTS: the first that is
    fastest in the cost model). Cached (a pure function of frozen values): the placements it tries cost seconds at
    P=16, and a dry run's memory plan asks once per stage."""
    return predict(kind, len(split.shards), num_microbatches, 4, vocab_op_costs(split),
                   vocab_parallel=True)["vocab_placement"]


def run_vocab_placement(cfg: RunConfig, split: VocabSplit) -> VocabPlacement:
    """parallel.vocab_placement resolved: the explicit [warm-up, slack] (train/preflight.py has checked it with
    validate_vocab_placement before anything is built), or the cost model's choice."""
    if cfg.parallel.vocab_placement is None:
        return vocab_placement(cfg.schedule.name, cfg.train.num_microbatches, split)
    return VocabPlacement(*cfg.parallel.vocab_placement)


def validate_vocab_placement(cfg: RunConfig, split: VocabSplit) -> None:
    """ScheduleError unless the run's placement gives a valid schedule at its pp and m (costmodel.
    placed_vocab_pipeline, as predict() checks each placement it tries)."""
    kind, P = cfg.schedule.name, len(split.shards)
    placed_vocab_pipeline(kind, cfg.train.num_microbatches, steady_delays(kind, P, 4), vocab_op_costs(split),
                          run_vocab_placement(cfg, split), bool(split.embed))


def vocab_pipeline(kind: str, num_microbatches: int, step_delays: Sequence[int], split: VocabSplit,
                   placement: VocabPlacement) -> list[list[Action]]:
    """Every stage's actions with the head's S and T placed (the same delays on every stage: the kinds that
    serve a vocabulary-parallel head give every stage one delay per step); with a sharded embedding (split.embed),
    its E and G placed into those (costmodel.place_embedding_passes)."""
    P = len(split.shards)
    skeleton = build_pipeline(kind, P, num_microbatches, [list(step_delays)] * P, vocab_warmup=placement.warmup)
    costs = vocab_op_costs(split)
    placed = place_vocab_passes(skeleton, costs, placement.slack)
    return place_embedding_passes(placed, costs) if split.embed else placed
