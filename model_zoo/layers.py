"""Small building blocks: RMSNorm, rotary position embedding (RoPE), SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model_zoo.init import GlobalRNG, Initializer


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, with the statistics taken in float32 so bf16 activations stay stable."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32, scale in the activation dtype (the HF Llama order of operations).
        return F.rms_norm(x.float(), self.weight.shape, eps=self.eps).type_as(x) * self.weight

    def init_weights(self, init: Initializer | None = None) -> None:
        (init or GlobalRNG()).ones_(self.weight)


def check_seq_len(seq_len: int, max_seq_len: int) -> None:
    if seq_len > max_seq_len:
        raise ValueError(
            f"seq_len={seq_len} exceeds model.max_seq_len={max_seq_len}; shorten the sequences "
            f"(data.seq_len) or raise model.max_seq_len to at least {seq_len}."
        )


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions arange(T), computed on demand.

    Nothing is stored in a buffer: a model built on the meta device and materialised with
    to_empty() would otherwise carry garbage tables. A one-entry cache (not in state_dict)
    avoids recomputing the table for every microbatch of the same length.
    """

    def __init__(self, head_dim: int, theta: float, max_seq_len: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.max_seq_len = max_seq_len
        self._cache: tuple[tuple[int, torch.device], Tensor, Tensor] | None = None

    def forward(self, seq_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """Returns float32 (cos, sin), each [seq_len, head_dim] (the half-dim table repeated twice); head_dim
        here is the rotated width (rotary_dim under partial rotary)."""
        check_seq_len(seq_len, self.max_seq_len)
        key = (seq_len, device)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1], self._cache[2]
        half = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim
        inv_freq = 1.0 / (self.theta ** half)
        angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        self._cache = (key, cos, sin)
        return cos, sin


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (i, i + rotary_dim/2) of x [B, H, T, head_dim]; the HF Llama "rotate_half" layout,
    so HF SmolLM2 checkpoints load without permuting q/k weights. rotary_dim = cos.shape[-1]; channels
    past it pass through unrotated (partial rotary, HF Qwen3-Next's layout)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); all projections bias-free."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def init_weights(self, std: float, out_std: float, init: Initializer | None = None) -> None:
        init = init or GlobalRNG()
        init.normal_(self.gate_proj.weight, std)
        init.normal_(self.up_proj.weight, std)
        init.normal_(self.down_proj.weight, out_std)
