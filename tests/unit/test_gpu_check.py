"""`make gpu-check` (bench/gpu_check.py) on the CPU: its --dry path runs the same parts with tiny shapes, so the JSON
a lent GPU will return has been produced once before the GPU is there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncpp.analysis.steptime import calibration_rows
from bench import gpu, gpu_check, gpu_check_parts

ROOT = Path(__file__).resolve().parents[2]


def test_the_profile_part_reports_top_ops_and_syncs_per_workload():
    """On the CPU the profiler has no kernels: the CPU ops stand in for the table (labelled so), and the counts are 0."""
    result = gpu_check_parts.profile_part(dry=True)
    assert set(result) == {"tiny_dense (smoke)", "tiny_hybrid x4 (smoke)"}
    for summary in result.values():
        assert summary["kernels_per_microbatch"] == 0
        assert 0 < len(summary["top_kernels"]) <= gpu_check_parts.TOP_KERNELS
        assert all(k["kernel"].startswith("(cpu op) aten::") or k["kernel"].startswith("(cpu op)")
                   for k in summary["top_kernels"])
        assert summary["aten_ops_per_microbatch"] > 100  # forward and backward of four blocks


@pytest.mark.slow  # ~35 s of CPU (bench/gpu.py --smoke with its Muon rows, two traces); the subprocess path is slower
def test_the_bench_rows_get_their_prediction_and_the_recorded_schema(tmp_path):
    """The bench part's JSON (bench/gpu.py --smoke, 3 repetitions) -> predict's rows -> the recorded block, which the
    step-time model's calibration reads as it is (in-process; the subprocess path is the test below)."""
    bench_json = tmp_path / "bench.json"
    gpu.main(["--smoke", "--backends", "local", "--repetitions", "3", "--iters", "1", "--out", str(bench_json)])
    timed = [r for r in json.loads(bench_json.read_text())["stages"] if "skipped" not in r]
    assert len(timed) == 2 and all(len(r["repetitions_s"]) == 3 and r["spread"] >= 0 for r in timed)
    predicted = gpu_check_parts.predict_part(bench_json, dry=True)
    assert [(p["workload"], p["gdn"]) for p in predicted] == [("tiny_dense (smoke)", "torch"),
                                                             ("tiny_hybrid x4 (smoke)", "torch")]
    assert all(p["predicted_s"] > 0 and p["structural_only"] for p in predicted)
    report = {"dry": True, "bench": {"result": json.loads(bench_json.read_text())},
              "environment": {"result": {"gpu_name": "none", "torch": "x"}}}
    folder = tmp_path / "recorded"
    folder.mkdir()
    (folder / "dry.json").write_text(json.dumps(gpu_check.recorded_block(report)))
    rows = calibration_rows(folder)
    assert [r["workload"] for r in rows] == [r["workload"] for r in timed]
    assert all(r["setup"]["micro_batch_size"] == 1 and r["setup"]["seq_len"] == 64 for r in rows)


@pytest.mark.slow  # ~40 s of CPU: four processes that each import torch
def test_dry_run_writes_one_json_with_the_bench_its_spread_and_the_models_prediction(tmp_path):
    out = tmp_path / "gpu_check.json"
    # The deadlines are the device's; a shared 2-core CPU gets ten times them (the dry run only checks the structure).
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry", "--parts", "bench", "predict",
                           "--deadline-scale", "10", "--budget-s", "3000", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=3000, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["environment"]["result"]["torch"] and report["environment"]["result"]["gpu_name"] == "none"
    timed = [r for r in report["bench"]["result"]["stages"] if "skipped" not in r]
    assert {r["workload"] for r in timed} == {"tiny_dense (smoke)", "tiny_hybrid x4 (smoke)"}
    assert all(len(r["repetitions_s"]) == 3 and r["spread"] >= 0 for r in timed)
    predicted = report["predict"]["result"]
    assert [(p["workload"], p["backend"]) for p in predicted] == [(r["workload"], r["backend"]) for r in timed]
    assert all(p["predicted_s"] > 0 and p["measured_s"] > 0 and p["structural_only"] for p in predicted)
    # The recorded block is bench/recorded/'s schema: the step-time model's calibration reads it as it is.
    folder = tmp_path / "recorded"
    folder.mkdir()
    (folder / "dry.json").write_text(json.dumps(report["recorded"]))
    rows = calibration_rows(folder)
    assert [(r["workload"], r["backend"]) for r in rows] == [(r["workload"], r["backend"]) for r in timed]
    assert all(r["setup"]["micro_batch_size"] == 1 and r["setup"]["seq_len"] == 64 for r in rows)
