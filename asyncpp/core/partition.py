"""Which pipeline stage owns which layer and parameter.

Works on any model with the model_zoo layout (`embed`, `layers`, `norm`, `lm_head`) without importing
model_zoo: the engine only needs the attribute names. The simulator uses the same map to give each
parameter its stage's delay, so both sides agree on the partition by construction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import nn

from asyncpp.config import ConfigError, RunConfig
from asyncpp.core.layer_costs import LayerCosts
from asyncpp.core.layer_split import balanced_split, stage_sizes
from asyncpp.core.layout import Layout, may_spread


def suggest_split(sizes: Sequence[int], busy_s: Sequence[float], layer_weights: Sequence[float]) -> list[int]:
    """A split for the next run from this run's measured per-stage busy time.

    The cost model's relative layer weights are kept, but the time of one unit of them and the extra of the
    first stage (embedding) and of the last (head and loss) are refitted to the measurement: every stage's
    busy time is its layers' weights times one per-unit time, plus the embedding or the head. With two
    stages or more, the middle stages (or, at P=2, the first stage with the embedding counted as layers)
    give the unit; the last stage's excess over its layers is the head."""
    sizes, n = list(sizes), len(sizes)
    if n < 2 or n > len(layer_weights):
        # More stages than layers (layer-less stages, issue 44): no split gives every stage a layer, which is what
        # balanced_split's suggestions keep (its min_layers); the user's layout stands.
        return sizes
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, start + size))
        start += size
    weight = [sum(layer_weights[a:b]) for a, b in ranges]
    # Per-unit time from the stages that hold only layers (the middle ones), else from the first stage.
    inner = [s for s in range(1, n - 1) if weight[s] > 0] or ([0] if weight[0] > 0 else [])
    if not inner:
        return sizes
    unit = sum(busy_s[s] for s in inner) / sum(weight[s] for s in inner)
    embedding = max(0.0, busy_s[0] - unit * weight[0]) if inner != [0] else 0.0
    head = max(0.0, busy_s[-1] - unit * weight[-1])
    measured = LayerCosts(tuple(w * unit for w in layer_weights), embedding, head)
    return balanced_split(measured, n)


IMBALANCE = 1.1
"""A split is called imbalanced when its busiest stage works this much longer than the stages' mean."""


def stage_balance(sizes: Sequence[int], busy_s: Sequence[float], layer_weights: Sequence[float]) -> dict:
    """Why a pipeline has a bubble that its schedule does not explain: per-stage busy time, and, when the
    busiest stage works more than IMBALANCE x the mean, the split `suggest_split` proposes from it."""
    mean = sum(busy_s) / len(busy_s)
    out = {"stage_layers": list(sizes), "busy_s_per_stage": list(busy_s),
           "busy_max_over_mean": max(busy_s) / mean if mean > 0 else 1.0}
    if out["busy_max_over_mean"] > IMBALANCE:
        suggestion = suggest_split(sizes, busy_s, layer_weights)
        if suggestion != list(sizes):
            out["suggested_stage_layers"] = suggestion
    busy = " / ".join(f"{b:.2f}" for b in busy_s)
    out["stage_balance"] = (
        f"busy time per stage {busy} s with parallel.stage_layers={list(sizes)}"
        + (f": imbalanced (busiest {out['busy_max_over_mean']:.2f}x the mean), which is bubble no schedule removes; "
           f"try parallel.stage_layers={out['suggested_stage_layers']}" if "suggested_stage_layers" in out else ""))
    return out


def head_of(cfg: RunConfig, model) -> str:
    """Where the LM head runs: "last" or "vocab" (spread over every stage); parallel.head=auto resolved by the cost
    model (core/layout.py)."""
    return Layout.of(cfg, model).head


def with_head_resolved(cfg: RunConfig, model):
    """cfg with parallel.head=auto replaced by its choice (what a run records in its config). The options that only
    a spread head reads (parallel.embedding=vocab, vocab_shards, vocab_placement) are refused when auto keeps it on
    the last stage: they would be recorded in config.json and do nothing."""
    p = cfg.parallel
    head = head_of(cfg, model)
    idle = [f"{k}={list(v) if isinstance(v, tuple) else v}" for k, v in (
        ("parallel.embedding", p.embedding if p.embedding == "vocab" else None),
        ("parallel.vocab_shards", p.vocab_shards), ("parallel.vocab_placement", p.vocab_placement)) if v]
    if p.head == "auto" and head != "vocab" and idle:
        why = ("the cost model found no gain" if may_spread(cfg, model) else
               "the schedule, the layout or a tied embedding under tensor parallelism rules it out")
        raise ConfigError(f"{', '.join(idle)} would do nothing: parallel.head=auto keeps the head on the last stage "
                          f"here ({why}), and only a vocabulary-parallel head reads them. Set parallel.head=vocab, or "
                          "drop them (parallel.embedding=first)")
    return cfg.replace(parallel=dataclasses.replace(p, head=head))


def check_stages_hold_weights(cfg: RunConfig, model) -> None:
    """A multi-process pipeline needs a weight on every stage: a stage without layers (parallel.stage_layers with
    zeros, issue 44) runs when it still holds the first stage's embedding, the last stage's norm, or rows of a
    vocabulary-parallel head; one holding nothing at all has no optimizer to build (torch: "optimizer got an empty
    parameter list", found by tests/matrix's layer-less cases), so it is refused here, before any process group,
    for the dry run and the real run alike."""
    layout = Layout.of(cfg, model)
    sizes, rows, last = layout.sizes, layout.shards, len(layout.sizes) - 1
    empty = [s for s, n in enumerate(sizes) if n == 0 and s != last and not (s == 0 and not layout.embedding)
             and (rows is None or rows[s] == 0)]
    if empty:
        holds = "no vocabulary rows" if rows is not None else "the LM head is whole on the last stage"
        raise ConfigError(
            f"parallel.stage_layers={list(sizes)}: stage(s) {empty} would hold no weight at all (no layer, and "
            f"{holds}); give each a layer, or set parallel.head=vocab so that they hold rows of the LM head "
            "(parallel.vocab_shards without zero rows for them)")


def vocab_shards_of(cfg: RunConfig, model) -> tuple[int, ...] | None:
    """Every stage's rows of the head under parallel.head=vocab (None otherwise)."""
    return Layout.of(cfg, model).shards


def embedding_sharded(cfg: RunConfig, model) -> bool:
    """parallel.embedding=vocab in effect: the input embedding sharded by the vocabulary-parallel head's rows. Only
    with the head spread (parallel.head=auto resolving to last keeps the embedding on the first stage too)."""
    return Layout.of(cfg, model).embedding


def stage_split(cfg: RunConfig, model) -> list[int]:
    """cfg.parallel.stage_layers resolved for `model` (a model_zoo.ModelConfig) under `cfg` (a RunConfig): the
    explicit list; `auto`, the cost model's balanced split at cfg.train's work shape on cfg.train.device
    (asyncpp.core.layer_costs), with a vocabulary-parallel head the one sized together with its shards
    (core/layout.py)."""
    return list(Layout.of(cfg, model).sizes)


def stage_layer_ranges(num_layers: int, num_stages: int, sizes: Sequence[int] | None = None) -> list[range]:
    """Contiguous layer index ranges, one per stage."""
    ranges, start = [], 0
    for size in stage_sizes(num_layers, num_stages, sizes):
        ranges.append(range(start, start + size))
        start += size
    return ranges


def param_stages(model: nn.Module, num_stages: int, sizes: Sequence[int] | None = None) -> dict[str, int]:
    """Map each named parameter (tied ones once, under their first name) to its owning stage.

    Embedding -> stage 0; layers -> their stage; final norm and LM head -> last stage. A tied
    embedding/head weight is reported under `embed.*` and so belongs to stage 0; the last stage's
    copy follows it (semantics.md: both copies receive the same update).
    """
    layer_stage = {}
    for s, r in enumerate(stage_layer_ranges(len(model.layers), num_stages, sizes)):
        for i in r:
            layer_stage[i] = s
    out = {}
    for name, _ in model.named_parameters():
        head, _, rest = name.partition(".")
        if head == "embed":
            out[name] = 0
        elif head == "layers":
            out[name] = layer_stage[int(rest.split(".", 1)[0])]
        elif head in ("norm", "lm_head"):
            out[name] = num_stages - 1
        else:
            raise ValueError(f"parameter {name!r} is outside embed/layers/norm/lm_head; cannot place it")
    return out
