"""Issue 44's fail-fast table: the seconds from one rank's exception to the job's exit, before and after fail fast
(asyncpp/parallel/failfast.py), for each injection point and 2 and 4 ranks, under torchrun, with the same
train.timeout_s on both sides; and, after, the rerun resuming from the last complete checkpoint.

Each row runs bench/faults.py's raise_<point>_<n>ranks scenario on this checkout (the uninterrupted run, the run in
which rank 1 raises, the rerun: its checks) and, with --before, only the run in which rank 1 raises on the other
checkout (a `git archive` of the commit before fail fast was merged). The two sides of a row run one after the
other; every run records /proc/loadavg at its start (the machine is shared: report the load next to the seconds).

    .venv/bin/python bench/fail_fast.py --before /tmp/before                  # the whole table (~30-40 min, 2 cores)
    .venv/bin/python bench/fail_fast.py --points forward --ranks 2            # one row, after only

Prints a markdown table, writes bench/results/fail_fast.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from faults import FAULT_POINTS, Bench, Outcome


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def seconds(out: Outcome, d: Path) -> float | None:
    """The faulty run's seconds from the exception to torchrun's exit (None: the fault never fired)."""
    crash = [a for a in out.attempts if a.what.startswith("rank 1 raises")]
    return crash[0].seconds if crash and (d / "fault_time").exists() else None


def row(at: str, n: int, after: Bench, before: Bench | None, work: Path) -> dict:
    r: dict = {"point": at, "ranks": n}
    if before is not None:
        r["load_before"], out = load(), Outcome(f"before_{at}_{n}ranks")
        a, _ = before.raise_once(out, work / out.fault, at, n)
        r["before_s"], r["before_exit"], r["before_said"] = seconds(out, work / out.fault), a.exit_code, a.said
    r["load_after"], out = load(), Outcome(f"raise_{at}_{n}ranks")
    after.raise_in(at, n)(out, work / out.fault)
    r["after_s"], r["checks"], r["ok"] = seconds(out, work / out.fault), out.checks, out.ok
    r["after_runs"] = [asdict(a) for a in out.attempts]
    return r


def fmt(s: float | None) -> str:
    return "fault did not fire" if s is None else f"{s:.1f} s"


def table(rows: list[dict], timeout: float) -> str:
    head = (f"| point | ranks | before (timeout_s={timeout:g}) | load | after (timeout_s={timeout:g}) | load | "
            "after: exit file, last checkpoint, rerun resumes, losses and weights equal |\n|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        checks = "all ok" if r["ok"] else "FAILED: " + "; ".join(k for k, v in r["checks"].items() if not v)
        lines.append(f"| {r['point']} | {r['ranks']} | {fmt(r.get('before_s')) if 'before_s' in r else '-'} | "
                     f"{r.get('load_before', '-')} | {fmt(r['after_s'])} | {r['load_after']} | {checks} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=Path, help="a checkout of the code before fail fast (its 'before' column)")
    p.add_argument("--points", default=",".join(FAULT_POINTS), help="comma-separated: forward,reduction,checkpoint")
    p.add_argument("--ranks", default="2,4", help="comma-separated pipeline sizes (torchrun --nproc_per_node)")
    p.add_argument("--timeout", type=float, default=300.0, help="train.timeout_s of every run, before and after")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fail_fast.json")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="asyncpp-fail-fast-"))
    after = Bench(ROOT, work, 0, args.timeout)
    before = Bench(args.before.resolve(), work, 0, args.timeout) if args.before else None
    rows = []
    for n in [int(x) for x in args.ranks.split(",")]:
        for at in args.points.split(","):
            rows.append(row(at, n, after, before, work))
            print(table(rows[-1:], args.timeout).splitlines()[-1], flush=True)
    print(table(rows, args.timeout))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"timeout_s": args.timeout, "rows": rows}, indent=2))
    print(f"details in {args.out}; runs in {work}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
