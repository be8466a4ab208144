"""flash-linear-attention's chunk_gated_delta_rule, checked once per process and shape against the PyTorch form.

Importable is not enough, and neither is a Triton version: FLA 0.6 on Hopper with Triton < 3.7.1 refuses its own
backward (fla-org/flash-linear-attention#640: wrong dk at 64-wide K tiles), and #984 reports a separate wrong
dk / dbeta in the WY backward at some shapes. So before a layer uses the kernel at a shape (T, H, Dk, Dv, dtype,
device), the kernel runs one forward and backward there on random inputs, next to the PyTorch form
(model_zoo/delta_rule.batched_chunk_gated_delta_rule) on the same inputs, and is used only if the output and every
input gradient are within a bound derived from bf16's own error (`BOUND_FACTOR`). The decision and its reason
are logged once and kept (`FlaChecks.decisions`); a refused shape runs the PyTorch form.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from model_zoo.backends.kernels import fla_chunk_gated_delta_rule, fla_status
from model_zoo.delta_rule import batched_chunk_gated_delta_rule

_LOG = logging.getLogger(__name__)

BOUND_FACTOR = 8.0
"""A quantity's bound is BOUND_FACTOR * e, e = how far the PyTorch form's same quantity moves when its q, k, v are
rounded to the activation dtype (bf16: relative 2^-9 per element), i.e. the error one rounding of the inputs
causes, at this shape and conditioning (the g and beta gradients, sums over every token with cancellation, get
larger bounds by themselves). The kernel's inputs are already rounded; what it adds is its own roundings of
intermediates to bf16 (the WY factors, the chunk states, the pseudo-values; in the backward dh, dv), each a
perturbation of the same size going through a map of about the same conditioning, a handful along any path:
8 leaves room for them. A wrong kernel is off by O(1) (#640's dk), hundreds of times e."""

Key = tuple[int, int, int, int, torch.dtype, torch.device]


@dataclass(frozen=True)
class FlaDecision:
    use: bool
    reason: str


def _rel(x: Tensor, ref: Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _inputs(t: int, h: int, dk: int, dv: int, device: torch.device, seed: int) -> list[Tensor]:
    """fp32 q, k, v, g, beta [1, T, H, *] as the layer makes them: unit-norm q and k, g in the layer's range
    (-exp(A_log) softplus(.) with A in [1, 16], dt in [1e-3, 0.1]), beta in (0, 1)."""
    gen = torch.Generator(device).manual_seed(seed)
    q, k = (F.normalize(torch.randn(1, t, h, dk, device=device, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(1, t, h, dv, device=device, generator=gen)
    g = -torch.rand(1, t, h, device=device, generator=gen) * 1.6
    beta = torch.rand(1, t, h, device=device, generator=gen).clamp(1e-3, 1 - 1e-3)
    return [q, k, v, g, beta]


def _forward_backward(fn: Callable, inputs: list[Tensor], cotangent_seed: int) -> list[Tensor]:
    """[o, dq, dk, dv, dg, dbeta] in fp32 of `fn` at `inputs`, with a fixed random cotangent on o."""
    # The first forward may run under no_grad or inference mode (an evaluation first): the check's backward needs
    # autograd whatever its caller's mode (seen on the H200 as the kernel's "failure").
    # Autocast off: the bound is about the kernel's own roundings, not a caller's autocast region's.
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast(inputs[0].device.type, enabled=False):
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
        o = fn(*leaves)[0]
        gen = torch.Generator(o.device).manual_seed(cotangent_seed)
        cotangent = torch.randn(o.shape, device=o.device, generator=gen, dtype=torch.float32).to(o.dtype)
        grads = torch.autograd.grad(o, leaves, cotangent)
    return [o.float(), *(x.float() for x in grads)]


def check_kernel(fused: Callable, t: int, h: int, dk: int, dv: int, dtype: torch.dtype, device: torch.device,
                 reference: Callable = batched_chunk_gated_delta_rule, seed: int = 0) -> FlaDecision:
    """FLA-style `fused(q, k, v, g, beta, output_final_state=False) -> (o, state)` against `reference` at one
    shape: forward and every input gradient within BOUND_FACTOR times bf16's own error (see BOUND_FACTOR)."""
    exact = _inputs(t, h, dk, dv, device, seed)
    rounded = [x.to(dtype) if i < 3 else x for i, x in enumerate(exact)]  # g and beta reach FLA in fp32
    truth = _forward_backward(reference, exact, seed + 1)
    ref = _forward_backward(reference, [x.float() for x in rounded], seed + 1)
    try:
        got = _forward_backward(lambda *x: fused(*x, output_final_state=False), rounded, seed + 1)
    except Exception as e:  # noqa: BLE001 - the reason is the decision's, logged and kept
        return FlaDecision(False, f"it raised {type(e).__name__}: {str(e)[:300]}")
    worst = (0.0, "")
    for name, g, r, tr in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), got, ref, truth):
        if g.shape != r.shape:
            return FlaDecision(False, f"{name} has shape {tuple(g.shape)}, the PyTorch form's {tuple(r.shape)}")
        if not torch.isfinite(g).all():
            return FlaDecision(False, f"{name} is not finite")
        bound = BOUND_FACTOR * _rel(r, tr)
        distance = _rel(g, r)
        if not distance <= bound:
            return FlaDecision(False, f"{name} is {distance:.3g} from the PyTorch form's, above its bound {bound:.3g} "
                                      f"({BOUND_FACTOR:g} x the error of rounding the inputs to {dtype})")
        worst = max(worst, (distance / bound, f"{name} {distance:.3g} of its bound {bound:.3g}"))
    return FlaDecision(True, f"forward and backward within their bounds (closest: {worst[1]})")


def _outside_compiled_graphs(method: Callable) -> Callable:
    """torch.compiler.disable, applied at the first call instead of at import: the decorator imports torch._dynamo
    (~3 s of a process's ~7 s of imports on 2 cores), which a process that never checks a kernel (a refused config,
    a dry run, a launcher) need not pay. Under a trace the first call breaks the graph once and runs eagerly."""

    @functools.wraps(method)
    def call(self, *args):  # a wrapper per call: `decide` runs once per shape, and a cache would warn under dynamo
        return torch.compiler.disable(method)(self, *args)

    return call


class FlaChecks:
    """The decisions of one process: each shape checked once (`check_kernel`), logged with its reason, kept."""

    def __init__(self, find_kernel: Callable[[], Callable | None] = fla_chunk_gated_delta_rule,
                 log: Callable[[str], None] = _LOG.warning):
        self.find_kernel, self.log = find_kernel, log
        self.decisions: dict[Key, FlaDecision] = {}

    @_outside_compiled_graphs  # a check runs real kernels and keeps Python state: never inside a compiled graph
    def decide(self, t: int, h: int, dk: int, dv: int, dtype: torch.dtype, device: torch.device) -> FlaDecision:
        key = (t, h, dk, dv, dtype, device)
        if key not in self.decisions:
            self.decisions[key] = decision = self._decide(t, h, dk, dv, dtype, device)
            verdict = "uses" if decision.use else "does not use"
            self.log(f"Gated DeltaNet {verdict} flash-linear-attention's kernel at T={t} H={h} Dk={dk} Dv={dv} "
                     f"{dtype} on {device}: {decision.reason}")
        return self.decisions[key]

    def _decide(self, t: int, h: int, dk: int, dv: int, dtype: torch.dtype, device: torch.device) -> FlaDecision:
        fused = self.find_kernel()
        if fused is None:
            return FlaDecision(False, fla_status())
        if device.type == "cuda" and not torch.cuda.is_available():  # fake or traced CUDA tensors: nothing to run
            return FlaDecision(False, "no CUDA device to check it on")
        return check_kernel(fused, t, h, dk, dv, dtype, device)

    def kernel_for(self, t: int, h: int, dk: int, dv: int, dtype: torch.dtype,
                   device: torch.device) -> Callable | None:
        """The kernel where it passed its check at this shape, else None (the caller runs the PyTorch form). A decided
        shape is a dict read, which a compiled block traces (as MoE.expert_kernel's); only the first call of a shape
        goes through `decide`, which torch.compile leaves out of the graph."""
        decision = self.decisions.get((t, h, dk, dv, dtype, device))
        if decision is None:
            decision = self.decide(t, h, dk, dv, dtype, device)
        return self.find_kernel() if decision.use else None


FLA_CHECKS = FlaChecks()
"""The process's decisions (a check costs one forward and backward of both forms at the shape: once per process)."""
