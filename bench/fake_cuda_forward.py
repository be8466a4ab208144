"""The fake-CUDA forward (issue 33) of every stage of the paper layouts: PyTorch's CUDA build on a machine
without a GPU (`make gpu-trace-env`), FakeTensorMode's cuda:0 tensors in bf16 (asyncpp/analysis/fake_cuda.py).
Prints, per stage, the kernels run (MoE: torch._grouped_mm or bmm; attention: flash), the device mixes and the
host reads that are not needed (both must be none; the expert all-to-all's split sizes are needed), and writes <out>/fake_cuda_forward.json. Exits 1 if any mix or read is found.

    make gpu-trace                         # = .venv-cuda/bin/python bench/fake_cuda_forward.py (PYTHONPATH=.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's asyncpp and data, not bench/data.py

import torch

from asyncpp import job
from asyncpp.analysis.fake_cuda import fake_cuda_forward

LAYOUTS = {"moe_2b_8gpu": ("moe_2b", 8, 2), "hybrid_moe_10b_8gpu": ("hybrid_moe_10b", 8, 4),
           "hybrid_moe_10b_32gpu": ("hybrid_moe_10b", 32, 4)}
WORK = ["train.precision=bf16", "train.seq_len=4096", "train.micro_batch_size=1", "staleness.ef_lambda=1.0"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_results")
    ap.add_argument("--only", nargs="*", default=list(LAYOUTS))
    args = ap.parse_args()
    if not torch.backends.cuda.is_built():
        print(f"torch {torch.__version__} is a CPU build: run this with .venv-cuda/bin/python (make gpu-trace-env)")
        return 2
    results, bad = {}, 0
    for layout in args.only:
        model, world, pp = LAYOUTS[layout]
        cfg, model_cfg = job.resolve(job.compose([f"model={model}", f"parallel={layout}", f"train.num_microbatches={pp}",
                                                  *WORK, "logging=disabled", f"out_dir={args.out}/fake_runs"]))
        for s in range(pp):
            started = time.perf_counter()
            r = fake_cuda_forward(cfg, model_cfg, world, s)
            print(f"== {layout} stage {s} ({time.perf_counter() - started:.0f} s)\n{r.text()}", flush=True)
            bad += len(r.mixes) + len(r.unneeded_reads)
            results[f"{layout}/stage{s}"] = {"ops_run": r.ops_run, "kernels": sorted(set(r.kernels.values())),
                                             "mixes": [list(m) for m in r.mixes],
                                             "host_reads": [h.to_dict() for h in r.host_reads],
                                             "ops": r.ops, "wall_s": r.wall_s}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fake_cuda_forward.json").write_text(json.dumps({"torch": torch.__version__, "stages": results}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
