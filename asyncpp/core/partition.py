"""Which pipeline stage owns which layer and parameter.

Works on any model with the model_zoo layout (`embed`, `layers`, `norm`, `lm_head`) without importing
model_zoo: the engine only needs the attribute names. The simulator uses the same map to give each
parameter its stage's delay, so both sides agree on the partition by construction.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def default_split(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage when parallel.stage_layers is not given: as even as possible, the extra layers on
    the first stages (30 layers on 4 stages: [8, 8, 7, 7]). The last stage also runs the final norm, the LM
    head and the loss, so it is the one that should get fewer layers when they cannot all be equal.
    Invariant: sizes differ by at most one and are non-increasing."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"{num_layers} layers cannot fill {num_stages} stages (each needs at least one layer); "
                         f"set parallel.pp<={num_layers} or give parallel.stage_layers")
    base, extra = divmod(num_layers, num_stages)
    return [base + 1 if s < extra else base for s in range(num_stages)]


def stage_sizes(num_layers: int, num_stages: int, sizes: Sequence[int] | None = None) -> list[int]:
    """Layers per stage: `sizes` if given (parallel.stage_layers), else `default_split`."""
    if sizes is not None:
        if len(sizes) != num_stages or sum(sizes) != num_layers or min(sizes) < 0:
            raise ValueError(
                f"parallel.stage_layers={list(sizes)} must have parallel.pp={num_stages} non-negative entries "
                f"summing to the model's {num_layers} layers"
            )
        return list(sizes)
    return default_split(num_layers, num_stages)


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
