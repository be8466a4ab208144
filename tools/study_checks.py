"""Checks that tie a study's runs to the code its report speaks for (issue 46: "each run on a commit whose
equivalence tests pass unchanged on the final code"; "check that every run really resumes bit-exactly").

    python -m tools.study_checks same-code --study /root/asyncpp-study --tree /work/wt/study --against .
    python -m tools.study_checks resumed --study /root/asyncpp-study --tree /work/wt/study
    python -m tools.study_checks equivalence --commit 13a0011

- same-code: short runs (--steps, default 12) of the study's own run configs, one per mechanism and one per
  optimizer, in the study's tree and in another; every step's loss, grad norm and validation loss must be the
  same bits. A study that ran on an older commit is then a study of the newer code for these configs.
- resumed: each run of the study that took more than one attempt (stopped at a checkpoint, then resumed) is run
  again from scratch in the study's tree; its records must equal the study's, step by step.
- equivalence: the equivalence-marked test files of an older commit, copied over this tree's tests in a
  throwaway worktree, run (those files only) by pytest (`-m "equivalence and not slow and not gpu"`). Files that no longer import
  (helpers moved since) are collection errors; the summary and each failure's first error line are printed for
  a person to read: a numeric assertion that fails is a changed result, an AttributeError is a moved API.

`--record docs/reproduction/checks.json` keeps a check's command, time, exit code and printed lines in that file,
under the check's name: a new invocation replaces the check's earlier ones, or with `--add` joins them (runs that
ended after the check). `tools.report` prints the file under the commits its runs ran on, when it sits in the
report's figure folder.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tools.study import MANIFEST, REPO, STATUS

KEYS = ("loss", "grad_norm", "val_loss")
"""What a run's metrics.jsonl records that the comparison reads (timings differ between any two runs)."""
SAID: list[str] = []
"""What this invocation printed, for --record (a check is one process; nothing else appends here)."""


def say(line: str) -> None:
    print(line, flush=True)
    SAID.append(line)


STEP_DEPENDENT = ("train.steps=", "train.eval_every=", "checkpoint.every=", "optimizer.schedule.warmup_steps=")
MECHANISM = ("schedule=", "staleness.", "parallel.", "optimizer.momentum=")


def records(metrics: Path) -> dict[int, dict]:
    """step -> the last record of that step (a resumed run rewrites the steps after its checkpoint)."""
    out = {}
    for line in metrics.read_text().splitlines():
        r = json.loads(line)
        out[r["step"]] = {k: r[k] for k in KEYS if k in r}
    return out


def representatives(runs: list[dict]) -> list[str]:
    """The first run of each mechanism (schedule, staleness, layout, momentum overrides) and of each optimizer."""
    seen, names = set(), []
    for run in runs:
        mech = tuple(sorted(o for o in run["overrides"] if o.startswith(MECHANISM)))
        opt = next((o for o in run["overrides"] if o.startswith("optimizer=")), "")
        if ("m", mech) not in seen or ("o", opt) not in seen:
            seen |= {("m", mech), ("o", opt)}
            names.append(run["name"])
    return names


def shortened(overrides: list[str], steps: int) -> list[str]:
    """A run's overrides at `steps` steps: evaluation and checkpoint halfway and at the end, a 2-step warmup, and a
    synchronous start scaled to a third of the run (the config refuses one longer than the run)."""
    kept = [o for o in overrides if not o.startswith(STEP_DEPENDENT)]
    kept = [f"staleness.sync_start_steps={max(1, steps // 3)}" if o.startswith("staleness.sync_start_steps=") else o
            for o in kept]
    return [*kept, f"train.steps={steps}", f"train.eval_every={steps // 2}", f"checkpoint.every={steps // 2}",
            "optimizer.schedule.warmup_steps=2"]


def train(tree: Path, experiment: str, overrides: list[str], out: Path, threads: int) -> dict[int, dict]:
    """pretrain.py of `tree` with the study's threads per run (another count picks other kernels), at low
    priority; its per-step records."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    cmd = ["nice", "-n", "19", sys.executable, str(tree / "pretrain.py"), f"+experiment={experiment}", *overrides,
           f"out_dir={out}"]
    proc = subprocess.run(cmd, check=False, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return records(out / "metrics.jsonl")


def same_code(study: Path, tree: Path, against: Path, steps: int, names: list[str], scratch: Path,
              threads: int) -> int:
    manifest = json.loads((study / MANIFEST).read_text())
    runs = {r["name"]: r for r in manifest["runs"]}
    differ = 0
    for name in names or representatives(manifest["runs"]):
        overrides = shortened(runs[name]["overrides"], steps)
        a = train(tree, manifest["experiment"], overrides, scratch / name / "a", threads)
        b = train(against, manifest["experiment"], overrides, scratch / name / "b", threads)
        same = a == b and len(a) == steps
        differ += not same
        say(f"{name}: {'same bits' if same else 'DIFFERENT'} over {len(a)} steps; last {a[max(a)]}")
    say(f"same-code: {differ} of the runs differ between {tree} ({commit_of(tree)}) and {against} "
        f"({commit_of(against)})")
    return int(differ > 0)


def threads_of(status: Path, given: int | None) -> int:
    """The threads the run's last attempt had (recorded by tools.study since session 12), else `given`, else 1
    (the rerun study's --jobs 2 on 2 cores, which ran before the count was recorded)."""
    if given is not None:
        return given
    attempts = json.loads(status.read_text()).get("attempts", []) if status.is_file() else []
    return next((a["threads"] for a in reversed(attempts) if a.get("threads")), 1)


def was_resumed(run_dir: Path) -> bool:
    """The run went on from a checkpoint: its train.log says so (the trainer's "resumed at step N"), which also
    finds a run whose process was killed before it could record its attempt; or more than one attempt is recorded."""
    log = run_dir / "train.log"
    if log.is_file() and "resumed at step" in log.read_text(errors="replace"):
        return True
    status = run_dir / STATUS
    return status.is_file() and len(json.loads(status.read_text()).get("attempts", [])) > 1


def resumed(study: Path, tree: Path, names: list[str], scratch: Path, threads: int | None, jobs: int = 1) -> int:
    manifest = json.loads((study / MANIFEST).read_text())
    runs = {r["name"]: r for r in manifest["runs"]}
    picked = names or [n for n in runs if was_resumed(study / n)]

    def rerun(name: str) -> dict[int, dict]:
        return train(tree, manifest["experiment"], runs[name]["overrides"], scratch / name,
                     threads_of(study / name / STATUS, threads))

    differ = 0
    with ThreadPoolExecutor(max_workers=jobs) as pool:  # each rerun is its own process; printed in order
        for name, fresh in zip(picked, pool.map(rerun, picked)):
            codes = [a.get("returncode") for a in json.loads((study / name / STATUS).read_text())["attempts"]]
            same = fresh == records(study / name / "metrics.jsonl")
            differ += not same
            say(f"{name} (attempts exited {codes}): {'same bits as' if same else 'DIFFERENT from'} an uninterrupted "
                f"run over {len(fresh)} steps")
    say(f"resumed: {len(picked)} resumed runs, {differ} differ from their uninterrupted rerun")
    return int(differ > 0)


def failure_causes(lines: list[str]) -> list[str]:
    """The distinct error lines of pytest's failure reports ("E   SomeError: ..."), a worker's re-raised ones
    included, without the harness's wrappers ("RuntimeError: rank 1:"): a changed number (AssertionError) or a
    moved API (ImportError, AttributeError, TypeError) at a glance."""
    causes = []
    for line in lines:
        text = line[1:].strip() if line.startswith("E ") else ""
        wrapper = re.fullmatch(r"RuntimeError: rank \d+:", text)
        if re.match(r"\w+(Error|Exception)\b", text) and not wrapper and text[:240] not in causes:
            causes.append(text[:240])
    return causes


def equivalence_files(commit: str) -> list[str]:
    """The test files at `commit` that hold equivalence-marked tests."""
    listed = subprocess.run(["git", "grep", "-l", "mark.equivalence", commit, "--", "tests/**/test_*.py"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split()
    return [f.split(":", 1)[1] for f in listed]


def equivalence(commit: str, keep: bool) -> int:
    work = Path(tempfile.mkdtemp(prefix="eqcheck-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(work), "HEAD"], cwd=REPO, check=True,
                   capture_output=True)
    try:
        (work / ".venv").symlink_to(REPO / ".venv")
        files = equivalence_files(commit)
        subprocess.run(["git", "checkout", commit, "--", *files], cwd=work, check=True)
        say(f"{len(files)} test files of {commit_of(REPO, commit)} over the tests of {commit_of(REPO)}")
        print(f"(in {work})", flush=True)
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                               "equivalence and not slow and not gpu", "--continue-on-collection-errors", *files],
                              check=False, cwd=work, env={**os.environ, "PYTHONPATH": str(work)},
                              capture_output=True, text=True)
        lines = proc.stdout.splitlines()
        for cause in failure_causes(lines):
            say("  " + cause)
        for line in lines:
            if line.startswith(("FAILED", "ERROR")) or " passed" in line:
                say(line)
        return proc.returncode
    finally:
        if not keep:
            subprocess.run(["git", "worktree", "remove", "--force", str(work)], check=False, cwd=REPO,
                           capture_output=True)


def commit_of(tree: Path, rev: str = "HEAD") -> str:
    return subprocess.run(["git", "rev-parse", rev], cwd=tree, capture_output=True, text=True,
                          check=True).stdout.strip()


def record(path: Path, check: str, argv: list[str], code: int, add: bool) -> None:
    """This invocation under its check in the report's checks file, replacing the check's earlier ones (or added
    to them: `add`, for runs that ended after the last check); the file's other checks are kept."""
    entries = json.loads(path.read_text()) if path.is_file() else {}
    run = {"command": "python -m tools.study_checks " + " ".join(argv), "exit": code,
           "when": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()), "lines": SAID}
    entries[check] = [*entries.get(check, []), run] if add else [run]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m tools.study_checks", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="check", required=True)
    for name in ("same-code", "resumed"):
        s = sub.add_parser(name)
        s.add_argument("--study", type=Path, required=True, help="the study directory (its study.json)")
        s.add_argument("--tree", type=Path, default=REPO, help="the repository the study ran from")
        s.add_argument("--scratch", type=Path, default=None, help="where the check's runs go (default: a temp dir)")
        s.add_argument("--threads", type=int, default=None, help="threads per run (default: as each run's status "
                       "records them, else 1); as the study gave them: cpu_count // "
                       "its --jobs (1 for --jobs 2 on 2 cores)")
        s.add_argument("runs", nargs="*", help="run names (default: see the module's docstring)")
    sub.choices["resumed"].add_argument("--jobs", type=int, default=1, help="reruns at a time (each with its "
                                        "recorded threads)")
    sub.choices["same-code"].add_argument("--against", type=Path, default=REPO, help="the other repository")
    sub.choices["same-code"].add_argument("--steps", type=int, default=12)
    e = sub.add_parser("equivalence")
    e.add_argument("--commit", required=True)
    e.add_argument("--keep", action="store_true", help="keep the worktree")
    for s in sub.choices.values():
        s.add_argument("--record", type=Path, default=None, help="keep this check's output for the report, e.g. "
                       "docs/reproduction/checks.json")
        s.add_argument("--add", action="store_true", help="with --record: add to the check's recorded output (the "
                       "runs named here ended after it) instead of replacing it")
    args = p.parse_args(argv)
    SAID.clear()
    if args.check == "equivalence":
        code = equivalence(args.commit, args.keep)
    elif args.check == "same-code":
        code = same_code(args.study, args.tree.resolve(), args.against.resolve(), args.steps, args.runs,
                         args.scratch or Path(tempfile.mkdtemp(prefix="study-check-")), args.threads or 1)
    else:
        code = resumed(args.study, args.tree.resolve(), args.runs,
                       args.scratch or Path(tempfile.mkdtemp(prefix="study-check-")), args.threads, args.jobs)
    if args.record:
        record(args.record, args.check, argv, code, args.add)
    return code


if __name__ == "__main__":
    sys.exit(main())
