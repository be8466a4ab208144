"""Mixture-of-experts MLP: softmax top-k router, stacked SwiGLU experts, optional gated shared expert,
and a Switch-style load-balancing loss whose gradient rides along with the activation.

Shapes: d = hidden_size, f = expert_ffn_hidden_size, E = num_experts, N = tokens in the microbatch,
k = top_k. An "assignment" is one (token, chosen expert) pair; there are N * k of them.

The routed experts run as one grouped computation over the experts this rank holds (grouped_swiglu),
not a loop. Where the experts live is the dispatcher's business (the seam below): the default keeps
every expert here; asyncpp.parallel.experts installs one that shards them over TP/EP groups.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model_zoo.backends.kernels import cuda_capability
from model_zoo.config import MoEConfig
from model_zoo.init import GlobalRNG, Initializer
from model_zoo.layers import SwiGLU

_LOG = logging.getLogger(__name__)

ExpertFn = Callable[[Tensor, Tensor], Tensor]
"""(rows [M, d] sorted by local expert, counts [E_local] int64 summing to M) -> outputs [M, d], same order."""

Kernel = Literal["bmm", "grouped_mm"]


class Dispatcher(Protocol):
    """The seam between the plain model and expert/tensor parallelism.

    MoE.forward calls, in this order: enter(x) on the input the experts read; scale(w) on every
    value that multiplies an expert output (routing weights, the shared expert's gate); dispatch()
    to run the routed experts; leave(out) on the sum of the weighted expert outputs. The router
    itself reads the input *before* enter(), so a replicated router never needs a reduction.
    """

    def enter(self, x: Tensor) -> Tensor: ...
    def scale(self, w: Tensor) -> Tensor: ...
    def leave(self, y: Tensor) -> Tensor: ...

    def dispatch(self, rows: Tensor, counts: Tensor, experts: ExpertFn) -> Tensor:
        """rows [M, d] sorted by global expert, counts [E] -> every row's expert output [M, d], same order."""
        ...


class LocalDispatcher:
    """All experts on this rank, input not shared with any other rank: nothing to move or reduce."""

    def enter(self, x: Tensor) -> Tensor:
        return x

    def scale(self, w: Tensor) -> Tensor:
        return w

    def leave(self, y: Tensor) -> Tensor:
        return y

    def dispatch(self, rows: Tensor, counts: Tensor, experts: ExpertFn) -> Tensor:
        return experts(rows, counts)


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
    counts = expert_counts(topk_idx, num_experts)
    frac = counts.to(probs.dtype) / topk_idx.numel()
    return num_experts * torch.sum(frac * probs.mean(dim=0)), counts


# ---- grouped expert computation ------------------------------------------------------------------

@functools.cache
def _log_once(message: str) -> None:
    """Every MoE layer reaches the same decision: say it once per process, not once per layer."""
    _LOG.warning(message)


def grouped_mm_unsupported(device: torch.device, dtype: torch.dtype, widths: tuple[int, ...],
                           capability: tuple[int, int] | None = None) -> str:
    """Why torch._grouped_mm's CUDA kernel cannot run the experts here ("" if it can).

    `widths` are the expert matrices' inner sizes (hidden size d, expert ffn f, after any TP split):
    the kernel needs every row of every operand 16-byte aligned. `capability` is the GPU's (major,
    minor), probed when None. Off CUDA the answer is always a reason: the padded bmm is the reference.
    """
    if device.type != "cuda":
        return f"the device is {device.type}, and torch._grouped_mm's kernel is CUDA's (the padded bmm is the reference)"
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm (torch >= 2.8 has it)"
    if dtype != torch.bfloat16:
        return (f"the experts compute in {dtype}, and torch._grouped_mm's CUDA kernel takes bfloat16 only "
                "(train.precision=bf16 uses it)")
    major, minor = capability if capability is not None else cuda_capability(device)
    if major < 8:
        return f"the GPU has compute capability {major}.{minor}, and torch._grouped_mm needs 8.0 (Ampere) or newer"
    align = 16 // dtype.itemsize
    unaligned = [w for w in widths if w % align]
    if unaligned:
        return (f"expert widths {list(widths)} (hidden size, expert ffn size on this rank) must be multiples of "
                f"{align} for torch._grouped_mm's 16-byte-aligned rows; {unaligned} are not")
    return ""


def grouped_mm_available(device: torch.device, dtype: torch.dtype, widths: tuple[int, ...] = ()) -> bool:
    """torch._grouped_mm's CUDA kernel (bf16, SM80+, aligned widths) can run here; elsewhere the padded bmm is used."""
    return not grouped_mm_unsupported(device, dtype, widths)


def grouped_swiglu(rows: Tensor, counts: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                   kernel: Kernel = "bmm") -> Tensor:
    """Expert e's SwiGLU, down(silu(gate(x)) * up(x)), on its rows, for every local expert at once.

    rows [M, d] sorted by expert, counts [E] int64 (sum M, zeros allowed), w_gate/w_up [E, f, d],
    w_down [E, d, f] -> [M, d] in the order of `rows`. Dropless: every row is computed; the buffers
    only add zero rows. "bmm" syncs with the host once (the busiest expert sizes the buffer);
    "grouped_mm" does not, and wastes at most 16 bytes of rows per expert.
    """
    if kernel == "grouped_mm":
        return _swiglu_grouped_mm(rows, counts, w_gate, w_up, w_down)
    if kernel != "bmm":
        raise ValueError(f"kernel={kernel!r} is not a grouped expert kernel; use 'bmm' or 'grouped_mm'.")
    return _swiglu_padded_bmm(rows, counts, w_gate, w_up, w_down)


def _padded_positions(counts: Tensor, group_starts: Tensor, num_rows: int) -> Tensor:
    """Row i of the expert-sorted input -> its row in a buffer where group e starts at row group_starts[e]."""
    row_starts = torch.cumsum(counts, 0) - counts
    shift = torch.repeat_interleave(group_starts - row_starts, counts, output_size=num_rows)
    return shift + torch.arange(num_rows, device=counts.device)


def _swiglu_padded_bmm(rows: Tensor, counts: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    E, (M, d) = counts.numel(), rows.shape
    cap = int(counts.max()) if M else 0  # host sync: the buffer is [E, busiest expert's rows, d]
    # Group e starts at e * cap. Not as the cumsum of a tensor full of cap: under torch.compile cap is a
    # value read from the device, and Inductor's rewrite of cumsum(full(v)) fails on such a v.
    pos = _padded_positions(counts, torch.arange(E, device=counts.device) * cap, M)
    buf = rows.new_zeros(E * cap, d).index_copy(0, pos, rows).view(E, cap, d)
    h = F.silu(torch.bmm(buf, w_gate.transpose(1, 2))) * torch.bmm(buf, w_up.transpose(1, 2))
    return torch.bmm(h, w_down.transpose(1, 2)).reshape(E * cap, d).index_select(0, pos)


def _swiglu_grouped_mm(rows: Tensor, counts: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    # Every group must start 16-byte aligned: in the weight-gradient GEMM the token dim is the
    # contiguous one, and TMA loads need aligned starts. So round each group up to `align` rows.
    # The buffer length is a static bound (no host sync); the last group absorbs the slack, so no
    # row of the buffer is left outside a group (uninitialised output).
    E, (M, d) = counts.numel(), rows.shape
    align = max(1, 16 // rows.element_size())
    total = M + E * (align - 1)
    sizes = (counts + align - 1) // align * align
    sizes = torch.cat([sizes[:-1], (total - sizes[:-1].sum()).reshape(1)])
    ends = torch.cumsum(sizes, 0)
    pos = _padded_positions(counts, ends - sizes, M)
    offs = ends.to(torch.int32)
    buf = rows.new_zeros(total, d).index_copy(0, pos, rows)
    gmm = torch._grouped_mm
    h = F.silu(gmm(buf, w_gate.transpose(1, 2), offs=offs)) * gmm(buf, w_up.transpose(1, 2), offs=offs)
    return gmm(h, w_down.transpose(1, 2), offs=offs).index_select(0, pos)


def sort_assignments(idx: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """idx [N, k] -> (order [N*k]: assignments sorted by expert (stable), token_of [N*k]: the token of
    each sorted assignment, counts [E] int64)."""
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)
    token_of = torch.div(order, idx.shape[1], rounding_mode="floor")  # assignment j is token j // k
    return order, token_of, expert_counts(flat, num_experts)


def expert_counts(idx: Tensor, num_experts: int) -> Tensor:
    """Assignments per expert [E] int64 of the expert indices `idx` (any shape). torch.bincount's CUDA
    kernel reads idx.max() on the host to size its output (a host sync, twice per MoE layer per
    forward); the size is known here, so a scatter-add does it on the device. Integer adds are exact in
    any order, so the counts equal bincount's bit for bit."""
    flat = idx.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=idx.device).scatter_add_(0, flat, torch.ones_like(flat))


# ---- the module ----------------------------------------------------------------------------------

class MoE(nn.Module):
    """[B, T, d] -> [B, T, d]. Expert weights are stacked 3-D parameters so an optimizer (Muon) can
    treat them as a batch of E matrices and an expert-parallel plan can shard dim 0.

    Aux-loss-free balancing (cfg.bias_update_rate > 0), the hooks a trainer drives:
      * `expert_bias` [E] (persistent fp32 buffer) is added to the router probabilities to choose the
        top-k experts; the weights of the chosen experts are still the un-biased probabilities.
      * every forward in training mode adds its per-expert assignment counts to `step_load`
        (non-persistent). Call pop_step_load() once per optimizer step to take and reset them, sum
        them over every rank that saw different tokens (DP and EP, not TP) and pass them to
        update_bias() together with the weight update of that step, so the microbatches of step t
        read the bias of version t-1. Activation recomputation would count a microbatch twice.
    """

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
        self.bias_update_rate = cfg.bias_update_rate
        # The one switch for torch._grouped_mm: on by default, honoured where grouped_mm_unsupported() finds
        # no reason against it (CUDA, bf16, SM80+, aligned widths); elsewhere the padded bmm runs, and on
        # CUDA the reason is logged once. The choice per (device, dtype) is made at first use and kept.
        self.use_grouped_mm = True
        self._kernels: dict[tuple[torch.device, torch.dtype], Kernel] = {}
        # Parallel plans replace this (asyncpp.parallel.experts.parallelize_moe); the model never looks inside.
        self.dispatcher: Dispatcher = LocalDispatcher()
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
        self.expert_bias: Tensor | None
        self.step_load: Tensor | None
        # Registered only when enabled, so models without it keep their state_dict keys.
        enabled = cfg.bias_update_rate > 0
        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32) if enabled else None)
        self.register_buffer("step_load", torch.zeros(E, dtype=torch.int64) if enabled else None, persistent=False)
        # Logging only; detached, overwritten every forward.
        self.last_aux_loss: Tensor | None = None
        self.last_expert_load: Tensor | None = None

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [N, d] -> (probs [N, E] float32, topk_weight [N, k] float32, topk_idx [N, k])."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        idx = self.choose(probs)
        weight = probs.gather(-1, idx)  # the chosen experts weigh their own probability, bias or not
        if self.normalize_topk:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        return probs, weight, idx

    def choose(self, probs: Tensor) -> Tensor:
        """The experts of each token [N, k] from its probabilities [N, E]: the top_k, steered by the expert
        bias when enabled (it steers which experts are chosen, never how much they weigh: DeepSeek-V3). The
        only discrete decision of the layer: a comparison of two implementations pins it (tests/routing.py)."""
        if self.expert_bias is None:
            return probs.topk(self.top_k, dim=-1).indices
        return (probs + self.expert_bias.float()).topk(self.top_k, dim=-1).indices

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        probs, weight, idx = self.route(x2)  # reads x2 before enter(): a replicated router needs no reduction
        region = self.dispatcher
        xe = region.enter(x2)
        out = self.experts_grouped(xe, region.scale(weight), idx)
        if self.shared_expert is not None:
            out = out + region.scale(torch.sigmoid(self.shared_gate(x2))) * self.shared_expert(xe)
        out = region.leave(out)
        aux, counts = load_balancing_loss(probs, idx, self.num_experts)
        self.last_aux_loss = aux.detach()
        self.last_expert_load = counts.detach()
        if self.step_load is not None and self.training:
            self.step_load += counts.detach()
        if self.aux_loss_coef > 0 and torch.is_grad_enabled():
            out = AttachAuxLoss.apply(out, aux * self.aux_loss_coef, self.aux_grad_scale)
        return out.reshape(shape)

    def experts_grouped(self, x: Tensor, weight: Tensor, idx: Tensor) -> Tensor:
        """x [N, d], weight/idx [N, k] -> sum_j weight[:, j] * expert_{idx[:, j]}(x) [N, d].

        Sort assignments by expert, let the dispatcher run them where the experts live (one grouped
        computation per rank), then weight and scatter-add back per token. Same contract as
        experts_reference.
        """
        order, token_of, counts = sort_assignments(idx, self.num_experts)
        rows = x.index_select(0, token_of)
        y = self.dispatcher.dispatch(rows, counts, self._local_experts)
        w_sorted = weight.flatten()[order].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, y * w_sorted[:, None])

    def _local_experts(self, rows: Tensor, counts: Tensor) -> Tensor:
        kernel = self.expert_kernel(rows.device, rows.dtype) if self.use_grouped_mm else "bmm"
        return grouped_swiglu(rows, counts, self.w_gate, self.w_up, self.w_down, kernel)

    def expert_kernel(self, device: torch.device, dtype: torch.dtype) -> Kernel:
        """The grouped kernel for experts computing on `device` in `dtype` (decided once per pair)."""
        key = (device, dtype)
        if key not in self._kernels:
            # The local expert matrices: w_gate/w_up [E, f, d], w_down [E, d, f] (f already TP-split).
            why = grouped_mm_unsupported(device, dtype, (self.w_gate.shape[2], self.w_gate.shape[1]))
            if why and device.type == "cuda":
                _log_once(f"MoE experts use the padded bmm instead of torch._grouped_mm: {why}")
            self._kernels[key] = "bmm" if why else "grouped_mm"
        return self._kernels[key]

    def pin_kernel(self, device: torch.device, dtype: torch.dtype, kernel: Kernel) -> None:
        """Decide the kernel for (device, dtype) in advance: a trace on meta tensors runs the kernel the GPU
        it stands for would choose (asyncpp/analysis/traced.py), not the reference the meta device gets."""
        self._kernels[(torch.device(device), dtype)] = kernel

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

    # ---- aux-loss-free balancing hooks (see the class docstring for the contract) -----------------

    def pop_step_load(self) -> Tensor:
        """This rank's assignments per expert [E] (int64) since the last call; resets the count."""
        if self.step_load is None:
            raise RuntimeError("pop_step_load() needs model.moe.bias_update_rate > 0 (aux-loss-free balancing is off).")
        load = self.step_load.clone()
        self.step_load.zero_()
        return load

    @torch.no_grad()
    def update_bias(self, load: Tensor) -> None:
        """b_i += rate * sign(mean(load) - load_i): under-loaded experts become likelier to be chosen."""
        if self.expert_bias is None:
            raise RuntimeError("update_bias() needs model.moe.bias_update_rate > 0 (aux-loss-free balancing is off).")
        load = load.to(device=self.expert_bias.device, dtype=torch.float32)
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> MoE:
        # model.to(bfloat16) casts every floating buffer; the bias moves in steps (~1e-3) that bf16
        # would round away, so it goes back to fp32 (device moves are kept).
        super()._apply(fn, recurse)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return self

    def init_weights(self, std: float, out_std: float, init: Initializer | None = None) -> None:
        init = init or GlobalRNG()
        init.normal_(self.router.weight, std)
        init.normal_(self.w_gate, std)
        init.normal_(self.w_up, std)
        init.normal_(self.w_down, out_std)
        if self.shared_expert is not None:
            self.shared_expert.init_weights(std, out_std, init)
            init.normal_(self.shared_gate.weight, std)
        # to_empty() leaves the buffers uninitialised too.
        if self.expert_bias is not None:
            self.expert_bias.zero_()
            self.step_load.zero_()

    def params_per_expert(self) -> int:
        return math.prod(self.w_gate.shape[1:]) + math.prod(self.w_up.shape[1:]) + math.prod(self.w_down.shape[1:])
