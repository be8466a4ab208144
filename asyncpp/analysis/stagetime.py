"""Predicted before measured: every stage of a layout traced with costs (traced.py + opcost.CostTracer), its time per
microbatch on an H100 and an H200 (steptime.py), and the job's tokens/s per GPU from the pipeline's own schedule
(asyncpp.schedules.costmodel.predict) with the links below. Printed by `dry_run=N dry_run_trace=true`.

What is assumed, and printed with the figures:
- the kernels a user gets by default on CUDA today: eager, Gated DeltaNet's PyTorch form where FLA's kernel does not
  run, the MoE's grouped GEMM, SDPA's flash kernel, no torch.compile (what the recorded rows ran);
- links: NVLink 450 GB/s one way per GPU inside a node of 8 (H100/H200 SXM: NVLink 4, 900 GB/s both ways), one
  400 Gb/s InfiniBand NIC per GPU (50 GB/s) between nodes; ranks are stage-major (a stage's dp x tp ranks are
  neighbours), so a stage's collectives stay in a node when it has <= 8 ranks, and the stage-to-stage sends cross
  nodes when the job has more than 8 GPUs;
- a collective inside an action (the expert all-to-all, TP) is on its critical path: payload / link added to the
  action (its largest tensor once: a ring all-reduce moves up to twice that); the DP reduction started in
  UPDATE_START overlaps the next compute as the cost model's dp_comm; a stage-to-stage send is the cost model's
  `comm` latency, micro batch x seq x hidden bf16 values.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncpp.analysis.opcost import DEVICES, Device, OpTable
from asyncpp.analysis.steptime import Timing, time_of
from asyncpp.analysis.traced import StageTrace
from asyncpp.config import RunConfig
from asyncpp.parallel.mesh import ParallelDims
from asyncpp.schedules.costmodel import OpCosts, predict
from model_zoo import ModelConfig

NVLINK_BYTES_PER_S = 450e9
IB_BYTES_PER_S = 50e9
GPUS_PER_NODE = 8
MICROBATCH_KINDS = ("F", "B", "S", "T", "E", "G")
"""Per-microbatch actions (schedules/actions.Op): forward, backward, the vocabulary head's S and T, the sharded
embedding's E and G."""


@dataclass(frozen=True)
class Links:
    p2p: float
    collective: float

    def describe(self) -> str:
        def name(bw: float) -> str:
            return f"NVLink {bw / 1e9:.0f} GB/s" if bw == NVLINK_BYTES_PER_S else f"InfiniBand {bw / 1e9:.0f} GB/s"
        return f"stage-to-stage {name(self.p2p)}, collectives in a stage {name(self.collective)} (one way, per GPU)"


def links_for(dims: ParallelDims) -> Links:
    world = dims.pp * dims.dp * dims.tp
    p2p = NVLINK_BYTES_PER_S if world <= GPUS_PER_NODE else IB_BYTES_PER_S
    collective = NVLINK_BYTES_PER_S if dims.dp * dims.tp <= GPUS_PER_NODE else IB_BYTES_PER_S
    return Links(p2p, collective)


@dataclass
class StageTime:
    stage: int
    device: str
    kinds: dict[str, float]
    """Seconds per action of each kind (compute and its collectives)."""
    timings: dict[str, Timing]
    microbatch_s: float
    update_s: float
    dp_comm_s: float
    flops_per_microbatch: float
    mfu: float
    bound: str
    top: list[tuple[str, float]]


def stage_time(table: OpTable, stage: int, device: Device, links: Links) -> StageTime:
    kinds, timings = {}, {}
    for kind in (*MICROBATCH_KINDS, "U0", "U"):
        if kind not in table.calls:
            continue
        calls = table.calls[kind]
        timings[kind] = time_of(table, kind, device, top=12)
        kinds[kind] = timings[kind].total_s + table.comm_bytes.get(kind, 0.0) / calls / links.collective
    # The DP reduction and the cross-stage norm run from UPDATE_START on; the UPDATE waits for them (costmodel).
    dp_bytes = sum(table.comm_bytes.get(k, 0.0) / table.calls[k] for k in ("U0", "U") if k in table.calls)
    update = timings["U"].total_s if "U" in timings else 0.0
    mb = [k for k in MICROBATCH_KINDS if k in kinds]
    microbatch = sum(kinds[k] for k in mb)
    flops = sum(timings[k].flops for k in mb)
    ops: dict[str, float] = {}
    for k in mb:
        for op, seconds, _ in timings[k].top:
            ops[op] = ops.get(op, 0.0) + seconds
    host = sum(timings[k].host_s for k in mb)
    dev = sum(timings[k].device_s for k in mb)
    return StageTime(stage, device.name, kinds, timings, microbatch, update, dp_bytes / links.collective, flops,
                     flops / microbatch / device.peak_flops if microbatch else 0.0, "host" if host > dev else "device",
                     sorted(ops.items(), key=lambda kv: -kv[1])[:5])


def job_time(cfg: RunConfig, hidden_size: int, dims: ParallelDims, stages: list[StageTime], links: Links,
             device: Device, num_microbatches: int | None = None) -> dict:
    """The pipeline's predicted step time with these stage times (costmodel.predict over the run's schedule) and
    the job's tokens/s per GPU; num_microbatches: the run's m (default cfg's; an action's time does not depend on
    it, so a trace at m = P predicts a run at any m)."""
    t = cfg.train
    m = num_microbatches or t.num_microbatches
    hidden_bytes = t.micro_batch_size * t.seq_len * hidden_size * 2
    costs = OpCosts(forward=[s.kinds.get("F", 0.0) for s in stages], backward=[s.kinds.get("B", 0.0) for s in stages],
                    update=[s.update_s for s in stages], comm=hidden_bytes / links.p2p,
                    dp_comm=[s.dp_comm_s for s in stages],
                    vocab_forward=[s.kinds.get("S", 0.0) for s in stages],
                    vocab_backward=[s.kinds.get("T", 0.0) for s in stages],
                    embed_forward=[s.kinds.get("E", 0.0) for s in stages],
                    embed_backward=[s.kinds.get("G", 0.0) for s in stages])
    result = predict(cfg.schedule.name, dims.pp, m, 4, costs, collective_updates=True,
                     vocab_parallel=cfg.parallel.head == "vocab", sharded_embedding=cfg.parallel.embedding == "vocab")
    tokens = m * t.micro_batch_size * t.seq_len * dims.dp
    world = dims.pp * dims.dp * dims.tp
    return {"step_s": result["step_time"], "bubble": result["bubble"], "tokens_per_step": tokens,
            "tokens_per_s_per_gpu": tokens / result["step_time"] / world,
            "num_microbatches": m, "mfu": sum(s.flops_per_microbatch for s in stages) * m * dims.dp
            / result["step_time"] / world / device.peak_flops}


def prediction_report(cfg: RunConfig, model_cfg: ModelConfig, dims: ParallelDims, traces: list[StageTrace],
                      num_microbatches: int | None = None) -> tuple[str, dict]:
    """The table `dry_run_trace` prints: per stage and device the predicted time per microbatch, what bounds it,
    the MFU and the top ops; per device the job's step and tokens/s per GPU. Returns (text, JSON-able dict)."""
    links = links_for(dims)
    lines = [("predicted step time (asyncpp/analysis/steptime.py; eager PyTorch as the recorded rows ran it: PyTorch "
             "Gated DeltaNet, grouped-GEMM experts, flash SDPA, no compile; bf16 dense peak 989 TFLOP/s)"),
             f"  links: {links.describe()}; collectives on the action's critical path, DP reduction overlapped",
             (f"  {'stage':>5} {'GPU':8} {'F ms':>8} {'B ms':>8} {'other ms':>8} {'per mb ms':>9} {'bound':6} "
             f"{'MFU':>6} {'update ms':>9}  top ops by predicted device time per microbatch (ms)")]
    out: dict = {"links": links.describe(), "devices": {}}
    for key, device in DEVICES.items():
        stages = [stage_time(tr.costs, tr.stage, device, links) for tr in traces]
        for s in stages:
            other = s.microbatch_s - s.kinds.get("F", 0.0) - s.kinds.get("B", 0.0)
            top = ", ".join(f"{op.removeprefix('aten::')} {sec * 1e3:.1f}" for op, sec in s.top)
            lines.append(f"  {s.stage:>5} {key:8} {s.kinds.get('F', 0) * 1e3:>8.1f} {s.kinds.get('B', 0) * 1e3:>8.1f} "
                         f"{other * 1e3:>8.1f} {s.microbatch_s * 1e3:>9.1f} {s.bound:6} {s.mfu:>6.1%} "
                         f"{s.update_s * 1e3:>9.1f}  {top}")
        entry = {"stages": [{"stage": s.stage, "kinds_s": s.kinds, "microbatch_s": s.microbatch_s, "mfu": s.mfu,
                             "bound": s.bound, "update_s": s.update_s, "top": s.top} for s in stages]}
        if len(stages) == dims.pp:
            job = job_time(cfg, model_cfg.hidden_size, dims, stages, links, device, num_microbatches)
            entry["job"] = job
            lines.append(f"  job on {key}: {cfg.schedule.name}, {dims.pp} stages x {job['num_microbatches']} "
                         f"microbatches, step {job['step_s']:.3f} s (bubble {job['bubble']:.1%}), "
                         f"{job['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, MFU {job['mfu']:.1%}")
        out["devices"][key] = entry
    if len(traces) != dims.pp:
        lines.append(f"  (the job's tokens/s needs every stage traced: {len(traces)} of {dims.pp} were)")
    return "\n".join(lines), out
