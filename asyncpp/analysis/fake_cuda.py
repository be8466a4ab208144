"""One stage's forward and evaluation on fake `cuda:0` tensors in bf16, on a machine without a GPU.

With PyTorch's CUDA build (`make gpu-trace-env`: .venv-cuda), FakeTensorMode makes cuda:0 tensors that carry
shapes, dtypes and devices but no memory, so the CUDA-only branches run: the MoE kernel choice and
torch._grouped_mm, SDPA's CUDA backend choice, the Gated DeltaNet kernel choice. (The autograd engine's
backward does not run on fake CUDA tensors without a device, so the backward and the update are traced on
meta instead: traced.py.) A StepTracer on top records every op; this module checks that

- every op's tensor inputs share one device (a 0-dim CPU tensor is a scalar argument and allowed),
- nothing is read back to the host (FakeTensorMode has no values: a read is recorded and answered by a
  stand-in, so one run finds all of them),

and records which MoE kernel and which attention kernel ran. The stage is the run's: built by
`build_rank_stage` on the fake process group (dryrun.py); its forward is `stage_forward` and the stage's loss, as
the executor's microbatch forward and its evaluation call them, or, with a vocabulary-parallel head and a sharded
embedding, the layers with every stage's S and E (stage_microbatch_forward).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten

from asyncpp.analysis.dryrun import fake_group
from asyncpp.analysis.trace import AttentionPath, HostRead, StandIns, StepTracer, needed
from asyncpp.analysis.traced import H100, balanced_stand_ins, pin_gpu_kernels
from asyncpp.config import RunConfig
from asyncpp.parallel.mesh import ParallelDims
from asyncpp.parallel.vocab_parallel import embedding_partial
from asyncpp.pipeline.build import build_rank_stage, mesh_for
from asyncpp.pipeline.stage import StageSpec, stage_forward, vocab_head_rows
from asyncpp.pipeline.vocab_head import shard_logits_statistics
from model_zoo import ModelConfig

ATTENTION_OPS = {"aten::_scaled_dot_product_flash_attention": "flash", "aten::_scaled_dot_product_cudnn_attention": "cudnn",
                 "aten::_scaled_dot_product_efficient_attention": "efficient",
                 "aten::_scaled_dot_product_flash_attention_for_cpu": "cpu flash"}
EXPERT_OPS = {"aten::_grouped_mm": "torch._grouped_mm", "aten::bmm": "bmm"}


class DeviceChecks(StepTracer):
    """A StepTracer that also finds ops whose tensor inputs sit on different devices."""

    def __init__(self, stand_ins: StandIns):
        super().__init__("cuda", stand_ins)
        self.mixes: list[tuple[str, str, tuple[str, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
        devices = {str(t.device) for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
        if len(devices) > 1:
            self.mixes.append((func.name(), self.action, tuple(sorted(devices))))
        return super().__torch_dispatch__(func, types, args, kwargs)


@dataclass
class FakeCudaReport:
    stage: int
    model: str
    kernels: dict[str, str]
    """The MoE kernel each layer was given (the GPU's choice at the compute capability the check stands for)."""
    ops_run: dict[str, int]
    """How often each attention and expert kernel op ran (forward and evaluation)."""
    mixes: list = field(default_factory=list)
    host_reads: list[HostRead] = field(default_factory=list)
    ops: int = 0
    wall_s: float = 0.0
    logits_width: int | None = None
    """The width of the logits this stage's forward made: a vocabulary-parallel head's rows on every stage, the whole
    vocabulary on the last stage otherwise (None on the other stages)."""
    embedding_rows: int | None = None
    """A sharded embedding's rows the stage's E looked up (None: the embedding whole on the first stage)."""

    @property
    def unneeded_reads(self) -> list[HostRead]:
        return [r for r in self.host_reads if not needed(r.site)]

    def text(self) -> str:
        by_site: dict[tuple[str, str], int] = {}
        for r in self.host_reads:  # FakeTensor's .tolist() reads element by element: counted per element
            key = (r.action, r.site)
            by_site[key] = by_site.get(key, 0) + 1
        lines = [f"fake-CUDA forward of {self.model} stage {self.stage}: {self.ops} ops in {self.wall_s:.1f} s",
                 f"  kernels run: {self.ops_run}",
                 f"  logits width {self.logits_width}, embedding rows looked up {self.embedding_rows}",
                 f"  MoE kernel per layer: {sorted(set(self.kernels.values())) or 'no MoE layer'}",
                 f"  device mixes: {len(self.mixes)}" + "".join(f"\n    {m}" for m in self.mixes[:20]),
                 f"  host reads (element reads): {len(self.host_reads)}, not needed: {len(self.unneeded_reads)}"]
        lines += [f"    {n:>5}  {action}: {site}  " + (f"needed: {needed(site)}" if needed(site) else "NOT NEEDED")
                  for (action, site), n in by_site.items()]
        return "\n".join(lines)


def on_device(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """The meta skeleton's parameters as new tensors on `device` (fake under FakeTensorMode), the floating
    ones in `dtype`, as a bf16 run's forward sees its weight version; buffers keep their dtype (the run keeps
    them as built). Tied parameters stay one. (module.to_empty would swap each tensor in place, which
    torch refuses for a tensor something holds a weak reference to.)"""
    made: dict[int, nn.Parameter] = {}
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(torch.empty(p.shape, device=device,
                                                       dtype=dtype if p.is_floating_point() else p.dtype),
                                           requires_grad=p.requires_grad)
            m._parameters[name] = made[id(p)]
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = torch.empty(b.shape, device=device, dtype=b.dtype)


def stage_microbatch_forward(model: nn.Module, spec: StageSpec, loss_fn, tokens: Tensor, x: Tensor, tp: int
                             ) -> tuple[int | None, int | None]:
    """The forward work of one microbatch on `spec`'s stage (TP rank 0), as the engine's actions do it: the
    layers, and on the last stage the loss; with a vocabulary-parallel head every stage's S instead of the loss (its
    rows' logits and their statistics, shard_statistics_, of the last stage's normed hidden states; elsewhere `x`
    stands for the broadcast ones); with a sharded embedding every stage's E (its rows' partial lookup; on the
    first stage it stands for the reduced sum, same shape and dtype). `x`: what a later stage receives. Returns
    (the logits' width, the embedding rows looked up), each None where the stage made none."""
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    if spec.vocab is None:
        out = stage_forward(model, spec, ids if spec.is_first else x)
        if spec.is_last:
            loss_fn(out, labels)
        return (out.shape[-1] if spec.is_last else None), None
    if spec.embed is not None:
        partial = embedding_partial(ids, model.embed.weight, spec.embed)
        inputs = partial if spec.is_first else x
    else:
        inputs = ids if spec.is_first else x
    h = stage_forward(model, spec, inputs, head=False)
    hidden = model.norm(h) if spec.is_last else x
    param, row0, piece = vocab_head_rows(model, spec, tp, 0)
    exps, _ = shard_logits_statistics(hidden.reshape(-1, hidden.shape[-1]), param.narrow(0, row0, piece.rows),
                                      labels.reshape(-1), piece)
    return exps.shape[-1], (spec.embed.rows if spec.embed is not None else None)


def fake_cuda_forward(cfg: RunConfig, model_cfg: ModelConfig, world_size: int, stage: int,
                      capability: tuple[int, int] = H100) -> FakeCudaReport:
    """One training forward (with its loss on the last stage) and one evaluation forward of `stage`, bf16,
    on fake cuda:0 tensors."""
    p = cfg.parallel
    dims = ParallelDims.for_world(world_size, pp=p.pp, tp=p.tp, ep=p.ep, dp=p.dp)
    rank = stage * dims.dp * dims.tp
    device = torch.device("cuda", 0)
    fake_group(rank, world_size)
    try:
        mesh = mesh_for(cfg, model_cfg, dims, "cpu")
        mesh.device = device
        built = build_rank_stage(cfg, model_cfg, mesh, "meta")
        model, spec = built.model, built.spec
        kernels = pin_gpu_kernels(model, device, torch.bfloat16, capability)
        checks = DeviceChecks(balanced_stand_ins(cfg, model_cfg, dims))
        t = cfg.train
        started = time.perf_counter()
        # Non-fake inputs allowed: to_empty reads the meta skeleton's parameters. A real CPU tensor reaching a
        # CUDA op later is still a device mix: DeviceChecks looks at the inputs before FakeTensorMode does.
        with FakeTensorMode(allow_non_fake_inputs=True):
            on_device(model, device, torch.bfloat16)
            tokens = torch.randint(0, model_cfg.vocab_size, (t.micro_batch_size, t.seq_len + 1), device=device)
            x = torch.randn(t.micro_batch_size, t.seq_len, model_cfg.hidden_size, device=device, dtype=torch.bfloat16,
                            requires_grad=True)  # what the stage receives: the previous stage's output, or a broadcast
            attention = AttentionPath(gpu=True, tracer=checks)  # SDPA's own choice needs a real GPU (trace.py)
            with attention, checks:
                for label, grad in (("forward", True), ("evaluate", False)):
                    checks.begin(label)
                    with torch.set_grad_enabled(grad):
                        widths = stage_microbatch_forward(model, spec, built.loss_fn, tokens, x, mesh.dims.tp)
                    checks.end()
        ops_run: dict[str, int] = {}
        for op in checks.ops:
            base = op.split(".")[0]
            name = ATTENTION_OPS.get(base) or EXPERT_OPS.get(base)
            if name is not None:
                ops_run[name] = ops_run.get(name, 0) + 1
        return FakeCudaReport(stage, model_cfg.name, kernels, ops_run, checks.mixes, checks.host_reads,
                              len(checks.ops), time.perf_counter() - started, *widths)
    finally:
        dist.destroy_process_group()
