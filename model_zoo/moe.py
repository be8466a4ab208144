"""Mixture-of-experts MLP: softmax top-k router, stacked SwiGLU experts, optional gated shared expert,
and a Switch-style load-balancing loss whose gradient rides along with the activation.

Shapes: d = hidden_size, f = expert_ffn_hidden_size, E = num_experts, N = tokens in the microbatch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model_zoo.config import MoEConfig
from model_zoo.layers import SwiGLU


class AttachAuxLoss(torch.autograd.Function):
    """Identity on `x` in forward; in backward also seeds d(aux)/d(aux) = scale.

    This makes the aux loss part of whatever loss is back-propagated through `x`, so a pipeline
    stage that only ever receives dL/d(activation) from the next stage still trains its routers.
    """

    @staticmethod
    def forward(ctx, x: Tensor, aux: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


def load_balancing_loss(probs: Tensor, topk_idx: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """Switch loss E * sum_i f_i * P_i for probs [N, E] and topk_idx [N, k].

    f_i is the fraction of the N*k routed assignments that went to expert i (sums to 1, not
    differentiable) and P_i the mean router probability of expert i. A uniform router gives 1.0
    for any k. Returns (loss, tokens_per_expert [E]).
    """
    counts = torch.bincount(topk_idx.flatten(), minlength=num_experts)
    frac = counts.to(probs.dtype) / topk_idx.numel()
    return num_experts * torch.sum(frac * probs.mean(dim=0)), counts


class MoE(nn.Module):
    """[B, T, d] -> [B, T, d]. Expert weights are stacked 3-D parameters so an optimizer (Muon) can
    treat them as a batch of E matrices and an expert-parallel plan can shard dim 0."""

    def __init__(self, hidden_size: int, cfg: MoEConfig) -> None:
        super().__init__()
        E, f, d = cfg.num_experts, cfg.expert_ffn_hidden_size, hidden_size
        self.num_experts = E
        self.top_k = cfg.top_k
        self.normalize_topk = cfg.normalize_topk
        self.aux_loss_coef = cfg.aux_loss_coef
        # Factor on the aux-loss gradient: 1.0 counts the aux loss once per microbatch backward;
        # a trainer that scales each microbatch's LM loss by 1/m can set 1/m here to match.
        self.aux_grad_scale = 1.0
        self.router = nn.Linear(d, E, bias=False)
        self.w_gate = nn.Parameter(torch.empty(E, f, d))
        self.w_up = nn.Parameter(torch.empty(E, f, d))
        self.w_down = nn.Parameter(torch.empty(E, d, f))
        self.shared_expert: SwiGLU | None = None
        self.shared_gate: nn.Linear | None = None
        if cfg.shared_expert_ffn_hidden_size > 0:
            self.shared_expert = SwiGLU(d, cfg.shared_expert_ffn_hidden_size)
            # Qwen3-Next "shared expert trainable weight": a per-token scalar sigmoid gate.
            self.shared_gate = nn.Linear(d, 1, bias=False)
        # Logging only; detached, overwritten every forward.
        self.last_aux_loss: Tensor | None = None
        self.last_expert_load: Tensor | None = None

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [N, d] -> (probs [N, E] float32, topk_weight [N, k] float32, topk_idx [N, k])."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weight, idx = probs.topk(self.top_k, dim=-1)
        if self.normalize_topk:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        return probs, weight, idx

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        probs, weight, idx = self.route(x2)
        out = self.experts_reference(x2, weight, idx)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_gate(x2)) * self.shared_expert(x2)
        aux, counts = load_balancing_loss(probs, idx, self.num_experts)
        self.last_aux_loss = aux.detach()
        self.last_expert_load = counts.detach()
        if self.aux_loss_coef > 0 and torch.is_grad_enabled():
            out = AttachAuxLoss.apply(out, aux * self.aux_loss_coef, self.aux_grad_scale)
        return out.reshape(shape)

    def experts_reference(self, x: Tensor, weight: Tensor, idx: Tensor) -> Tensor:
        """Loop over experts that received tokens: gather, SwiGLU, scale by router weight, scatter-add.

        x [N, d], weight/idx [N, k] -> [N, d]. Correct everywhere, fast nowhere; the grouped-GEMM
        path must match it. unbind() (not w[e]) so backward writes each stacked grad once.
        """
        k = idx.shape[1]
        flat_idx = idx.flatten()
        order = torch.argsort(flat_idx, stable=True)
        token_of = torch.div(order, k, rounding_mode="floor")  # assignment j belongs to token j // k
        w_sorted = weight.flatten()[order].to(x.dtype)
        counts = torch.bincount(flat_idx, minlength=self.num_experts).tolist()  # host sync
        gates, ups, downs = self.w_gate.unbind(0), self.w_up.unbind(0), self.w_down.unbind(0)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = token_of[start:start + n]
            xe = x.index_select(0, tok)
            ye = F.linear(F.silu(F.linear(xe, gates[e])) * F.linear(xe, ups[e]), downs[e])
            out.index_add_(0, tok, ye * w_sorted[start:start + n, None])
            start += n
        return out

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.router.weight, mean=0.0, std=std)
        nn.init.normal_(self.w_gate, mean=0.0, std=std)
        nn.init.normal_(self.w_up, mean=0.0, std=std)
        nn.init.normal_(self.w_down, mean=0.0, std=out_std)
        if self.shared_expert is not None:
            self.shared_expert.init_weights(std, out_std)
            nn.init.normal_(self.shared_gate.weight, mean=0.0, std=std)

    def params_per_expert(self) -> int:
        return math.prod(self.w_gate.shape[1:]) + math.prod(self.w_up.shape[1:]) + math.prod(self.w_down.shape[1:])
