"""asyncpp's pipeline schedules against torch.distributed.pipelining's, side by side, and the physical limit.

Same model (tiny_dense), same split (embedding + layers 0-1 | layers 2-3, norm, head), same work (micro
batch 4 x seq 128, M microbatches, AdamW, `--steps` steps of which the first `--warmup` are not timed), two
ranks with one thread each (gloo on CPU). Torch's interleaved and V schedules need two chunks per rank:
they get the model in 4 chunks (embedding + layer 0 | layer 1 | layer 2 | layer 3, norm, head), placed
loop-style (Interleaved1F1B, InterleavedZeroBubble) or V-style (ZBVZeroBubble, DualPipeV). Torch's
pipelining has no cross-stage tied weights, so its last chunk holds an untied copy of the head; asyncpp
also all-reduces the tied embedding's gradient between its two stages every step.

The limit is 2 x the single-process rate (one thread, the whole model, the same microbatches): two
processes cannot do more work than two copies of one on two cores.

Repetitions are interleaved (rep 1 of every configuration, then rep 2, in a rotated order), and every run
records the machine's load: the CPU seconds the whole machine spent during the run (/proc/stat) minus those
of the run's own processes, over its wall time ("other load", in cores), and /proc/loadavg.

    .venv/bin/python bench/peers.py                # M=4 and 8, 2 repetitions (about 10 minutes, quiet machine)
    .venv/bin/python bench/peers.py --quick        # smoke run: M=4, 12 steps, 1 repetition
    .venv/bin/python bench/peers.py --memory       # RSS at steps 20, 80, 160 and tokens/s: 2BW under glibc's
                                                   # defaults, the fixed 128 KiB mmap threshold and the retained
                                                   # heap, torch 1F1B (about 10 minutes, quiet)
    .venv/bin/python bench/peers.py --only 2bw single --m 8 --splits [2,2] auto   # auto split vs the even one
    .venv/bin/python bench/peers.py --only 2bw 1f1b single --splits [2,2] [2,2]+vocab auto+vocab   # vocab head

A split ending in `+vocab` sets parallel.head=vocab (the LM head's vocabulary
spread over both stages, pipeline/vocab_head.py; `+vocab=[r0,r1]` sets the rows, parallel.vocab_shards; `@W,S`
after it the placement of its passes, parallel.vocab_placement: `+vocab@2,1`):

    .venv/bin/python bench/peers.py --only 2bw single --m 4 8 --reps 4 --splits auto [2,2]+vocab \
        "[2,2]+vocab@2,1"   # plain 2BW and the vocabulary-parallel head at the cost model's placement and at [2,1]

Writes bench_results/peers.json and bench_results/peers.png (bars: median tokens/s, whiskers: min-max).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "bench" / "peers_worker.py"
sys.path.insert(0, str(ROOT / "bench"))

from peers_worker import MULTI_STAGE, OURS, TORCH

EVEN = "[2,2]"
"""The split every peer uses (embedding + layers 0-1 | layers 2-3, norm, head)."""
MICROBATCH_TOKENS = 4 * 128
"""Tokens per microbatch: the worker's micro batch x seq (peers_worker.py's defaults, which this script keeps)."""


def configs_for(splits: list[str]) -> list[tuple[str, str, str]]:
    """(implementation, schedule, asyncpp's parallel.stage_layers or "") of every run of one repetition."""
    return ([("asyncpp", s, split) for s in OURS for split in splits] + [("torch", s, "") for s in TORCH]
            + [("single", "", "")])


def machine_cpu_s() -> float:
    """CPU seconds every core of the machine has spent busy since boot (/proc/stat: all but idle, iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def head_overrides(head: str) -> list[str]:
    """A split's suffix as overrides: none (the whole head on the last stage, parallel.head=last: plain 2BW; the
    config's default head=auto would pick the vocabulary-parallel head at pp=2), "auto" (the cost model picks),
    "vocab" / "vocab=[4096,4096]" (the vocabulary-parallel head, the shards by the cost model or by hand), with
    "@W,S" appended its placement (parallel.vocab_placement=[W,S]: warm-up and slack; else the cost model's)."""
    head, _, placement = head.partition("@")
    kind, _, value = head.partition("=")
    if placement and kind != "vocab":
        raise SystemExit(f"split suffix +{head}@{placement}: a placement (@W,S) goes with +vocab only")
    if kind in ("", "auto"):
        return [f"parallel.head={kind or 'last'}"]
    if kind == "vocab":
        return (["parallel.head=vocab"] + ([f"parallel.vocab_shards={value}"] if value else [])
                + ([f"parallel.vocab_placement=[{placement}]"] if placement else []))
    raise SystemExit(f"split suffix +{head}: expected +auto or +vocab[=[r0,r1]][@W,S] (the token head split, "
                     "+tokens, was removed: the vocabulary-parallel head matched or beat it)")


def run_one(impl: str, schedule: str, m: int, args, split: str = "") -> dict:
    """One job; returns its worker JSON with the load it ran under."""
    layers, _, head = split.partition("+")
    head_args = head_overrides(head)
    extra = [f"parallel.stage_layers={layers}", *head_args, *args.overrides] if impl == "asyncpp" else []
    out = Path(args.scratch) / f"{impl}-{schedule}-{m}-{split.replace('+', '_').replace('@', '_at_')}.json"
    steps = args.steps
    if impl == "single":  # its rate is steady after the warm-up: half the measured steps keep the bench short
        steps = args.warmup + max(2, (args.steps - args.warmup) // 2)
    worker = [str(WORKER), "--impl", {"asyncpp": "ours"}.get(impl, impl), "--schedule", schedule,
              "--microbatches", str(m), "--steps", str(steps), "--warmup", str(args.warmup),
              "--out", str(out), *extra]
    if impl == "single":
        cmd = [sys.executable, *worker]
    else:
        cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node=2", *worker]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(dict(e.split("=", 1) for e in args.asyncpp_env)
                                                      if impl == "asyncpp" else {})}
    load_before = Path("/proc/loadavg").read_text().split()[0]
    machine0, own0, t0 = machine_cpu_s(), children_cpu_s(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    machine, own = machine_cpu_s() - machine0, children_cpu_s() - own0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(out.read_text())
    result.update(impl=impl, schedule=schedule, split=split, m=m, run_wall_s=wall, other_load_cores=max(0.0, machine - own) / wall,
                  loadavg_before=float(load_before), loadavg_after=float(Path("/proc/loadavg").read_text().split()[0]))
    return result


def summarize(run: dict) -> dict:
    """The figures of one run: throughput over the slowest rank's measured interval, per-rank busy share
    (CPU time / wall time) and peak anonymous and total resident memory."""
    ranks = run["ranks"]
    steps = ranks[0]["steps_measured"]
    tokens = steps * run["m"] * MICROBATCH_TOKENS
    return {
        "tokens_per_s": tokens / max(r["wall_s"] for r in ranks),
        "bubble_per_rank": [1.0 - r["busy"] for r in ranks],
        "peak_anon_mb_per_rank": [max(s["anon"] for s in r["memory_mb"]) for r in ranks],
        "peak_rss_mb_per_rank": [max(s["hwm"] for s in r["memory_mb"]) for r in ranks],
        "other_load_cores": run["other_load_cores"],
        "ms_per_step_per_rank": [r.get("ms_per_step") for r in ranks],
    }


def label(impl: str, schedule: str, split: str = "") -> str:
    if impl == "single":
        return "ideal (2 x single process)"
    chunks = " (4 chunks)" if schedule in MULTI_STAGE else ""
    split, _, head = split.partition("+")
    layers = f" layers={split}" if split and split != EVEN else ""
    if head.startswith("vocab"):
        return f"{impl} {schedule}{chunks}{layers} head=vocab" + head[len("vocab"):]
    return f"{impl} {schedule}{chunks}{layers}" + (f" head={head}" if head else " head=last")


def table(rows: list[dict], reps: int) -> str:
    head = (f"{'schedule':38} {'M':>2} {'tokens/s':>9} {'spread':>7} {'of ideal':>8} {'bubble r0/r1':>13} "
            f"{'peak anon MB r0/r1':>19} {'peak RSS MB r0/r1':>18} {'other load':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        bub = "/".join(f"{b:.2f}" for b in r["bubble_per_rank"]) if r["impl"] != "single" else ""
        anon = "/".join(f"{x:.0f}" for x in r["peak_anon_mb_per_rank"])
        rss = "/".join(f"{x:.0f}" for x in r["peak_rss_mb_per_rank"])
        lines.append(f"{label(r['impl'], r['schedule'], r['split']):38} {r['m']:>2} {r['tokens_per_s']:>9.0f} "
                     f"{r['spread']:>6.1%} {r['share_of_ideal']:>8.2f} {bub:>13} {anon:>19} {rss:>18} "
                     f"{r['other_load_cores']:>9.2f}c")
    lines.append(f"\nmedian of {reps} interleaved repetitions; spread = (max - min) / median of tokens/s; bubble = "
                 "1 - CPU time / wall time of each rank over the measured steps; other load = cores the rest of the "
                 "machine kept busy during the runs (mean); ideal = 2 x the single-process rate (its bubble and "
                 "memory are those of the single process).")
    return "\n".join(lines)


def aggregate(runs: list[dict], configs: list[tuple[str, str, str]]) -> list[dict]:
    rows = []
    ideal = {}
    for m in sorted({r["m"] for r in runs}):
        single = [summarize(r)["tokens_per_s"] for r in runs if r["m"] == m and r["impl"] == "single"]
        ideal[m] = 2 * statistics.median(single) if single else float("nan")
    for impl, schedule, split in configs:
        for m in sorted({r["m"] for r in runs}):
            mine = [summarize(r) for r in runs
                    if (r["impl"], r["schedule"], r["split"], r["m"]) == (impl, schedule, split, m)]
            if not mine:
                continue
            tps = [x["tokens_per_s"] * (2 if impl == "single" else 1) for x in mine]
            med = statistics.median(tps)
            n = len(mine[0]["bubble_per_rank"])
            rows.append({
                "impl": impl, "schedule": schedule, "split": split, "m": m, "tokens_per_s": med, "tokens_per_s_runs": tps,
                "spread": (max(tps) - min(tps)) / med, "share_of_ideal": med / ideal[m],
                "bubble_per_rank": [statistics.median(x["bubble_per_rank"][i] for x in mine) for i in range(n)],
                "peak_anon_mb_per_rank": [max(x["peak_anon_mb_per_rank"][i] for x in mine) for i in range(n)],
                "peak_rss_mb_per_rank": [max(x["peak_rss_mb_per_rank"][i] for x in mine) for i in range(n)],
                "other_load_cores": statistics.mean(x["other_load_cores"] for x in mine),
                "ms_per_step_per_rank": [_median_kinds([x["ms_per_step_per_rank"][i] for x in mine]) for i in range(n)],
            })
    return rows


def _median_kinds(per_run: list[dict | None]) -> dict[str, float] | None:
    """The median over repetitions of each kind's ms per step (None where the run has no breakdown)."""
    if any(d is None for d in per_run):
        return None
    kinds = sorted({k for d in per_run for k in d})
    return {k: statistics.median(d.get(k, 0.0) for d in per_run) for k in kinds}


BREAKDOWN_KINDS = ("F", "B", "S", "T", "U", "idle", "untimed")


def breakdown_table(rows: list[dict]) -> str:
    """asyncpp's runs: where each rank's step goes (ms per step, medians), against the single process's whole
    step; `compute / single` is the stages' F + B + S + T summed over ranks over the single process's step time."""
    head = f"{'schedule':38} {'M':>2} {'rank':>4} " + " ".join(f"{k:>8}" for k in BREAKDOWN_KINDS) + \
        f" {'wall':>8} {'compute / single':>16}"
    lines = [head, "-" * len(head)]
    single = {r["m"]: r["m"] * MICROBATCH_TOKENS / (r["tokens_per_s"] / 2) * 1e3 for r in rows if r["impl"] == "single"}
    for r in rows:
        if r["impl"] != "asyncpp" or not r["ms_per_step_per_rank"] or None in r["ms_per_step_per_rank"]:
            continue
        compute = sum(d.get(k, 0.0) for d in r["ms_per_step_per_rank"] for k in ("F", "B", "S", "T"))
        ratio = f"{compute / single[r['m']]:.2f}" if r["m"] in single else ""
        for rank, d in enumerate(r["ms_per_step_per_rank"]):
            cells = " ".join(f"{d.get(k, 0.0):>8.1f}" for k in BREAKDOWN_KINDS)
            lines.append(f"{label(r['impl'], r['schedule'], r['split']):38} {r['m']:>2} {rank:>4} {cells} "
                         f"{sum(d.values()):>8.1f} {ratio if rank == 0 else '':>16}")
    lines.append("\nms per measured step, medians over the repetitions: F, B, S and T (the vocabulary-parallel "
                 "head's passes, without their waits), U (the update, U0 + U), idle (timed waits for a reduction), untimed (the rest of the wall time: waiting "
                 "for or posting a transfer, the engine's bookkeeping). single process: "
                 + ", ".join(f"M={m} {v:.1f} ms per step" for m, v in sorted(single.items())) + ".")
    return "\n".join(lines)


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = sorted({r["m"] for r in rows})
    names = list(dict.fromkeys(label(r["impl"], r["schedule"], r["split"]) for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(ms)
    for k, m in enumerate(ms):
        sel = {label(r["impl"], r["schedule"], r["split"]): r for r in rows if r["m"] == m}
        xs = [i + k * width for i, n in enumerate(names) if n in sel]
        med = [sel[n]["tokens_per_s"] for n in names if n in sel]
        lo = [sel[n]["tokens_per_s"] - min(sel[n]["tokens_per_s_runs"]) for n in names if n in sel]
        hi = [max(sel[n]["tokens_per_s_runs"]) - sel[n]["tokens_per_s"] for n in names if n in sel]
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=f"M={m}")
    ax.set_xticks([i + width * (len(ms) - 1) / 2 for i in range(len(names))])
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title("tiny_dense, 2 ranks x 1 thread, micro batch 4 x 128")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


MEMORY_STEPS = (20, 80, 160)
MEMORY_RUNS = (("asyncpp 2bw, glibc dynamic threshold", "asyncpp", "2bw", []),  # the default
               ("asyncpp 2bw, threshold 128 KiB", "asyncpp", "2bw", ["train.host_mmap_threshold=131072"]),
               ("asyncpp 2bw, heap retained", "asyncpp", "2bw",
                ["train.host_mmap_threshold=33554432", "train.host_trim_threshold=2147483647"]),
               ("torch 1F1B", "torch", "1F1B", []))


def memory_mode(args) -> dict:
    """Resident memory of rank 0 and 1 after steps 20, 80 and 160 at M=4, and the throughput of the same runs:
    asyncpp 2BW under glibc's defaults, with the fixed 128 KiB mmap threshold and with the heap retained
    (asyncpp/host/allocator.py), and torch 1F1B; `--reps` interleaved repetitions in a rotated order."""
    args.steps, args.warmup = MEMORY_STEPS[-1], 5
    runs: dict[str, list[dict]] = {name: [] for name, *_ in MEMORY_RUNS}
    for rep in range(args.reps):
        k = rep % len(MEMORY_RUNS)
        for name, impl, schedule, extra in MEMORY_RUNS[k:] + MEMORY_RUNS[:k]:
            mine = argparse.Namespace(**{**vars(args), "overrides": [*args.overrides, *extra]})
            run = run_one(impl, schedule, 4, mine, EVEN if impl == "asyncpp" else "")
            runs[name].append({
                "tokens_per_s": summarize(run)["tokens_per_s"], "other_load_cores": run["other_load_cores"],
                "loadavg_before": run["loadavg_before"],
                "ranks": [{str(s): r["memory_mb"][s - 1] for s in MEMORY_STEPS} for r in run["ranks"]]})
            print(f"rep {rep} {name:38} {runs[name][-1]['tokens_per_s']:8.0f} tokens/s "
                  f"(other load {run['other_load_cores']:.2f} cores)", flush=True)
    print(memory_table(runs))
    return {"steps": MEMORY_STEPS, "runs": runs}


def _median_sample(reps: list[dict], rank: int, step: int, key: str) -> float:
    return statistics.median(r["ranks"][rank][str(step)][key] for r in reps)


def memory_table(runs: dict[str, list[dict]]) -> str:
    """Per configuration and rank: anonymous and total resident MB and the high-water mark at each step, the
    heap's free MB at the last step (glibc), medians over the repetitions; tokens/s median (min-max)."""
    cols = " ".join(f"{f'step {s} anon/RSS/HWM':>22}" for s in MEMORY_STEPS)
    head = f"{'run':38} {'rank':>4} {cols} {'heap free':>9} {'tokens/s (min-max)':>20}"
    lines = [head, "-" * len(head)]
    for name, reps in runs.items():
        tps = [r["tokens_per_s"] for r in reps]
        for rank in range(len(reps[0]["ranks"])):
            cells = " ".join(f"{_median_sample(reps, rank, s, 'anon'):>8.0f}/{_median_sample(reps, rank, s, 'rss'):>6.0f}/"
                             f"{_median_sample(reps, rank, s, 'hwm'):>6.0f}" for s in MEMORY_STEPS)
            last = reps[0]["ranks"][rank][str(MEMORY_STEPS[-1])]
            free = f"{_median_sample(reps, rank, MEMORY_STEPS[-1], 'heap_free'):>9.0f}" if "heap_free" in last else f"{'':>9}"
            rate = f"{statistics.median(tps):.0f} ({min(tps):.0f}-{max(tps):.0f})" if rank == 0 else ""
            lines.append(f"{name:38} {rank:>4} {cells} {free} {rate:>20}")
    lines.append("\nMB; medians over the repetitions. anon = RssAnon (no file mappings: the data's memory map and the "
                 "libraries excluded), RSS = VmRSS, HWM = VmHWM so far; heap free = glibc's free bytes inside its "
                 "heaps at the last step (mallinfo2).")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=None, help="configurations to run, e.g. 2bw 1F1B single")
    parser.add_argument("--splits", nargs="+", default=[EVEN],
                        help=f"parallel.stage_layers of asyncpp's runs (default {EVEN}, the peers' split; "
                             "e.g. --splits [2,2] auto compares auto with it)")
    parser.add_argument("--quick", action="store_true", help="smoke run: M=4, 12 steps (3 warm-up), 1 repetition")
    parser.add_argument("--memory", action="store_true",
                        help="resident memory at steps 20/80/160 and tokens/s, 2BW before/after the fixed mmap "
                             "threshold, and torch 1F1B (--reps interleaved repetitions)")
    parser.add_argument("--asyncpp-env", nargs="*", default=[], metavar="KEY=VALUE",
                        help="environment of asyncpp's runs only, e.g. MALLOC_MMAP_THRESHOLD_=65536 (glibc: large "
                             "blocks always mmapped, which keeps the heap from fragmenting; costs page faults)")
    parser.add_argument("--out", default="bench_results/peers.json")
    parser.add_argument("overrides", nargs="*", help="hydra overrides for asyncpp's runs")
    args = parser.parse_args()
    if args.quick:
        args.m, args.steps, args.warmup, args.reps = [4], 12, 3, 1
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        args.scratch = scratch
        if args.memory:
            result = memory_mode(args)
            out.with_name(out.stem + "_memory.json").write_text(json.dumps(result, indent=2))
            return
        configs = [c for c in configs_for(args.splits) if args.only is None or c[1] in args.only or c[0] in args.only]
        runs = []
        for rep in range(args.reps):
            for m in args.m:
                k = rep % len(configs)  # rotate the order so no configuration always runs first
                for impl, schedule, split in configs[k:] + configs[:k]:
                    runs.append(run_one(impl, schedule, m, args, split))
                    s = summarize(runs[-1])
                    name = "single process" if impl == "single" else label(impl, schedule, split)
                    print(f"rep {rep} M={m} {name:38} {s['tokens_per_s']:8.0f} tokens/s "
                          f"(other load {s['other_load_cores']:.2f} cores)", flush=True)
    rows = aggregate(runs, configs)
    print(table(rows, args.reps))
    print("\n" + breakdown_table(rows))
    for r in runs:
        for rank in r["ranks"]:
            rank.pop("memory_mb", None)  # per-step samples: large, and the table has their peaks
    out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "scratch"}, "rows": rows,
                               "runs": runs}, indent=2))
    chart(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
