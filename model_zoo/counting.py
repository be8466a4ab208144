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


# ---- FLOPs: the one count (the training log's TFLOP/s and MFU, bench/gpu.py, and the matmul part of the
#      pipeline's cost model, asyncpp/core/layer_costs.py) ----------------------------------------------------
#
# FLOPs per token of a training step (forward + backward = 3 x forward):
#   6 N              N = parameters a token multiplies in matmuls (q/k/v/o, GDN projections and convolutions,
#                    MLP/shared expert, router, top_k of the E experts, the LM head; not the embedding lookup);
#   + 6 T H hd       per attention layer (causal QK^T and AV, T/2 keys on average, 2 FLOPs per MAC);
#   + 3 H [6 Dk Dv + C (5 Dk + 3 Dv)]   per GDN layer (the chunked form's state and intra-chunk matmuls).
# The usual model-FLOPs convention (Chowdhery et al. 2022): recomputation and padding do not count.

def matmul_params_per_token(cfg: ModelConfig, layers: range, head: bool) -> float:
    """N of the 6N rule for these layers (+ the LM head)."""
    h, n = cfg.hidden_size, 0.0
    for i in layers:
        if cfg.layer_types[i] == "attn":
            n += h * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
            if cfg.attn_output_gate:  # gate_proj: hidden -> heads x head_dim, like q_proj
                n += h * cfg.head_dim * cfg.num_heads
        else:
            g = cfg.gdn
            hk, hv = g.num_heads * g.head_k_dim, g.num_heads * g.head_v_dim
            n += h * (2 * hk + 3 * hv + 2 * g.num_heads) + (2 * hk + hv) * g.conv_size
        if cfg.moe is None:
            n += 3 * h * cfg.ffn_hidden_size
        else:
            m = cfg.moe
            n += h * m.num_experts + m.top_k * 3 * h * m.expert_ffn_hidden_size
            if m.shared_expert_ffn_hidden_size:
                n += 3 * h * m.shared_expert_ffn_hidden_size + h
    return n + (h * cfg.vocab_size if head else 0)


def layer_flops_per_token(cfg: ModelConfig, i: int, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token of layer `i`: 6 x its matmul parameters, plus attention's
    scores (T/2 keys on average) or Gated DeltaNet's chunked recurrence."""
    total = 6 * matmul_params_per_token(cfg, range(i, i + 1), head=False)
    if cfg.layer_types[i] == "attn":
        return total + 6 * seq_len * cfg.num_heads * cfg.head_dim
    g = cfg.gdn
    c = min(g.chunk_size, seq_len)
    return total + 3 * g.num_heads * (6 * g.head_k_dim * g.head_v_dim + c * (5 * g.head_k_dim + 3 * g.head_v_dim))


def flops_per_token(cfg: ModelConfig, seq_len: int, layers: range | None = None, head: bool = True) -> float:
    """Training FLOPs (forward + backward) per token of `layers` (default: all) and, with `head`, the LM head."""
    layers = range(cfg.num_layers) if layers is None else layers
    head_flops = 6 * cfg.hidden_size * cfg.vocab_size if head else 0.0
    return sum(layer_flops_per_token(cfg, i, seq_len) for i in layers) + head_flops
