"""Activation memory with and without activation recomputation (issue 20), measured on the CPU.

    python bench/recompute_memory.py [--model smollm2_360m --pp 2 --stage 0 --seq-len 512 --micro-batch-size 1]

Each mode (train.recompute = none, selective, full) runs in a fresh process: build the stage
(asyncpp/pipeline/build.py), run one microbatch's forward and keep its graph, as a pipeline stage holds an
in-flight microbatch until its backward. "activations" is the resident set after the forward minus before
it (the children run with MALLOC_MMAP_THRESHOLD_=65536: every tensor of 64 KiB or more is mmap'ed and
unmapped when freed, so RSS follows live tensor bytes); the plan's
estimate for recompute=none (asyncpp/core/memory.activation_bytes) is printed next to it. Then the
backward runs and the gradients are checked against mode none's, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without install

MODES = ("none", "selective", "full")


def child(args: argparse.Namespace, mode: str) -> dict:
    import gc

    import torch

    from asyncpp.core.memory import activation_bytes
    from asyncpp.core.recompute import modes_per_layer
    from asyncpp.host.measured import host_rss_bytes
    from asyncpp.pipeline.build import build_stage
    from asyncpp.pipeline.stage import StageSpec, stage_forward
    from model_zoo import get_model_config

    torch.set_num_threads(1)
    cfg = get_model_config(args.model)
    spec = StageSpec(args.stage, args.pp, cfg.num_layers)
    stage = build_stage(cfg, spec, "cpu", seed=0,
                        recompute=modes_per_layer(mode, cfg.num_layers, args.pp)).model
    g = torch.Generator().manual_seed(1)
    shape = (args.micro_batch_size, args.seq_len)
    x = (torch.randint(0, cfg.vocab_size, shape, generator=g) if spec.is_first
         else torch.randn(*shape, cfg.hidden_size, generator=g).requires_grad_())
    gc.collect()
    before = host_rss_bytes()
    start = time.perf_counter()
    out = stage_forward(stage, spec, x)
    forward_s = time.perf_counter() - start
    held = host_rss_bytes() - before
    start = time.perf_counter()
    out.float().square().mean().backward()
    backward_s = time.perf_counter() - start
    digest = float(sum(p.grad.double().square().sum() for p in stage.parameters() if p.grad is not None))
    plan = activation_bytes(cfg, spec.layers, dtype=torch.float32, micro_batch_size=args.micro_batch_size,
                            seq_len=args.seq_len, first=spec.is_first, last=spec.is_last)
    return {"mode": mode, "activation_bytes": held, "plan_bytes_without_recompute": plan,
            "forward_s": forward_s, "backward_s": backward_s, "grad_sq_sum": digest}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2_360m")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--out", default="bench_results/recompute_memory.json")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args, args.child)))
        return
    rows = []
    for mode in args.modes:
        cmd = [sys.executable, __file__, "--child", mode, "--model", args.model, "--pp", str(args.pp),
               "--stage", str(args.stage), "--seq-len", str(args.seq_len),
               "--micro-batch-size", str(args.micro_batch_size)]
        # glibc keeps freed heap chunks below its mmap threshold (up to 32 MiB) resident, which hides what the
        # forward frees and reuses; with every block of 64 KiB or more mmap'ed, RSS follows the live tensors.
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        proc = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
        rows.append(json.loads(proc.stdout.splitlines()[-1]))
    base = rows[0]
    mib = 2**20
    print(f"{args.model}, stage {args.stage} of pp={args.pp}, one microbatch of {args.micro_batch_size} x "
          f"{args.seq_len} tokens, fp32 (plan for recompute=none: {base['plan_bytes_without_recompute'] / mib:.0f} MiB)")
    print(f"{'recompute':<10} {'activations MiB':>16} {'vs first':>9} {'forward s':>10} {'backward s':>11} "
          f"{'grads equal first':>18}")
    for r in rows:
        same = r["grad_sq_sum"] == base["grad_sq_sum"]
        print(f"{r['mode']:<10} {r['activation_bytes'] / mib:>16.0f} {r['activation_bytes'] / base['activation_bytes']:>9.2f} "
              f"{r['forward_s']:>10.2f} {r['backward_s']:>11.2f} {same!s:>18}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
