"""Peak host memory of building one pipeline stage for real on the CPU (issue 19, "Build memory").

    python bench/build_memory.py [--model moe_2b --pp 2 --stage 0] [--out bench_results/build_memory.json]

Each way of building runs in a fresh process (so one's peak cannot hide the other's) and reports the
resident-set high-water mark (VmHWM; asyncpp/host/measured.py) over the build, next to the stage's own
parameter bytes (fp32):

    whole_then_prune  the old path: build_model(whole model, cpu) and initialize it, then prune to the stage
    build_stage       asyncpp/pipeline/build.py: meta -> prune -> materialize and initialize the stage only

"build" is the peak minus the RSS just before building (the interpreter and torch, the same in both).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without install

MODES = ("build_stage", "whole_then_prune")


def child(mode: str, model: str, pp: int, stage: int) -> dict:
    """One build in this (fresh) process; returns its measurements."""
    import torch

    from asyncpp.host.measured import host_peak_bytes, host_rss_bytes, reset_host_peak
    from asyncpp.pipeline.build import build_stage
    from asyncpp.pipeline.stage import StageSpec, prune_to_stage
    from model_zoo import build_model, get_model_config

    torch.set_num_threads(1)
    cfg = get_model_config(model)
    spec = StageSpec(stage, pp, cfg.num_layers)
    before = host_rss_bytes()
    reset_host_peak()
    start = time.perf_counter()
    if mode == "build_stage":
        built = build_stage(cfg, spec, "cpu", seed=1234).model
    else:
        built = prune_to_stage(build_model(cfg, "cpu", seed=1234), spec)
    seconds = time.perf_counter() - start
    peak = host_peak_bytes()
    params = sum(p.numel() for p in built.parameters())
    return {"mode": mode, "model": model, "pp": pp, "stage": stage, "stage_params": params,
            "stage_param_bytes": params * 4, "rss_before_bytes": before, "peak_bytes": peak,
            "build_peak_bytes": peak - before, "ratio": (peak - before) / (params * 4), "seconds": seconds}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="moe_2b")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--out", default="bench_results/build_memory.json")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.model, args.pp, args.stage)))
        return
    rows = []
    for mode in args.modes:
        cmd = [sys.executable, __file__, "--child", mode, "--model", args.model, "--pp", str(args.pp),
               "--stage", str(args.stage)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    gib = 2**30
    print(f"{args.model}, stage {args.stage} of pp={args.pp}, fp32 on the CPU")
    print(f"{'mode':<18} {'stage params':>13} {'param GiB':>10} {'RSS before':>11} {'peak GiB':>9} "
          f"{'build GiB':>10} {'build/params':>13} {'seconds':>8}")
    for r in rows:
        print(f"{r['mode']:<18} {r['stage_params'] / 1e6:>12.1f}M {r['stage_param_bytes'] / gib:>10.2f} "
              f"{r['rss_before_bytes'] / gib:>11.2f} {r['peak_bytes'] / gib:>9.2f} {r['build_peak_bytes'] / gib:>10.2f} "
              f"{r['ratio']:>13.2f} {r['seconds']:>8.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
