"""Everything the first lent GPU should run, in one command and at most 20 minutes, into one JSON file.

    make first-gpu                         # = .venv/bin/python bench/first_gpu.py --out bench_results/first_gpu.json

1. `pytest -m gpu tests/gpu` (te/mcore/FLA against local, the host-sync counts on CUDA, the event timer, the
   memory estimate against torch.cuda.memory_allocated), its per-test outcomes and times from a JUnit report;
2. `bench/gpu.py` (tokens/s, TFLOP/s, MFU, the allocator's peak per workload and backend, the Muon step),
   with whatever time is left (its own JSON is embedded).

Each part runs under a deadline and in a process of its own, so a hang or a crash in one still leaves the other's
figures and the reason in the JSON. Without a CUDA device it refuses at once (exit 2): nothing here means anything
on a CPU (`bench/gpu.py --smoke` is the CPU check of the harness).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 20 * 60
PYTEST_SHARE_S = 10 * 60  # the tests' deadline; the benchmark gets the rest


def run(cmd: list[str], timeout_s: float) -> dict:
    started = time.perf_counter()
    try:
        done = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=max(timeout_s, 1))
        out = {"returncode": done.returncode, "tail": (done.stdout + done.stderr)[-4000:]}
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        out = {"returncode": None, "timed_out_after_s": timeout_s, "tail": text[-4000:]}
    out["cmd"], out["wall_s"] = " ".join(cmd), round(time.perf_counter() - started, 1)
    return out


def junit_cases(path: Path) -> list[dict]:
    if not path.exists():
        return []
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
                break
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "time_s": float(case.get("time") or 0.0),
                      "message": next((c.get("message", "")[:500] for c in case if c.tag != "system-out"), "")})
    return cases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_results/first_gpu.json")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S)
    args = ap.parse_args()
    import torch  # after argparse: --help answers without loading torch

    if not torch.cuda.is_available():
        print("bench/first_gpu.py needs a CUDA device; none is visible (torch.cuda.is_available() is False). "
              "On a CPU machine run `bench/gpu.py --smoke` to check the harness.", file=sys.stderr)
        return 2
    started = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    report: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": props.name,
                    "capability": list(torch.cuda.get_device_capability(0)), "memory_gib": props.total_memory / 2**30,
                    "budget_s": args.budget_s}
    with tempfile.TemporaryDirectory() as tmp:
        junit, bench_json = Path(tmp) / "gpu.xml", Path(tmp) / "gpu.json"
        report["pytest"] = run([sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-v", "-p", "no:cacheprovider",
                                f"--junitxml={junit}"], min(PYTEST_SHARE_S, args.budget_s / 2))
        report["pytest"]["cases"] = junit_cases(junit)
        left = args.budget_s - (time.perf_counter() - started)
        report["benchmark"] = run([sys.executable, "bench/gpu.py", "--out", str(bench_json)], left - 10)
        if bench_json.exists():
            report["benchmark"]["result"] = json.loads(bench_json.read_text())
    report["wall_s"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    cases = report["pytest"]["cases"]
    print(f"wrote {out}: {sum(c['outcome'] == 'passed' for c in cases)}/{len(cases)} GPU tests passed, benchmark "
          f"exit {report['benchmark']['returncode']}, {report['wall_s']:.0f} s")
    return 0 if report["pytest"]["returncode"] == 0 and report["benchmark"]["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
