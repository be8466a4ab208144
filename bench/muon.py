"""Muon optimizer step time: torch.optim.Muon (per matrix) vs ours in one process vs ours DP-sharded.

    .venv/bin/python bench/muon.py                                   # CPU: both cases, 64 experts
    .venv/bin/python bench/muon.py --device cuda --out bench_results/muon_gpu.json   # full 512 experts

Cases: (a) the Muon matrices of SmolLM2-135M (split_params on the meta-device model), (b) the expert
stacks of one hybrid_moe_10b layer (w_gate, w_up, w_down [E, ., .]; E = --experts, default the full
512 on GPU and 64 on CPU, where the full layer takes tens of seconds per step). Every variant steps
the same matrices with the same gradients; torch.optim.Muon takes 2-D parameters only, so it gets
each expert matrix as its own parameter. torch runs Newton-Schulz in bf16, so ours does too here
(compute_dtype=bfloat16; --fp32 adds our fp32 row). The sharded variant spawns --procs processes
(gloo on CPU, NCCL on GPU) with every matrix on every rank (dp_group = expert_dp_group = all ranks):
each rank orthogonalises its share and all-gathers the rest; its step time is the slowest rank's.
One-process variants run at each of --threads (default: all cores, then 1), sharded ranks at
max(threads)/procs each, so the sharded run and the first 1-process rows use the same cores.
Variants run in rounds (--repeats) so load drift on a shared machine hits all of them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runnable from a checkout without install

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncpp.optim import Muon, split_params
from model_zoo import build_model, get_model_config

HP = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True}


def smollm2_shapes() -> list[tuple[int, ...]]:
    model = build_model(get_model_config("smollm2_135m"), device="meta")
    return [tuple(p.shape) for _, p in split_params(model)[0]]


def expert_shapes(experts: int) -> list[tuple[int, ...]]:
    """One hybrid_moe_10b layer's expert stacks, with E replaced by `experts`."""
    model = build_model(get_model_config("hybrid_moe_10b", num_layers=1), device="meta")
    stacks = [p for name, p in split_params(model)[0] if p.ndim == 3]
    return [(experts, *p.shape[1:]) for p in stacks]


def make_tensors(shapes: list[tuple[int, ...]], device: torch.device) -> tuple[list, list]:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]
    grads = [torch.randn(s, generator=g).to(device) for s in shapes]
    return params, grads


def as_matrices(params: list, grads: list) -> tuple[list, list]:
    """Each [E, m, n] stack as E separate 2-D parameters (torch.optim.Muon's only input)."""
    ps, gs = [], []
    for p, g in zip(params, grads):
        if p.ndim == 2:
            ps.append(p)
            gs.append(g)
        else:
            ps += [torch.nn.Parameter(x.clone()) for x in p.detach().unbind(0)]
            gs += list(g.unbind(0))
    return ps, gs


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(opt, params, grads, steps: int, warmup: int, device: torch.device, barrier=None) -> list[float]:
    times = []
    for i in range(warmup + steps):
        for p, g in zip(params, grads):
            p.grad = g
        sync(device)
        if barrier:
            barrier()
        t0 = time.perf_counter()
        opt.step()
        sync(device)
        if barrier:
            barrier()  # the step ends when the slowest rank has its results
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def one_process(variant: str, threads: int, shapes, args, device: torch.device) -> list[float]:
    torch.set_num_threads(threads)
    params, grads = make_tensors(shapes, device)
    if variant == "torch.optim.Muon":
        params, grads = as_matrices(params, grads)
        opt = torch.optim.Muon(params, adjust_lr_fn="match_rms_adamw", **HP)
    else:
        dtype = torch.float32 if variant.endswith("fp32") else torch.bfloat16
        opt = Muon(params, adjust_lr="match_rms_adamw", compute_dtype=dtype, **HP)
    return time_steps(opt, params, grads, args.steps, args.warmup, device)


def _rank(rank: int, procs: int, port: int, shapes, args, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, max(args.threads) // procs))
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=procs)
    try:
        params, grads = make_tensors(shapes, device)
        world = dist.group.WORLD
        opt = Muon(params, adjust_lr="match_rms_adamw", compute_dtype=torch.bfloat16, dp_group=world,
                   expert_dp_group=world, **HP)
        times = time_steps(opt, params, grads, args.steps, args.warmup, device, barrier=dist.barrier)
        Path(out_dir, f"{rank}.json").write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def sharded(shapes, args) -> list[float]:
    with tempfile.TemporaryDirectory() as out_dir, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        mp.spawn(_rank, args=(args.procs, port, shapes, args, out_dir), nprocs=args.procs, join=True)
        per_rank = [json.loads(Path(out_dir, f"{r}.json").read_text()) for r in range(args.procs)]
    return [max(step) for step in zip(*per_rank)]


def run_case(name: str, shapes, args, device: torch.device) -> list[dict]:
    kinds = ["torch.optim.Muon", "ours bf16"] + (["ours fp32"] if args.fp32 else [])
    variants = [(k, t) for t in args.threads for k in kinds]  # (kind, threads), one process each
    sharded_ok = args.procs > 1 and (device.type != "cuda" or torch.cuda.device_count() >= args.procs)
    sharded_threads = max(1, max(args.threads) // args.procs)
    if sharded_ok:
        variants.append((f"ours bf16 DP-sharded x{args.procs}", sharded_threads))
    times: dict[tuple[str, int], list[float]] = {v: [] for v in variants}
    for round_ in range(args.repeats):
        for kind, threads in variants:
            run = sharded(shapes, args) if "sharded" in kind else one_process(kind, threads, shapes, args, device)
            times[(kind, threads)] += run
        print(f"{name} round {round_ + 1}/{args.repeats}: "
              + ", ".join(f"{k} ({t} thr) {statistics.median(ts):.3f}s" for (k, t), ts in times.items()), flush=True)
    base = {t: statistics.median(times[("torch.optim.Muon", t)]) for t in args.threads}
    matrices = sum(torch.Size(s[:-2]).numel() for s in shapes)
    rows = []
    for (kind, threads), ts in times.items():
        procs = args.procs if "sharded" in kind else 1
        median = statistics.median(ts)
        rows.append({"case": name, "variant": kind, "procs": procs, "threads_per_proc": threads, "matrices": matrices,
                     "median_s": median, "min_s": min(ts), "steps": len(ts),
                     **{f"vs_torch_{t}thr": median / b for t, b in base.items()}})
    return rows


def print_table(rows: list[dict], threads: list[int]) -> None:
    ratios = "".join(f"{f'vs torch {t}thr':>15}" for t in threads)
    head = f"{'case':<24}{'variant':<26}{'procs x thr':>12}{'median s':>10}{'min s':>9}{ratios}"
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = "".join(f"{r[f'vs_torch_{t}thr']:>14.2f}x" for t in threads)
        print(f"{r['case']:<24}{r['variant']:<26}{r['procs']:>6} x {r['threads_per_proc']:<3}"
              f"{r['median_s']:>10.3f}{r['min_s']:>9.3f}{cells}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda (sharded on cuda needs --procs GPUs)")
    p.add_argument("--experts", type=int, default=None, help="experts in case (b); default 512 on GPU, 64 on CPU")
    p.add_argument("--cases", nargs="+", default=["smollm2_135m", "hybrid_moe_10b_layer_experts"])
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2, help="rounds over all variants (medians pool every round)")
    p.add_argument("--procs", type=int, default=2, help="processes of the DP-sharded variant")
    cores = torch.get_num_threads()
    p.add_argument("--threads", type=int, nargs="+", default=sorted({cores, 1}, reverse=True),
                   help="thread counts the 1-process variants run at (each its own row); the sharded ranks "
                   "get max(threads) / procs each")
    p.add_argument("--fp32", action="store_true", help="also time ours with fp32 Newton-Schulz")
    p.add_argument("--out", default="bench_results/muon.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.experts is None:
        args.experts = 512 if device.type == "cuda" else 64
    t0 = time.perf_counter()
    cases = {"smollm2_135m": smollm2_shapes, "hybrid_moe_10b_layer_experts": lambda: expert_shapes(args.experts)}
    rows = []
    for name in args.cases:
        label = name if name == "smollm2_135m" else f"hybrid_moe_10b E={args.experts}"
        rows += run_case(label, cases[name](), args, device)
    print_table(rows, args.threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "torch": torch.__version__, "rows": rows}, indent=1))
    print(f"\nwrote {out} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
