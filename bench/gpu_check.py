"""Everything a lent GPU should run, in one command within ~9 minutes, into ONE JSON file (issue 45): `make gpu-check`.

    make gpu-wheels                      # here, with network: what the device lacks, into .gpu/wheels (~4 MiB)
    make gpu-check                       # there: = python3 bench/gpu_check.py --wheels .gpu/wheels --out $OUT/gpu_check.json
    python3 bench/gpu_check.py --dry     # the same structure on the CPU, tiny shapes (tests/unit/test_gpu_check.py)

Parts, each in a process of its own under its own deadline (a hang or a crash in one leaves the others' figures and
the reason in the JSON):
  install  the wheels of --wheels (no network: pip --no-index) into a private site folder the other parts import;
  bench    bench/gpu.py: local and mcore, compile off, >= 3 repetitions per row with their spread;
  environment  python, torch, CUDA, the GPU, and which of triton, megatron.core, fla, transformer_engine import;
  profile  torch.profiler around one microbatch of each workload: the top 30 kernels by CUDA time, and per
           microbatch the kernel launches and the host synchronisations (cuda*Synchronize, blocking copies, .item());
  pytest   pytest -m gpu tests/gpu, per-test outcomes from a JUnit report;
  predict  the step-time model (asyncpp/analysis/steptime.py) for every bench row, next to the measurement, with the
           Gated DeltaNet kernel that ran (PyTorch form or FLA's: the fused what-if).
The JSON's "recorded" block has bench/recorded/'s schema: copy it there (bench/recorded/<gpu>-<date>.json) and
tests/unit/test_steptime.py checks the model against it from then on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS_SCRIPT = ROOT / "bench" / "gpu_check_parts.py"
"""The parts that import torch and the project: a process of their own, after the install (this file imports only
the standard library, so it runs before the wheels are there)."""

BUDGET_S = 9 * 60
DEADLINES_S = {"install": 90, "bench": 240, "profile": 120, "pytest": 180, "predict": 90}
"""Each part's own deadline; a part also never gets more than what is left of --budget-s."""
PARTS = ("bench", "predict", "profile", "pytest")
"""In this order: the figures first (bench, and the model next to them, CPU work), the tests last (the likeliest to hang)."""


def run(cmd: list[str], timeout_s: float, env: dict | None = None) -> dict:
    started = time.perf_counter()
    try:
        done = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=max(timeout_s, 1),
                              env=env)
        out = {"returncode": done.returncode, "tail": (done.stdout + done.stderr)[-3000:]}
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        out = {"returncode": None, "timed_out_after_s": round(timeout_s), "tail": text[-3000:]}
    out["cmd"], out["wall_s"] = " ".join(cmd), round(time.perf_counter() - started, 1)
    return out


def junit_cases(path: Path) -> list[dict]:
    if not path.exists():
        return []
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "time_s": float(case.get("time") or 0.0),
                      "message": next((c.get("message", "")[:400] for c in case if c.tag != "system-out"), "")})
    return cases


# ---- the orchestration ---------------------------------------------------------------------------------------

def install_wheels(folder: Path, site: Path, timeout_s: float) -> dict:
    wheels = sorted(str(p) for p in folder.glob("*.whl"))
    if not wheels:
        return {"returncode": None, "tail": f"no wheels in {folder}: run `make gpu-wheels` where there is network"}
    return {**run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--no-cache-dir", "--upgrade", "--target", str(site), *wheels], timeout_s), "wheels": wheels}


def part_cmd(part: str, tmp: Path, dry: bool, bench_args: list[str]) -> list[str]:
    py = [sys.executable]
    if part == "bench":
        base = ["--smoke", "--backends", "local", "mcore", "--repetitions", "3", "--iters", "1"] if dry else \
            ["--backends", "local", "mcore", "--compile", "off", "--warmup", "1", "--iters", "3", "--repetitions", "3"]
        return py + ["bench/gpu.py", *base, *bench_args, "--out", str(tmp / "bench.json")]
    if part == "pytest":
        return py + ["-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-p", "no:cacheprovider",
                     f"--junitxml={tmp / 'pytest.xml'}", *(["--collect-only"] if dry else [])]
    return py + [str(PARTS_SCRIPT), part, "--tmp", str(tmp), *(["--dry"] if dry else [])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", "bench_results")) / "gpu_check.json"))
    ap.add_argument("--wheels", default=None, help="a folder of wheels to install first, without network")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S)
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    ap.add_argument("--dry", action="store_true", help="the structure on the CPU with tiny shapes (no GPU needed)")
    ap.add_argument("--deadline-scale", type=float, default=1.0,
                    help="multiply every part's deadline (a shared or slow CPU running --dry)")
    ap.add_argument("--bench-args", nargs=argparse.REMAINDER, default=[], help="more arguments for bench/gpu.py")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    report: dict = {"dry": args.dry, "budget_s": args.budget_s}
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        env = dict(os.environ, PYTHONUNBUFFERED="1")  # a part cut by its deadline still leaves its output
        if args.wheels:
            site = tmp / "site"
            report["install"] = install_wheels(Path(args.wheels), site, DEADLINES_S["install"] * args.deadline_scale)
            env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")])
        else:
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        report["environment"] = run([sys.executable, str(PARTS_SCRIPT), "environment", "--tmp", str(tmp)],
                                    60 * args.deadline_scale, env)
        collect(report, "environment", tmp)
        for part in args.parts:
            left = args.budget_s - (time.perf_counter() - started) - 5
            report[part] = run(part_cmd(part, tmp, args.dry, args.bench_args),
                               min(DEADLINES_S[part] * args.deadline_scale, left), env)
            collect(report, part, tmp)
        report["recorded"] = recorded_block(report)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(summary(report, out))
    return 0 if all(report[p]["returncode"] == 0 for p in args.parts) else 1


def collect(report: dict, part: str, tmp: Path) -> None:
    """The part's own figures into the report, next to its process's outcome."""
    if part == "pytest":
        report[part]["cases"] = junit_cases(tmp / "pytest.xml")
        return
    source = tmp / ("bench.json" if part == "bench" else f"{part}.json")
    if source.exists():
        report[part]["result"] = json.loads(source.read_text())
    if part == "bench" and "result" in report[part]:  # the GPU's name, for predict's device table
        env = report.get("environment", {}).get("result", {})
        report[part]["result"]["gpu_name"] = env.get("gpu_name", "")
        source.write_text(json.dumps(report[part]["result"]))


def recorded_block(report: dict) -> dict:
    """The bench rows in bench/recorded/'s schema (steptime.calibration_rows reads it)."""
    bench = report.get("bench", {}).get("result")
    env = report.get("environment", {}).get("result", {})
    if not bench:
        return {}
    a = bench["args"]
    rows = []
    for r in bench["stages"]:
        if "skipped" in r:
            continue
        rows.append({k: r[k] for k in ("workload", "backend", "tokens_per_s", "tflops", "mfu", "repetitions_s",
                                       "spread", "activation_estimate_gib") if k in r}
                    | {"setup": {"gdn_kernel": "torch" if r.get("gdn_kernel") in ("torch", "-") else r.get("gdn_kernel"),
                                 "compile": r["compile"]}})
    gpu = bench.get("gpu_name", "")
    return {"schema": "asyncpp-recorded/1", "date": date.today().isoformat(), "source": "bench/gpu_check.py",
            "device": {"name": gpu, "model": "H200" if "H200" in gpu else "H100" if "H100" in gpu else gpu},
            "setup": {"torch": bench.get("torch"), "dtype": "bfloat16", "micro_batch_size": a["micro_batch_size"],
                      "seq_len": a["seq_len"], "peak_tflops": a["peak_tflops"], "warmup": a["warmup"],
                      "iters": a["iters"], "repetitions": a["repetitions"], "software": env},
            "stages": rows, "muon": bench.get("muon", []), "dry": report["dry"]}


def summary(report: dict, out: Path) -> str:
    lines = [f"wrote {out} ({report['wall_s']:.0f} s{', dry run on the CPU' if report['dry'] else ''})"]
    for part in PARTS:
        if part in report:
            r = report[part]
            lines.append(f"  {part:8} exit {r['returncode']} in {r['wall_s']:.0f} s"
                         + (f" (timed out after {r['timed_out_after_s']} s)" if "timed_out_after_s" in r else ""))
    for p in report.get("predict", {}).get("result", []):
        lines.append(f"  {p['workload']:22} {p['backend']:6} measured {p['measured_s'] * 1e3:8.1f} ms  predicted "
                     f"{p['predicted_s'] * 1e3:8.1f} ms  (predicted/measured tok/s {p['predicted_over_measured']:.2f})")
    cases = report.get("pytest", {}).get("cases", [])
    if cases:
        lines.append(f"  pytest: {sum(c['outcome'] == 'passed' for c in cases)} of {len(cases)} passed")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
