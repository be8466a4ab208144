"""Which pipeline stage owns which layer and parameter.

Works on any model with the model_zoo layout (`embed`, `layers`, `norm`, `lm_head`) without importing
model_zoo: the engine only needs the attribute names. The simulator uses the same map to give each
parameter its stage's delay, so both sides agree on the partition by construction.
"""

from __future__ import annotations

from torch import nn


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous, as-even-as-possible split; earlier stages take the remainder.

    The last stage also runs the norm and the LM head, so it is the one that should not get an
    extra layer.
    """
    if not 1 <= num_stages <= num_layers:
        raise ValueError(
            f"num_stages={num_stages} must be in [1, num_layers={num_layers}]; lower parallel.pp"
        )
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def param_stages(model: nn.Module, num_stages: int) -> dict[str, int]:
    """Map each named parameter (tied ones once, under their first name) to its owning stage.

    Embedding -> stage 0; layers -> their stage; final norm and LM head -> last stage. A tied
    embedding/head weight is reported under `embed.*` and so belongs to stage 0; the last stage's
    copy follows it (semantics.md: both copies receive the same update).
    """
    layer_stage = {}
    for s, r in enumerate(stage_layer_ranges(len(model.layers), num_stages)):
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
