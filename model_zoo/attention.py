"""Causal grouped-query attention with RoPE, on top of F.scaled_dot_product_attention.

Three options, all off by default (the paper's configs; the model and its checkpoints are then exactly the
plain Llama-style attention), that make the layer Qwen3-MoE's or Qwen3-Next's (docs/hf.md):
  * qk_norm: RMSNorm over each head's q and k (one weight [head_dim] shared by all heads), before RoPE;
  * output_gate: out * sigmoid(gate_proj(x)) per channel before o_proj (Qwen3-Next's gated attention);
  * rotary_dim < head_dim: RoPE on the first rotary_dim channels of each head only (partial rotary).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model_zoo.init import GlobalRNG, Initializer
from model_zoo.layers import RMSNorm, RotaryEmbedding, apply_rotary


class Attention(nn.Module):
    """[B, T, hidden] -> [B, T, hidden]. num_heads query heads share num_kv_heads K/V heads (GQA).

    Projections are separate bias-free Linears (q, k, v, o, and the optional gate) so a tensor-parallel
    plan can shard q/k/v/gate column-wise and o row-wise by name, and HF checkpoints map by name (Qwen3-Next
    interleaves q and gate per head in one q_proj; tools/hf.py splits it).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope_theta: float, max_seq_len: int, *, qk_norm: bool = False, output_gate: bool = False,
                 rotary_dim: int | None = None, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        # Created only when enabled, so a model without them keeps its state_dict keys and RNG draws.
        # Per head: a TP shard holds whole heads, so the norms stay local and the gate shards like q.
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.gate_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False) if output_gate else None
        self.rotary = RotaryEmbedding(head_dim if rotary_dim is None else rotary_dim, rope_theta, max_seq_len)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        q, k, v = project_qkv(self, x)
        gqa = self.num_heads != self.num_kv_heads
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return project_out(self, out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim), x)

    def init_weights(self, std: float, out_std: float, init: Initializer | None = None) -> None:
        init = init or GlobalRNG()
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            init.normal_(proj.weight, std)
        init.normal_(self.o_proj.weight, out_std)
        # The options exist (and draw) only when enabled: a model without them initializes as before.
        if self.gate_proj is not None:
            init.normal_(self.gate_proj.weight, std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.init_weights(init)


def project_qkv(attn: nn.Module, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x [B, T, hidden] -> rotated q [B, H, T, hd], k and v [B, Hkv, T, hd] (the layout SDPA expects).

    A function of the module's projections, norms and rotary, so transformer-engine's attention
    (model_zoo/backends/te.py), which keeps the same submodules, computes the same q, k, v."""
    B, T, _ = x.shape
    cos, sin = attn.rotary(T, x.device)
    q = attn.q_proj(x).view(B, T, attn.num_heads, attn.head_dim)
    k = attn.k_proj(x).view(B, T, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None:  # per head, before RoPE (Qwen3)
        q, k = attn.q_norm(q), attn.k_norm(k)
    v = attn.v_proj(x).view(B, T, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    return apply_rotary(q.transpose(1, 2), cos, sin), apply_rotary(k.transpose(1, 2), cos, sin), v


def project_out(attn: nn.Module, out: Tensor, x: Tensor) -> Tensor:
    """The attention output out [B, T, H*hd] -> o_proj(out), gated by sigmoid(gate_proj(x)) when enabled."""
    if attn.gate_proj is not None:
        out = out * torch.sigmoid(attn.gate_proj(x))
    return attn.o_proj(out)
