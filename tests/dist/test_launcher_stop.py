"""Stops through launch.local (issue 47): a SIGTERM to the launcher reaches torchrun and the ranks, which
checkpoint and exit; the launcher waits, says "stopped at step N, checkpointed; rerun <command> to resume" and exits
143; and no process of the job outlives it. A SIGKILLed launcher leaves no orphan either: torchrun has
PR_SET_PDEATHSIG = SIGTERM, so it gets the same orderly stop."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model=tiny_dense", "logging=disabled", "logging.progress=false", "train.eval_every=0", "train.steps=100000",
         "train.micro_batch_size=2", "train.num_microbatches=2", "train.seq_len=32", "schedule=2bw", "parallel.pp=2",
         "optimizer=adamw", "checkpoint.every_minutes=0"]


def children_of() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            out.setdefault(ppid, []).append(int(entry))
    return out


def descendants(pid: int) -> set[int]:
    tree, found, todo = children_of(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    """The pids still running (a zombie has finished: its parent only has not reaped it yet)."""
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(pid)
    return out


def start(run: Path) -> tuple[subprocess.Popen, set[int]]:
    """launch.local with 2 ranks, until rank 0 has logged a step; the launcher and its process tree."""
    cmd = [sys.executable, "-m", "launch.local", "--nproc-per-node", "2", "--", *SMALL, f"hydra.run.dir={run}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 900  # the first step of a 2-rank CPU job: seconds when idle, minutes at load 30
    metrics = run / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run did not log a step (exit {proc.poll()}): {proc.communicate()[0][-3000:]}")
        time.sleep(0.5)
    tree = descendants(proc.pid)
    assert len(tree) >= 3, tree  # torchrun and its two ranks
    return proc, tree


def wait_gone(pids: set[int], timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive(pids)


def newest_step(run: Path) -> int | None:
    steps = sorted(run.glob("checkpoints/step_*/manifest.json"))
    return json.loads(steps[-1].read_text())["step"] if steps else None


@pytest.mark.slow  # re-tiered (session 8): the default suite's budget; 63 s on a quiet machine (a torchrun job of 2 ranks, stopped and resumed); launch.local's signal
# forwarding keeps default unit tests (tests/unit/test_launch.py)
def test_sigterm_to_launch_local_checkpoints_says_so_and_leaves_no_orphan(tmp_path):
    run = tmp_path / "run"
    proc, tree = start(run)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=400)[0]
    assert proc.returncode == 143, out[-3000:]
    last = out.strip().splitlines()[-1]
    said = re.fullmatch(r"\[launch\.local\] stopped at step (\d+), checkpointed; rerun `\S*python\S* -m launch\.local "
                        r"--nproc-per-node 2 -- .*` to resume \(exit 143\)", last)
    assert said, last
    assert newest_step(run) == int(said.group(1)) > 0
    # torchrun's SignalException traceback is one line of launch.local's (launch/torchrun_report.py)
    assert "Traceback" not in out and "[torchrun] exited on signal 15 after its ranks did" in out, out[-3000:]
    assert not wait_gone(tree, 30), "processes of the job outlived its launcher"


@pytest.mark.slow  # ~70 s of CPU for a torchrun job of 2 ranks
def test_a_killed_launcher_leaves_no_orphan(tmp_path):
    run = tmp_path / "run"
    proc, tree = start(run)
    proc.kill()
    proc.communicate(timeout=60)
    assert not wait_gone(tree, 400), "torchrun or a rank trained on after its launcher was killed"
    assert newest_step(run) is not None  # torchrun got SIGTERM (PDEATHSIG) and the ranks checkpointed
