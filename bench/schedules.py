"""Predicted step time, bubble and memory of every schedule kind (cost model; no processes).

    python bench/schedules.py [--out bench_results/schedules.json] [--plots bench_results/schedules]
    python bench/schedules.py --dp-table [--dp 8 --bandwidth-gbs 50 ...]

Prints one row per (kind, P, m), writes them as JSON, and draws 1F1B vs 2BW (P=4, m=8) as Gantt
PNGs and Chrome traces on a shared time axis.

--dp-table: the DP gradient all-reduce against 1F1B and 2BW at P=8 and 16, on the stage shapes of real
models (smollm2_135m; hybrid_moe_10b with its experts sharded over EP). Per stage: F from the model's
FLOPs per token (bench/gpu.py's count) at --peak-tflops x --mfu, B = 2F; the all-reduce of the stage's
fp32 gradients is a ring over --dp replicas at --bandwidth-gbs (costmodel.dp_allreduce_time); with EP,
expert gradients are reduced over the DP/EP replicas that hold the same experts only. The p2p latency
is the activation's bytes at the same bandwidth. This part imports torch (meta-device parameter counts).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without install

from asyncpp.schedules import build_pipeline
from asyncpp.schedules.costmodel import OpCosts, dp_allreduce_time, predict, simulate, steady_delays
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
    p.add_argument("--dp-table", action="store_true", help="the DP all-reduce table (see the module docstring)")
    p.add_argument("--dp", type=int, default=8, help="data-parallel replicas per stage")
    p.add_argument("--bandwidth-gbs", type=float, default=50.0,
                   help="per-GPU all-reduce bus bandwidth in GB/s (50: one 400 Gb/s InfiniBand NIC per GPU)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="peak bf16 TFLOP/s (989: H100 SXM dense)")
    p.add_argument("--mfu", type=float, default=0.4, help="fraction of the peak the stage's F and B reach")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--out", default=None,
                   help="JSON file (default bench_results/schedules.json, or schedules_dp.json with --dp-table)")
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


# ---- DP all-reduce on real stage shapes ----------------------------------------------------------

DP_MODELS = (("smollm2_135m", 1), ("hybrid_moe_10b", 8))
"""(model, expert parallelism): the MoE's 512 experts are sharded 8 ways, 64 per GPU, as it would be run."""


def balanced_split(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage, as even as possible; the extra layers go to the first stages (the last one runs the head)."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (s < extra) for s in range(num_stages)]


def stage_costs(name: str, ep: int, num_stages: int, args: argparse.Namespace) -> tuple[OpCosts, list[float]]:
    """OpCosts (seconds) of each stage of `name` split over `num_stages`, and each stage's DP all-reduced
    parameter count (experts only where EP leaves replicas to reduce over). A tied embedding is held, and reduced, by the first and the last stage."""
    import torch

    from asyncpp.core.partition import param_stages, stage_layer_ranges
    from model_zoo import flops_per_token, get_model_config
    from model_zoo.transformer import CausalLM

    cfg = get_model_config(name)
    sizes = balanced_split(cfg.num_layers, num_stages)
    with torch.device("meta"):
        model = CausalLM(cfg)
    owner = param_stages(model, num_stages, sizes)
    dense, experts = [0.0] * num_stages, [0.0] * num_stages
    for n, p in model.named_parameters():
        stages = {owner[n], num_stages - 1} if n.startswith("embed.") and cfg.tie_embeddings else {owner[n]}
        for s in stages:
            if ".mlp.w_" in n:  # stacked routed experts: this GPU holds 1/ep of them
                experts[s] += p.numel() / ep
            else:
                dense[s] += p.numel()
    bandwidth, edp = args.bandwidth_gbs * 1e9, max(args.dp // ep, 1)
    dp_comm = [dp_allreduce_time(d, args.dp, bandwidth) + dp_allreduce_time(e, edp, bandwidth)
               for d, e in zip(dense, experts)]
    tokens, rate = args.micro_batch_size * args.seq_len, args.peak_tflops * 1e12 * args.mfu
    last = num_stages - 1
    forward = [tokens * flops_per_token(cfg, args.seq_len, r, head=s == last) / 3 / rate
               for s, r in enumerate(stage_layer_ranges(cfg.num_layers, num_stages, sizes))]
    activation = tokens * cfg.hidden_size * 2  # bf16
    costs = OpCosts(forward, [2 * f for f in forward], comm=activation / bandwidth, dp_comm=dp_comm)
    return costs, [d + (e if edp > 1 else 0.0) for d, e in zip(dense, experts)]


def run_dp_table(args: argparse.Namespace) -> list[dict]:
    rows = []
    for name, ep in DP_MODELS:
        for p in (8, 16):
            costs, reduced = stage_costs(name, ep, p, args)
            for m in (p, 2 * p):
                for kind in ("1f1b", "2bw"):
                    plain = predict(kind, p, m, 8, OpCosts(costs.forward, costs.backward, comm=costs.comm),
                                    collective_updates=True)
                    with_dp = predict(kind, p, m, 8, costs, collective_updates=True)
                    rows.append({"model": name, "ep": ep, "kind": kind, "num_stages": p, "num_microbatches": m,
                                 "dp": args.dp, "dp_params_max": max(reduced), "dp_comm_max": with_dp["dp_comm"],
                                 "step_time_no_dp": plain["step_time"], "step_time": with_dp["step_time"],
                                 "exposed": with_dp["step_time"] - plain["step_time"]})
    return rows


def print_dp_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"DP all-reduce: dp={args.dp}, {args.bandwidth_gbs:g} GB/s per GPU (ring, fp32 gradients), "
          f"F/B at {args.mfu:g} x {args.peak_tflops:g} TFLOP/s, microbatch {args.micro_batch_size}x{args.seq_len}")
    head = (f"{'model':<16}{'ep':>3}{'P':>4}{'m':>4} {'kind':<6}{'DP params':>11}{'all-reduce':>12}"
            f"{'step, no DP':>13}{'step':>10}{'exposed':>10}{'exposed %':>11}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['model']:<16}{r['ep']:>3}{r['num_stages']:>4}{r['num_microbatches']:>4} {r['kind']:<6}"
              f"{r['dp_params_max'] / 1e6:>10.1f}M{1e3 * r['dp_comm_max']:>10.2f}ms"
              f"{1e3 * r['step_time_no_dp']:>11.2f}ms{1e3 * r['step_time']:>8.2f}ms{1e3 * r['exposed']:>8.2f}ms"
              f"{100 * r['exposed'] / r['dp_comm_max']:>10.0f}%")
    print("DP params, all-reduce: of the stage with the largest all-reduce; exposed: step time added by it")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    if args.dp_table:
        rows = run_dp_table(args)
        print_dp_table(rows, args)
        out = Path(args.out or "bench_results/schedules_dp.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
        print(f"\nwrote {out}\n({time.perf_counter() - t0:.1f} s)")
        return
    costs = OpCosts(args.forward, args.backward, comm=args.comm, update=args.update)
    rows = run_grid(args, costs)
    print_table(rows)
    out = Path(args.out or "bench_results/schedules.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"costs": vars(args), "rows": rows}, indent=1))
    written = write_plots(args, costs, Path(args.plots)) if args.plots else []
    print(f"\nwrote {out}" + "".join(f"\nwrote {w}" for w in written))
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
