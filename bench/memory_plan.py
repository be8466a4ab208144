"""Each rank's measured peak memory next to the plan (issue 19 "Memory: plan, measure, compare"), and the
activation memory activation recomputation saves (issue 20).

Each configuration is a real `torchrun` job of pretrain.py; the figures come from its summary.json
(`memory_per_rank`: the plan's total from asyncpp/core/memory.py, the measured peak: the resident-set
high-water mark on the CPU, torch.cuda.max_memory_allocated on CUDA, and the process baseline, the RSS
before the stage was built, which the plan does not count).

    .venv/bin/python bench/memory_plan.py                                 # smollm2_360m, pp=2, 2bw, seq 512
    .venv/bin/python bench/memory_plan.py --recompute none full           # the saving of recomputation
    .venv/bin/python bench/memory_plan.py --model tiny_hybrid --seq-len 128 --steps 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_job(args: argparse.Namespace, recompute: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc_per_node={args.pp}",
            str(ROOT / "pretrain.py"), f"model={args.model}", f"parallel.pp={args.pp}", f"schedule={args.schedule}",
            f"train.steps={args.steps}", f"train.seq_len={args.seq_len}", f"train.num_microbatches={args.m}",
            f"train.micro_batch_size={args.micro_batch_size}", f"train.recompute={recompute}",
            "train.eval_every=0", "optimizer.schedule.warmup_steps=0", "checkpoint.enabled=false", "logging=disabled",
            "logging.progress=false",
            # The plan counts live bytes; glibc's dynamic mmap threshold keeps freed heap resident as well (1.32x
            # on stage 0 with it), so the measurement fixes the threshold unless --extra sets it.
            "train.host_mmap_threshold=131072", f"hydra.run.dir={out}", *args.extra,
        ]
        proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        summary = json.loads((Path(out) / "summary.json").read_text())
    return {"recompute": recompute, "memory_per_rank": summary["memory_per_rank"]}


def rows_of(job: dict) -> list[dict]:
    rows = []
    for m in job["memory_per_rank"]:
        base = m.get("process_baseline_bytes") or 0
        measured = m["measured_peak_bytes"] - (base if m["measured"] == "host_rss_high_water_mark" else 0)
        activations = next((v for k, v in m["plan"].items() if k.startswith("activations")), 0)
        rows.append({"recompute": job["recompute"], "rank": m["rank"], "stage": m["stage"],
                     "plan_bytes": m["plan_total_bytes"], "plan_activation_bytes": activations,
                     "measured_peak_bytes": m["measured_peak_bytes"], "baseline_bytes": base,
                     "measured_minus_baseline_bytes": measured, "measured_over_plan": measured / m["plan_total_bytes"],
                     "how": m["measured"]})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2_360m")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--schedule", default="2bw")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--m", type=int, default=2, help="microbatches per step (2BW needs m >= pp)")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--recompute", nargs="+", default=["none"], help="train.recompute values to compare")
    p.add_argument("--extra", nargs="*", default=[], help="more hydra overrides")
    p.add_argument("--out", default="bench_results/memory_plan.json")
    args = p.parse_args(argv)
    rows = [r for mode in args.recompute for r in rows_of(run_job(args, mode))]
    mib = 2**20
    print(f"{args.model}, pp={args.pp}, {args.schedule}, seq_len={args.seq_len}, m={args.m}, "
          f"micro_batch_size={args.micro_batch_size} (MiB; measured = peak - process baseline on the CPU)")
    print(f"{'recompute':<10} {'rank':>4} {'stage':>5} {'plan':>9} {'plan act.':>10} {'peak':>9} {'baseline':>9} "
          f"{'measured':>9} {'meas/plan':>10}")
    for r in rows:
        print(f"{r['recompute']:<10} {r['rank']:>4} {r['stage']:>5} {r['plan_bytes'] / mib:>9.0f} "
              f"{r['plan_activation_bytes'] / mib:>10.0f} {r['measured_peak_bytes'] / mib:>9.0f} "
              f"{r['baseline_bytes'] / mib:>9.0f} {r['measured_minus_baseline_bytes'] / mib:>9.0f} "
              f"{r['measured_over_plan']:>10.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
