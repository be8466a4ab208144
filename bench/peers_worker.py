"""One measured run of bench/peers.py: asyncpp's pipeline, a torch.distributed.pipelining schedule, or the
single-process baseline, on the same model, split and work. Launched by bench/peers.py (torchrun for the
pipelines, plain python for the baseline); writes one JSON file.

Every implementation is timed the same way: the wall time between the ends of consecutive steps on the
last rank (where a step's last backward ends), over the steps after the warm-up, plus per rank its CPU
time over the same interval (one thread per rank, and gloo's waits sleep, so CPU time / wall time is the
rank's busy share; the rest is its bubble, or time the machine's other load took from it) and its
resident memory after every step.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch
import torch.distributed as dist
from torch import Tensor, nn

from asyncpp.core.loss import cross_entropy
from asyncpp.host.allocator import heap_stats, set_mmap_threshold, set_trim_threshold
from model_zoo import build_model, get_model_config

MODEL = "tiny_dense"
LR = 1e-3
OURS = ("2bw", "1f1b")
TORCH = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
MULTI_STAGE = {"Interleaved1F1B": "loop", "InterleavedZeroBubble": "loop", "ZBVZeroBubble": "v", "DualPipeV": "v"}
"""Schedules that need two model chunks per rank: "loop" places chunk c on rank c % 2, "v" on rank
min(c, 3 - c) (the V shape: rank 0 holds the first and the last chunk)."""
SPLIT_2 = ([0, 1], [2, 3])
SPLIT_4 = ([0], [1], [2], [3])


def memory_mb() -> dict[str, float]:
    """This process's resident memory: anonymous (heap and tensors, no file mappings such as the data's
    memory map or the shared libraries), total, and the kernel's high-water mark of the total; with glibc
    also the heap's live and free bytes and the bytes in mmapped blocks (asyncpp/host/allocator.py)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    out = {"anon": fields["RssAnon"], "rss": fields["VmRSS"], "hwm": fields["VmHWM"]}
    heap = heap_stats()
    if heap is not None:
        out.update(heap_in_use=heap.heap_in_use_bytes / 2**20, heap_free=heap.heap_free_bytes / 2**20,
                   mmapped=heap.mmapped_bytes / 2**20)
    return out


class Recorder:
    """Wall and CPU time of one rank over the measured steps, its memory after every step, and (where the
    implementation can tell) when each measured step ended."""

    def __init__(self):
        self.memory: list[dict[str, float]] = []
        self.step_ends: list[float] = []
        self._start: tuple[float, float] | None = None
        self._stop: tuple[float, float] | None = None

    def step_done(self) -> None:
        self.memory.append(memory_mb())

    def start(self) -> None:
        self._start = (time.perf_counter(), time.process_time())

    def stop(self) -> None:
        self._stop = (time.perf_counter(), time.process_time())

    def result(self, steps: int, tokens_per_step: int) -> dict:
        wall, cpu = self._stop[0] - self._start[0], self._stop[1] - self._start[1]
        return {
            "steps_measured": steps, "wall_s": wall, "cpu_s": cpu, "busy": cpu / wall,
            "tokens_per_s": steps * tokens_per_step / wall,
            "step_times_s": [b - a for a, b in zip(self.step_ends, self.step_ends[1:])],
            "memory_mb": self.memory,
        }


def tokens_pool(m: int, micro_batch: int, seq: int, vocab: int, seed: int) -> list[Tensor]:
    """Fixed random token blocks [micro_batch, seq + 1]: the work does not depend on the values."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (micro_batch, seq + 1), generator=g) for _ in range(m)]


class PoolData:
    """asyncpp's data source over the peers' token pool: microbatch j of every step is pool[j], the blocks the
    single process and torch's schedules train on. The same work, and no data loader in the measured process
    (megatron-core's datasets would add their package import, 72 MB per process, and a read per microbatch)."""

    def __init__(self, pool: list[Tensor]):
        self.pool = pool

    def train_microbatch(self, index: int) -> Tensor:
        return self.pool[index % len(self.pool)]

    def val_batches(self) -> list[Tensor]:
        return []


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0, foreach=True)


# ---- the single-process baseline ------------------------------------------------------------------------
def run_single(args) -> dict:
    torch.manual_seed(0)
    model = build_model(get_model_config(MODEL))
    opt = adamw(model.parameters())
    batches = tokens_pool(args.m, args.micro_batch, args.seq, model.config.vocab_size, 0)
    rec = Recorder()
    for step in range(args.steps):
        if step == args.warmup:
            rec.start()
        for b in batches:
            (cross_entropy(model(b[:, :-1]), b[:, 1:]) / args.m).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        rec.step_done()
        if step >= args.warmup - 1:
            rec.step_ends.append(time.perf_counter())
    rec.stop()
    return {"ranks": [rec.result(args.steps - args.warmup, args.m * args.micro_batch * args.seq)]}


# ---- torch.distributed.pipelining -----------------------------------------------------------------------
class Chunk(nn.Module):
    """Layers `layers` of the model, with the embedding in front if `first`, norm and head after if `last`."""

    def __init__(self, model: nn.Module, layers: list[int], first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.embed = model.embed if first else None
        self.layers = nn.ModuleList(model.layers[i] for i in layers)
        self.norm = model.norm if last else None
        # torch's pipelining has no cross-stage tied weights: the last chunk gets its own copy of the head.
        self.lm_head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False) if last else None
        if last:
            with torch.no_grad():
                self.lm_head.weight.copy_(model.lm_head.weight)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x) if self.first else x
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h)) if self.last else h


def torch_chunks(schedule: str, rank: int) -> list[int]:
    style = MULTI_STAGE.get(schedule)
    if style is None:
        return [rank]
    return [rank, rank + 2] if style == "loop" else [rank, 3 - rank]


def run_torch(args) -> dict:
    from torch.distributed import pipelining as pp
    from torch.distributed.pipelining import schedules as sch

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = build_model(get_model_config(MODEL))
    split = SPLIT_4 if args.schedule in MULTI_STAGE else SPLIT_2
    n = len(split)
    chunk_ids = torch_chunks(args.schedule, rank)
    stages = [pp.PipelineStage(Chunk(model, list(split[c]), c == 0, c == n - 1), c, n, torch.device("cpu"))
              for c in chunk_ids]
    del model
    params = [p for s in stages for p in s.submod.parameters()]
    opt = adamw(params)

    def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
        return cross_entropy(logits, labels)

    cls = getattr(sch, f"Schedule{args.schedule}")
    schedule = (cls(stages[0], args.m, loss_fn=loss_fn) if len(stages) == 1
                else cls(stages, args.m, loss_fn=loss_fn))
    batch = torch.cat(tokens_pool(args.m, args.micro_batch, args.seq, get_model_config(MODEL).vocab_size, 0))
    inputs, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    holds_first = any(c == 0 for c in chunk_ids)
    holds_last = any(c == n - 1 for c in chunk_ids)
    rec = Recorder()
    for step in range(args.steps):
        if step == args.warmup:
            dist.barrier()  # every rank starts the measured interval together, as asyncpp's runs do
            rec.start()
        kwargs = {"target": targets, "losses": []} if holds_last else {}
        schedule.step(inputs, **kwargs) if holds_first else schedule.step(**kwargs)
        opt.step()
        opt.zero_grad(set_to_none=False)
        rec.step_done()
        if holds_last and step >= args.warmup - 1:
            rec.step_ends.append(time.perf_counter())
    rec.stop()
    return {"ranks": gather(rec.result(args.steps - args.warmup, args.m * args.micro_batch * args.seq))}


# ---- asyncpp ---------------------------------------------------------------------------------------------
def run_ours(args) -> dict:
    """asyncpp's PipelineExecutor driven directly (no trainer: no logging, evaluation or checkpoints)."""
    from asyncpp.job import compose, optimizer_for, resolve
    from asyncpp.parallel.mesh import ParallelDims
    from asyncpp.pipeline.build import build_rank_stage, mesh_for
    from asyncpp.pipeline.compose import pipeline_executor
    from asyncpp.schedules.actions import Op

    overrides = [f"model={MODEL}", "optimizer=adamw", f"optimizer.lr={LR}", "optimizer.weight_decay=0.0",
                 "optimizer.schedule.kind=constant", "optimizer.schedule.warmup_steps=0",
                 f"schedule={args.schedule}", "parallel.pp=2", f"train.num_microbatches={args.m}",
                 f"train.micro_batch_size={args.micro_batch}", f"train.seq_len={args.seq}",
                 f"train.steps={args.steps}", "train.eval_every=0", "train.grad_clip=0", "logging=disabled",
                 f"out_dir={args.scratch}", *args.overrides]
    cfg, model_cfg = resolve(compose(overrides))
    set_mmap_threshold(cfg.train.host_mmap_threshold)  # as pretrain.py does at start
    set_trim_threshold(cfg.train.host_trim_threshold)
    dims = ParallelDims.for_world(dist.get_world_size(), pp=2, tp=1, ep=1, dp=None)
    mesh = mesh_for(cfg, model_cfg, dims, "cpu")
    data = PoolData(tokens_pool(args.m, args.micro_batch, args.seq, model_cfg.vocab_size, 0))
    torch.manual_seed(cfg.seed)
    stage = build_rank_stage(cfg, model_cfg, mesh, mesh.device)  # pretrain.py's per-rank build
    executor = pipeline_executor(cfg, stage, mesh, data, optimizer_for(cfg, mesh))
    rec = Recorder()
    # Two segments: the warm-up, then the measured steps. A segment drains at its end, so the measured one
    # includes one pipeline fill and drain (2BW: about one microbatch slot in 35 * m; a flushing schedule
    # drains every step anyway).
    for _ in executor.steps(0, args.warmup):
        rec.step_done()
    dist.barrier()
    rec.start()
    for _ in executor.steps(args.warmup, args.steps):
        rec.step_done()
    rec.stop()
    timer = executor.engine.timer
    if mesh.is_last_stage:  # when each step's last backward ended (2BW yields a step two updates late)
        rec.step_ends = [timer.end_of(Op.BACKWARD, t) for t in range(args.warmup, args.steps)]
    result = rec.result(args.steps - args.warmup, args.m * args.micro_batch * args.seq)
    result["ms_per_step"] = time_per_step(timer.events, args.warmup, args.steps, result["wall_s"])
    result["asyncpp_summary"] = executor.summary(0.0)
    return {"ranks": gather(result)}


def time_per_step(events, first: int, last: int, wall_s: float) -> dict[str, float]:
    """Where a rank's measured steps went, in ms per step: each kind of timed action (F, B, the vocabulary-parallel
    head's S and T, U0 + U the update), `idle` (waits for a reduction the timer records) and `untimed`, the
    rest of the wall time: waiting for a transfer, posting one, the engine's own bookkeeping. Events count
    in the step they belong to, so the sums are per step of work, not per wall-clock window."""
    steps, sums = last - first, {}
    for e in events:
        if e.step is not None and first <= e.step < last:
            kind = "U" if e.kind == "U0" else e.kind
            sums[kind] = sums.get(kind, 0.0) + e.duration
    out = {kind: total / steps * 1e3 for kind, total in sums.items()}
    out["untimed"] = wall_s / steps * 1e3 - sum(out.values())
    return out


def gather(result: dict) -> list[dict]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, result)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["ours", "torch", "single"], required=True)
    parser.add_argument("--schedule", default="")
    parser.add_argument("--microbatches", dest="m", type=int, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--out", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread per rank: ranks do not compete for the cores
    start = time.perf_counter()
    if args.impl == "single":
        result = run_single(args)
    else:
        from asyncpp.parallel.mesh import init_distributed

        init_distributed("cpu", 600.0)
        with tempfile.TemporaryDirectory() as scratch:
            args.scratch = scratch
            result = run_ours(args) if args.impl == "ours" else run_torch(args)
        if dist.get_rank() != 0:
            result = None
        dist.barrier()
        dist.destroy_process_group()
    if result is not None:
        result["elapsed_s"] = time.perf_counter() - start
        Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
