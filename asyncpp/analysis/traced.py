"""One pipeline stage's training step at real size, on meta tensors: `dry_run=N dry_run_trace=true`.

The stage is the run's own: the mesh on a fake process group (dryrun.py), `build_rank_stage` on meta, the
trainer's `PipelineExecutor`, composed as a run composes it (pipeline/compose.py: `build_stage_runtime` builds its
engine, and its microbatch forward is the run's), the run's optimizer. The engine then executes the stage's schedule for `steps` steps, drained at both
ends like one segment of a run: every FORWARD, BACKWARD, UPDATE_START and UPDATE, the drain, then the
checkpoint state a save would write. A StepTracer (trace.py) watches it: live storage bytes per action, every
host read with its call site, every collective and p2p op. Nothing is allocated and nothing is sent.

What differs from a run on the GPU, and how it is handled:
- the MoE kernel: the meta device would get the CPU's reference (the padded bmm); `as_gpu` pins the kernel
  the GPU would choose (model_zoo.moe.grouped_mm_unsupported at the given compute capability);
- host reads have no values on meta: StandIns (trace.py), with the balanced router's counts for the integers;
- p2p receives on the fake group arrive as they were allocated: `FilledComm` fills them (one fill_ per
  receive, also on meta, so a real CPU run of the same stage runs the same ops: the tests compare the two);
- the stop agreement and the bubble gather (gloo, CPU tensors: host-side, no device sync) are not run.
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.optim.optimizer as torch_optimizer
from torch import Tensor
from torch.autograd.profiler import record_function

import asyncpp.optim.build as optim_build
from asyncpp.analysis.dryrun import BuildOptimizer, fake_group
from asyncpp.analysis.trace import AttentionPath, CommOp, HostRead, StandIns, StepTracer, needed
from asyncpp.config import RunConfig
from asyncpp.core.masters import compute_dtype_of
from asyncpp.parallel.mesh import ParallelDims
from asyncpp.pipeline.build import build_rank_stage, mesh_for
from asyncpp.pipeline.compose import pipeline_executor
from asyncpp.pipeline.executor import PipelineExecutor
from asyncpp.pipeline.memory import STEADY_STEPS
from asyncpp.pipeline.p2p import StageComm
from asyncpp.schedules.actions import Action
from model_zoo import ModelConfig
from model_zoo.gated_deltanet import GatedDeltaNet, Kernel
from model_zoo.moe import MoE, grouped_mm_unsupported

TRACED_WINDOW = "asyncpp.traced_step"
H100 = (9, 0)
"""The compute capability the trace stands for by default (the paper's GPUs)."""


def fill_received(buf: Tensor) -> Tensor:
    """What a fake group's receive leaves in `buf`, made finite: a small constant (0 for integers)."""
    return buf.fill_(0.01 if buf.is_floating_point() else 0)


class FilledComm(StageComm):
    """The stage links on a fake process group: a receive completes at once and writes nothing, so each
    received buffer is filled with a small constant (finite activations and gradients in a real CPU run)."""

    def _arrived(self, buf: Tensor) -> Tensor:
        return fill_received(buf)


class FilledCollectives:
    """The fake process group completes a collective at once and writes nothing into its output. On meta that is
    harmless (no values); on a real device an all-to-all's output would be uninitialized memory, and the expert
    dispatcher reads its split sizes from the exchanged token counts (garbage sizes, seen on an H200). So, as
    FilledComm does for the stage links: each peer is taken to send what this rank sends (an all-to-all
    returns its input, the symmetric balanced exchange) and an all-gather returns its input repeated. A broadcast
    fills a receiver's buffer with a small constant: left as allocated, the vocabulary head's hidden states and the
    distributed optimizer's weight shards were garbage on the H200, and the steps they fed were skipped as
    non-finite (two of three, so the update ran once per stage in the traced window; on the CPU, now and then, so the
    tiny runs' op sequences differed from the meta trace's: a flaky test_traced_step)."""

    def __init__(self):
        self.saved = dist.all_to_all_single, dist.all_gather_into_tensor, dist.broadcast

    def __enter__(self):
        a2a, gather, bcast = self.saved

        def all_to_all_single(output, input, *args, **kwargs):
            work = a2a(output, input, *args, **kwargs)
            if output.shape == input.shape:
                output.copy_(input)
            else:
                fill_received(output)
            return work

        def all_gather_into_tensor(output, input, *args, **kwargs):
            work = gather(output, input, *args, **kwargs)
            output.view(-1, *input.shape).copy_(input.unsqueeze(0).expand(output.numel() // input.numel(), *input.shape))
            return work

        def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
            work = bcast(tensor, src=src, group=group, async_op=async_op, group_src=group_src)
            source = group_src if group_src is not None else dist.get_group_rank(group, src) if group else src
            if dist.get_rank(group) != source:
                fill_received(tensor)
            return work

        dist.all_to_all_single, dist.all_gather_into_tensor, dist.broadcast = all_to_all_single, all_gather_into_tensor, broadcast
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single, dist.all_gather_into_tensor, dist.broadcast = self.saved


class TokenSource:
    """Token blocks on the stage's device: random on the CPU and CUDA (seeded by index), shapes only on meta."""

    def __init__(self, cfg: RunConfig, vocab_size: int, device: torch.device):
        self.shape = (cfg.train.micro_batch_size, cfg.train.seq_len + 1)
        self.vocab_size, self.device, self.eval_batches = vocab_size, device, cfg.train.eval_batches

    def train_microbatch(self, index: int) -> Tensor:
        # A generator on the tensor's own device (a CUDA tensor needs a CUDA one); meta has none and ignores it.
        g = torch.Generator("cpu" if self.device.type == "meta" else self.device).manual_seed(index)
        return torch.empty(self.shape, dtype=torch.int64, device=self.device).random_(0, self.vocab_size, generator=g)

    def val_batches(self) -> list[Tensor]:
        return [self.train_microbatch(-1 - i) for i in range(self.eval_batches)]


@dataclass
class StageTrace:
    stage: int
    rank: int
    device: str
    kernels: dict[str, str]
    attention: dict[str, int]
    plan: dict
    plan_table: str
    steps: int
    microbatches: int
    peak_bytes: int
    start_bytes: int
    cyclic_bytes: int
    """The most bytes a garbage collection freed at an action's end: storages only reference cycles held."""
    actions: list = field(default_factory=list)
    host_reads: list[HostRead] = field(default_factory=list)
    comms: list[CommOp] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    op_actions: list[str] = field(default_factory=list)
    scalars: list = field(default_factory=list)
    host_copies: set[int] = field(default_factory=set)
    wall_s: float = 0.0
    costs: object = None
    """The OpTable of a trace run with opcost.CostTracer (tracer_cls): every op's FLOPs, bytes and host cost by
    action kind, for the step-time model (steptime.py); None for a plain StepTracer."""
    updates: list[dict] = field(default_factory=list)
    """Per step whose update ran in the window: its gradient norm and whether it was skipped (a step that
    skips measures no optimizer step: on a real device, unfilled receive buffers make non-finite steps)."""

    def reads_per_step(self) -> dict[str, float]:
        """Host reads by call site, per training step (the reads of training actions / steps; evaluation
        and the checkpoint state apart)."""
        counts: dict[str, int] = {}
        for r in self.host_reads:
            if r.action in ("evaluate", "checkpoint state", "drain"):
                continue
            counts[r.site] = counts.get(r.site, 0) + 1
        return {site: n / self.steps for site, n in counts.items()}

    def report(self) -> str:
        """The peak next to the plan's items, the host reads with their sites, the communication by op."""
        mib = 2**20
        lines = [self.plan_table,
                 f"  traced peak (live storages, {self.steps} steps x {self.microbatches} microbatches on "
                 f"{self.device})".ljust(50) + f"{self.peak_bytes / mib:>10.2f}  "
                 f"({self.peak_bytes / max(self.plan['total_bytes'], 1):.3f} of the plan)",
                 f"  kernels (MoE, GDN): {self._kernel_summary()}; attention: {self.attention or 'no attention layer'}"]
        lines.append(f"  held only by reference cycles at an action's end (freed by gc): {self.cyclic_bytes / mib:.2f} MiB")
        skipped = [u["step"] for u in self.updates if u["skipped"]]
        lines.append(f"  updates in the window: {len(self.updates) - len(skipped)} applied"
                     + (f", skipped at steps {skipped} (non-finite)" if skipped else ", none skipped"))
        worst = max(self.actions, key=lambda a: a.peak_bytes) if self.actions else None
        if worst is not None:
            lines.append(f"  the peak is reached in {worst.action}")
        lines.append(f"  host reads of device values: {len(self.host_reads)} in all; per training step, by call site:")
        for site, n in sorted(self.reads_per_step().items(), key=lambda kv: -kv[1]):
            kinds = sorted({f"{r.kind}: {r.op}" for r in self.host_reads if r.site == site})
            why = needed(site)
            lines.append(f"    {n:>7.2f}  {site}  [{'; '.join(kinds)}]  " + (f"needed: {why}" if why else "NOT NEEDED"))
        other: dict[tuple[str, str, str], int] = {}
        for r in self.host_reads:
            if r.action in ("evaluate", "checkpoint state", "drain"):
                key = (r.action, r.site, f"{r.kind}: {r.op}")
                other[key] = other.get(key, 0) + 1
        for (action, site, what), n in other.items():
            lines.append(f"    {n:>7d}  {site}  [{what}]  ({action}, once)")
        by_op: dict[str, int] = {}
        for c in self.comms:
            by_op[c.op] = by_op.get(c.op, 0) + 1
        lines.append("  communication: " + (", ".join(f"{op} x{n}" for op, n in sorted(by_op.items())) or "none"))
        return "\n".join(lines)

    def _kernel_summary(self) -> str:
        if not self.kernels:
            return "no MoE or GDN layer (or the device's own choice)"
        counts: dict[str, int] = {}
        for k in self.kernels.values():
            counts[k] = counts.get(k, 0) + 1
        return ", ".join(f"{k} x{n}" for k, n in counts.items())

    def to_dict(self) -> dict:
        return {"stage": self.stage, "rank": self.rank, "device": self.device, "kernels": self.kernels,
                "attention": self.attention,
                "plan": self.plan, "steps": self.steps, "microbatches": self.microbatches,
                "peak_bytes": self.peak_bytes, "start_bytes": self.start_bytes, "cyclic_bytes": self.cyclic_bytes,
                "wall_s": self.wall_s, "updates": self.updates,
                "actions": [vars(a) for a in self.actions], "reads_per_step": self.reads_per_step(),
                "host_reads": [r.to_dict() for r in self.host_reads], "comms": [c.to_dict() for c in self.comms]}


def balanced_stand_ins(cfg: RunConfig, model_cfg: ModelConfig, dims: ParallelDims) -> StandIns:
    """Host-read stand-ins of a balanced router (the memory plan's moe_imbalance=1): every expert gets
    tokens * top_k / experts rows of each rank's microbatch, every EP peer tokens * top_k / ep of them."""
    moe = model_cfg.moe
    if moe is None:
        return StandIns()
    assignments = cfg.train.micro_batch_size * cfg.train.seq_len * moe.top_k
    per_expert = math.ceil(assignments * dims.ep / moe.num_experts)  # rows of a local expert, from every peer
    return StandIns(ints={"asyncpp/parallel/experts.py": math.ceil(assignments / dims.ep),
                          "model_zoo/moe.py": per_expert})


def pin_gpu_kernels(model, device: torch.device, dtype: torch.dtype, capability: tuple[int, int],
                    gdn: Kernel | None = None) -> dict:
    """Every MoE layer runs, on `device`, the kernel a GPU of `capability` would choose; with `gdn`, every Gated
    DeltaNet layer runs that form ("batched": the CUDA default where FLA's kernel has not passed its check, which
    a meta or fake-CUDA trace cannot run). Returns the choices by module name."""
    chosen = {}
    for name, m in model.named_modules():
        if isinstance(m, MoE):
            widths = (m.w_gate.shape[2], m.w_gate.shape[1])
            why = grouped_mm_unsupported(torch.device("cuda"), dtype, widths, capability)
            kernel = "bmm" if why or not m.use_grouped_mm else "grouped_mm"
            m.pin_kernel(device, dtype, kernel)
            chosen[name] = kernel + (f" ({why})" if why else "")
        elif isinstance(m, GatedDeltaNet) and gdn is not None:
            m.kernel = gdn
            chosen[name] = f"gdn {gdn}"
    return chosen


@contextmanager
def fused_kernels_on_meta():
    """The optimizer the run builds on a GPU or a CPU: fused AdamW (asyncpp/optim/build.py asks torch which
    devices have fused kernels). torch's list leaves out meta although the fused kernels have meta
    implementations, so a meta stage would get the foreach variant and its temporaries (a copy of the state
    per update); for the trace, meta is on the list."""
    saved = torch_optimizer._get_fused_kernels_supported_devices, optim_build._get_fused_kernels_supported_devices

    def with_meta() -> list[str]:
        return [*saved[0](), "meta"]

    torch_optimizer._get_fused_kernels_supported_devices = optim_build._get_fused_kernels_supported_devices = with_meta
    try:
        yield
    finally:
        torch_optimizer._get_fused_kernels_supported_devices, optim_build._get_fused_kernels_supported_devices = saved


class MarkingActions:
    """The engine's observer (engine.ActionObserver): every action's boundaries marked in the tracer, so that an
    action's ops and bytes are booked to it (the parts' S, T, E and G included)."""

    def __init__(self, tracer: StepTracer):
        self.tracer = tracer

    def begin(self, a: Action) -> None:
        self.tracer.begin(str(a))

    def end(self, a: Action) -> None:
        self.tracer.end()


@contextmanager
def marking_actions(executor: PipelineExecutor, tracer: StepTracer):
    """Mark every action's boundaries in the tracer while the block runs (the engine's observer)."""
    engine = executor.engine
    saved, engine.observer = engine.observer, MarkingActions(tracer)
    try:
        yield
    finally:
        engine.observer = saved


TRACED_STEPS = STEADY_STEPS
"""The steps a trace runs by default: the plan's own list length (pipeline/memory.STEADY_STEPS says why), so the
trace holds what the plan counts. At 3 steps the steady-state UPDATE(1) fell into the drain, and hybrid_moe_10b_8gpu's
last stage traced 0.90 of its plan."""


def trace_stage(cfg: RunConfig, model_cfg: ModelConfig, world_size: int, stage: int, build_optimizer: BuildOptimizer, *,
                device: str = "meta", steps: int = TRACED_STEPS, stand_ins: StandIns | None = None, record: bool = False,
                as_gpu: tuple[int, int] | None = H100, evaluate: bool = True,
                tracer_cls: type[StepTracer] = StepTracer) -> StageTrace:
    """Run `steps` steps of `stage`'s schedule (drained at both ends) on `device` under a StepTracer.

    TRACED_STEPS by default (why: its docstring).

    device="meta": the real size, nothing allocated. device="cpu" with record=True: a real run of the same stage
    on the same fake group (the tests run a tiny model both ways). as_gpu: the MoE kernel of a GPU of that
    compute capability (None: the device's own choice). tracer_cls: opcost.CostTracer books every op's cost too
    (StageTrace.costs)."""
    p = cfg.parallel
    dims = ParallelDims.for_world(world_size, pp=p.pp, tp=p.tp, ep=p.ep, dp=p.dp)
    if not 0 <= stage < dims.pp:
        raise ValueError(f"dry_run_stage={stage}: the layout has stages 0..{dims.pp - 1}")
    rank = stage * dims.dp * dims.tp  # dp rank 0, tp rank 0 of the stage (as dryrun.py)
    target = torch.device(device)
    fake_group(rank, world_size)
    try:
        # Filled on meta too (nothing to fill there): the meta trace then runs the real run's op sequence.
        with fused_kernels_on_meta(), FilledCollectives():
            return _trace(cfg, model_cfg, dims, stage, rank, target, build_optimizer, steps, stand_ins, record,
                          as_gpu, evaluate, tracer_cls)
    finally:
        dist.destroy_process_group()


def _trace(cfg: RunConfig, model_cfg: ModelConfig, dims, stage, rank, target, build_optimizer, steps, stand_ins, record,
           as_gpu, evaluate, tracer_cls) -> StageTrace:
    # The trace saves nothing, and an async save's background gloo group cannot be made on the fake backend (a
    # recipe with checkpoint.async_save=true failed here: "ProcessGroupGloo ... Not implemented").
    cfg = cfg.replace(checkpoint=dataclasses.replace(cfg.checkpoint, async_save=False))
    mesh = mesh_for(cfg, model_cfg, dims, "cpu")
    mesh.device = target  # the groups are the fake backend's; the stage's tensors live on `device`
    built = build_rank_stage(cfg, model_cfg, mesh, target)
    dtype = compute_dtype_of(cfg.train.precision) or torch.float32
    # The GPU's GDN form is the batched one unless FLA passes its check there (unknowable before the GPU is yours).
    kernels = pin_gpu_kernels(built.model, target, dtype, as_gpu, gdn="batched") if as_gpu is not None else {}
    data = TokenSource(cfg, model_cfg.vocab_size, target)
    executor = pipeline_executor(cfg, built, mesh, data, lambda model, plan: build_optimizer(model, plan, mesh),
                                 comm_cls=FilledComm)
    plan = executor.report.memory_plan()
    actions = executor.actions_of(0, steps)
    tracer = tracer_cls(target.type, stand_ins if stand_ins is not None else balanced_stand_ins(cfg, model_cfg, dims),
                        record=record)
    start_bytes = tracer.start()
    started = time.perf_counter()
    attention = AttentionPath(gpu=as_gpu is not None, tracer=tracer)
    # The record_function names the traced window for a profiler around the call (the tests read the CPU
    # allocator's peak inside it: the build before it may peak higher, materializing weights).
    with record_function(TRACED_WINDOW), attention, tracer, marking_actions(executor, tracer):
        executor.engine.execute(actions)
        tracer.begin("drain")
        executor.engine.finish()
        tracer.end()
        tracer.begin("checkpoint state")
        executor.checkpoint.stage_state()
        tracer.end()
        if evaluate:
            tracer.begin("evaluate")
            executor.evaluate(executor.val_batches()[:1])
            tracer.end()
    return StageTrace(stage, rank, str(target), kernels, attention.chosen, plan.to_dict(),
                      plan.table(), steps, executor.m, tracer.peak_bytes, start_bytes, tracer.cyclic_bytes,
                      tracer.actions,
                      tracer.host_reads, tracer.comms, tracer.ops, tracer.op_actions, tracer.scalars, tracer.host_copies,
                      time.perf_counter() - started, getattr(tracer, "table", None), update_records(executor))


def update_records(executor: PipelineExecutor) -> list[dict]:
    records = sorted(executor.engine.records.values(), key=lambda r: r.step)
    return [{"step": r.step, "grad_norm": r.grad_norm, "skipped": r.skipped} for r in records]


def op_sequence(trace: StageTrace) -> list[tuple[str, str]]:
    """(action, op) of every op, less the copies to the host that only a device tensor needs (on the CPU
    `.tolist()` reads memory directly, on meta and CUDA it is a copy first)."""
    return [(a, op) for i, (op, a) in enumerate(zip(trace.ops, trace.op_actions)) if i not in trace.host_copies]
