"""What each ATen op of a traced step costs on a GPU: FLOPs, bytes moved, a kernel or not, host dispatch time.

`CostTracer` is the meta trace's StepTracer (trace.py) that also books every op it dispatches into an `OpTable`:
per (action kind, op, input shapes) the count, FLOPs, bytes, whether it launches a kernel, and whether autograd's
engine ran it (a backward op: C++, no Python frame) or eager Python did (a forward op, with autograd's bookkeeping
when grad is on). A host read of a device value (trace.py's HostRead) is a synchronisation point in the table.

`Device` turns a table into time (steptime.py says how ops combine into a microbatch):

    device time of an op = max(FLOPs / (peak x efficiency), bytes / (HBM x efficiency), launch floor)
    host time of an op   = the per-op dispatch cost of its kind (forward / backward)

The free constants are named below with where each came from; steptime.py's calibration test checks them
against every row of bench/recorded/*.json.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch.utils.flop_counter import flop_registry

from asyncpp.analysis.trace import SCALAR_READ, StepTracer

aten = torch.ops.aten

# ---- the device table ------------------------------------------------------------------------------------------

MATMUL_EFFICIENCY = 788.0 / 989.0
"""cuBLAS's share of the dense bf16 peak on a large GEMM: an 8192^3 bf16 matmul ran at ~788 TFLOP/s on the lent
H200 (docs/gpu.md, /work/shared/research/gpu-anchors-2026-11-29.md). Used for every GEMM (mm, addmm, bmm,
baddbmm, _grouped_mm): smaller GEMMs reach less, which the calibration rows absorb within their tolerance."""
ATTENTION_EFFICIENCY = 0.40
"""Flash attention's share of the peak (forward and backward together, causal, head_dim 64-128, PyTorch's FA2 at
torch 2.11): fitted on the recorded smollm2_135m row, where attention is ~35% of the FLOPs (FA2 reaches ~35-50%
of an H100's peak in its authors' causal benchmarks, which brackets the fit)."""
HBM_EFFICIENCY = 4.3 / 4.8
"""The share of HBM bandwidth a memory-bound kernel reaches: device-to-device copies moved ~4.3 TB/s on the lent
H200 of 4.8 TB/s (the research note above); the same share is assumed on the H100."""
LAUNCH_FLOOR_S = 3.0e-6
"""The shortest a kernel occupies the device, back to back in one stream (launch, tail, the next's ramp): a few
microseconds on Hopper (NVIDIA's launch-latency figures, ~2-4 us); 3 us fitted within that range on the rows."""
HOST_FORWARD_OP_S = 15.0e-6
"""Host time of one eager op called from Python with autograd recording (the forward; also the optimizer and the
loss), views included, and the Python around it (Gated DeltaNet's chunk loop): fitted on the recorded
hybrid_moe_10b x4 rows, host-bound (8.1k forward and 11.6k backward ops per microbatch, three GDN layers' Python
loop), to their mean (220 ms local, 236 ms mcore); at the top of the 5-15 us per op usually quoted for eager PyTorch."""
HOST_BACKWARD_OP_S = 9.0e-6
"""Host time of one op run by autograd's C++ engine (the backward: no Python frame, but the dispatcher, the node's
bookkeeping, the allocator): fitted with HOST_FORWARD_OP_S on the same rows (one equation for two constants: the
ratio 15:9 is assumed, from the forward's Python frame and autograd's recording that the backward does not pay)."""


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float
    """Dense bf16 peak, FLOP/s."""
    hbm_bytes_per_s: float
    matmul_efficiency: float = MATMUL_EFFICIENCY
    attention_efficiency: float = ATTENTION_EFFICIENCY
    hbm_efficiency: float = HBM_EFFICIENCY
    launch_floor_s: float = LAUNCH_FLOOR_S
    host_forward_op_s: float = HOST_FORWARD_OP_S
    host_backward_op_s: float = HOST_BACKWARD_OP_S

    def kernel_time(self, kind: str, flops: float, nbytes: float) -> float:
        efficiency = {"matmul": self.matmul_efficiency, "attention": self.attention_efficiency}.get(kind, 1.0)
        compute = flops / (self.peak_flops * efficiency) if flops else 0.0
        return max(compute, nbytes / (self.hbm_bytes_per_s * self.hbm_efficiency), self.launch_floor_s)

    def host_time(self, backward: bool) -> float:
        return self.host_backward_op_s if backward else self.host_forward_op_s


DEVICES = {
    "H100": Device("H100 SXM", 989e12, 3.35e12),
    "H200": Device("H200", 989e12, 4.8e12),
}
"""Both: dense bf16 989 TFLOP/s (the same GH100 die and clocks); HBM3 3.35 TB/s vs HBM3e 4.8 TB/s."""


# ---- per-op cost -----------------------------------------------------------------------------------------------

NO_KERNEL = {aten.empty.memory_format, aten.empty_strided.default, aten.detach.default, aten.alias.default,
             aten.lift_fresh.default, SCALAR_READ, aten._local_scalar_dense.default, aten.set_.source_Storage,
             aten.set_.source_Storage_storage_offset, aten.resize_.default, aten.empty_like.default,
             aten.new_empty.default, aten.new_empty_strided.default, aten._to_copy.default,
             aten._unsafe_view.default, aten._reshape_alias.default}
"""Ops that allocate or relabel without touching memory on the device (_to_copy is re-admitted below when it
changes the dtype or device: then it is a copy kernel). _unsafe_view is a view whose schema does not say so."""
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm"}
ATTENTION = {"aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_flash_attention_backward",
             "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_efficient_attention_backward",
             "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_cudnn_attention_backward",
             "aten::_flash_attention_forward", "aten::_flash_attention_backward"}
ACTION = re.compile(r"^(U0|[A-Z])\d")
COMM_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::")


def is_view(func) -> bool:
    """An op whose outputs alias its inputs without writing them (view, transpose, expand, select, split, ...)."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def launches_kernel(func, args, out) -> bool:
    if func.name().startswith(COMM_PREFIXES):
        return False  # booked as communication, not compute (steptime.py)
    if func is aten._to_copy.default:
        src = args[0]
        return isinstance(out, torch.Tensor) and (out.dtype != src.dtype or out.device != src.device)
    return func not in NO_KERNEL and not is_view(func)


def grouped_mm_flops(a: torch.Tensor, b: torch.Tensor) -> int:
    """torch._grouped_mm: 2d x 3d (each row of a times its group's matrix), 3d x 2d, 2d x 2d (the weight gradient:
    a [K, M] x b [M, N] split along M, out [G, K, N]), 3d x 3d (a batched mm)."""
    if a.dim() == 2 and b.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * b.shape[2]
    if a.dim() == 3 and b.dim() == 2:
        return 2 * a.numel() * b.shape[1]
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]


def op_flops(func, args, kwargs, out) -> int:
    packet = func.overloadpacket
    if packet in flop_registry:
        return int(flop_registry[packet](*args, **kwargs, out_val=out))
    if func.name() == "aten::_grouped_mm":
        return grouped_mm_flops(args[0], args[1])
    return 0


def tensor_bytes(t: torch.Tensor, read: bool) -> int:
    """Bytes an op moves for t: its elements, or for an input at most its storage (a broadcast operand, an
    expanded view, is read once, not once per element it stands for)."""
    n = t.numel() * t.element_size()
    if read:
        try:
            n = min(n, t.untyped_storage().nbytes())
        except (RuntimeError, NotImplementedError):
            pass
    return n


def op_bytes(args, kwargs, out) -> int:
    inputs = [a for a in torch.utils._pytree.tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
    outputs = [t for t in torch.utils._pytree.tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return sum(tensor_bytes(t, True) for t in inputs) + sum(tensor_bytes(t, False) for t in outputs)


def op_kind(name: str) -> str:
    return "matmul" if name in MATMULS else "attention" if name in ATTENTION else "memory"


# ---- the table -------------------------------------------------------------------------------------------------

@dataclass
class OpRow:
    """One (action kind, segment, op, shapes) entry of a trace, summed over its calls."""

    op: str
    kind: str
    kernel: bool
    backward: bool
    calls: int = 0
    flops: float = 0.0
    bytes: float = 0.0


@dataclass
class OpTable:
    """Per action kind (F, B, U, S, T, E, G, ...: the first letter of an action, or a workload's own label): the
    ops in dispatch order, folded by (segment, op, shapes, backward or not): a segment is the ops between two host
    reads of one action; and the host reads (synchronisations) per kind."""

    rows: dict[str, dict[tuple, OpRow]] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    """Per kind: how many actions of that kind the trace ran (a microbatch's F is one)."""
    syncs: dict[str, int] = field(default_factory=dict)
    comm_bytes: dict[str, float] = field(default_factory=dict)
    """Per kind: the payload of its collectives (each op's largest tensor), not its stage-to-stage sends."""
    comm_ops: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, key: tuple, row: OpRow, flops: float, nbytes: float) -> None:
        entry = self.rows.setdefault(kind, {}).setdefault(key, row)
        entry.calls += 1
        entry.flops += flops
        entry.bytes += nbytes

    def ops(self, kind: str) -> list[OpRow]:
        return list(self.rows.get(kind, {}).values())

    def segments(self, kind: str) -> list[list[OpRow]]:
        """The ops of `kind` by segment (the ops between two host reads, summed over the kind's actions)."""
        out: dict[int, list[OpRow]] = {}
        for key, row in self.rows.get(kind, {}).items():
            out.setdefault(key[0], []).append(row)
        return [out[s] for s in sorted(out)]


def action_kind(action: str) -> str:
    """"F3.1@v2" -> "F", "U03" (UPDATE_START) -> "U0", "U3" -> "U" (schedules/actions.Action's str); anything else
    ("evaluate", "drain", a workload's own label) is its own kind."""
    match = ACTION.match(action)
    return match.group(1) if match else action


class CostTracer(StepTracer):
    """A StepTracer that also books every op's FLOPs, bytes, kernel and host cost into `table` (by action kind)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.table = OpTable()
        self._reads_seen = 0
        self.segment = 0
        """Host reads so far in the current action: ops between two reads are one segment (steptime.py)."""

    def begin(self, action: str) -> None:
        super().begin(action)
        self.segment = 0
        kind = action_kind(action)
        self.table.calls[kind] = self.table.calls.get(kind, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        backward = torch._C._current_graph_task_id() != -1
        out = super().__torch_dispatch__(func, types, args, kwargs)
        kind = action_kind(self.action)
        if len(self.host_reads) > self._reads_seen:  # a host read: the host waits for the device here
            self._reads_seen = len(self.host_reads)
            self.table.syncs[kind] = self.table.syncs.get(kind, 0) + 1
            self.table.add(kind, (self.segment, "<sync>"), OpRow("<host sync>", "sync", False, backward), 0, 0)
            self.segment += 1
            return out
        name = func.name()
        if name.startswith(COMM_PREFIXES):
            if "send" not in name and "recv" not in name:  # the stage links are steptime's p2p term
                tensors = [a for a in torch.utils._pytree.tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
                payload = max((tensor_bytes(t, False) for t in tensors), default=0)
                self.table.comm_bytes[kind] = self.table.comm_bytes.get(kind, 0.0) + payload
                self.table.comm_ops[kind] = self.table.comm_ops.get(kind, 0) + 1
            return out
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        kernel = launches_kernel(func, args, out)
        flops = op_flops(func, args, kwargs, out) if kernel else 0
        nbytes = op_bytes(args, kwargs, out) if kernel else 0
        self.table.add(kind, (self.segment, name, shapes, backward), OpRow(name, op_kind(name), kernel, backward), flops, nbytes)
        return out
