"""The parts of bench/gpu_check.py that import torch and the project, one per process: `environment` (versions, and
what imports), `profile` (torch.profiler: top kernels, kernel launches and host syncs per microbatch), `predict` (the
step-time model next to each bench row). Run by bench/gpu_check.py after its install; not meant to be run by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from asyncpp.analysis.opcost import DEVICES
from asyncpp.analysis.steptime import time_of, trace_workload, workload_named, workloads
from model_zoo.backends.kernels import try_import

TOP_KERNELS = 30
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpy2D", "aten::_local_scalar_dense")
"""Profiler events that make the host wait for the device (a cudaMemcpy without Async is a blocking copy)."""


def profile_part(dry: bool) -> dict:
    """One microbatch of each bench workload (local, eager) under torch.profiler, after warm-ups."""
    device = torch.device("cpu" if dry else "cuda")
    batch, seq = (1, 64) if dry else (4, 4096)
    activities = [ProfilerActivity.CPU] + ([] if dry else [ProfilerActivity.CUDA])
    out = {}
    for w in workloads(smoke=dry):
        model = w.build(device)
        step = w.step_fn(model, batch, seq, device)
        for _ in range(2):
            step()
        if not dry:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            step()
            if not dry:
                torch.cuda.synchronize()
        out[w.name] = profile_summary(prof, on_device=not dry)
        del model, step
    return out


def profile_summary(prof, on_device: bool) -> dict:
    events = prof.events()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    syncs = {name: sum(1 for e in events if e.name == name) for name in SYNC_CALLS}
    averages = prof.key_averages()
    if on_device:
        ranked = sorted((a for a in averages if a.self_device_time_total > 0), key=lambda a: -a.self_device_time_total)
        top = [{"kernel": a.key[:160], "calls": a.count, "cuda_ms": a.self_device_time_total / 1e3} for a in ranked]
    else:  # the dry run: no kernels, the CPU ops stand in so the table's structure is exercised
        ranked = sorted(averages, key=lambda a: -a.self_cpu_time_total)
        top = [{"kernel": f"(cpu op) {a.key[:150]}", "calls": a.count, "cuda_ms": a.self_cpu_time_total / 1e3}
               for a in ranked]
    return {"kernels_per_microbatch": len(kernels), "kernel_ms": sum(e.device_time_total for e in kernels) / 1e3,
            "host_syncs_per_microbatch": sum(syncs.values()), "host_syncs_by_call": {k: v for k, v in syncs.items() if v},
            "aten_ops_per_microbatch": sum(1 for e in events if e.name.startswith("aten::")),
            "top_kernels": top[:TOP_KERNELS]}


def predict_part(bench_json: Path, dry: bool) -> list[dict]:
    """The model's prediction for every timed bench row, with the GDN kernel that ran."""
    if not bench_json.exists():
        raise SystemExit(f"predict: {bench_json} is missing: the bench part wrote no result (its own entry says why)")
    bench = json.loads(bench_json.read_text())
    gpu = bench.get("gpu_name", "")
    model = "H200" if "H200" in gpu else "H100"
    args = bench["args"]
    out = []
    for row in bench["stages"]:
        if "skipped" in row or row["compile"] or row["backend"] not in ("local", "mcore"):
            continue
        gdn = {"fla": "fused", "batched": "batched"}.get(row.get("gdn_kernel"), "torch")  # "-": no GDN layer
        table = trace_workload(workload_named(row["workload"]), row["backend"], args["micro_batch_size"],
                               args["seq_len"], gdn=gdn)
        t = time_of(table, "microbatch", DEVICES[model])
        out.append({"workload": row["workload"], "backend": row["backend"], "gdn": gdn, "device_model": model,
                    "measured_s": row["seconds_per_microbatch"], "predicted_s": t.total_s,
                    "predicted_over_measured": row["seconds_per_microbatch"] / t.total_s,  # of tokens/s
                    "predicted_device_s": t.device_s, "predicted_host_s": t.host_s,
                    "predicted_kernels": t.kernels, "predicted_ops": t.ops, "structural_only": dry})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("part", choices=["environment", "profile", "predict"])
    ap.add_argument("--tmp", required=True, help="where bench/gpu_check.py keeps the parts' JSON")
    ap.add_argument("--dry", action="store_true")
    args = ap.parse_args()
    tmp = Path(args.tmp)
    if args.part == "environment":
        info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                "gpu_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"}
        for name in ("triton", "megatron.core", "fla", "transformer_engine", "hydra", "omegaconf"):
            module, why = try_import(name)  # the JSON says what the device lacks and why
            info[name] = getattr(module, "__version__", "importable") if module is not None else f"not importable: {why}"[:200]
        result: object = info
    elif args.part == "profile":
        result = profile_part(args.dry)
    elif args.part == "predict":
        result = predict_part(tmp / "bench.json", args.dry)
    (tmp / f"{args.part}.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, default=str)[:2000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
