"""launch.slurm against a real slurm controller and two real slurmd nodes (tests/slurm/conftest.py): a 2-stage
2BW pipeline across the two nodes, preemption and requeue, deliberate exits. Each compares against a run that
did not meet slurm (torchrun --standalone) or was not interrupted."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.slurm.harness import (
    PIPELINE,
    checkpoint_tensors,
    job,
    logs,
    losses,
    metrics,
    scontrol,
    steps_logged,
    submit,
    torchrun_standalone,
    wait_ended,
    wait_for,
)

pytestmark = pytest.mark.slurm

STEPS = 24
OVERRIDES = [*PIPELINE, f"train.steps={STEPS}"]


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    """One two-node job that runs to the end: (job id, its record, run dir, tmp dir)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    start = time.monotonic()
    job_id, run_dir = submit(cluster, tmp, "full", OVERRIDES)
    record = wait_ended(cluster, job_id)
    print(f"two-node job {job_id}: {record['JobState']} in {time.monotonic() - start:.1f} s")
    return job_id, record, run_dir, tmp


def test_two_node_job_equals_torchrun_standalone(uninterrupted, tmp_path):
    job_id, record, run_dir, tmp = uninterrupted
    out, err = logs(tmp, "full", job_id)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", (record, err[-3000:])
    assert record["NodeList"] == "node[1-2]" and record["NumNodes"] == "2", record
    assert f"[launch] job {job_id} (restart 0): 2 x 1 ranks, rendezvous node1:{20000 + int(job_id)}" in out
    # One rank on each node: stage 0 on node1, stage 1 on node2, over gloo between the namespaces.
    assert "summary: " in out

    reference = tmp_path / "standalone"
    proc = torchrun_standalone(reference, OVERRIDES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    across, alone = losses(run_dir), losses(reference)
    assert sorted(across) == list(range(STEPS))
    assert across == alone  # bit for bit: the same kernels in the same order, only the transport differs


def test_preemption_checkpoints_requeues_under_the_same_id_and_resumes_exactly(cluster, uninterrupted, tmp_path):
    """`scancel --signal=TERM --batch` is what `#SBATCH --signal=B:TERM@N` delivers before the time limit (and a
    preemption): the batch shell forwards it, the ranks checkpoint, the script requeues the job, and the job comes
    back under its id and finishes from that checkpoint."""
    full_dir = uninterrupted[2]
    job_id, run_dir = submit(cluster, tmp_path, "pre", OVERRIDES, "--signal-seconds", "60")
    wait_for("3 steps logged", lambda: steps_logged(run_dir) >= 3, 400)
    subprocess.run([str(cluster.bin_dir / "scancel"), "--signal=TERM", "--batch", job_id], env=cluster.env(),
                   check=True, timeout=30)
    signalled = time.monotonic()
    # The stop is prompt: signal -> checkpoint -> every process of the job gone, well inside torchrun's grace
    # (TORCH_ELASTIC_SHUTDOWN_TIMEOUT = 60 - 20 = 40 s here): the job is requeued when its batch script exits.
    wait_for("the job is requeued", lambda: (r := job(cluster, job_id))["Restarts"] == "1"
             and r["JobState"] == "PENDING", 120, 0.1)
    requeued_s = time.monotonic() - signalled
    # slurmctld holds a requeued job for two minutes (Reason=BeginTime); let it start now. Only once it is
    # PENDING: an update while the requeue is under way lost the requeue (the job ended FAILED, exit 143).
    scontrol(cluster, "update", f"JobId={job_id}", "StartTime=now")
    record = wait_ended(cluster, job_id)
    out, err = logs(tmp_path, "pre", job_id)
    print(f"preempted job {job_id}: requeued {requeued_s:.1f} s after the signal; {record['JobState']}")
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", (str(record), err[-3000:])
    assert "[launch] SIGTERM: asking the ranks to checkpoint and exit" in out
    assert f"[launch] requeueing job {job_id} (requeue 1 of 10)" in out
    assert f"[launch] job {job_id} (restart 1)" in out  # the same job id, SLURM_RESTART_COUNT bumped
    stops = [line for line in (out + err).splitlines() if line.startswith("stop requested (signal 15")]
    assert len(stops) == 2, out[-3000:] + err[-3000:]  # both ranks, one per node
    stopped = int(stops[0].split("checkpoint at step ")[1].split(";")[0])
    assert 3 <= stopped < STEPS and f"resumed at step {stopped}" in out + err

    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(STEPS))  # each step exactly once
    assert losses(run_dir) == losses(full_dir)
    final = f"checkpoints/step_{STEPS:08d}"
    resumed, reference = checkpoint_tensors(run_dir / final), checkpoint_tensors(full_dir / final)
    assert resumed.keys() == reference.keys() and len(reference) > 10
    assert all(resumed[k].equal(reference[k]) for k in reference), [k for k in reference if not resumed[k].equal(reference[k])]
    assert requeued_s < 20, f"{requeued_s:.1f} s from the preemption signal to the requeue"


@pytest.mark.parametrize("name, extra, options, code, message", [
    ("config", ["trian.steps=3"], ["--no-validate"], 2, "config error: trian.steps"),
    ("diverged", ["optimizer.lr=1e30"], [], 3, "training diverged"),
])
def test_deliberate_exits_are_neither_retried_nor_requeued(cluster, tmp_path, name, extra, options, code, message):
    job_id, _ = submit(cluster, tmp_path, name, [*OVERRIDES, *extra], *options)
    record = wait_ended(cluster, job_id)
    out, err = logs(tmp_path, name, job_id)
    assert record["JobState"] == "FAILED" and record["ExitCode"] == f"{code}:0", (str(record), out[-2000:], err[-3000:])
    assert record["Restarts"] == "0" and out.count(f"[launch] job {job_id} ") == 1  # started once, never requeued
    assert f"[launch] the run exited {code}: " in out and "not retried" in out and "restart 1 of" not in out
    assert message in err
