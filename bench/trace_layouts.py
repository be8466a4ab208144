"""Every paper layout of configs/parallel/ traced at real size on meta tensors, stage by stage (issue 33).

For moe_2b and hybrid_moe_10b at the work shape of the layouts' comments (bf16, seq 4096, micro batch 1, EF on,
Muon): each stage's traced peak of live storage bytes next to its memory plan, and its host reads per step by
call site (asyncpp/analysis/traced.py). Writes <out>/trace_layouts.json and prints a markdown table.

The microbatch count is the smallest 2BW takes (m = P) unless --m is given: in 2BW (and 1F1B) a stage holds the
activations of P - s microbatches whatever m is, so the peak does not depend on it; the host reads per step
grow as a*m + b, and the table gives a and b from the trace's per-action reads (a: the reads in FORWARD and
BACKWARD actions per microbatch; b: the rest, per step).

    .venv/bin/python bench/trace_layouts.py --out bench_results          # ~10 min of CPU on a quiet machine
    .venv/bin/python bench/trace_layouts.py --only moe_2b_8gpu --stages 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's asyncpp and data, not bench/data.py

from asyncpp import job
from asyncpp.analysis.opcost import DEVICES, CostTracer
from asyncpp.analysis.stagetime import links_for, prediction_report, stage_time
from asyncpp.analysis.trace import StepTracer
from asyncpp.analysis.traced import TRACED_STEPS, trace_stage
from asyncpp.parallel.mesh import ParallelDims

LAYOUTS = {  # layout -> (model, world size, pipeline stages)
    "moe_2b_8gpu": ("moe_2b", 8, 2),
    "hybrid_moe_10b_8gpu": ("hybrid_moe_10b", 8, 4),
    "hybrid_moe_10b_32gpu": ("hybrid_moe_10b", 32, 4),
}
WORK = ["train.precision=bf16", "train.seq_len=4096", "train.micro_batch_size=1", "staleness.ef_lambda=1.0"]


MICROBATCH_ACTIONS = "FBSTEG"
"""The first letter of the per-microbatch actions (schedules/actions.Op): forward, backward, the vocabulary head's
S and T, the sharded embedding's E and G."""


def reads_split(trace: dict) -> tuple[float, float]:
    """(host reads per microbatch in its actions, other host reads per step) of a traced stage."""
    steps, m = trace["steps"], trace["microbatches"]
    training = [r for r in trace["host_reads"] if r["action"] not in ("evaluate", "checkpoint state", "drain")]
    per_mb = sum(1 for r in training if r["action"][0] in MICROBATCH_ACTIONS) / (steps * m)
    other = sum(1 for r in training if r["action"][0] not in MICROBATCH_ACTIONS) / steps
    return per_mb, other


def dims_of(cfg, world: int) -> ParallelDims:
    p = cfg.parallel
    return ParallelDims.for_world(world, pp=p.pp, tp=p.tp, ep=p.ep, dp=p.dp)


def stage_lines(trace, dims: ParallelDims) -> list[str]:
    """One stage's predicted ms per microbatch (F, B, per microbatch in all), bound, MFU and update, per GPU."""
    lines = []
    for key, device in DEVICES.items():
        st = stage_time(trace.costs, trace.stage, device, links_for(dims))
        lines.append(f"{key}: F {st.kinds.get('F', 0) * 1e3:.1f} ms, B {st.kinds.get('B', 0) * 1e3:.1f} ms, per "
                     f"microbatch {st.microbatch_s * 1e3:.1f} ms ({st.bound}-bound), MFU {st.mfu:.1%}, update "
                     f"{st.update_s * 1e3:.1f} ms; top: " + ", ".join(f"{op} {sec * 1e3:.1f}" for op, sec in st.top))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_results")
    ap.add_argument("--only", nargs="*", default=list(LAYOUTS))
    ap.add_argument("--stages", default=None, help="comma-separated stages (default: all)")
    ap.add_argument("--m", type=int, default=None, help="microbatches per step (default: P)")
    ap.add_argument("--steps", type=int, default=TRACED_STEPS)
    ap.add_argument("--head", default=None, help="parallel.head (default: the layout's own, vocab for the paper's)")
    ap.add_argument("--predict", action="store_true",
                    help="also book every op's cost and print the step-time prediction per layout (as dry_run_trace); "
                         "the per-action times need no more than --steps 1")
    ap.add_argument("--predict-m", type=int, default=None,
                    help="the job's microbatches per step for --predict (default --m): a trace at m = P predicts any m")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "trace_layouts.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    for layout in args.only:
        model, world, pp = LAYOUTS[layout]
        m = args.m or pp
        head = [f"parallel.head={args.head}"] if args.head else []
        cfg, model_cfg = job.resolve(job.compose([f"model={model}", f"parallel={layout}", f"train.num_microbatches={m}",
                                                  *WORK, *head, "logging=disabled", f"out_dir={out / 'trace_runs'}"]))
        stages = [int(s) for s in args.stages.split(",")] if args.stages else list(range(pp))
        traces = []
        for s in stages:
            started = time.perf_counter()
            trace = trace_stage(cfg, model_cfg, world, s, lambda st, plan, mesh, c=cfg: job.optimizer_for(c, mesh)(st, plan),
                                steps=args.steps, tracer_cls=CostTracer if args.predict else StepTracer)
            traces.append(trace)
            print(f"== {layout} stage {s}: {time.perf_counter() - started:.0f} s", flush=True)
            print(trace.report(), flush=True)
            d = trace.to_dict()
            d.pop("comms")  # thousands of entries; the report's counts are kept below
            d["comm_counts"] = {}
            for c in trace.comms:
                d["comm_counts"][c.op] = d["comm_counts"].get(c.op, 0) + 1
            if args.predict:  # each stage's prediction as soon as it is traced (a cut run keeps the stages done)
                d["predicted"] = stage_lines(trace, dims_of(cfg, world))
                print("\n".join(f"  {layout} stage {s} {line}" for line in d["predicted"]), flush=True)
            results[f"{layout}/head={cfg.parallel.head}/m={m}/stage{s}"] = d
            path.write_text(json.dumps(results, indent=1))
        if args.predict:
            dims = dims_of(cfg, world)
            text, prediction = prediction_report(cfg, model_cfg, dims, traces, args.predict_m)
            print(f"== {layout} (traced at m={m}, {args.steps} steps)\n{text}", flush=True)
            (out / f"predict_{layout}_m{m}.json").write_text(json.dumps(prediction, indent=1))
    print("| layout | head | stage | plan GiB | traced peak GiB | peak / plan | host reads per step (a*m + b) | kernels |")
    print("|---|---|---|---|---|---|---|---|")
    for key, d in sorted(results.items()):
        layout, head, m, stage = key.split("/")
        plan = d["plan"]["total_bytes"]
        a, b = reads_split(d)
        kernels = sorted(set(d["kernels"].values()))
        print(f"| {layout} ({m}) | {head[5:]} | {stage[5:]} | {plan / 2**30:.2f} | {d['peak_bytes'] / 2**30:.2f} | "
              f"{d['peak_bytes'] / plan:.3f} | {a:g}*m + {b:g} | {', '.join(kernels) or '-'}; {d['attention']} |")


if __name__ == "__main__":
    main()
