"""The distributed optimizer's memory per rank, planned and measured, with and without it (CPU, gloo).

Runs a PP=2 x DP=2 2BW pipeline with Error Feedback for a few steps, twice (parallel.distributed_optimizer
false / true), four gloo processes each, and reports per rank:
- plan: the fp32-master, optimizer-state and EF rows of asyncpp.core.memory's per-rank report (what
  pretrain.py prints at start), built from the engine's own versions, optimizer and EF buffer;
- measured: the bytes of the fp32 masters kept apart from the weight versions (bf16 only; in fp32 they are the
  newest version), of the optimizer-state and of the EF tensors that exist after training (the storages torch
  allocated, counted once each), and the process's peak RSS (ru_maxrss; it includes the Python runtime,
  torch and the data, so only its difference between the two runs is meaningful).
Prints a table and writes JSON:

    .venv/bin/python bench/distributed_optimizer.py --out outputs/bench/distributed_optimizer.json
    .venv/bin/python bench/distributed_optimizer.py --precision bf16 --out outputs/bench/distributed_optimizer_bf16.json
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository's asyncpp and tests, not an installed copy

import torch

from asyncpp.core.memory import optimizer_state_tensors, storage_bytes

_MIB = 1024 * 1024


def _rank(rank: int, cfg_dict: dict) -> dict:
    from asyncpp import job
    from asyncpp.pipeline.build import build_rank_stage
    from asyncpp.pipeline.compose import pipeline_executor
    from asyncpp.pipeline.memory import stage_memory
    from asyncpp.train.trainer import Trainer
    from tests.dist.workers import Collect, data_for, rank_layout

    cfg, model_cfg, mesh = rank_layout(cfg_dict)
    torch.manual_seed(cfg.seed)
    run = pipeline_executor(cfg, build_rank_stage(cfg, model_cfg, mesh, "cpu"), mesh,
                            data_for(cfg, model_cfg.vocab_size), job.optimizer_for(cfg, mesh))
    e = run.engine.update
    plan = stage_memory(cfg, model_cfg, mesh, run.spec, e.versions, e.optimizer, e.error_feedback.prev_update)
    Trainer(cfg, run, Collect()).run()
    masters = [q for q in e.versions.masters if q is not None] if e.versions.mixed else []
    return {
        "stage": mesh.pp_rank, "dp": mesh.dp_rank,
        "params_bytes": sum(p.numel() for p in e.params) * 4,  # the stage's parameters in fp32
        "plan_master_bytes": plan.get("fp32 master weights") if e.versions.mixed else 0,
        "measured_master_bytes": storage_bytes(masters),
        "plan_optimizer_bytes": plan.get("optimizer state"), "plan_ef_bytes": plan.get("error feedback"),
        "plan_total_bytes": plan.total,
        "measured_optimizer_bytes": storage_bytes(optimizer_state_tensors(e.optimizer)),
        "measured_ef_bytes": storage_bytes(e.error_feedback.prev_update),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        # The broadcast of x_{t+1}: how long each was in flight, and how long a read of x_{t+1} waited for it.
        "broadcasts": e.shards.broadcasts if e.shards else 0,
        "broadcast_in_flight_s": e.shards.in_flight_s if e.shards else 0.0,
        "broadcast_blocked_s": e.shards.blocked_s if e.shards else 0.0,
        "busy_s": e.timer.busy(),
    }


def measure(optimizer: str, zero: bool, steps: int, hidden: int, precision: str) -> list[dict]:
    from tests.dist.harness import run_ranks
    from tests.dist.workers import make_config

    # Untied (as moe_2b and hybrid_moe_10b): a tied embedding stays replicated under the distributed optimizer.
    overrides = {"hidden_size": hidden, "ffn_hidden_size": 3 * hidden, "tie_embeddings": False}
    cfg = make_config(model={"name": "tiny_dense", "overrides": overrides},
                      parallel={"pp": 2, "dp": 2, "distributed_optimizer": zero}, optimizer={"name": optimizer},
                      train={"steps": steps, "num_microbatches": 2, "precision": precision},
                      staleness={"ef_lambda": 1.0})
    return sorted(run_ranks(_rank, 4, cfg.to_dict(), timeout=900), key=lambda r: (r["stage"], r["dp"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizers", default="adamw,muon")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512, help="tiny_dense's hidden size (memory scale)")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                    help="train.precision; bf16 keeps fp32 masters apart, sharded by the distributed optimizer")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "distributed_optimizer.json")
    args = ap.parse_args()
    rows = []
    for name in args.optimizers.split(","):
        for zero in (False, True):
            for r in measure(name, zero, args.steps, args.hidden, args.precision):
                rows.append({"optimizer": name, "distributed_optimizer": zero, **r})
    head = (f"{'optimizer':<9} {'dist.opt':<8} {'stage':>5} {'dp':>3} {'params':>8} {'mst plan':>9} {'mst meas':>9} "
            f"{'opt plan':>9} {'opt meas':>9} "
            f"{'EF plan':>8} {'EF meas':>8} {'peak RSS':>9} (MiB)  broadcasts: n, in flight, waited (s)")
    print(head)
    for r in rows:
        print(f"{r['optimizer']:<9} {r['distributed_optimizer']!s:<8} {r['stage']:>5} {r['dp']:>3} "
              f"{r['params_bytes'] / _MIB:>8.2f} {r['plan_master_bytes'] / _MIB:>9.2f} "
              f"{r['measured_master_bytes'] / _MIB:>9.2f} {r['plan_optimizer_bytes'] / _MIB:>9.2f} "
              f"{r['measured_optimizer_bytes'] / _MIB:>9.2f} {r['plan_ef_bytes'] / _MIB:>8.2f} "
              f"{r['measured_ef_bytes'] / _MIB:>8.2f} {r['peak_rss_bytes'] / _MIB:>9.1f}        "
              f"{r['broadcasts']:>3} {r['broadcast_in_flight_s']:>7.3f} {r['broadcast_blocked_s']:>7.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"steps": args.steps, "hidden": args.hidden, "precision": args.precision,
                                    "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
