"""Gated DeltaNet (Yang et al., arXiv 2412.06464), the linear-attention layer of Qwen3-Next, in pure PyTorch.

Conventions shared by both functions below:

* ``g`` is the *log* of the per-step multiplicative state decay, so ``alpha_t = exp(g_t)`` and ``g_t <= 0``.
* ``beta`` in (0, 1) is the delta-rule write strength.
* State ``S`` is ``[B, H, Dk, Dv]``. One step is::

      S   = exp(g_t) * S
      S   = S + beta_t * k_t (v_t - S^T k_t)^T
      o_t = S^T (q_t * Dk**-0.5)

  i.e. q is scaled by ``Dk**-0.5`` *inside* the functions (callers pass unscaled q), exactly like the
  default ``scale`` of flash-linear-attention's kernels.
* Inputs below fp32 are computed in fp32; ``o`` is returned in ``v``'s dtype and the final state in the
  compute dtype (fp32, or fp64 for fp64 inputs).

``chunk_gated_delta_rule`` is the single entry point ``GatedDeltaNet`` calls. On CUDA with bf16/fp16
activations, flash-linear-attention's fused kernel (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``,
same argument order and semantics) is used instead when it is importable (``GatedDeltaNet.kernel``;
model_zoo/backends/kernels.py probes it).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model_zoo.backends.kernels import fla_chunk_gated_delta_rule
from model_zoo.init import GlobalRNG, Initializer


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> None:
    b, t, h, _ = q.shape
    if k.shape != q.shape or v.shape[:3] != (b, t, h) or g.shape != (b, t, h) or beta.shape != (b, t, h):
        raise ValueError(
            f"expected q,k [B,T,H,Dk], v [B,T,H,Dv], g/beta [B,T,H]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}"
        )
    if t == 0:
        raise ValueError("sequence length T must be >= 1")


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    # The state accumulates over the whole sequence; bf16/fp16 accumulation drifts, so never go below fp32.
    dtype = torch.float32
    for x in tensors:
        dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def _upcast(x: Tensor) -> Tensor:
    """At least fp32, but never lower fp64 (the fp64 tests compare the layer at 1e-10)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _initial_state(init: Tensor | None, shape: tuple[int, ...], like: Tensor) -> Tensor:
    if init is None:
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    if tuple(init.shape) != shape:
        raise ValueError(f"initial_state must be [B,H,Dk,Dv]={shape}, got {tuple(init.shape)}")
    return init.to(like.dtype)


def recurrent_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Step-by-step reference: returns (o [B,T,H,Dv], final_state [B,H,Dk,Dv]). See module docstring."""
    _check_inputs(q, k, v, g, beta)
    b, t, h, dk = q.shape
    out_dtype, dt = v.dtype, _compute_dtype(q, k, v)
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    q = q * dk**-0.5
    state = _initial_state(initial_state, (b, h, dk, v.shape[-1]), q)
    outs = []
    for i in range(t):
        # Out-of-place updates throughout so autograd can differentiate through the loop.
        state = state * g[:, i].exp()[..., None, None]
        prediction = torch.einsum("bhkv,bhk->bhv", state, k[:, i])
        delta = (v[:, i] - prediction) * beta[:, i, :, None]
        state = state + k[:, i, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, i]))
    return torch.stack(outs, dim=1).to(out_dtype), state


def _pad_time(x: Tensor, pad: int) -> Tensor:
    # F.pad lists dims last-first; time is dim 1 of a [B, T, ...] tensor.
    return F.pad(x, [0, 0] * (x.dim() - 2) + [0, pad]) if pad else x


def _to_chunks(x: Tensor, chunk_size: int) -> Tensor:
    """[B, T, H, *rest] with T % C == 0 -> [B, H, N, C, *rest]."""
    b, t, h = x.shape[:3]
    return x.reshape(b, t // chunk_size, chunk_size, h, *x.shape[3:]).movedim(3, 1)


def _intra_chunk(
    q: Tensor, k: Tensor, v: Tensor, g_cum: Tensor, beta: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Everything that does not depend on the state entering a chunk, for all chunks at once.

    Shapes: q,k [B,H,N,C,Dk], v [B,H,N,C,Dv], g_cum/beta [B,H,N,C] with g_cum the within-chunk cumsum of g
    (gamma_i). Writing the state inside a chunk as S_i = e^{gamma_i} S_0 + sum_{j<=i} e^{gamma_i-gamma_j}
    k_j u_j^T, the recurrence gives the "pseudo-values" u_i = beta_i (v_i - e^{gamma_i} S_0^T k_i
    - sum_{j<i} e^{gamma_i-gamma_j} (k_i.k_j) u_j), i.e. (I + diag(beta) L) U = beta V - beta e^gamma K S_0
    with L strictly lower triangular. With T = (I + diag(beta) L)^{-1} (the UT transform / WY form),
    U = W_v - W_k S_0 where W_v = T beta V and W_k = T beta e^gamma K; both are computed here.
    """
    c = g_cum.shape[-1]
    idx = torch.arange(c, device=g_cum.device)
    causal = idx[:, None] >= idx[None, :]
    # Only differences gamma_i - gamma_j with j <= i are exponentiated; they are <= 0 when g <= 0, so no
    # overflow however long the chunk. The upper triangle is set to -inf *before* exp (exp -> 0, grad 0).
    decay = (g_cum[..., :, None] - g_cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kk = (k @ k.transpose(-1, -2)) * decay
    # Unit lower-triangular system; only the strictly-lower part of beta*kk enters. solve_triangular is a
    # batched, differentiable forward substitution (trsm) instead of a Python loop over the C rows. Not the
    # Neumann / doubling product prod_j (I + (-N)^(2^j)): for near-parallel keys N^j has binomial-sized
    # entries that cancel catastrophically in fp32, whereas substitution only forms the true inverse.
    lhs = (beta[..., None] * kk).tril(-1) + torch.eye(c, dtype=kk.dtype, device=kk.device)
    rhs = torch.cat([beta[..., None] * v, (beta * g_cum.exp())[..., None] * k], dim=-1)
    w_v, w_k = torch.linalg.solve_triangular(lhs, rhs, upper=False, unitriangular=True).split(
        [v.shape[-1], k.shape[-1]], dim=-1
    )
    attn = (q @ k.transpose(-1, -2)) * decay  # causal, inclusive of the diagonal
    q_decayed = q * g_cum.exp()[..., None]  # reads S_0 decayed to step i
    k_to_end = k * (g_cum[..., -1:] - g_cum).exp()[..., None]  # writes decayed to the chunk's end
    return w_v, w_k, attn, q_decayed, k_to_end, g_cum[..., -1].exp()


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int = 64,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Chunked (WY / UT-transform) form, equal to ``recurrent_gated_delta_rule`` up to rounding.

    Parallel within a chunk, a Python loop over the T / chunk_size chunks for the state hand-off.
    T need not divide by chunk_size: padded steps get k = v = q = 0, g = 0, beta = 0, which makes them an
    exact identity on the state (no decay, no write), so the final state needs no masking and the padded
    outputs are sliced off.
    """
    _check_inputs(q, k, v, g, beta)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    b, t, h, dk = q.shape
    dv, c = v.shape[-1], min(chunk_size, t)  # a short sequence is one chunk, not one padded to 64
    out_dtype, dt = v.dtype, _compute_dtype(q, k, v)
    n = math.ceil(t / c)
    q, k, v, g, beta = (_pad_time(x.to(dt), n * c - t) for x in (q, k, v, g, beta))
    q = q * dk**-0.5
    q, k, v, g, beta = (_to_chunks(x, c) for x in (q, k, v, g, beta))
    w_v, w_k, attn, q_decayed, k_to_end, decay_end = _intra_chunk(q, k, v, g.cumsum(-1), beta)

    state = _initial_state(initial_state, (b, h, dk, dv), q)
    outs = []
    for i in range(n):
        u = w_v[:, :, i] - w_k[:, :, i] @ state  # [B,H,C,Dv] pseudo-values given the incoming state
        outs.append(q_decayed[:, :, i] @ state + attn[:, :, i] @ u)
        state = state * decay_end[:, :, i, None, None] + k_to_end[:, :, i].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2)  # [B,H,N,C,Dv]
    o = o.movedim(1, 3).reshape(b, n * c, h, dv)[:, :t]
    return o.to(out_dtype), state


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
        # "auto": FLA's fused kernel where it applies (CUDA, bf16/fp16, importable), else the PyTorch form;
        # "torch": always the PyTorch form (the reference a GPU test compares FLA against).
        self.kernel = "auto"
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

    def _delta_rule(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, act: torch.dtype) -> Tensor:
        """o [B, T, H, Dv]. FLA takes q/k/v in the activation dtype (it accumulates in fp32 inside; it has no
        fp32-input guarantee across versions, hence bf16/fp16 only), g in log space and beta as fp32, the
        same [B, T, H, *] layout and default scale Dk**-0.5. Its chunk size is fixed (64); chunking
        changes only the rounding, not the result."""
        fused = None
        if self.kernel == "auto" and q.is_cuda and act in (torch.bfloat16, torch.float16):
            fused = fla_chunk_gated_delta_rule()
        if fused is None:
            return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=self.chunk_size)[0]
        o, _ = fused(q.to(act), k.to(act), v.to(act), g, beta, output_final_state=False)
        return o

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
