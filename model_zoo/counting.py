"""Parameter counts from a meta-device model: exact, and free of memory and init cost."""

from __future__ import annotations

from typing import NamedTuple

import torch

from model_zoo.config import ModelConfig
from model_zoo.transformer import CausalLM


class ParamCount(NamedTuple):
    total: int
    active: int


def count_parameters(cfg: ModelConfig) -> ParamCount:
    """Total and per-token active parameter counts.

    Convention: `total` counts every distinct parameter once (a tied LM head shares the embedding
    and is not counted twice). `active` is total minus the routed experts a token does not visit:
    (num_experts - top_k) experts' weights per MoE layer. Everything else counts as active: the
    embedding table, the LM head, attention / Gated DeltaNet, norms, routers, the shared expert and
    its gate. (Some papers leave embeddings out of "active"; we do not.)
    """
    with torch.device("meta"):
        model = CausalLM(cfg)
    total = sum(p.numel() for p in model.parameters())  # parameters() already de-duplicates ties
    idle = sum((m.num_experts - m.top_k) * m.params_per_expert() for m in model.moe_layers())
    return ParamCount(total=total, active=total - idle)
