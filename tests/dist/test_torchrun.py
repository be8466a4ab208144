"""pretrain.py under torchrun, as a user runs it: one run directory, one metrics file, clear errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.dist


def torchrun(tmp_path: Path, nproc: int, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc_per_node={nproc}",
           "pretrain.py", f"hydra.run.dir={tmp_path}", "logging=disabled", "logging.progress=false", *overrides]
    return subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_two_stage_2bw_run_writes_one_metrics_file_and_a_timeline(tmp_path):
    proc = torchrun(tmp_path, 2, "parallel.pp=2", "schedule=2bw", "model=tiny_dense", "train.steps=12",
                    "train.eval_every=6", "train.seq_len=32", "train.micro_batch_size=2",
                    "optimizer.schedule.warmup_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(12))
    assert {"loss", "lr", "grad_norm", "update_norm", "tokens_per_s"} <= records[0].keys()
    assert [r["step"] for r in records if "val_loss" in r] == [5, 11]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["bubble_fraction_per_rank"]) == 2 and 0 <= summary["bubble_fraction"] < 1
    # Each rank's measured peak next to its plan (the host RSS high-water mark on the CPU, above the RSS the
    # process had before it built its stage).
    memory = summary["memory_per_rank"]
    assert [m["stage"] for m in memory] == [0, 1] and all(m["measured"] == "host_rss_high_water_mark" for m in memory)
    assert all(m["plan_total_bytes"] > 0 and m["measured_peak_bytes"] > m["process_baseline_bytes"] > 0
               for m in memory)
    trace = json.loads((tmp_path / "timeline.json").read_text())
    assert {e["tid"] for e in trace["traceEvents"] if e.get("ph") == "X"} == {0, 1}
    assert (tmp_path / "timeline.png").stat().st_size > 0
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["parallel"]["dp"] == 1  # derived from the world size and recorded
    # The writer (the last stage, a rank without hydra's job logging) keeps pretrain.log: the log line with
    # the pipeline's bubble (mean over ranks, worst stage), every 10 iterations, at evaluations and at the end.
    log = (tmp_path / "pretrain.log").read_text()
    lines = [line for line in log.splitlines() if "] iteration" in line]
    assert [line.split("iteration ")[1].split(" |")[0].strip() for line in lines] == ["6/12", "10/12", "12/12"], log
    assert all(re.search(r"bubble -?[\d.]+ mean, -?[\d.]+ max \(stage [01]; so far\)", line)
               and "TFLOP/s/device" in line for line in lines), log
    assert "summary (" in log and "  bubble " in log  # the summary table (asyncpp/train/metrics.py summary_table)


@pytest.mark.slow  # re-tiered (session 8, the default suite's budget): 20 s; the one-process rerun stays default (tests/unit/test_continue_run.py)
def test_a_rerun_of_a_finished_pipeline_run_is_one_line_and_exit_0(tmp_path):
    """Issue 47: under torchrun the rerun's RunComplete (every rank raises it after rank 0's broadcast) was taken for
    a rank's failure (exit 1, torchrun's ChildFailedError report); it is one line from rank 0 and exit 0."""
    small = ("parallel.pp=2", "schedule=2bw", "model=tiny_dense", "train.steps=2", "train.eval_every=0",
             "train.seq_len=32", "train.micro_batch_size=2")
    assert torchrun(tmp_path, 2, *small).returncode == 0
    proc = torchrun(tmp_path, 2, *small)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert said.count("run complete: ") == 1 and "is at step 2 = train.steps" in said
    assert "Traceback" not in said and "failed" not in said


@pytest.mark.parametrize("overrides, message", [
    (["parallel.pp=2", "parallel.dp=2"], "parallel.dp=2 but 2 ranks"),
    (["parallel.pp=2", "schedule=2bw", "train.num_microbatches=1"],
     "at least parallel.pp=2 microbatches per replica, got train.num_microbatches=1"),
    # One torchrun start per case (~6 s): two in the default tier; the validator's own tests check every message.
    pytest.param(["parallel.pp=2", "parallel.tp=2"], "not divisible by parallel.tp=2 x parallel.pp=2",
                 marks=pytest.mark.slow),
    # dp = 2 ranks / pp 1 = 2: 24 sequences do not split into microbatches of 8 on 2 replicas
    pytest.param(["parallel.pp=1", "schedule=sync", "train.global_batch_size=24"], "train.micro_batch_size=8 x dp=2 = 16",
                 marks=pytest.mark.slow),
])
def test_bad_layouts_fail_before_any_process_group(tmp_path, overrides, message):
    proc = torchrun(tmp_path, 2, *overrides)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.count("config error") == 1  # one line per run: rank 0's (both ranks resolve alike)
    assert "init_process_group" not in proc.stderr and "Traceback" not in proc.stderr.split("config error")[0]
