"""Causal grouped-query attention with RoPE, on top of F.scaled_dot_product_attention."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from model_zoo.init import GlobalRNG, Initializer
from model_zoo.layers import RotaryEmbedding, apply_rotary


class Attention(nn.Module):
    """[B, T, hidden] -> [B, T, hidden]. num_heads query heads share num_kv_heads K/V heads (GQA).

    Projections are separate bias-free Linears (q, k, v, o) so a tensor-parallel plan can shard
    q/k/v column-wise and o row-wise by name, and HF Llama checkpoints map one to one.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope_theta: float, max_seq_len: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.rotary = RotaryEmbedding(head_dim, rope_theta, max_seq_len)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        cos, sin = self.rotary(T, x.device)
        # [B, T, H*hd] -> [B, H, T, hd], the layout SDPA expects.
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        gqa = self.num_heads != self.num_kv_heads
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

    def init_weights(self, std: float, out_std: float, init: Initializer | None = None) -> None:
        init = init or GlobalRNG()
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            init.normal_(proj.weight, std)
        init.normal_(self.o_proj.weight, out_std)
