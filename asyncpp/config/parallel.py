"""parallel.*: the layout (pp, tp, ep, dp, the stage split, the head split) and its checks, Megatron's
divisibility rules among them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from asyncpp.config.base import ModelLimits, positive
from asyncpp.schedules.build import check_vocab_parallel
from asyncpp.schedules.registry import ScheduleKindError, kind_of
from asyncpp.typed import REMOVED, ConfigError

if TYPE_CHECKING:  # annotations only: run.py imports this module
    from asyncpp.config.run import RunConfig


TOKEN_SPLIT_REMOVED = ("the token head split was removed: the vocabulary-parallel head spreads the head over every "
                       "stage in every layout (dp, tp, the distributed optimizer) and measured as fast or faster "
                       "(docs/parallelism.md); use parallel.head=vocab, or auto (the cost model's choice)")
"""Why parallel.head=tokens and parallel.head_split_tokens are refused (issue 28 removed the token split)."""


@dataclass(kw_only=True)
class ParallelConfig:
    pp: int = 1
    """Pipeline stages. In a single process this is the number of stages the simulator models."""
    tp: int = 1
    ep: int = 1
    dp: int | None = None
    """Data-parallel replicas; None = world_size / (pp * tp) under torchrun, 1 in one process.
    In one process, dp > 1 simulates the replicas (m * dp microbatches per step)."""
    sequence_parallel: bool = False
    """With tp > 1: norms and residuals work on sequence shards (activation memory / tp); the TP
    regions all-gather their input and reduce-scatter their output instead of all-reducing it."""
    stage_layers: tuple[int, ...] | Literal["auto"] | None = None
    """Layers per pipeline stage, e.g. [3, 1] or [4, 0] (an explicit split may give a stage 0 layers: only the
    embedding, or only the norm, head and loss); `auto` (configs/parallel/default.yaml) picks the split whose
    slowest stage is cheapest under the cost model of asyncpp.core.layer_costs (the last stage also runs the
    LM head and the loss, the first the embedding; at least 1 layer per stage); None (a config built in
    Python without a split) = the near-even asyncpp.core.partition.default_split. Resolved by
    asyncpp.core.partition.stage_split, the same on every rank and in the simulator."""
    distributed_optimizer: bool = False
    """Megatron's --use-distributed-optimizer (ZeRO-1) over DP: each replica owns whole parameters, keeps
    their optimizer state and Error-Feedback buffer, receives their reduced gradient and broadcasts their
    new weights (asyncpp/optim/distributed.py, pipeline/sharded.py). Pipeline runs only; with dp=1 it is a
    no-op, as in Megatron. Not with the gradient corrections (staleness.dc_lambda, grad_ef_lambda)."""
    head: Literal["last", "vocab", "auto"] = field(default="last", metadata={REMOVED: {"tokens": TOKEN_SPLIT_REMOVED}})
    """Where the LM head and its loss run (docs/parallelism.md), the one key for it:
    - last: on the last stage;
    - vocab: its vocabulary spread over every stage, each holding rows sized with its layers by the cost model
      (asyncpp/core/vocab_split.py, pipeline/vocab_head.py), so a 128k-wide head no longer makes the last stage
      the pipeline's slowest; pp >= 2 (refused at one stage, where it would change nothing);
    - auto (configs/parallel/default.yaml): vocab where the cost model predicts it faster and the layout allows
      it, else last (asyncpp.core.partition.head_of). The simulator ignores it: the mathematics is the unsplit
      model's."""
    vocab_shards: tuple[int, ...] | None = None
    """With head=vocab: every stage's rows of the head, in stage order, summing to the vocabulary; None = the
    cost model's (sized together with stage_layers)."""
    vocab_placement: tuple[int, int] | None = None
    """With head=vocab: [warm-up, slack] of the head's S and T in the schedule (asyncpp.schedules.costmodel
    VocabPlacement: the extra warm-up forwards, and how many of its own S passes a stage runs between S(i) and
    T(i)); None = the cost model's choice. [2, 1] trades one more microbatch of activations on every stage for
    collectives that never make the stages wait in lock step (bench/peers.py measures both)."""
    embedding: Literal["first", "vocab"] = "first"
    """Where the input embedding lives (docs/parallelism.md):
    - first: whole on the first stage;
    - vocab (with head=vocab, pp >= 2): sharded by the head's rows, stage s holding embedding rows vocab_rows(s) too; each
      stage looks up the tokens in its rows, the partial embeddings are summed onto the first stage, and the first
      stage's embedding gradient is broadcast back (the E and G actions, pipeline/vocab_embedding.VocabEmbedding). The
      first stage no longer holds the whole [vocab, hidden] table, its gradient and optimizer state; a tied
      embedding's head and embedding rows are then one tensor on each stage (no cross-stage tied all-reduce).
      The paper layouts take it where the dry run's largest rank drops (configs/parallel/*.yaml)."""


DRY_RUN_MAX_RANKS = 65536
"""The largest dry_run=N: laying out 65536 ranks of tiny_dense takes ~40 s on a shared 2-core machine (the mesh's
process groups, one per data-parallel and pipeline slice, are created one by one on the fake backend)."""


def check_dry_run_size(cfg: RunConfig) -> None:
    """dry_run=N as a world size; first of all checks (RunConfig.validate), since the microbatch count is derived from
    the data-parallel size it implies."""
    if cfg.dry_run < 0:
        raise ConfigError(f"dry_run={cfg.dry_run} must be a world size (e.g. dry_run=8), or 0 to train")
    if cfg.dry_run > DRY_RUN_MAX_RANKS:
        raise ConfigError(f"dry_run={cfg.dry_run} ranks is more than a dry run lays out (at most {DRY_RUN_MAX_RANKS}: "
                          "it creates every process group of the mesh on the fake backend, minutes beyond that); "
                          f"give the job's real world size, at most {DRY_RUN_MAX_RANKS}")


def check_parallel(cfg: RunConfig, model: ModelLimits) -> None:
    p, m = cfg.parallel, cfg.train.num_microbatches
    if (cfg.dry_run_trace or cfg.dry_run_stage is not None) and not cfg.dry_run:
        key = "dry_run_trace=true" if cfg.dry_run_trace else f"dry_run_stage={cfg.dry_run_stage}"
        raise ConfigError(f"{key} traces a dry run's stage, but dry_run=0; add dry_run=N (the world size)")
    if cfg.dry_run_stage is not None and not 0 <= cfg.dry_run_stage < cfg.parallel.pp:
        raise ConfigError(f"dry_run_stage={cfg.dry_run_stage} is not a stage of parallel.pp={cfg.parallel.pp}; "
                          f"use 0..{cfg.parallel.pp - 1}, or leave it null for the largest")
    if cfg.dry_run_stage is not None and not cfg.dry_run_trace:
        raise ConfigError(f"dry_run_stage={cfg.dry_run_stage} picks the stage dry_run_trace traces, but "
                          "dry_run_trace=false; add dry_run_trace=true")
    n = cfg.dry_run_trace_microbatches
    if n is not None and not (cfg.dry_run_trace and 1 <= n <= m):
        raise ConfigError(f"dry_run_trace_microbatches={n} must be 1..train.num_microbatches={m} with "
                          f"dry_run_trace=true (dry_run_trace={str(cfg.dry_run_trace).lower()}); "
                          f"parallel.pp={p.pp} is enough to reach the steady state, or leave it null to trace m")
    for name in ("pp", "tp", "ep"):
        positive(f"parallel.{name}", getattr(p, name))
    if p.dp is not None:
        positive("parallel.dp", p.dp, "or leave it null to derive it from the world size")
    s = cfg.staleness
    if p.distributed_optimizer and (s.dc_lambda or s.grad_ef_lambda):
        raise ConfigError(
            f"parallel.distributed_optimizer=true with staleness.dc_lambda={s.dc_lambda}, staleness.grad_ef_lambda="
            f"{s.grad_ef_lambda}: the gradient corrections read every parameter's gradient, which the distributed "
            "optimizer leaves on its owner only; set both to 0 or parallel.distributed_optimizer=false")
    if p.sequence_parallel and p.tp == 1:  # megatron-core's ModelParallelConfig refuses it too
        raise ConfigError("parallel.sequence_parallel=true with parallel.tp=1: sequence parallelism splits the "
                          "sequence over the tensor-parallel ranks, and there is only one; set "
                          "parallel.sequence_parallel=false, or parallel.tp=2 (or more) to split it")
    if p.sequence_parallel and cfg.train.seq_len % p.tp:
        raise ConfigError(
            f"parallel.sequence_parallel=true splits the sequence over parallel.tp={p.tp} ranks, which does not "
            f"divide train.seq_len={cfg.train.seq_len}; use a multiple of {p.tp} or parallel.sequence_parallel=false"
        )
    if cfg.schedule.name == "pipedream" and p.pp < 2:
        raise ConfigError(
            f"schedule=pipedream with parallel.pp={p.pp}: its per-stage delays P-1-s depend on the number of "
            "stages, so say how many it models, e.g. parallel.pp=4 (one process simulates them)"
        )
    if p.stage_layers == "auto" and getattr(model, "hidden_size", None) is None:
        raise ConfigError(f"parallel.stage_layers=auto needs the model's shape to cost its layers (model "
                          f"'{model.name}' was given by its limits only); give the split, e.g. parallel.stage_layers=[3,1]")
    explicit = p.stage_layers not in (None, "auto")
    if explicit and (
        len(p.stage_layers) != p.pp or sum(p.stage_layers) != model.num_layers or min(p.stage_layers) < 0
    ):
        raise ConfigError(
            f"parallel.stage_layers={list(p.stage_layers)} must have parallel.pp={p.pp} non-negative entries "
            f"summing to the {model.num_layers} layers of model '{model.name}', or be auto (balanced by the "
            "cost model)"
        )
    if not explicit and p.pp > model.num_layers:
        raise ConfigError(
            f"parallel.pp={p.pp} is more stages than model '{model.name}' has layers ({model.num_layers}); "
            f"set parallel.pp<={model.num_layers}"
        )
    _check_microbatches_serve(cfg)
    try:  # the registry knows which (P, m) each kind serves (2bw: m >= P)
        kind_of(cfg.schedule.name).check(p.pp, m)
    except ScheduleKindError as e:
        raise ConfigError(str(e)) from None
    _check_vocab_head(cfg, model)


def _check_microbatches_serve(cfg: RunConfig) -> None:
    """2BW's m >= P, said in the global batch's terms: under Megatron's fixed global batch (the default) m is
    train.global_batch_size / (train.micro_batch_size x dp), so adding replicas can leave fewer than the stages."""
    p, t = cfg.parallel, cfg.train
    m, dp = t.num_microbatches, p.dp or 1
    if p.pp < 1 or m is None or m < 1 or kind_of(cfg.schedule.name).serves(p.pp, m):
        return
    raise ConfigError(
        f"schedule={cfg.schedule.name} needs at least parallel.pp={p.pp} microbatches per replica, got "
        f"train.num_microbatches={m} = train.global_batch_size={t.global_batch_size} / (train.micro_batch_size="
        f"{t.micro_batch_size} x dp={dp}): with fewer microbatches than stages two weight versions cannot cover the "
        f"in-flight work; raise train.global_batch_size to {p.pp * t.micro_batch_size * dp} (Megatron's "
        f"--global-batch-size) or, where train.num_microbatches is given instead, raise train.num_microbatches to "
        f"{p.pp}"
    )


def _check_vocab_head(cfg: RunConfig, model: ModelLimits) -> None:
    """parallel.head=vocab: the layouts it is proven in (tests/dist/test_vocab_parallel_pipeline.py) and the ones
    it refuses, each with its reason (the note of issue 28 lists them)."""
    p = cfg.parallel
    if p.head not in ("last", "vocab", "auto"):
        raise ConfigError(f"parallel.head={p.head!r} is not one of last, vocab, auto")
    # At one stage both would be accepted and do nothing (vocab_shards_of is None at pp=1): refuse them instead.
    if p.head == "vocab" and p.pp == 1:
        raise ConfigError("parallel.head=vocab spreads the LM head's vocabulary over the pipeline stages, but "
                          "parallel.pp=1 has one stage (with parallel.tp > 1 the head is already vocabulary-parallel "
                          "over the TP ranks); use parallel.head=last or auto, or parallel.pp >= 2")
    if p.embedding == "vocab" and p.pp == 1:
        raise ConfigError("parallel.embedding=vocab shards the input embedding over the pipeline stages by the "
                          "vocabulary-parallel head's rows, but parallel.pp=1 has one stage; use "
                          "parallel.embedding=first, or parallel.pp >= 2 with parallel.head=vocab")
    if p.vocab_shards is not None and p.head not in ("vocab", "auto"):
        raise ConfigError(f"parallel.vocab_shards={list(p.vocab_shards)} needs parallel.head=vocab; set it or leave "
                          "vocab_shards null")
    if p.vocab_placement is not None:
        pair = list(p.vocab_placement)
        if p.head not in ("vocab", "auto"):
            raise ConfigError(f"parallel.vocab_placement={pair} needs parallel.head=vocab; set it or leave "
                              "vocab_placement null")
        if len(pair) != 2 or pair[0] < 1 or pair[1] < 0:
            raise ConfigError(f"parallel.vocab_placement={pair} must be [warm-up, slack] with warm-up >= 1 (the extra "
                              "forwards before the first backward) and slack >= 0 (S passes between a stage's S and "
                              "T of a microbatch), e.g. [2, 1]; or null (the cost model's choice)")
    if p.embedding == "vocab" and p.head not in ("vocab", "auto"):
        raise ConfigError(f"parallel.embedding=vocab shards the embedding by the vocabulary-parallel head's rows, but "
                          f"parallel.head={p.head}; set parallel.head=vocab, or parallel.embedding=first")
    if p.embedding == "vocab" and p.tp > 1:
        raise ConfigError(f"parallel.embedding=vocab with parallel.tp={p.tp} is not supported yet (each stage's "
                          "embedding rows would be split again over TP; no equivalence test covers it); use "
                          "parallel.embedding=first with tp > 1")
    if p.head != "vocab":
        return
    try:
        check_vocab_parallel(cfg.schedule.name)
    except ValueError as e:
        raise ConfigError(f"parallel.head=vocab: {e}") from None
    if p.tp > 1 and getattr(model, "tie_embeddings", False):
        raise ConfigError(f"parallel.head=vocab with parallel.tp={p.tp} and the tied embedding of model "
                          f"'{model.name}' is not supported yet: a later stage's TP piece of the head is not the same "
                          "rows as the first stage's TP piece of the embedding, so their gradients would be summed "
                          "across TP ranks (no equivalence test covers it); use parallel.head=last with tp > 1, or "
                          "an untied model (model.tie_embeddings=false)")
    if p.vocab_shards is not None:
        rows = list(p.vocab_shards)
        if len(rows) != p.pp or min(rows) < 0 or sum(rows) != model.vocab_size or any(r % p.tp for r in rows):
            raise ConfigError(f"parallel.vocab_shards={rows} must have parallel.pp={p.pp} non-negative entries, each a "
                              f"multiple of parallel.tp={p.tp} (its TP ranks split a stage's rows equally), summing "
                              f"to model '{model.name}''s vocab_size={model.vocab_size}; or be null (the cost model's "
                              "shards)")


def check_tp_ep(cfg: RunConfig, model: ModelLimits) -> None:
    check_parallel_sizes(model, cfg.parallel.tp, cfg.parallel.ep)


def check_parallel_sizes(model: ModelLimits, tp: int, ep: int = 1) -> None:
    """Megatron's divisibility rules, the one copy of them (config validation and the TP plan both call
    it): a TP rank holds whole query heads, whole KV groups, whole GDN heads and an equal slice of the
    ffn, every expert's ffn and the vocabulary; an EP rank holds whole experts. Read with getattr:
    ModelLimits only promises what every caller can provide. Needs no process group."""
    heads = {k: getattr(model, k, None) for k in ("num_heads", "num_kv_heads")}
    common = math.gcd(*(v for v in heads.values() if v is not None))
    gdn, moe = getattr(model, "gdn", None), getattr(model, "moe", None)
    sizes = {
        **{key: (n, "whole heads", common) for key, n in heads.items()},
        "gdn.num_heads": (getattr(gdn, "num_heads", None) if "gdn" in getattr(model, "layer_types", ()) else None,
                          "whole heads", None),
        "vocab_size": (model.vocab_size, "an equal slice of the embedding and LM head rows", None),
        "ffn_hidden_size": (getattr(model, "ffn_hidden_size", None) if moe is None else None, "an equal slice", None),
    }
    if moe is not None:  # each TP rank holds a slice of every expert's (and the shared expert's) ffn
        sizes["moe.expert_ffn_hidden_size"] = (moe.expert_ffn_hidden_size, "an equal slice of every expert", None)
        sizes["moe.shared_expert_ffn_hidden_size"] = (moe.shared_expert_ffn_hidden_size, "an equal slice", None)
    for key, (n, holds, choices_of) in sizes.items():
        if n is not None and n % tp:
            raise ConfigError(
                f"model.{key}={n} is not divisible by parallel.tp={tp} (model '{model.name}': each "
                f"tensor-parallel rank holds {holds}); choose parallel.tp in {divisors(choices_of or n)}"
            )
    if ep > 1 and moe is None:
        raise ConfigError(f"parallel.ep={ep} but model '{model.name}' has no experts; set parallel.ep=1")
    if moe is not None and moe.num_experts % ep:
        raise ConfigError(
            f"parallel.ep={ep} does not divide the {moe.num_experts} experts of model '{model.name}'; "
            f"choose parallel.ep in {divisors(moe.num_experts)}"
        )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
