"""The fake-CUDA forward (issue 33, asyncpp/analysis/fake_cuda.py) in PyTorch's CUDA build (.venv-cuda, made by
`make gpu-trace-env`; never the suite's .venv): a tiny MoE stage's forward and evaluation on fake cuda:0 tensors
in bf16 with expert parallelism, so the CUDA branches run. Slow: it starts the side environment's torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CUDA_PY = ROOT / ".venv-cuda" / "bin" / "python"
SCRIPT = """
import json, sys
from asyncpp import job
from asyncpp.analysis.fake_cuda import fake_cuda_forward
cfg, model_cfg = job.resolve(job.compose(["model=tiny_moe", "parallel.pp=2", "parallel.ep=2", "train.precision=bf16",
                                          "parallel.head=vocab", "parallel.embedding=vocab",
                                          "train.num_microbatches=2", "logging=disabled", "out_dir=" + sys.argv[1]]))
out = []
for s in (0, 1):
    r = fake_cuda_forward(cfg, model_cfg, 4, s)
    out.append({"ops_run": r.ops_run, "kernels": sorted(set(r.kernels.values())), "mixes": len(r.mixes),
                "widths": [r.logits_width, r.embedding_rows], "vocab": model_cfg.vocab_size,
                "unneeded": [h.site for h in r.unneeded_reads], "reads": [h.site for h in r.host_reads]})
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_fake_cuda_forward_of_a_tiny_moe_stage_with_expert_parallelism(tmp_path):
    assert CUDA_PY.exists(), "the CUDA build of torch lives in .venv-cuda: run `make gpu-trace-env` first"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    done = subprocess.run([str(CUDA_PY), "-c", SCRIPT, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    stages = json.loads(done.stdout.split("RESULT", 1)[1])
    for s in stages:
        assert s["ops_run"].get("torch._grouped_mm", 0) > 0 and s["kernels"] == ["grouped_mm"], s
        assert s["ops_run"].get("flash", 0) > 0, s
        assert s["mixes"] == 0 and s["unneeded"] == [], s
        assert s["reads"] and all(r.startswith("asyncpp/parallel/experts.py") for r in s["reads"]), s  # the split sizes
    # The vocabulary-parallel head's S and the sharded embedding's E ran on both stages, each on its own rows.
    widths = [s["widths"] for s in stages]
    assert all(0 < w < s["vocab"] and w == e for (w, e), s in zip(widths, stages)), widths
    assert sum(w for w, _ in widths) == stages[0]["vocab"], widths
    assert sys.executable != str(CUDA_PY)  # the suite itself runs on the CPU build
