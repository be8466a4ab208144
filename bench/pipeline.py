"""Measured pipeline throughput and bubble: 1F1B (flush every step) against 2BW, side by side.

Each configuration is a real `torchrun` job of pretrain.py (one stage per process, gloo on CPU,
NCCL on GPU with train.device=cuda); the figures come from each run's summary.json. Schedules are
compared as ratios within one invocation because machines are noisy.

    .venv/bin/python bench/pipeline.py                       # P=2, m in {2, 4, 8}
    .venv/bin/python bench/pipeline.py --m 4 --steps 40 --out bench_results/pipeline.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncpp.core.records import StepMetrics
from asyncpp.schedules.costmodel import OpCosts, predict


def run_job(schedule: str, pp: int, m: int, steps: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc_per_node={pp}",
            str(ROOT / "pretrain.py"), f"parallel.pp={pp}", f"schedule={schedule}", f"train.steps={steps}",
            f"train.num_microbatches={m}", "train.eval_every=0", "logging=disabled", "logging.progress=false",
            f"hydra.run.dir={out}", *extra,
        ]
        proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        summary = json.loads((Path(out) / "summary.json").read_text())
        records = [StepMetrics.from_json(json.loads(line))
                   for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    steady = [r.step_time_s for r in records[len(records) // 4:]]  # skip start-up and warm-up
    return {
        "schedule": schedule, "pp": pp, "m": m, "steps": steps,
        "tokens_per_s": summary["tokens_per_s"],
        "steady_step_time_s": sum(steady) / len(steady),
        "bubble_fraction": summary["bubble_fraction"],
        "bubble_per_stage": summary["bubble_fraction_per_rank"],
        "final_loss": summary["final_loss"],
        "mean_forward_s": summary["mean_forward_s_per_rank"],
        "mean_backward_s": summary["mean_backward_s_per_rank"],
        "mean_update_s": summary["mean_update_s_per_rank"],
    }


def predicted_step_time(kind: str, pp: int, m: int, forward: list[float], backward: list[float],
                        update: list[float]) -> float:
    """The schedule cost model (asyncpp.schedules.costmodel) fed with the measured per-stage times."""
    return predict(kind, pp, m, 24, OpCosts(forward=forward, backward=backward, update=update))["step_time"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--m", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "2bw"])
    parser.add_argument("--out", default="bench_results/pipeline.json")
    parser.add_argument("extra", nargs="*", help="more hydra overrides, e.g. model=tiny_dense")
    args = parser.parse_args()

    rows = []
    for m in args.m:
        group = [run_job(s, args.pp, m, args.steps, args.extra) for s in args.schedules]
        base = group[0]
        for row in group:
            # costs measured in the 2bw run (no flush waits inflate them), used for both predictions
            costs = group[-1]["mean_forward_s"], group[-1]["mean_backward_s"], group[-1]["mean_update_s"]
            row["speedup_measured"] = base["steady_step_time_s"] / row["steady_step_time_s"]
            row["speedup_theory"] = (m + args.pp - 1) / m if row["schedule"] in ("2bw", "pipedream") else 1.0
            row["speedup_predicted"] = (predicted_step_time(base["schedule"], args.pp, m, *costs)
                                        / predicted_step_time(row["schedule"], args.pp, m, *costs))
        rows.extend(group)

    header = (f"{'schedule':9} {'P':>2} {'m':>3} {'tok/s':>8} {'step s':>7} {'bubble':>7} {'per stage':>11} "
              f"{'speedup':>8} {'theory':>7} {'costmodel':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        stages = "/".join(f"{b:.2f}" for b in r["bubble_per_stage"])
        print(f"{r['schedule']:9} {r['pp']:>2} {r['m']:>3} {r['tokens_per_s']:>8.0f} {r['steady_step_time_s']:>7.3f} "
              f"{r['bubble_fraction']:>7.1%} {stages:>11} {r['speedup_measured']:>7.2f}x {r['speedup_theory']:>6.2f}x "
              f"{r['speedup_predicted']:>8.2f}x")
    print("\ntheory: 1F1B runs at m/(m+P-1) of 2BW's rate on balanced stages; costmodel: the schedule simulator "
          "fed with the measured per-stage F/B times.")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
