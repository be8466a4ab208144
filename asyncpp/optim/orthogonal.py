"""What Muon and NorMuon share: quintic Newton-Schulz on a batch of matrices, the NS compute dtype,
and the momentum EMA (with its Nesterov look-ahead) that feeds NS.

Both optimizers keep one `momentum_buffer` per parameter, shaped like the parameter (torch.optim.Muon's
state layout), so a parameter sharded over TP or EP has its state sharded exactly the same way.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from asyncpp.optim.common import GroupwiseOptimizer, check_matrix_params

__all__ = ["COMPUTE_DTYPES", "CPU_CHUNK_NUMEL", "NS_COEFFICIENTS", "MatrixOptimizer", "Workspace", "chunk_matrices",
           "compute_dtype_name", "default_bucket_numel", "newton_schulz", "orthogonalize"]

# Keller Jordan's quintic coefficients (maximise the slope at zero; the iteration lands the
# singular values in roughly [0.7, 1.2] rather than exactly at 1, which does not hurt training).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
COMPUTE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def compute_dtype_name(dtype: torch.dtype | str | None, owner: str = "Muon") -> str | None:
    """The NS dtype as a plain string: param groups (hence state_dicts) then hold only plain values,
    which torch.distributed.checkpoint and json-style tooling accept."""
    if dtype is None:
        return None
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"{owner} compute_dtype={dtype!r} is not one of {sorted(COMPUTE_DTYPES)} (or None)")
    return name


class Workspace:
    """Named scratch tensors reused across calls: get() returns a `shape` view of a flat buffer that
    grows to the largest request under that name, valid until the next get() of the same name.
    Why: on CPU every fresh multi-megabyte tensor costs page faults (glibc hands large blocks back
    to the OS), ~100k faults (~10% of the time) per SmolLM2-135M step. GPU allocators cache blocks."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        numel = math.prod(shape)
        key = (name, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)


def orthogonalize(
    G: Tensor,
    steps: int,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    compute_dtype: torch.dtype | None = None,
    workspace: Workspace | None = None,
) -> Tensor:
    """newton_schulz without the final cast: the result stays in `compute_dtype` (shape of G).

    The sharded Muon communicates this (half the bytes in bf16) and casts afterwards; casting is
    exact and elementwise, so cast-then-gather equals gather-then-cast bit for bit. With a
    `workspace` every intermediate lives in its buffers and the result is a view into them, valid
    until the workspace's next NS call; G is never written.
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs a [..., m, n] tensor, got shape {tuple(G.shape)}")
    if len(coefficients) != 3:
        raise ValueError(f"newton_schulz coefficients must be 3 floats (a, b, c), got {coefficients}")
    if steps < 0:
        raise ValueError(f"newton_schulz steps={steps} must be >= 0")
    ws = workspace or Workspace()
    a, b, c = coefficients
    m, n = G.shape[-2:]
    k = G.numel() // (m * n)
    X = ws.get("ns_x", (k, m, n), compute_dtype or G.dtype, G.device).copy_(G.reshape(k, m, n))  # the cast
    tall = m > n
    if tall:
        X = X.mT
    X.div_(X.norm(dim=(-2, -1), keepdim=True).clamp_(min=eps))
    short, wide = X.shape[-2:]
    A = ws.get("ns_a", (k, short, short), X.dtype, X.device)
    B = ws.get("ns_b", (k, short, short), X.dtype, X.device)
    for i in range(steps):
        torch.bmm(X, X.mT, out=A)
        torch.baddbmm(A, A, A, beta=b, alpha=c, out=B)  # b*A + c*A@A, one rounding (as torch's addmm)
        Y = ws.get(f"ns_y{i % 2}", (k, short, wide), X.dtype, X.device)
        X = torch.baddbmm(X, B, X, beta=a, out=Y)  # a*X + B@X
    if tall:
        X = X.mT
    return X.reshape(G.shape)


def newton_schulz(
    G: Tensor,
    steps: int,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    compute_dtype: torch.dtype | None = None,
) -> Tensor:
    """Approximately orthogonalise every matrix of G [..., m, n]; returns G's shape and dtype.

    Each matrix is divided by its own Frobenius norm (so its spectral norm is <= 1), then
    `steps` quintic iterations X <- aX + (bA + cA^2)X with A = XX^T. Tall matrices are
    transposed first so the Gram matrix A is min(m, n) square (cost m*n*min(m, n)).
    """
    return orthogonalize(G, steps, coefficients, eps, compute_dtype).to(G.dtype)


# How many matrices one NS call (and each elementwise pass around it) takes. On CPU, work on a whole
# large stack streams it through memory ~20 times; chunks of <= 2**19 elements (one 576 x 1536 matrix,
# two 256 x 1024 ones) stay in cache, and with the Workspace they allocate nothing. Measured on a 2-core
# AVX512 EPYC at 1 thread, bf16, SmolLM2-135M's matrices, medians of 6 steps interleaved with
# torch.optim.Muon (3.85 s): 2**19 3.79 s, 2**20 3.81 s, 2**21 4.01 s; one whole [64, 256, 1024] stack
# is 1.5x slower than chunks of 2-8. Per-matrix results do not depend on the batch they are in, so
# chunking changes no bits. Accelerators want the opposite (few large launches): the whole bucket.
CPU_CHUNK_NUMEL = 2**19


# Elements gathered together by the DP-sharded Muon (one collective each). On CPU (gloo) small buckets
# win: more of the transfer overlaps the next bucket's NS and the send/receive buffers stay small (the
# 2-core box above, 2 ranks, 192 matrices 256 x 1024: 2**19-2**20 took ~0.7 s a step, 2**24 ~1.1 s).
# NCCL prefers fewer, larger messages.
CPU_BUCKET_NUMEL = 2**20
ACCELERATOR_BUCKET_NUMEL = 2**24


def default_bucket_numel(device: torch.device) -> int:
    return CPU_BUCKET_NUMEL if device.type == "cpu" else ACCELERATOR_BUCKET_NUMEL


def chunk_matrices(device: torch.device, m: int, n: int) -> int:
    """Matrices of shape [m, n] per NS call / elementwise pass on `device` (see CPU_CHUNK_NUMEL)."""
    if device.type != "cpu":
        return 1 << 62
    return max(1, CPU_CHUNK_NUMEL // (m * n))


class MatrixOptimizer(GroupwiseOptimizer):
    """Base of Muon and NorMuon: matrix-only param groups, a `compute_dtype` group option (None = the
    parameter's dtype) and the momentum EMA feeding Newton-Schulz."""

    name = "Muon"

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # Validate here (not only in __init__) so groups added later are checked too.
        param_group["params"] = check_matrix_params(self.name, param_group["params"])
        if "compute_dtype" in param_group:
            param_group["compute_dtype"] = compute_dtype_name(param_group["compute_dtype"], self.name)
        super().add_param_group(param_group)

    @staticmethod
    def compute_dtype(group: dict[str, Any]) -> torch.dtype | None:
        name = group["compute_dtype"]
        return None if name is None else COMPUTE_DTYPES[name]

    def _momentum_buffers(self, params: list[Tensor], memory_format=torch.preserve_format) -> list[Tensor]:
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=memory_format)
            bufs.append(state["momentum_buffer"])
        return bufs

    def _update_momentum(self, params: list[Tensor], momentum: float) -> list[Tensor]:
        """buf <- lerp(buf, g, 1 - momentum) in place, one foreach call (elementwise identical to
        torch.optim.Muon's per-tensor lerp_); returns the buffers."""
        bufs = self._momentum_buffers(params)
        torch._foreach_lerp_(bufs, [p.grad for p in params], 1.0 - momentum)
        return bufs

    def _ns_inputs(self, params: list[Tensor], momentum: float, nesterov: bool) -> list[Tensor]:
        """The momentum step, then per parameter lerp(g, buf, momentum) (Nesterov) or buf itself
        (callers must not modify the returned tensors)."""
        bufs = self._update_momentum(params, momentum)
        return list(torch._foreach_lerp([p.grad for p in params], bufs, momentum)) if nesterov else bufs
