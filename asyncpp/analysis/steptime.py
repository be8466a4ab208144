"""The step-time model: a traced microbatch's ops (opcost.py) turned into time on an H100 or an H200.

Per op: device time = max(FLOPs / (peak x efficiency), bytes / (HBM x efficiency), launch floor) if it launches a
kernel, else 0; host time = the dispatch cost of an eager forward op or of an op autograd's engine runs.

How host and device overlap (eager PyTorch, one stream): the host enqueues kernels and runs ahead of the device,
which executes them in order; the device is never ahead of the host. Between two host reads of a device value
(a synchronisation: the host waits until the device has caught up), a segment of ops therefore takes
max(device time, host time): the device idles whenever the host is the slower one (the host-bound regime of a
Python loop of small ops), the host waits in its queue whenever the device is (large GEMMs). A segment's ops are
summed first (not max per op): the launch queue (~1,000 kernels deep) lets either side run ahead within a
segment. An action takes the sum of its segments.

`Workload` is bench/gpu.py's unit (a whole model or a middle stage's blocks, one microbatch forward + backward);
`calibration_rows` reads bench/recorded/*.json, whose rows tests/unit/test_steptime.py checks the model against.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import model_zoo.gated_deltanet as gdn_module
from asyncpp.analysis.opcost import DEVICES, CostTracer, Device, OpRow, OpTable, action_kind
from asyncpp.analysis.trace import AttentionPath
from asyncpp.analysis.traced import H100, pin_gpu_kernels
from asyncpp.reference.simulator import lm_loss
from model_zoo import ModelConfig, build_model, get_model_config
from model_zoo.backends.mcore import swap_to_mcore

RECORDED = Path(__file__).resolve().parents[2] / "bench" / "recorded"
GDN_FORMS = ("torch", "batched", "fused")  # trace_workload's Gated DeltaNet: chunk loop, batched form, FLA's what-if
"""Measured rows (bench/recorded/*.json, schema in bench/recorded/README.md): the model's calibration data."""


# ---- time of a traced action -----------------------------------------------------------------------------------

@dataclass
class Timing:
    """One action kind's predicted time per call, on one device."""

    total_s: float
    device_s: float
    host_s: float
    flops: float
    kernels: float
    ops: float
    syncs: float
    top: list[tuple[str, float, float]]
    """(op, seconds of device time per call, calls per action) of the ops with the most device time."""

    @property
    def bound(self) -> str:
        return "host" if self.host_s > self.device_s else "device"


def time_of(table: OpTable, kind: str, device: Device, top: int = 8) -> Timing:
    """The predicted time of one action of `kind` (the table's sum over its actions, divided by their count)."""
    calls = max(table.calls.get(kind, 1), 1)
    total = dev_total = host_total = 0.0
    per_op: dict[str, list[float]] = {}
    for segment in table.segments(kind):
        dev = host = 0.0
        for row in segment:
            host += row.calls * device.host_time(row.backward)
            if row.kernel:
                t = row_time(row, device)
                dev += t
                entry = per_op.setdefault(row.op, [0.0, 0.0])
                entry[0] += t
                entry[1] += row.calls
        total += max(dev, host)
        dev_total += dev
        host_total += host
    rows = table.ops(kind)
    ranked = sorted(per_op.items(), key=lambda kv: -kv[1][0])[:top]
    return Timing(total / calls, dev_total / calls, host_total / calls,
                  sum(r.flops for r in rows) / calls, sum(r.calls for r in rows if r.kernel) / calls,
                  sum(r.calls for r in rows if r.kind != "sync") / calls, table.syncs.get(kind, 0) / calls,
                  [(op, t / calls, n / calls) for op, (t, n) in ranked])


def row_time(row: OpRow, device: Device) -> float:
    """Device time of a folded row: each call its own kernel (the launch floor counts per call)."""
    return row.calls * device.kernel_time(row.kind, row.flops / row.calls, row.bytes / row.calls)


# ---- bench/gpu.py's workloads ----------------------------------------------------------------------------------

class Workload:
    """One microbatch's forward and backward of a whole model (embedding, blocks, head and fp32 loss) or of a middle
    pipeline stage's blocks (activation in, activation gradient in): bench/gpu.py's unit, traced here."""

    def __init__(self, name: str, cfg: ModelConfig, layers: range, whole_model: bool):
        self.name, self.cfg, self.layers, self.whole_model = name, cfg, layers, whole_model

    def build(self, device: torch.device | str) -> nn.Module:
        torch.manual_seed(0)
        model = build_model(self.cfg, device=device)
        if not self.whole_model:  # a middle stage: only its blocks
            model = nn.ModuleDict({"layers": nn.ModuleList(model.layers[i] for i in self.layers)})
        return model.to(torch.bfloat16)

    def step_fn(self, model: nn.Module, batch: int, seq: int, device: torch.device | str) -> Callable[[], None]:
        if self.whole_model:
            tokens = torch.randint(0, self.cfg.vocab_size, (batch, seq + 1), device=device)
            return lambda: lm_loss(model, tokens).backward()
        x = torch.randn(batch, seq, self.cfg.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn_like(x)

        def run() -> None:
            h = x
            for layer in model["layers"]:
                h = layer(h)
            h.backward(grad)
        return run


def workloads(smoke: bool, moe_layers: int = 4) -> list[Workload]:
    if smoke:
        dense, hybrid = get_model_config("tiny_dense"), get_model_config("tiny_hybrid")
        return [Workload("tiny_dense (smoke)", dense, range(dense.num_layers), True),
                Workload("tiny_hybrid x4 (smoke)", hybrid, range(4), False)]
    smol = get_model_config("smollm2_135m")
    hybrid = get_model_config("hybrid_moe_10b", num_layers=moe_layers)  # the gdn,gdn,gdn,attn period, tiled
    return [Workload("smollm2_135m", smol, range(smol.num_layers), True),
            Workload(f"hybrid_moe_10b x{moe_layers}", hybrid, range(moe_layers), False)]


def workload_named(name: str) -> Workload:
    """The workload of a recorded row's name ("smollm2_135m", "hybrid_moe_10b x4", "tiny_dense (smoke)")."""
    layers = int(name.split(" x")[1].split()[0]) if " x" in name else 4
    found = [w for w in workloads("(smoke)" in name, layers) if w.name == name]
    if not found:
        raise ValueError(f"recorded row workload={name!r}: not one of bench/gpu.py's workloads")
    return found[0]


def mcore_swiglu_stand_in(y: Tensor, bias: None) -> Tensor:
    """megatron-core's bias_swiglu_impl(y, None) = silu(gate) * up on y = [gate | up]: one fused kernel forward and
    one backward on the GPU (torch.jit), three element-wise ops here; the stand-in keeps the GEMM on the
    concatenated weights, which is what differs in cost (a per-call cat of the two weight matrices)."""
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- what if Gated DeltaNet ran as one fused kernel ------------------------------------------------------------

FUSED_GDN_KERNELS = (6, 12)
"""Launches of a fused chunked GDN (flash-linear-attention's chunk_gated_delta_rule, 0.6): forward the gate's
cumsum, beta K K^T, its triangular solve, w and u, the chunk states, the output; the backward recomputes the
states and runs about twice as many. An estimate for the what-if, not a count of FLA's code."""
FUSED_GDN_BACKWARD_BYTES = 2.5
"""The backward's bytes against the forward's: it reads q, k, v, g, beta, the output's gradient and the recomputed
chunk states and writes five gradients (an estimate: 2-3x)."""


def fused_gdn_cost(q: Tensor, v: Tensor, chunk: int, backward: bool) -> tuple[float, float]:
    """(FLOPs, bytes) of a fused chunked GDN pass: the FLOPs of model_zoo.counting's GDN term (3 H [6 Dk Dv +
    C (5 Dk + 3 Dv)] per token for forward + backward: a third forward), the bytes of its inputs, output and fp32
    chunk states (one [Dk, Dv] per head per chunk)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    flops = b * t * 3 * h * (6 * dk * dv + chunk * (5 * dk + 3 * dv))
    io = b * t * h * (2 * dk + 2 * dv) * q.element_size() + 2 * b * t * h * 4
    states = b * h * -(-t // chunk) * dk * dv * 4
    forward = (flops / 3, io + states)
    return (flops * 2 / 3, forward[1] * FUSED_GDN_BACKWARD_BYTES) if backward else forward


class _FusedGDN(torch.autograd.Function):
    """Shapes only (meta): books a fused kernel's cost into the tracer instead of running the chunk loop."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, tracer, chunk):  # type: ignore[override]
        ctx.tracer, ctx.chunk, ctx.shapes = tracer, chunk, (q, k, v, g, beta)
        ctx.save_for_backward(q, v)
        book_fused(tracer, q, v, chunk, backward=False)
        return v.new_empty(v.shape)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, v = ctx.saved_tensors
        book_fused(ctx.tracer, q, v, ctx.chunk, backward=True)
        return (*(x.new_empty(x.shape) for x in ctx.shapes), None, None)


def book_fused(tracer: CostTracer, q: Tensor, v: Tensor, chunk: int, backward: bool) -> None:
    flops, nbytes = fused_gdn_cost(q, v, chunk, backward)
    kernels = FUSED_GDN_KERNELS[backward]
    kind = action_kind(tracer.action)
    for i in range(kernels):
        row = OpRow("fused chunk_gated_delta_rule (what-if)", "attention", True, backward)
        tracer.table.add(kind, (tracer.segment, row.op, i, backward), row, flops / kernels, nbytes / kernels)


@contextmanager
def fused_gdn(tracer: CostTracer) -> Iterator[None]:
    """GatedDeltaNet's chunk_gated_delta_rule replaced, for one trace, by a fused kernel's booked cost."""
    saved = gdn_module.chunk_gated_delta_rule

    def stand_in(q, k, v, g, beta, chunk_size=64, initial_state=None):
        return _FusedGDN.apply(q, k, v, g, beta, tracer, min(chunk_size, q.shape[1])), None

    gdn_module.chunk_gated_delta_rule = stand_in
    try:
        yield
    finally:
        gdn_module.chunk_gated_delta_rule = saved


def trace_workload(w: Workload, backend: str = "local", batch: int = 4, seq: int = 4096,
                   capability: tuple[int, int] = H100, gdn: str = "torch") -> OpTable:
    """One microbatch of `w` on meta tensors, as bench/gpu.py runs it on a GPU of `capability` (bf16, the MoE
    kernel that GPU picks, SDPA's flash kernel, no compile; Gated DeltaNet's chunk loop (gdn="torch"), its batched
    form ("batched", the CUDA default where FLA is not checked) or one fused kernel's booked cost ("fused": FLA's
    kernel as a what-if, fused_gdn). Kind "microbatch"."""
    model = w.build("meta")
    if backend == "mcore":
        swap_to_mcore(model, log=lambda m: None, swiglu=mcore_swiglu_stand_in, rms_norm=None)
    elif backend != "local":
        raise ValueError(f"backend={backend!r}: the step-time model traces local and mcore (te needs its own kernels)")
    if gdn not in GDN_FORMS:
        raise ValueError(f"gdn={gdn!r}: expected one of {GDN_FORMS}")
    pin_gpu_kernels(model, torch.device("meta"), torch.bfloat16, capability, gdn="batched" if gdn == "batched" else "torch")
    step = w.step_fn(model, batch, seq, "meta")
    tracer = CostTracer("meta")
    tracer.start()
    with AttentionPath(gpu=True, tracer=tracer), tracer, fused_gdn(tracer) if gdn == "fused" else nullcontext():
        tracer.begin("microbatch")
        step()
        tracer.end()
    return tracer.table


# ---- the recorded rows -----------------------------------------------------------------------------------------

def recorded_files(folder: Path = RECORDED) -> list[Path]:
    return sorted(folder.glob("*.json"))


def calibration_rows(folder: Path = RECORDED) -> list[dict]:
    """Every stage row of every recorded file, with its file's device and setup merged in; only the rows that ran
    the kernels the model traces (Gated DeltaNet's chunk loop or batched form, no torch.compile, backend local or
    mcore)."""
    rows = []
    for path in recorded_files(folder):
        data = json.loads(path.read_text())
        for row in data["stages"]:
            setup = {**data["setup"], **row.get("setup", {})}
            if setup.get("gdn_kernel") in ("torch", "batched") and not setup.get("compile") \
                    and row["backend"] in ("local", "mcore"):
                rows.append({**row, "setup": setup, "device_model": data["device"]["model"], "file": path.name})
    return rows


def predict_row(row: dict, tables: dict | None = None) -> dict:
    """The model's tokens/s for a recorded row (tables: a cache of traced workloads by (name, backend, shape))."""
    setup = row["setup"]
    batch, seq = setup["micro_batch_size"], setup["seq_len"]
    gdn = setup.get("gdn_kernel", "torch")  # calibration_rows keeps "torch" and "batched" rows
    key = (row["workload"], row["backend"], batch, seq, gdn)
    cache = tables if tables is not None else {}
    if key not in cache:
        cache[key] = trace_workload(workload_named(row["workload"]), row["backend"], batch, seq, gdn=gdn)
    timing = time_of(cache[key], "microbatch", DEVICES[row["device_model"]])
    predicted = batch * seq / timing.total_s
    return {"workload": row["workload"], "backend": row["backend"], "measured_tokens_per_s": row["tokens_per_s"],
            "predicted_tokens_per_s": predicted, "ratio": predicted / row["tokens_per_s"], "timing": timing}
