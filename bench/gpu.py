"""GPU throughput of one pipeline stage per layer backend, with and without torch.compile, and the Muon
step time against torch.optim.Muon. Prints a table, writes JSON.

    .venv/bin/python bench/gpu.py                             # a CUDA machine: the full table
    .venv/bin/python bench/gpu.py --smoke                     # tiny shapes on the CPU (tests/unit/test_backends.py)
    .venv/bin/python bench/gpu.py --peak-tflops 989 --micro-batch-size 4 --seq-len 4096 --out bench_results/gpu.json

Workloads, in bf16 (the run's train.precision=bf16 compute; masters and optimizer are not part of a
forward/backward):
  smollm2_135m        the whole model as one stage (pp=1): embedding, 30 blocks, head and loss;
  hybrid_moe_10b x4   one period of the 10B hybrid (GDN, GDN, GDN, attention; 512 experts top-10 + shared)
                      as a middle pipeline stage: activation in, activation gradient in, ~1.6B parameters.
tokens/s counts forward + backward of one microbatch (the optimizer is benchmarked separately: Muon rows).

MFU = achieved FLOP/s / peak, peak = --peak-tflops (default 989: H100 SXM dense bf16). FLOPs per token come
from model_zoo.flops_per_token (the one count; the training log's TFLOP/s and MFU use it too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch
from torch import nn

from asyncpp.analysis.steptime import Workload, workloads
from asyncpp.core.memory import activation_bytes
from model_zoo import flops_per_token
from model_zoo.backends import BACKENDS, BackendError, apply_backend, compile_blocks, probe_backend
from model_zoo.backends.kernels import fla_status
from model_zoo.gated_deltanet import GatedDeltaNet

H100_BF16_DENSE_TFLOPS = 989.0


# ---- timing --------------------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], device: torch.device, warmup: int, iters: int) -> float:
    """Median seconds of fn() over `iters` calls after `warmup` (compilation and autotuning happen there)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---- stage workloads: asyncpp.analysis.steptime.Workload (one home: the step-time model traces the same) ---


def bench_stage(w: Workload, backend: str, compiled: bool, args, device: torch.device) -> dict:
    row = {"workload": w.name, "backend": backend, "compile": compiled}
    model = w.build(device)
    messages: list[str] = []
    try:
        used = apply_backend(model, backend, device, log=messages.append)
    except BackendError as e:
        return {**row, "skipped": str(e)}
    if used != backend:
        return {**row, "skipped": " ".join(messages)}
    if compiled:
        compile_blocks(model)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    step = w.step_fn(model, args.micro_batch_size, args.seq_len, device)
    # Repetitions: the median of `iters` timed calls each, after one warm-up (the first repetition's also compiles);
    # the row's figure is their median, the spread (max - min) / median says how far one run can be trusted.
    reps = [timed(step, device, args.warmup, args.iters) for _ in range(args.repetitions)]
    seconds = statistics.median(reps)
    row.update(repetitions_s=reps, spread=(max(reps) - min(reps)) / seconds, gdn_kernel=gdn_kernel(model, device, args.seq_len))
    tokens = args.micro_batch_size * args.seq_len
    flops = flops_per_token(w.cfg, args.seq_len, w.layers, head=w.whole_model) * tokens
    act_est = activation_bytes(w.cfg, w.layers, dtype=torch.bfloat16, micro_batch_size=args.micro_batch_size,
                               seq_len=args.seq_len, first=w.whole_model, last=w.whole_model)
    row.update(seconds_per_microbatch=seconds, tokens_per_s=tokens / seconds, tflops=flops / seconds / 1e12,
               mfu=flops / seconds / (args.peak_tflops * 1e12), activation_estimate_gib=act_est / 2**30)
    if device.type == "cuda":  # peak above the weights ~ activations (+ grads, + workspace)
        row["peak_above_weights_gib"] = (torch.cuda.max_memory_allocated(device) - before) / 2**30
    return row


def gdn_kernel(model: nn.Module, device: torch.device, seq_len: int) -> str:
    """Which Gated DeltaNet form ran (GatedDeltaNet.form_at: FLA's kernel where it passed its check at the shape,
    else the batched PyTorch form on CUDA, the chunk loop elsewhere); "-" for a model without GDN layers."""
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    return layers[0].form_at(seq_len, torch.bfloat16, device) if layers else "-"


# ---- Muon ----------------------------------------------------------------------------------------

def muon_matrices(w: Workload, device: torch.device) -> list[nn.Parameter]:
    """The hidden 2-D matrices of the workload (what Muon takes; expert stacks are 3-D: asyncpp only)."""
    model = w.build(device).float()
    return [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n and "lm_head" not in n]


def bench_muon(w: Workload, impl: str, args, device: torch.device) -> dict:
    row = {"workload": w.name, "optimizer": impl}
    if impl == "torch.optim.Muon" and not hasattr(torch.optim, "Muon"):
        return {**row, "skipped": f"torch {torch.__version__} has no torch.optim.Muon (added in 2.9)"}
    params = muon_matrices(w, device)
    if impl == "asyncpp":
        from asyncpp.optim.muon import Muon

        opt = Muon(params, lr=0.02, compute_dtype=torch.bfloat16 if device.type == "cuda" else None)
    else:
        opt = torch.optim.Muon(params, lr=0.02)
    for p in params:
        p.grad = torch.randn_like(p)
    seconds = timed(opt.step, device, args.warmup, args.iters)
    return {**row, "step_s": seconds, "matrices": len(params), "params": sum(p.numel() for p in params)}


# ---- main ----------------------------------------------------------------------------------------

def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on whatever device is there (CPU ok)")
    parser.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_TFLOPS,
                        help="the accelerator's dense bf16 peak, TFLOP/s (H100 SXM: 989; H200: 989)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="default 4 (smoke: 1)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 4096 (smoke: 64)")
    parser.add_argument("--moe-layers", type=int, default=4, help="hybrid_moe_10b blocks in the stage")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--compile", nargs="+", default=None, choices=["off", "on"],
                        help="default: off and on (smoke: off; CPU inductor takes ~30 s per block type)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--repetitions", type=int, default=None, help="timed repetitions per row (default 3; smoke 1)")
    parser.add_argument("--out", default="bench_results/gpu.json")
    args = parser.parse_args(argv)
    defaults = {"micro_batch_size": (1, 4), "seq_len": (64, 4096), "warmup": (1, 3), "iters": (2, 10),
                "repetitions": (1, 3)}
    for key, (smoke, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, smoke if args.smoke else full)
    if args.compile is None:
        args.compile = ["off"] if args.smoke else ["off", "on"]
    return args


def print_table(rows: list[dict], muon: list[dict], args, device: torch.device) -> None:
    print(f"device: {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"bf16, microbatch {args.micro_batch_size}x{args.seq_len}, MFU vs {args.peak_tflops:g} TFLOP/s")
    header = f"{'workload':26} {'backend':8} {'compile':7} {'tok/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'act est GiB':>11} {'peak GiB':>8} {'spread':>6} GDN"
    print(header + "\n" + "-" * len(header))
    for r in rows:
        if "skipped" in r:
            print(f"{r['workload']:26} {r['backend']:8} {r['compile']!s:7} skipped: {r['skipped']}")
            continue
        peak = f"{r['peak_above_weights_gib']:.2f}" if "peak_above_weights_gib" in r else "n/a"
        print(f"{r['workload']:26} {r['backend']:8} {r['compile']!s:7} {r['tokens_per_s']:>10.0f} "
              f"{r['tflops']:>8.2f} {r['mfu']:>6.1%} {r['activation_estimate_gib']:>11.2f} {peak:>8} {r['spread']:>6.1%} "
              f"{r['gdn_kernel']}")
    print()
    for r in muon:
        text = f"skipped: {r['skipped']}" if "skipped" in r else \
            f"{r['step_s'] * 1e3:8.2f} ms/step  ({r['matrices']} matrices, {r['params'] / 1e6:.1f}M params)"
        print(f"Muon {r['workload']:26} {r['optimizer']:17} {text}")


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA device (torch.cuda.is_available() is False here); "
                         "run `bench/gpu.py --smoke` for the tiny-shape check that works on the CPU")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows, muon = [], []
    for w in workloads(args.smoke, args.moe_layers):
        for backend in args.backends:
            for mode in args.compile:
                rows.append(bench_stage(w, backend, mode == "on", args, device))
        for impl in ("asyncpp", "torch.optim.Muon"):
            muon.append(bench_muon(w, impl, args, device))
    print_table(rows, muon, args, device)
    result = {"args": vars(args), "device": str(device), "torch": torch.__version__,
              "probes": {**{b: probe_backend(b, device).reason or "available" for b in BACKENDS}, "fla": fla_status()},
              "stages": rows, "muon": muon}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
