"""Submitting launch.slurm jobs to the test cluster and watching them: job records (scontrol), run directories,
metrics and checkpoints."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from launch.testing.cluster import Cluster

ROOT = Path(__file__).resolve().parents[2]

# The tiny 2-stage 2BW pipeline of tests/dist/test_preemption.py: one rank per node, gloo between the namespaces.
PIPELINE = ["logging=disabled", "logging.progress=false", "model=tiny_dense", "schedule=2bw", "parallel.pp=2",
            "train.eval_every=0", "train.seq_len=32", "train.micro_batch_size=2", "train.num_microbatches=2",
            "optimizer.schedule.warmup_steps=2", "staleness.ef_lambda=1.0", "checkpoint.every=4"]
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def submit(cluster: Cluster, tmp: Path, name: str, overrides: list[str], *options: str) -> tuple[str, Path]:
    """`python -m launch.slurm --nodes 2 ...` against the cluster. Returns (job id, run directory)."""
    cmd = [sys.executable, "-m", "launch.slurm", "--nodes", "2", "--gpus-per-node", "0", "--time", "15",
           "--job-name", name, "--log-dir", str(tmp / "logs"), "--run-root", str(tmp / "runs"), *options,
           "--", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=cluster.env(), capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(r"submitted job (\d+): logs \S+, run dir (.+)$", proc.stdout.strip())
    assert m, proc.stdout
    return m.group(1), Path(m.group(2))


def scontrol(cluster: Cluster, *args: str) -> str:
    return subprocess.run([str(cluster.bin_dir / "scontrol"), *args], env=cluster.env(), capture_output=True,
                          text=True, check=True, timeout=30).stdout


def job(cluster: Cluster, job_id: str) -> dict[str, str]:
    """The job's record (`scontrol show job -o`): JobState, Restarts, ExitCode, NodeList, ..."""
    line = scontrol(cluster, "show", "job", "-o", job_id).strip()
    return dict(f.split("=", 1) for f in line.split() if "=" in f)


def wait_for(what: str, predicate, timeout: float, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")


def wait_ended(cluster: Cluster, job_id: str, timeout: float = 400) -> dict[str, str]:
    return wait_for(f"job {job_id} ends", lambda: (r := job(cluster, job_id))["JobState"] in ENDED and r, timeout, 1)


def steps_logged(run_dir: Path) -> int:
    f = run_dir / "metrics.jsonl"
    return len(f.read_text().splitlines()) if f.exists() else 0


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir)}


def logs(tmp: Path, name: str, job_id: str) -> tuple[str, str]:
    """The job's stdout and stderr (appended across requeues)."""
    return tuple((tmp / "logs" / f"{name}-{job_id}.{ext}").read_text() for ext in ("out", "err"))


def torchrun_standalone(run_dir: Path, overrides: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """The same command on one node: torchrun --standalone, two ranks."""
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node=2", "pretrain.py",
           f"hydra.run.dir={run_dir}", *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400, env=env, check=False)


def checkpoint_tensors(step_dir: Path) -> dict:
    """Every tensor of a distributed checkpoint, read back whole (torch's dcp -> one state dict)."""
    out = step_dir.parent / f"{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, out)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", torch.load(out, weights_only=False))
    out.unlink()
    return flat


def ranks_on(cluster: Cluster, node: str) -> list[int]:
    """The pretrain.py worker processes on `node` (torchrun's children, not torchrun itself)."""
    pids = []
    for pid in cluster.node_pids(node):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pretrain.py" in argv and not any(a.endswith(b"torchrun") for a in argv):
            pids.append(pid)
    return pids


def completions(cluster: Cluster, job_id: str) -> list[dict[str, str]]:
    """slurmctld's job completion log for the job: one line per end of a run of it. A requeue writes one too,
    with JobState=PENDING (the job is back in the queue) and the ended run's StartTime and EndTime."""
    return [r for r in cluster.completions() if r.get("JobId") == job_id]


def sacct(cluster: Cluster, job_id: str) -> list[dict[str, str]]:
    """slurmdbd's records of the job, one per run of it (--duplicates: a requeued job has one per start)."""
    assert cluster.accounting, (
        "sacct needs the cluster's accounting (slurmdbd): this cluster was started with --no-accounting; run this "
        "test under `make test-slurm`, which starts a cluster with it")
    fields = ["JobID", "JobName", "State", "ExitCode", "Start", "End", "NodeList"]
    out = subprocess.run([str(cluster.bin_dir / "sacct"), "-D", "-X", "-n", "-P", "-j", job_id,
                          "-o", ",".join(fields)], env=cluster.env(), capture_output=True, text=True, check=True,
                         timeout=30).stdout
    return [dict(zip(fields, line.split("|"), strict=True)) for line in out.splitlines() if line]


def sacct_final(cluster: Cluster, job_id: str, timeout: float = 60) -> list[dict[str, str]]:
    """sacct's records once slurmdbd has the job's end (it learns it after scontrol does)."""
    return wait_for(f"sacct has job {job_id}'s end", lambda: (r := sacct(cluster, job_id))
                    and r[-1]["State"] not in ("RUNNING", "PENDING", "COMPLETING") and r, timeout, 0.5)
