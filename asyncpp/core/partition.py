"""Which pipeline stage owns which layer and parameter.

Works on any model with the model_zoo layout (`embed`, `layers`, `norm`, `lm_head`) without importing
model_zoo: the engine only needs the attribute names. The simulator uses the same map to give each
parameter its stage's delay, so both sides agree on the partition by construction.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def stage_sizes(num_layers: int, num_stages: int, sizes: Sequence[int] | None = None) -> list[int]:
    """Layers per stage: `sizes` if given (parallel.stage_layers), else an even split (an uneven one
    must be spelled out: the last stage also runs the norm and the LM head, so which stage gets the
    extra layers is a performance decision, not a default)."""
    if sizes is not None:
        if len(sizes) != num_stages or sum(sizes) != num_layers or min(sizes) < 0:
            raise ValueError(
                f"parallel.stage_layers={list(sizes)} must have parallel.pp={num_stages} non-negative entries "
                f"summing to the model's {num_layers} layers"
            )
        return list(sizes)
    if not 1 <= num_stages <= num_layers or num_layers % num_stages:
        raise ValueError(
            f"{num_layers} layers cannot be split evenly into {num_stages} stages; give parallel.stage_layers"
        )
    return [num_layers // num_stages] * num_stages


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
