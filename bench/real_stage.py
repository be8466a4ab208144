"""The paper layouts' stages run for real, one at a time, on one GPU: the memory plan against the CUDA allocator.

`dry_run=N dry_run_trace=true` (asyncpp/analysis/traced.py) runs one stage's 2BW steps at real size on meta
tensors and compares its live storage with the memory plan. This runs the same stage, the same schedule and the
same fake process group on a real CUDA device (`trace_stage(device="cuda")`): real kernels, real values, the real
allocator. Per stage it reports

- the plan's total (what `dry_run=N` prints);
- the tracer's peak of live storage bytes on the device (what the meta trace measures);
- the CUDA allocator's peak (`torch.cuda.max_memory_allocated`, reset when the traced window opens: the build
  before it is not counted) and its reserved peak;
- the traced window's wall time (under the tracer's dispatch mode: an upper bound of the step's time);
- the host reads per step by call site, the MoE kernel and the attention path the device chose.

A stage that does not fit (or fails) is recorded with its error and the script goes on to the next. Writes
<out>/real_stage.json after every stage and prints a markdown table.

    python bench/real_stage.py --out bench_results                       # every stage of the three layouts
    python bench/real_stage.py --only moe_2b_8gpu --stages 1 --head last
    python bench/real_stage.py --smoke                                   # CPU: tiny models, checks the harness
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's asyncpp and data, not bench/data.py

import torch

from asyncpp import job
from asyncpp.analysis import trace as trace_mod
from asyncpp.analysis.traced import TRACED_STEPS, trace_stage

LAYOUTS = {  # layout -> (model, world size, pipeline stages); the same as bench/trace_layouts.py
    "moe_2b_8gpu": ("moe_2b", 8, 2),
    "hybrid_moe_10b_8gpu": ("hybrid_moe_10b", 8, 4),
    "hybrid_moe_10b_32gpu": ("hybrid_moe_10b", 32, 4),
}
SMOKE = {"tiny_moe_2stage": ("tiny_moe", 2, 2)}  # the harness on the CPU (--smoke): a parallel= override below
WORK = ["train.precision=bf16", "train.seq_len=4096", "train.micro_batch_size=1", "staleness.ef_lambda=1.0"]
GIB = 2**30


class AllocatorPeak:
    """The CUDA allocator's peak from the moment the tracer opens its window (StepTracer.start), so the build
    (materializing the weights) is not counted: the plan and the trace describe the running step."""

    def __init__(self, device: torch.device):
        self.device, self.base, self._start = device, 0, trace_mod.StepTracer.start

    def __enter__(self):
        peak = self

        def start(tracer):
            if peak.device.type == "cuda":
                torch.cuda.synchronize(peak.device)
                torch.cuda.reset_peak_memory_stats(peak.device)
                peak.base = torch.cuda.memory_allocated(peak.device)
            return peak._start(tracer)

        trace_mod.StepTracer.start = start
        return self

    def __exit__(self, *exc):
        trace_mod.StepTracer.start = self._start

    def read(self) -> dict:
        if self.device.type != "cuda":
            return {}
        torch.cuda.synchronize(self.device)
        return {"allocated_at_start_bytes": self.base,
                "max_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
                "max_reserved_bytes": torch.cuda.max_memory_reserved(self.device)}


def config_of(layout: str, model: str, m: int, head: str | None, out: Path, smoke: bool):
    overrides = [f"model={model}", f"train.num_microbatches={m}", "logging=disabled", f"out_dir={out / 'real_stage_runs'}"]
    if smoke:
        overrides += ["parallel.pp=2", "train.seq_len=64", "train.micro_batch_size=2", "staleness.ef_lambda=1.0"]
    else:
        overrides += [f"parallel={layout}", *WORK]
    if head is not None:
        overrides.append(f"parallel.head={head}")
    return job.resolve(job.compose(overrides))


def run_stage(cfg, model_cfg, world: int, stage: int, device: torch.device, steps: int) -> dict:
    started = time.perf_counter()
    with AllocatorPeak(device) as peak:  # trace_stage fills the fake group's collectives (traced.FilledCollectives)
        trace = trace_stage(cfg, model_cfg, world, stage,
                            lambda st, plan, mesh, c=cfg: job.optimizer_for(c, mesh)(st, plan),
                            device=device.type, steps=steps, as_gpu=None)
        allocator = peak.read()
    d = trace.to_dict()
    comms = d.pop("comms")
    d.update(allocator)
    d["comm_count"] = len(comms)
    d["wall_with_build_s"] = round(time.perf_counter() - started, 2)
    for key in ("ops", "op_actions", "scalars", "actions"):  # per-op lists: large, and the meta trace has them
        d.pop(key, None)
    print(trace.report(), flush=True)
    return d


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def table(results: dict) -> str:
    header = ("| layout | head | stage | plan GiB | tracer peak GiB | allocator peak GiB | reserved GiB | "
              "allocator / plan | traced window s | error |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for key, d in results.items():
        layout, head, stage = key.split("/")
        if "error" in d:
            lines.append(f"| {layout} | {head} | {stage} | | | | | | | {d['error'][:80]} |")
            continue
        plan = d["plan"]["total_bytes"]
        alloc = d.get("max_allocated_bytes", 0)
        lines.append(f"| {layout} | {head} | {stage} | {plan / GIB:.2f} | {d['peak_bytes'] / GIB:.2f} | "
                     f"{alloc / GIB:.2f} | {d.get('max_reserved_bytes', 0) / GIB:.2f} | "
                     f"{alloc / plan:.3f} | {d.get('wall_s', 0):.1f} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_results")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--stages", default=None, help="comma-separated stages (default: all)")
    ap.add_argument("--head", nargs="*", default=[None], help="parallel.head values (default: the layout's own)")
    ap.add_argument("--m", type=int, default=None, help="microbatches per step (default: P, as trace_layouts)")
    ap.add_argument("--steps", type=int, default=TRACED_STEPS)
    ap.add_argument("--smoke", action="store_true", help="CPU: a tiny model, to check the harness")
    args = ap.parse_args(argv)
    layouts = SMOKE if args.smoke else LAYOUTS
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/real_stage.py needs a CUDA device (use --smoke on a CPU)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "real_stage.json"
    results: dict = {}
    for layout in args.only or list(layouts):
        model, world, pp = layouts[layout]
        stages = [int(s) for s in args.stages.split(",")] if args.stages else list(range(pp))
        for head in args.head:
            cfg, model_cfg = config_of(layout, model, args.m or pp, head, out, args.smoke)
            for s in stages:
                key = f"{layout}/{cfg.parallel.head}/{s}"
                print(f"== {key}", flush=True)
                try:
                    results[key] = run_stage(cfg, model_cfg, world, s, device, args.steps)
                except Exception as e:  # noqa: BLE001 - recorded, not swallowed: the table and the JSON carry it, exit is 1
                    traceback.print_exc()
                    results[key] = {"error": f"{type(e).__name__}: {e}"}
                free(device)
                path.write_text(json.dumps(results, indent=1, default=str))
    print(table(results), flush=True)
    return results


if __name__ == "__main__":
    sys.exit(1 if any("error" in d for d in main().values()) else 0)
