"""Gated DeltaNet (Yang et al., arXiv 2412.06464), the linear-attention layer of Qwen3-Next, in PyTorch.

The delta rule itself, its conventions and its three PyTorch forms live in model_zoo/delta_rule.py. Which form a
layer runs is `GatedDeltaNet.kernel` (see `_delta_rule`): on CUDA with bf16/fp16 activations
flash-linear-attention's fused kernel (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, same argument order
and semantics) where it passed its check at the layer's shape (model_zoo/backends/fla_check.py), else the batched
PyTorch form; off CUDA the chunk-loop form, the CPU's tested default.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model_zoo.backends.fla_check import FLA_CHECKS, FlaChecks
from model_zoo.delta_rule import (
    batched_chunk_gated_delta_rule,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from model_zoo.init import GlobalRNG, Initializer

__all__ = [
    "GatedDeltaNet",
    "Kernel",
    "batched_chunk_gated_delta_rule",
    "chunk_gated_delta_rule",
    "delta_rule_form",
    "form_name",
    "recurrent_gated_delta_rule",
]

Kernel = Literal["auto", "torch", "batched"]
"""GatedDeltaNet.kernel: "auto" (FLA where checked at the shape, else "batched" on CUDA and "torch" elsewhere),
"torch" (the chunk-loop form everywhere: the reference a GPU test compares against), "batched" (everywhere)."""


def _upcast(x: Tensor) -> Tensor:
    """At least fp32, but never lower fp64 (the fp64 tests compare the layer at 1e-10)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def delta_rule_form(kernel: Kernel, device: torch.device, act: torch.dtype, shape: tuple[int, int, int, int],
                    checks: FlaChecks = FLA_CHECKS) -> Callable:
    """The delta rule's form for a layer with `kernel` on `device` with activations `act`, at shape (T, H, Dk, Dv):
    FLA's kernel where "auto" allows it and it passed its check at the shape, else the batched form on CUDA (a few
    dozen kernels plus one per chunk each way, instead of ~36 per chunk: bench/op_counts.py) and the chunk-loop
    form elsewhere (the CPU's default, unchanged)."""
    if kernel not in ("auto", "torch", "batched"):
        raise ValueError(f"GatedDeltaNet.kernel={kernel!r}: expected 'auto', 'torch' or 'batched'")
    if kernel == "auto" and device.type == "cuda" and act in (torch.bfloat16, torch.float16):
        fused = checks.kernel_for(*shape, act, device)
        if fused is not None:
            return fused
    if kernel == "batched" or (kernel == "auto" and device.type == "cuda"):
        return batched_chunk_gated_delta_rule
    return chunk_gated_delta_rule


def form_name(form: Callable) -> str:
    """The name a bench row and the step-time model give a form: "torch" (the chunk loop), "batched", "fla"."""
    if form is chunk_gated_delta_rule:
        return "torch"
    return "batched" if form is batched_chunk_gated_delta_rule else "fla"


class GatedDeltaNet(nn.Module):
    """Qwen3-Next / FLA-style Gated DeltaNet token mixer: [B, T, hidden] -> [B, T, hidden].

    x -> q,k,v projections -> causal depthwise conv + SiLU -> L2-normalised q,k per head;
    beta = sigmoid(x W_b), g = -exp(A_log) * softplus(x W_a + dt_bias) per head;
    o = chunk_gated_delta_rule(...) -> RMSNorm per head * silu(x W_gate) -> o_proj.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_size: int = 4,
        norm_eps: float = 1e-5,
        chunk_size: int = 64,
        fla_l2norm: bool = False,
    ) -> None:
        super().__init__()
        self.fla_l2norm = fla_l2norm  # GDNConfig.fla_l2norm
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.conv_size, self.norm_eps, self.chunk_size = conv_size, norm_eps, chunk_size
        key_dim, value_dim = num_heads * head_k_dim, num_heads * head_v_dim

        self.q_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, value_dim, bias=False)
        self.a_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.g_proj = nn.Linear(hidden_size, value_dim, bias=False)
        self.o_proj = nn.Linear(value_dim, hidden_size, bias=False)
        # Depthwise (groups == channels); causality comes from left padding in _causal_conv.
        self.conv_q = nn.Conv1d(key_dim, key_dim, conv_size, groups=key_dim, bias=False)
        self.conv_k = nn.Conv1d(key_dim, key_dim, conv_size, groups=key_dim, bias=False)
        self.conv_v = nn.Conv1d(value_dim, value_dim, conv_size, groups=value_dim, bias=False)
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        # Shared over heads (weight [Dv]) as in FLA's FusedRMSNormGated; applied per head in _gated_norm.
        self.o_norm = nn.RMSNorm(head_v_dim, eps=norm_eps, elementwise_affine=True)
        self.kernel: Kernel = "auto"  # which form of the delta rule runs: see Kernel and _delta_rule
        # A usable default so the module is never left with torch.empty garbage; model builders call
        # reset_parameters again with the configured std. Only RNG-driven in-place ops: fine on meta.
        self.reset_parameters(std=0.02)

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float | None = None, init: Initializer | None = None) -> None:
        """Linear weights ~ N(0, std); o_proj ~ N(0, out_std), default std.

        o_proj writes into the residual stream, so builders usually pass out_std = std / sqrt(2 * n_layers)
        (GPT-2 / Megatron scaled init) to keep the residual variance from growing with depth; this layer
        does not know the depth, hence the argument.
        """
        init = init or GlobalRNG()
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.a_proj, self.b_proj, self.g_proj):
            init.normal_(lin.weight, std)
        init.normal_(self.o_proj.weight, std if out_std is None else out_std)
        # PyTorch's Conv1d default (kaiming-uniform, a=sqrt(5)), as FLA / HF Qwen3-Next keep it:
        # U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = in_channels / groups * kernel = conv_size (depthwise).
        bound = 1.0 / math.sqrt(self.conv_size)
        for conv in (self.conv_q, self.conv_k, self.conv_v):
            init.uniform_(conv.weight, -bound, bound)
        # Mamba2 / FLA init: decay rate A ~ U[1, 16] stored as log; step dt log-uniform in
        # [1e-3, 1e-1] (floored at 1e-4) stored through the inverse softplus, so that
        # softplus(dt_bias) == dt at init and g = -A * dt spans slow and fast forgetting heads.
        # Elementwise transforms after the draw: they commute with any slice (model_zoo/init.py).
        init.uniform_(self.A_log, 1.0, 16.0)
        self.A_log.log_()
        init.uniform_(self.dt_bias, math.log(1e-3), math.log(1e-1))
        dt = self.dt_bias.exp().clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        init.ones_(self.o_norm.weight)

    def _causal_conv(self, conv: nn.Conv1d, x: Tensor) -> Tensor:
        """[B, T, C] -> [B, T, C]; left-pad by K-1 so position t sees only t-K+1..t."""
        x = F.pad(x.transpose(1, 2), (self.conv_size - 1, 0))
        return F.silu(conv(x)).transpose(1, 2)

    def _l2norm(self, x: Tensor) -> Tensor:
        if self.fla_l2norm:  # FLA's / HF Qwen3-Next's form (eps inside the root)
            return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)
        return F.normalize(x, p=2.0, dim=-1, eps=1e-6)

    def _gated_norm(self, o: Tensor, gate: Tensor) -> Tensor:
        # In fp32: o comes from a long accumulation and the norm divides by its RMS.
        w = _upcast(self.o_norm.weight)
        return F.rms_norm(_upcast(o), (self.head_v_dim,), w, self.norm_eps) * F.silu(_upcast(gate))

    def form_at(self, seq_len: int, act: torch.dtype, device: torch.device) -> str:
        """The form this layer runs at `seq_len` with activations `act` on `device`: "torch", "batched" or "fla"
        (what a bench row records next to its time, so the step-time model traces the same kernels)."""
        shape = (seq_len, self.num_heads, self.head_k_dim, self.head_v_dim)
        return form_name(delta_rule_form(self.kernel, device, act, shape))

    def _delta_rule(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, act: torch.dtype) -> Tensor:
        """o [B, T, H, Dv], by the form `delta_rule_form` picks. FLA takes q/k/v in the activation dtype (it
        accumulates in fp32 inside; it has no fp32-input guarantee across versions, hence bf16/fp16 only), g in
        log space and beta as fp32, the same [B, T, H, *] layout and default scale Dk**-0.5. Its chunk size is
        fixed (64); chunking changes only the rounding, not the result."""
        form = delta_rule_form(self.kernel, q.device, act, (q.shape[1], *q.shape[2:], v.shape[-1]))
        if form is batched_chunk_gated_delta_rule or form is chunk_gated_delta_rule:
            return form(q, k, v, g, beta, chunk_size=self.chunk_size)[0]
        return form(q.to(act), k.to(act), v.to(act), g, beta, output_final_state=False)[0]

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        h, dk, dv = self.num_heads, self.head_k_dim, self.head_v_dim
        q = self._causal_conv(self.conv_q, self.q_proj(x)).reshape(b, t, h, dk)
        k = self._causal_conv(self.conv_k, self.k_proj(x)).reshape(b, t, h, dk)
        v = _upcast(self._causal_conv(self.conv_v, self.v_proj(x)).reshape(b, t, h, dv))
        # q, k, v in fp32 so o stays fp32 through the norm; cast back to x's dtype only before o_proj.
        # L2-normalised keys keep the delta-rule transition (I - beta k k^T) a contraction (beta < 1).
        q, k = self._l2norm(_upcast(q)), self._l2norm(_upcast(k))
        beta = _upcast(self.b_proj(x)).sigmoid()
        g = -_upcast(self.A_log).exp() * F.softplus(_upcast(self.a_proj(x)) + _upcast(self.dt_bias))
        o = self._delta_rule(q, k, v, g, beta, x.dtype)
        o = self._gated_norm(o, self.g_proj(x).reshape(b, t, h, dv)).to(x.dtype)
        return self.o_proj(o.reshape(b, t, h * dv))
