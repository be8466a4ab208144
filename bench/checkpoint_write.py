"""The checkpoint write rate at real size: a paper recipe's whole state, built on the CPU, written through the run's
own checkpoint path (asyncpp/train/checkpoint: Saver, DCP's file writer, the manifest, the atomic rename) to a local
directory, repeated; prints a table and writes JSON.

    .venv/bin/python -m bench.checkpoint_write                          # smollm2_135m (1.9 GiB), 5 repetitions
    .venv/bin/python -m bench.checkpoint_write --recipe smollm2_360m --reps 4 --dir /scratch/ckpt

The state is the recipe's own (its model at full size, its optimizer after one step, EF's buffer and both 2BW weight
versions, bf16 as the recipe): the simulator's executor (asyncpp/reference/executor.py) as a 1-GPU run builds it, with
a batch of 1 x 16 tokens so the step that makes the optimizer state is cheap (the state does not depend on the batch).
Its bytes are asyncpp/train/checkpoint/size.py's (checked against the written files). Each repetition saves the same
step again (the run's replace-and-prune path), timed twice: save() returning (what a synchronous save makes the
training loop wait for: the files written, possibly still in the page cache) and after os.sync() (on the disk).
A larger recipe's write time at this rate is its size (docs/recipes.md) / the rate, for one writer; with DCP every rank
writes its own share at once, so on a node-local disk per node the time is the largest node's share / the rate.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from asyncpp import job
from asyncpp.optim import build_from_config
from asyncpp.pipeline.build import build_whole_model
from asyncpp.reference.executor import ReferenceExecutor
from asyncpp.train.checkpoint.size import checkpoint_size

ROOT = Path(__file__).resolve().parents[1]
SMALL_BATCH = ["train.micro_batch_size=1", "train.seq_len=16", "train.global_batch_size=1", "train.steps=1",
               "train.eval_every=0", "train.device=cpu", "logging=disabled", "logging.progress=false", "data=default"]


def disk_of(path: Path) -> str:
    """The device and filesystem holding `path` (from /proc/mounts: the longest mount point above it)."""
    path, best = path.resolve(), ("?", "?", "")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mount, fs = line.split()[:3]
            if str(path).startswith(mount) and len(mount) > len(best[2]):
                best = (dev, fs, mount)
    except OSError:
        pass
    return f"{best[0]} ({best[1]}, mounted at {best[2] or '?'})"


def build_state(recipe: str, out_dir: Path) -> tuple[ReferenceExecutor, int]:
    """The recipe's executor after one step, and its checkpoint's tensor bytes."""
    cfg, model_cfg = job.resolve(job.compose([f"+experiment=paper/{recipe}", *SMALL_BATCH, f"out_dir={out_dir}",
                                              "checkpoint.keep_last=1", "checkpoint.async_save=false"]))
    torch.manual_seed(cfg.seed)
    model = build_whole_model(cfg, model_cfg, torch.device("cpu")).model
    executor = ReferenceExecutor(cfg, model, build_from_config(model, cfg.optimizer), job.build_data(cfg, model_cfg))
    for _ in executor.steps(0, 1):
        pass
    return executor, checkpoint_size(cfg, model_cfg).total


def measure(executor: ReferenceExecutor, reps: int) -> list[dict]:
    runs = []
    for i in range(reps + 1):  # the first: warm-up (DCP's imports, the directory's first write)
        os.sync()
        start = time.perf_counter()
        path = executor.checkpoint.save(1)
        returned = time.perf_counter() - start
        os.sync()
        synced = time.perf_counter() - start
        files = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        if i:
            runs.append({"save_s": returned, "synced_s": synced, "file_bytes": files})
    return runs


def summarize(runs: list[dict], key: str, nbytes: int) -> dict:
    times = [r[key] for r in runs]
    median = statistics.median(times)
    return {"median_s": median, "min_s": min(times), "max_s": max(times), "gb_per_s": nbytes / median / 1e9,
            "gb_per_s_range": [nbytes / max(times) / 1e9, nbytes / min(times) / 1e9]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="smollm2_135m", help="configs/experiment/paper/<recipe>.yaml")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (after one warm-up)")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench_results" / "checkpoint_write.json")
    args = ap.parse_args(argv)
    if args.reps < 4:
        ap.error(f"--reps={args.reps}: at least 4, for a median with a spread")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="asyncpp-ckpt-bench-") as tmp:
        executor, nbytes = build_state(args.recipe, Path(tmp))
        runs = measure(executor, args.reps)
        where = disk_of(Path(tmp))
    files = runs[0]["file_bytes"]
    result = {"recipe": args.recipe, "tensor_bytes": nbytes, "file_bytes": files, "disk": where,
              "host": platform.node(), "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "runs": runs,
              "save": summarize(runs, "save_s", files), "synced": summarize(runs, "synced_s", files)}
    print(f"{args.recipe}: {files / 2**30:.2f} GiB of files ({nbytes / 2**30:.2f} GiB of tensors) to {where}, "
          f"{args.reps} repetitions after a warm-up, load {result['load_avg'][0]:.1f}")
    print(f"{'':12} {'median s':>9} {'min s':>7} {'max s':>7} {'GB/s':>6} {'GB/s range':>13}")
    for key in ("save", "synced"):
        s = result[key]
        lo, hi = s["gb_per_s_range"]
        print(f"{key + '()' if key == 'save' else '+ os.sync()':12} {s['median_s']:9.2f} {s['min_s']:7.2f} "
              f"{s['max_s']:7.2f} {s['gb_per_s']:6.2f} {lo:6.2f}-{hi:<6.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
