"""The gated delta rule (Gated DeltaNet's token mixer, Yang et al., arXiv 2412.06464) as functions, three forms.

Conventions shared by every form:

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

The forms:

* ``recurrent_gated_delta_rule``: token by token, the truth the others are tested against.
* ``chunk_gated_delta_rule``: the WY / UT-transform chunked form, all chunks' intra-chunk work batched, a Python
  loop over the chunks for the state hand-off (about 38 ATen ops per chunk forward, 90 forward + backward:
  thousands per layer at 4096 tokens). The CPU's default.
* ``batched_chunk_gated_delta_rule``: the same algebra with everything batched over the chunks except the state
  recurrence itself, which runs in a custom autograd Function (``ChunkStates``) with no per-op bookkeeping, as a
  two-level scan (``affine_scan``: ~2 sqrt(2N) sequential kernels each way instead of N) whose backward is the same
  scan over the chunks in reverse. The CUDA default where flash-linear-attention's kernel is not trusted
  (model_zoo/gated_deltanet.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


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


def _chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int,
             initial_state: Tensor | None) -> tuple[tuple[Tensor, ...], Tensor, torch.dtype]:
    """The chunked forms' common start: checks, padding, chunking and the intra-chunk work.

    Returns (_intra_chunk's six tensors, the initial state in the compute dtype, o's dtype).
    T need not divide by chunk_size: padded steps get k = v = q = 0, g = 0, beta = 0, which makes them an
    exact identity on the state (no decay, no write), so the final state needs no masking and the padded
    outputs are sliced off by `_unchunk`."""
    _check_inputs(q, k, v, g, beta)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    b, t, h, dk = q.shape
    c = min(chunk_size, t)  # a short sequence is one chunk, not one padded to 64
    out_dtype, dt = v.dtype, _compute_dtype(q, k, v)
    n = math.ceil(t / c)
    q, k, v, g, beta = (_pad_time(x.to(dt), n * c - t) for x in (q, k, v, g, beta))
    q = q * dk**-0.5
    q, k, v, g, beta = (_to_chunks(x, c) for x in (q, k, v, g, beta))
    state = _initial_state(initial_state, (b, h, dk, v.shape[-1]), q)
    return _intra_chunk(q, k, v, g.cumsum(-1), beta), state, out_dtype


def _unchunk(o: Tensor, t: int) -> Tensor:
    """[B, H, N, C, Dv] -> [B, T, H, Dv], the padding sliced off."""
    b, h, n, c, dv = o.shape
    return o.movedim(1, 3).reshape(b, n * c, h, dv)[:, :t]


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

    Parallel within a chunk, a Python loop over the T / chunk_size chunks for the state hand-off."""
    (w_v, w_k, attn, q_decayed, k_to_end, decay_end), state, out_dtype = _chunked(
        q, k, v, g, beta, chunk_size, initial_state)
    outs = []
    for i in range(w_v.shape[2]):
        u = w_v[:, :, i] - w_k[:, :, i] @ state  # [B,H,C,Dv] pseudo-values given the incoming state
        outs.append(q_decayed[:, :, i] @ state + attn[:, :, i] @ u)
        state = state * decay_end[:, :, i, None, None] + k_to_end[:, :, i].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2)  # [B,H,N,C,Dv]
    return _unchunk(o, q.shape[1]).to(out_dtype), state


def _sequential_scan(a: Tensor, b: Tensor, states: Tensor) -> None:
    """states[i+1] = a[i] states[i] + b[i] in place, states[0] given: one baddbmm per step."""
    s, a_i, b_i = states.unbind(0), a.unbind(0), b.unbind(0)  # one op for all views (a[i] is one per use)
    for i in range(len(b_i)):
        torch.baddbmm(b_i[i], a_i[i], s[i], out=s[i + 1])


def affine_scan(a: Tensor, b: Tensor, s0: Tensor) -> Tensor:
    """[N+1, X, Dk, Dv]: S_0 = s0, S_{i+1} = A_i S_i + B_i for a [N, X, Dk, Dk], b [N, X, Dk, Dv], s0 [X, Dk, Dv].

    In two levels, so that the number of sequential kernels is ~2M + N/M instead of N (M = sqrt(N/2): 6 and 11
    groups for N = 64): within groups of M steps the prefix maps S_{start+j+1} = P_j S_start + Q_j are composed
    for all groups at once (P_j = A_j P_{j-1}, Q_j = A_j Q_{j-1} + B_j: M steps of two batched kernels), then the
    groups hand their states on (one baddbmm per group), then every state is P_j S_start + Q_j (one batched
    baddbmm). The products of up to M transitions are products of contractions (the delta rule's with unit keys,
    beta < 1, decays <= 1): no growth. Costs M extra Dk x Dk products per group: ~2.5x the sequential form's FLOPs,
    a few GFLOP at hybrid_moe_10b's shapes, against ~N fewer launches. No autograd (ChunkStates' both directions)."""
    n, x, dk, dv = b.shape
    states = torch.empty((n + 1, x, dk, dv), dtype=b.dtype, device=b.device)
    states[0].copy_(s0)
    m = round(math.sqrt(n / 2))
    if m < 2:
        _sequential_scan(a, b, states)
        return states
    groups = -(-n // m)
    if groups * m > n:  # identity steps at the end: they change no state
        pad = groups * m - n
        a = torch.cat([a, torch.eye(dk, dtype=a.dtype, device=a.device).expand(pad, x, dk, dk)])
        b = torch.cat([b, b.new_zeros(pad, x, dk, dv)])
    # [G, M, X] -> [M, G * X]: position j of every group is one contiguous batch.
    a_m = a.reshape(groups, m, x, dk, dk).transpose(0, 1).reshape(m, groups * x, dk, dk)
    b_m = b.reshape(groups, m, x, dk, dv).transpose(0, 1).reshape(m, groups * x, dk, dv)
    p, q = torch.empty_like(a_m), torch.empty_like(b_m)
    p_j, q_j, a_j, b_j = p.unbind(0), q.unbind(0), a_m.unbind(0), b_m.unbind(0)
    p_j[0].copy_(a_j[0])
    q_j[0].copy_(b_j[0])
    for j in range(1, m):
        torch.bmm(a_j[j], p_j[j - 1], out=p_j[j])
        torch.baddbmm(b_j[j], a_j[j], q_j[j - 1], out=q_j[j])
    starts = torch.empty((groups, x, dk, dv), dtype=b.dtype, device=b.device)  # the state entering each group
    starts[0].copy_(s0)
    _sequential_scan(p[m - 1].reshape(groups, x, dk, dk)[:-1], q[m - 1].reshape(groups, x, dk, dv)[:-1], starts)
    every = torch.baddbmm(q.reshape(m * groups * x, dk, dv), p.reshape(m * groups * x, dk, dk),
                          starts.reshape(1, groups * x, dk, dv).expand(m, -1, -1, -1).reshape(-1, dk, dv))
    states[1:].copy_(every.reshape(m, groups, x, dk, dv).transpose(0, 1).reshape(groups * m, x, dk, dv)[:n])
    return states


class ChunkStates(torch.autograd.Function):
    """The states entering every chunk of the affine recurrence S_{i+1} = A_i S_i + B_i, i = 0..N-1.

    a [N, X, Dk, Dk], b [N, X, Dk, Dv], s0 [X, Dk, Dv] -> states [N+1, X, Dk, Dv] (states[0] = s0, states[N] the
    final state), X the batch of independent recurrences (B * H). Forward: `affine_scan`. Backward: the adjoint
    recurrence lambda_i = G_i + A_i^T lambda_{i+1} from lambda_N = G_N (G the states' incoming gradient), the same
    affine scan run on the reversed chunks with the transposed A; then dB_i = lambda_{i+1}, dA_i = lambda_{i+1} S_i^T
    (one batched matmul for all chunks) and ds0 = lambda_0. Autograd through a Python loop records ~10 ops per
    chunk and saves every intermediate; this saves a and the states, which the output's matmuls need anyway."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, s0: Tensor) -> Tensor:  # type: ignore[override]
        states = affine_scan(a, b, s0)
        ctx.save_for_backward(a, states)
        return states

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        a, states = ctx.saved_tensors
        reversed_lam = affine_scan(a.transpose(-1, -2).flip(0), grad[:-1].flip(0), grad[-1])
        lam = reversed_lam.flip(0)  # lam[i] = dL/dS_i, all paths
        d_a = lam[1:] @ states[:-1].transpose(-1, -2)
        return d_a, lam[1:], lam[0]


def batched_chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int = 64,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The chunked form with only the state recurrence sequential; equal to ``recurrent_gated_delta_rule`` up to
    rounding. Same arguments and results as ``chunk_gated_delta_rule``.

    With the pseudo-values u_i = W_v,i - W_k,i S_i (see _intra_chunk) a chunk maps its entering state to
    S_{i+1} = d_i S_i + K_i^T u_i = A_i S_i + B_i with A_i = d_i I - K_i^T W_k,i and B_i = K_i^T W_v,i (K_i the keys
    decayed to the chunk's end, d_i the chunk's total decay): A and B for all chunks are two batched matmuls,
    ChunkStates runs the recurrence, and the outputs o_i = Q_i S_i + P_i u_i = (Q_i - P_i W_k,i) S_i + P_i W_v,i
    (Q the decayed queries, P the intra-chunk attention) are batched again. A_i is Dk x Dk: forming it costs
    2 C Dk^2 FLOPs per chunk, as much as one of the loop form's per-chunk products."""
    (w_v, w_k, attn, q_decayed, k_to_end, decay_end), s0, out_dtype = _chunked(
        q, k, v, g, beta, chunk_size, initial_state)
    bsz, h, n, _, dk = w_k.shape
    dv = w_v.shape[-1]
    k_t = k_to_end.transpose(-1, -2)  # [B,H,N,Dk,C]
    eye = torch.eye(dk, dtype=w_k.dtype, device=w_k.device)
    a = decay_end[..., None, None] * eye - k_t @ w_k  # [B,H,N,Dk,Dk]
    b = k_t @ w_v  # [B,H,N,Dk,Dv]
    # Chunks first and (B, H) flattened, so each chunk's step is one contiguous 3-d baddbmm.
    states = ChunkStates.apply(a.permute(2, 0, 1, 3, 4).reshape(n, bsz * h, dk, dk),
                               b.permute(2, 0, 1, 3, 4).reshape(n, bsz * h, dk, dv),
                               s0.reshape(bsz * h, dk, dv))
    # The state term in the recurrence's chunk-major layout: the states are used as they lie (a view, saved once
    # by ChunkStates); the [C, Dk] left operands are what gets copied, half a state's size per chunk.
    left = (q_decayed - attn @ w_k).permute(2, 0, 1, 3, 4).reshape(n * bsz * h, -1, dk)
    from_state = torch.bmm(left, states[:-1].reshape(n * bsz * h, dk, dv))
    o = from_state.reshape(n, bsz, h, -1, dv).permute(1, 2, 0, 3, 4) + attn @ w_v  # [B,H,N,C,Dv]
    return _unchunk(o, q.shape[1]).to(out_dtype), states[-1].reshape(bsz, h, dk, dv)
