"""train.backend=te: transformer-engine modules in place of the local ones, on the same weights.

Swapped (parameter names kept: `layers.3.mixer.q_proj.weight` stays that):
* nn.Linear projections of attention, Gated DeltaNet (q/k/v/g/o) and dense/shared-expert SwiGLUs, and an
  untied LM head -> te.Linear (cuBLASLt GEMMs; FP8-capable later without touching the model);
* model_zoo RMSNorm -> te.RMSNorm;
* the attention core (SDPA) -> te.DotProductAttention (cuDNN/flash fused attention, causal, GQA), in a
  TEAttention that keeps the local projections' names and the local rotary embedding.
Kept local: the tied LM head (swapping it would untie it from the embedding), GDN's tiny a/b gate
projections and convolutions, the router and the stacked expert weights (MoE has its own grouped GEMM,
torch._grouped_mm, in model_zoo/moe.py; TE's GroupedLinear wants one Parameter per expert, which would
change the checkpoint layout), LayerNormLinear (fusing a norm into the next projection(s) would merge
Parameters that are separate here; pending a name-preserving wrapper).

`te` is transformer_engine.pytorch, passed in so that the swap logic can be exercised on the CPU with a
stand-in (tests/unit/test_backends.py); the real comparison is tests/gpu/test_gpu_backends.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from model_zoo.attention import Attention, project_out, project_qkv
from model_zoo.gated_deltanet import GatedDeltaNet
from model_zoo.layers import RMSNorm, SwiGLU

_GDN_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj")


class TEAttention(nn.Module):
    """Attention with te.DotProductAttention as its core; same submodule names as model_zoo Attention."""

    def __init__(self, local: Attention, te: Any) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = local.num_heads, local.num_kv_heads, local.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = local.q_proj, local.k_proj, local.v_proj, local.o_proj
        # The optional q/k norms and output gate (None when off), so project_qkv/project_out compute what
        # the local layer computes.
        self.q_norm, self.k_norm, self.gate_proj = local.q_norm, local.k_norm, local.gate_proj
        self.rotary = local.rotary
        # Causal mask inside the kernel; softmax scale defaults to 1/sqrt(head_dim), as SDPA's.
        self.core = te.DotProductAttention(
            self.num_heads, self.head_dim, num_gqa_groups=self.num_kv_heads, attention_dropout=0.0,
            qkv_format="bshd", attn_mask_type="causal",
        )

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        # The local layer's q, k, v in [B, H, T, hd]; TE takes [B, T, H, hd].
        q, k, v = project_qkv(self, x)
        out = self.core(*(y.transpose(1, 2).contiguous() for y in (q, k, v)))
        return project_out(self, out.reshape(b, t, self.num_heads * self.head_dim), x)


@torch.no_grad()
def te_linear(local: nn.Linear, te: Any) -> nn.Module:
    new = te.Linear(local.in_features, local.out_features, bias=local.bias is not None,
                    params_dtype=local.weight.dtype, device=local.weight.device)
    new.weight.copy_(local.weight)
    if local.bias is not None:
        new.bias.copy_(local.bias)
    return new


@torch.no_grad()
def te_rms_norm(local: RMSNorm, te: Any) -> nn.Module:
    new = te.RMSNorm(local.weight.numel(), eps=local.eps, params_dtype=local.weight.dtype,
                     device=local.weight.device)
    new.weight.copy_(local.weight)
    return new


def _swap_linears(module: nn.Module, names: tuple[str, ...], te: Any) -> int:
    for name in names:
        setattr(module, name, te_linear(getattr(module, name), te))
    return len(names)


def swap_to_te(model: nn.Module, te: Any) -> dict[str, int]:
    """Replace local modules by TE ones in place (see module docstring); returns counts per kind."""
    counts = {"linear": 0, "rmsnorm": 0, "attention": 0}
    replacements: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in list(model.modules()):
        for attr, child in list(parent.named_children()):
            if isinstance(child, Attention):
                gate = ("gate_proj",) if child.gate_proj is not None else ()
                counts["linear"] += _swap_linears(child, ("q_proj", "k_proj", "v_proj", "o_proj", *gate), te)
                replacements.append((parent, attr, TEAttention(child, te)))
                counts["attention"] += 1
            elif isinstance(child, GatedDeltaNet):
                counts["linear"] += _swap_linears(child, _GDN_PROJECTIONS, te)
            elif isinstance(child, SwiGLU):
                counts["linear"] += _swap_linears(child, ("gate_proj", "up_proj", "down_proj"), te)
            elif isinstance(child, RMSNorm) and not isinstance(parent, Attention):
                # (q/k norms stay local: the TEAttention built above already holds them.)
                replacements.append((parent, attr, te_rms_norm(child, te)))
                counts["rmsnorm"] += 1
    for parent, attr, new in replacements:
        setattr(parent, attr, new)
    head, embed = getattr(model, "lm_head", None), getattr(model, "embed", None)
    if isinstance(head, nn.Linear) and not (embed is not None and head.weight is embed.weight):
        model.lm_head = te_linear(head, te)
        counts["linear"] += 1
    return counts
