"""Predicted step time, bubble and memory of every schedule kind (cost model; no torch, no processes).

    python bench/schedules.py [--out bench_results/schedules.json] [--plots bench_results/schedules]

Prints one row per (kind, P, m), writes them as JSON, and draws 1F1B vs 2BW (P=4, m=8) as Gantt
PNGs and Chrome traces on a shared time axis.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without install

from asyncpp.schedules import build_pipeline
from asyncpp.schedules.costmodel import OpCosts, predict, simulate, steady_delays
from asyncpp.train.timeline import plot_gantt, write_chrome_trace

KINDS = ("gpipe", "1f1b", "2bw", "pipedream")
STAGES = (2, 4, 8)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--forward", type=float, default=1.0, help="forward time of one microbatch on a stage")
    p.add_argument("--backward", type=float, default=2.0, help="backward time of one microbatch on a stage")
    p.add_argument("--comm", type=float, default=0.05, help="p2p latency between neighbouring stages")
    p.add_argument("--update", type=float, default=0.0, help="optimizer step time on a stage")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps simulated (default max(8, 3P): pipedream needs ~2P steps before its delay "
        "stops being clamped at x_0; the middle half of the run is measured as steady state)",
    )
    p.add_argument(
        "--collective-updates",
        action="store_true",
        help="UPDATE(t) waits for UPDATE_START(t) of every stage (global grad-norm clipping)",
    )
    p.add_argument("--pp", type=int, nargs="+", default=list(STAGES), help="pipeline depths P to predict")
    p.add_argument("--out", default="bench_results/schedules.json")
    p.add_argument("--plots", default="bench_results/schedules", help="folder for Gantt PNGs and traces")
    return p.parse_args(argv)


def run_grid(args: argparse.Namespace, costs: OpCosts) -> list[dict]:
    rows = []
    for p in args.pp:
        for m in (p, 2 * p, 4 * p):
            for kind in KINDS:
                steps = args.steps or max(8, 3 * p)
                r = predict(kind, p, m, steps, costs, collective_updates=args.collective_updates)
                r["ideal_step_time"] = m * (args.forward + args.backward + args.update)
                rows.append(r)
    return rows


def print_table(rows: list[dict]) -> None:
    head = f"{'kind':<10}{'P':>3}{'m':>4}{'step time':>11}{'vs ideal':>10}{'bubble %':>10}"
    head += f"{'peak act':>10}{'versions':>10}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['kind']:<10}{r['num_stages']:>3}{r['num_microbatches']:>4}{r['step_time']:>11.2f}"
            f"{r['step_time'] / r['ideal_step_time']:>10.3f}{100 * r['bubble']:>10.1f}"
            f"{max(r['peak_activations']):>10}{max(r['weight_versions']):>10}"
        )


def write_plots(args: argparse.Namespace, costs: OpCosts, folder: Path) -> list[Path]:
    """1F1B vs 2BW for P=4, m=8 on the same time axis, so the bubbles compare at a glance."""
    folder.mkdir(parents=True, exist_ok=True)
    p, m, steps = 4, 8, 3
    timelines = {
        kind: simulate(
            build_pipeline(kind, p, m, steady_delays(kind, p, steps)),
            costs,
            collective_updates=args.collective_updates,
        )
        for kind in ("1f1b", "2bw")
    }
    span = (0.0, max(tl.makespan for tl in timelines.values()))
    written = []
    for kind, tl in timelines.items():
        stem = folder / f"{kind}_P{p}_m{m}"
        title = (
            f"{kind}: P={p}, m={m}, {steps} steps, F={args.forward}, B={args.backward}, comm={args.comm}"
            f" — makespan {tl.makespan:.1f}, bubble {100 * tl.bubble_fraction():.1f}%"
        )
        plot_gantt(tl.events, stem.with_suffix(".png"), title=title, xlim=span, time_unit="cost units")
        write_chrome_trace(tl.events, stem.with_suffix(".trace.json"), name=f"asyncpp {kind} P={p} m={m}")
        written += [stem.with_suffix(".png"), stem.with_suffix(".trace.json")]
    return written


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    costs = OpCosts(args.forward, args.backward, comm=args.comm, update=args.update)
    rows = run_grid(args, costs)
    print_table(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"costs": vars(args), "rows": rows}, indent=1))
    written = write_plots(args, costs, Path(args.plots)) if args.plots else []
    print(f"\nwrote {out}" + "".join(f"\nwrote {w}" for w in written))
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
