"""Worker of tests/dist/test_vocab_parallel.py: on every rank, the vocabulary-parallel head over a process group
with unequal shards (asyncpp/parallel/vocab_parallel.py), and the unsplit head + F.cross_entropy in this one
process on the same weights; returns both, and the bound on their difference derived from the data."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from asyncpp.parallel.tp import group_rank
from asyncpp.parallel.vocab_parallel import (
    broadcast_hidden,
    reduce_input_grad,
    shard_rows_of,
    split_for_tp,
    vocab_parallel_loss,
    vocab_shards,
)

U = 2.0 ** -24
"""fp32 unit roundoff."""
ROUNDOFF = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -9}
"""The extra rounding of a result stored in the compute dtype (fp32's is in gamma already; bf16's unit roundoff)."""


def gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative bound of an n-term dot product or sum in fp32, any order."""
    return n * U / (1 - n * U)


def reference(full_weight: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor) -> dict:
    w = full_weight.clone().requires_grad_()
    h = hidden.clone().requires_grad_()
    logits = F.linear(h, w)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    loss.backward()
    return {"loss": loss.detach(), "dW": w.grad, "dH": h.grad, "logits": logits.detach()}


def bounds(full_weight: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor, ranks: int = 1) -> dict:
    """Bounds on |vocabulary-parallel - unsplit| for the loss, the weight gradient and the input gradient, first
    order in u, in float64 from the data. Each of the two computations differs from exact arithmetic by at most
    the one-sided bound below, so their difference by twice it. One-sided, per token i and vocabulary id j:
    logits x_ij: gamma_h A_ij with A = |H| |W|^T (any summation order);
    one exp term exp(x_ij - M_i): e_ij = 2u (1 + |x_ij - M_i|) (the shift's rounding, a 1-ulp exp) + gamma_h A_ij;
    the sum S_i over the vocabulary (shards summed, then the all-reduce, in any order): s_i = max_j e_ij + gamma_V;
    the token's loss log S_i + M_i - x_it: s_i + 2u |log S_i| + u |lse_i| + gamma_h A_it + u |loss_i|;
    the mean over the n counted tokens: their mean + gamma_n mean |loss_i|;
    the softmax p_ij: eps_ij = e_ij + s_i + u; G = p - onehot: eps_ij p_ij + u |G_ij|;
    dW = G^T H / n: (|dG|^T |H| + gamma_n |G|^T |H|) / n + u |dW|; dH = G W / n likewise with gamma_V.
    In bf16 (b = 2^-9, ROUNDOFF) the logits, the logits' gradient, dW and each rank's partial dH are rounded to bf16
    once more (b |x|, b |G|, b |dW|, b |partial|), and the partials are summed over the `ranks` in bf16 (the reduce):
    gamma_ranks in b of the sum of |partials| <= |G| |W| / n."""
    b = ROUNDOFF[hidden.dtype]
    w, h = full_weight.double(), hidden.double().reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    valid = (t != -100).double()
    n, (V, hid) = int(valid.sum()), w.shape
    A = h.abs() @ w.abs().T
    x = h @ w.T
    M = x.max(dim=1, keepdim=True).values
    S = (x - M).exp().sum(dim=1, keepdim=True)
    lse = M + S.log()
    p = (x - M).exp() / S
    onehot = torch.zeros_like(x)
    rows = torch.arange(x.shape[0])
    onehot[rows[t >= 0], t[t >= 0]] = 1.0
    G = (p - onehot) * valid.unsqueeze(1)
    e = 2 * U * (1 + (x - M).abs()) + gamma(hid) * A + b * x.abs()
    s = e.max(dim=1, keepdim=True).values + gamma(V)
    loss_i = (lse.squeeze(1) - x[rows, t.clamp(min=0)]) * valid
    target_err = gamma(hid) * A[rows, t.clamp(min=0)] + b * x[rows, t.clamp(min=0)].abs()
    per_token = (s.squeeze(1) + 2 * U * S.log().abs().squeeze(1) + U * lse.abs().squeeze(1) + target_err
                 + U * loss_i.abs()) * valid
    loss_bound = per_token.sum() / n + gamma(n) * loss_i.abs().sum() / n
    eps = e + s + U
    dG = (eps * p + (U + b) * G.abs()) * valid.unsqueeze(1)
    dW = G.T @ h / n
    dW_bound = (dG.T @ h.abs() + gamma(n) * G.abs().T @ h.abs()) / n + (U + b) * dW.abs()
    dH = G @ w / n
    bf16_sum = ranks * b / (1 - ranks * b)  # gamma_ranks in bf16's unit roundoff: the partials' rounding and sum
    dH_bound = ((dG @ w.abs() + gamma(V) * G.abs() @ w.abs()) / n + (U + b) * dH.abs()
                + bf16_sum * G.abs() @ w.abs() / n)
    return {"loss": 2 * loss_bound.item(), "dW": 2 * dW_bound.float(), "dH": 2 * dH_bound.float().reshape(hidden.shape)}


def inputs(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(case["seed"])
    V, hid, B, T = case["vocab"], case["hidden"], 2, 6
    dtype = case.get("dtype", torch.float32)
    weight = torch.randn(V, hid, generator=g) / hid ** 0.5
    weight[case["hot_rows"]] *= 8  # one shard's logits dominate: a shard-local max would overflow exp
    weight = weight.to(dtype)
    hidden = torch.randn(B, T, hid, generator=g).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, :2] = -100  # ignored tokens
    targets[1, 0] = V - 1  # the last shard's last row
    return weight, hidden, targets


def run_case(case: dict) -> dict | None:
    """One case on this rank: None where this rank is outside the head's group."""
    members = case["ranks"]
    group = dist.new_group(members)  # every rank must call new_group, members or not
    if dist.get_rank() not in members:
        return None
    weight, hidden, targets = inputs(case)
    widths = case["shards"]
    if case.get("tp", 1) > 1:  # each stage's shard split again over its TP ranks: (stage, tp rank) order
        widths = [piece.rows for stage in vocab_shards(widths, case["vocab"]) for piece in split_for_tp(stage, case["tp"])]
    shards = vocab_shards(widths, case["vocab"])
    shard = shards[group_rank(group)]
    src = dst = case["last"]  # the rank of the last stage: runs the final norm, continues the backward
    h = broadcast_hidden(hidden if dist.get_rank() == src else None, hidden.shape, hidden.dtype, "cpu", src, group)
    h.requires_grad_()
    w = shard_rows_of(weight, shard).requires_grad_()
    loss = vocab_parallel_loss(h, w, targets, shard, group)
    loss.backward()
    dH = reduce_input_grad(h.grad, dst, group)
    ref = reference(weight, hidden, targets)
    return {
        "rank": dist.get_rank(), "widths": widths, "rows": (shard.start, shard.end), "weight_rows": w.shape[0],
        "loss": loss.item(), "ref_loss": ref["loss"].item(),
        "dW": w.grad, "ref_dW": ref["dW"][shard.start:shard.end],
        "dH": dH, "ref_dH": ref["dH"] if dH is not None else None,
        "partial_dH": h.grad, "bounds": bounds(weight, hidden, targets, len(members)),
        "dtype": str(w.grad.dtype),
    }


def vocab_rank(rank: int, cases: dict[str, dict]) -> dict:
    """Entry point for run_ranks: every case on this rank, by name (one spawn for the whole file)."""
    torch.manual_seed(0)
    return {name: run_case(case) for name, case in cases.items()}
