"""launch.slurm against a real slurm controller and two real slurmd nodes (tests/slurm/conftest.py): a 2-stage
2BW pipeline across the two nodes, preemption and requeue, deliberate exits. Each compares against a run that
did not meet slurm (torchrun --standalone) or was not interrupted."""

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

from launch.slurm import DEFAULT_ENV_SETUP
from tests.slurm.harness import (
    PIPELINE,
    ROOT,
    checkpoint_tensors,
    completions,
    job,
    logs,
    losses,
    metrics,
    ranks_on,
    sacct_final,
    steps_logged,
    submit,
    torchrun_standalone,
    wait_ended,
    wait_for,
)

pytestmark = pytest.mark.slurm

STEPS = 40
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
    assert "summary (" in out  # the summary table (asyncpp/train/metrics.py summary_table)

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
    logged = steps_logged(run_dir)
    # The stop is prompt: signal -> checkpoint -> every process of the job gone, well inside torchrun's grace
    # (TORCH_ELASTIC_SHUTDOWN_TIMEOUT = 60 - 20 = 40 s here): the job is requeued when its batch script exits.
    wait_for("the job is requeued", lambda: (r := job(cluster, job_id))["Restarts"] == "1"
             and r["JobState"] == "PENDING", 120, 0.1)
    requeued_s = time.monotonic() - signalled
    # slurmctld now holds it for cred_expire (5 s here, 120 s by default: Reason=BeginTime). Releasing it
    # earlier (scontrol update StartTime=now) fails it: node1 still refuses the job's revoked credential.
    record = wait_ended(cluster, job_id)
    out, err = logs(tmp_path, "pre", job_id)
    print(f"preempted job {job_id}: signalled with {logged} steps logged, requeued {requeued_s:.1f} s after the "
          f"signal; {record['JobState']}")
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", (str(record), err[-3000:])
    assert "[launch] SIGTERM: asking the ranks to checkpoint and exit" in out
    assert f"[launch] requeueing job {job_id} (requeue 1 of 10)" in out
    assert f"[launch] job {job_id} (restart 1)" in out  # the same job id, SLURM_RESTART_COUNT bumped
    stops = [line for line in (out + err).splitlines() if line.startswith("stop requested (signal 15")]
    assert len(stops) == 2, out[-3000:] + err[-3000:]  # both ranks, one per node
    stopped = int(stops[0].split("checkpoint at step ")[1].split(";")[0])
    assert 3 <= stopped < STEPS and f"resumed at step {stopped}" in out + err

    # slurmctld's own record (the job completion log): the first run ended by the requeue (the job went back to
    # PENDING), then the second ran to COMPLETED, both under the job's id.
    ends = completions(cluster, job_id)
    for end in ends:
        print("jobcomp: " + " ".join(f"{k}={end[k]}" for k in ("JobId", "JobState", "StartTime", "EndTime", "NodeList")))
    assert [e["JobState"] for e in ends] == ["PENDING", "COMPLETED"], ends
    assert ends[0]["EndTime"] <= ends[1]["StartTime"], ends
    if cluster.accounting:  # slurmdbd's, when the cluster keeps one (make test-slurm; not CI's, --no-accounting)
        runs = sacct_final(cluster, job_id)  # one row per start of the job
        for run in runs:
            print("sacct: " + " ".join(run.values()))
        assert [(r["JobID"], r["State"]) for r in runs] == [(job_id, "REQUEUED"), (job_id, "COMPLETED")], runs
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(STEPS))  # each step exactly once
    assert losses(run_dir) == losses(full_dir)
    final = f"checkpoints/step_{STEPS:08d}"
    resumed, reference = checkpoint_tensors(run_dir / final), checkpoint_tensors(full_dir / final)
    assert resumed.keys() == reference.keys() and len(reference) > 10
    assert all(resumed[k].equal(reference[k]) for k in reference), [k for k in reference if not resumed[k].equal(reference[k])]
    assert requeued_s < 20, f"{requeued_s:.1f} s from the preemption signal to the requeue"


@pytest.mark.parametrize("name, extra, options, code, message", [
    ("config", ["trian.steps=3"], ["--no-validate"], 2, "trian.steps is not a config key; did you mean train.steps?"),
    ("diverged", ["optimizer.lr=1e30"], [], 3, "training diverged"),
])
def test_deliberate_exits_are_neither_retried_nor_requeued(cluster, tmp_path, name, extra, options, code, message):
    job_id, _ = submit(cluster, tmp_path, name, [*OVERRIDES, *extra], *options)
    record = wait_ended(cluster, job_id)
    out, err = logs(tmp_path, name, job_id)
    assert record["JobState"] == "FAILED" and record["ExitCode"] == f"{code}:0", (str(record), out[-2000:], err[-3000:])
    assert record["Restarts"] == "0" and out.count(f"[launch] job {job_id} ") == 1  # started once, never requeued
    assert [(r["State"], r["ExitCode"]) for r in sacct_final(cluster, job_id)] == [("FAILED", f"{code}:0")]
    assert f"[launch] the run exited {code}: " in out and "not retried" in out and "restart 1 of" not in out
    assert message in err and "config error: " in err if code == 2 else message in err


def test_a_dead_node_fails_the_job_which_slurm_requeues_and_resumes(cluster, uninterrupted, tmp_path):
    """node2's slurmd and every process on it are SIGKILLed mid-run: slurmctld marks the node DOWN
    (SlurmdTimeout), the job ends NODE_FAIL and is requeued under its id; once the node is back it resumes from
    the newest complete checkpoint and ends where the uninterrupted job did."""
    full_dir = uninterrupted[2]
    job_id, run_dir = submit(cluster, tmp_path, "node", OVERRIDES)
    wait_for("6 steps logged", lambda: steps_logged(run_dir) >= 6, 400)
    cluster.kill_node("node2")
    wait_for("the job is requeued after the node failure", lambda: (r := job(cluster, job_id))["Restarts"] == "1"
             and r["JobState"] == "PENDING", 180, 0.5)
    cluster.start_node("node2")  # the node comes back (ReturnToService=2)
    record = wait_ended(cluster, job_id)
    out, err = logs(tmp_path, "node", job_id)
    print(f"job {job_id} after a dead node: {record['JobState']}, restarts {record['Restarts']}")
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", (str(record), err[-3000:])
    saved = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    m = re.search(r"resumed at step (\d+)", out + err)
    resumed_at = int(m.group(1)) if m else None
    assert resumed_at is not None and resumed_at % 4 == 0 and resumed_at >= 4, out[-3000:]  # checkpoint.every=4
    assert saved[-1] == STEPS
    steps = [r["step"] for r in metrics(run_dir)]
    assert set(steps) == set(range(STEPS))  # steps after the last checkpoint were logged twice: they ran twice
    assert losses(run_dir) == losses(full_dir)
    final = f"checkpoints/step_{STEPS:08d}"
    resumed, reference = checkpoint_tensors(run_dir / final), checkpoint_tensors(full_dir / final)
    assert all(resumed[k].equal(reference[k]) for k in reference)


def test_a_hung_rank_fails_its_neighbour_within_the_timeout_and_the_job_restarts(cluster, uninterrupted, tmp_path):
    """SIGSTOP the rank on node2: stage 0 gives up within train.timeout_s naming the stage and what it waited
    for, the attempt fails, the script restarts the group (not slurm: the job keeps running) and it resumes."""
    timeout_s = 20
    full_dir = uninterrupted[2]
    job_id, run_dir = submit(cluster, tmp_path, "hang", [*OVERRIDES, f"train.timeout_s={timeout_s}"])
    wait_for("6 steps logged", lambda: steps_logged(run_dir) >= 6, 400)
    (rank,) = ranks_on(cluster, "node2")
    frozen_at = time.time()
    os.kill(rank, signal.SIGSTOP)
    stopped = time.monotonic()
    err_file = tmp_path / "logs" / f"hang-{job_id}.err"
    wait_for("stage 0 gives up", lambda: "stage 0 (rank 0) gave up waiting for" in err_file.read_text(), 120, 0.2)
    gave_up_s = time.monotonic() - stopped
    record = wait_ended(cluster, job_id)
    out, err = logs(tmp_path, "hang", job_id)
    print(f"job {job_id}: stage 0 gave up {gave_up_s:.1f} s after SIGSTOP (train.timeout_s={timeout_s}); "
          f"{record['JobState']}")
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "0", (str(record), err[-3000:])
    assert f"(train.timeout_s={float(timeout_s)})" in err
    assert timeout_s <= gave_up_s < timeout_s + 15  # the timeout, plus the step that was under way
    assert re.search(r"\[launch\] attempt 1 failed \(exit \d+\); restart 1 of 3", out), out[-3000:]
    assert "resumed at step " in out + err
    assert {r["step"] for r in metrics(run_dir)} == set(range(STEPS))
    assert losses(run_dir) == losses(full_dir)
    _evidence_shows_who_waited_for_what(run_dir, err, frozen_at)


def _evidence_shows_who_waited_for_what(run_dir, err: str, frozen_at: float) -> None:
    """Both ranks left their flight records in <run dir>/comm_ops (asyncpp/parallel/flight.py). Stage 0's error names
    its file, whose first pending op is the one it gave up on, with rank 1 among its peers; rank 1, thawed by the
    step's teardown (slurmstepd's SIGCONT and SIGTERM), wrote its record then: nothing in it was issued after the
    SIGSTOP, so its last op and its pending ones (none, if it froze between ops) are where it stood."""
    m = re.search(r"stage 0 \(rank 0\) gave up waiting for (.+?) \(train\.timeout_s=.*? This rank's recent "
                  r"communication ops are in (\S+\.json)\.", err)
    assert m, err[-3000:]
    waited, named = m.group(1), Path(m.group(2))
    files = {r: sorted((run_dir / "comm_ops").glob(f"rank{r}-*.json")) for r in (0, 1)}
    print("flight records: " + ", ".join(f"rank {r}: {[f.name for f in fs]}" for r, fs in files.items()))
    assert named in files[0] and files[1], files
    mine = json.loads(named.read_text())
    first = mine["pending"][0]
    print(f"rank 0 ({mine['reason'][:60]}...): {first}")
    assert mine["rank"] == 0 and ": failed after waiting " in first and waited.split(" on ")[0] in first, first
    (failed,) = [e for e in mine["entries"] if e.get("state") == "failed"]
    assert 1 in failed["ranks"] and failed["waited"] is not None, failed  # rank 0 waited for rank 1
    theirs = json.loads(files[1][0].read_text())
    ops = [e for e in theirs["entries"] if "wait" not in e]
    last = ops[-1] if ops else {}
    print(f"rank 1 ({theirs['reason'][:60]}): pending {theirs['pending'][:3]}; its last op #{last.get('seq')} "
          f"{last.get('name')} {last.get('state')} at {last.get('site')}, {frozen_at - last.get('issued', 0):.1f} s "
          "before the SIGSTOP")
    assert theirs["rank"] == 1 and ops, theirs
    assert last["issued"] < frozen_at + 0.5, (frozen_at, last)  # frozen: nothing issued after the SIGSTOP


def test_a_hydra_sweep_runs_each_point_as_a_slurm_job_in_its_own_directory(cluster, tmp_path):
    """pretrain.py -m ... hydra/launcher=slurm: submitit submits one job per point (an array) and waits for them."""
    sweep = tmp_path / "multirun"
    cmd = [sys.executable, "pretrain.py", "-m", "hydra/launcher=slurm", f"hydra.sweep.dir={sweep}",
           "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1",
           "hydra.launcher.timeout_min=10", "logging=disabled", "logging.progress=false", "model=tiny_dense",
           "train.steps=6", "train.eval_every=0", "train.seq_len=32", "train.micro_batch_size=2",
           "train.num_microbatches=2", "seed=1,2"]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=cluster.env(), capture_output=True, text=True, timeout=600, check=False)
    print(f"hydra sweep on slurm: exit {proc.returncode} in {time.monotonic() - start:.1f} s")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # each point in the directory named after its own overrides (docs/launch.md), with its own record
    runs = sorted(p.parent for p in sweep.glob("*/summary.json"))
    assert len(runs) == 2 and ",seed=1," in runs[0].name and ",seed=2," in runs[1].name, runs
    for run in runs:
        assert [r["step"] for r in metrics(run)] == list(range(6))
    assert losses(runs[0]) != losses(runs[1])  # two seeds, two runs: not one directory written twice
    tasks = sorted(p.name for p in (sweep / ".submitit").glob("*_*") if p.is_dir())  # one array task per point
    assert len(tasks) == 2 and {t.split("_")[1] for t in tasks} == {"0", "1"}, tasks
    runs_of = {t: sacct_final(cluster, t) for t in tasks}
    assert all([r["State"] for r in rows] == ["COMPLETED"] for rows in runs_of.values()), runs_of


def test_a_raising_rank_ends_the_attempt_in_seconds_and_the_job_restarts_from_its_checkpoint(cluster, uninterrupted,
                                                                                            tmp_path):
    """Issue 44: the rank on node2 raises a RuntimeError in a forward (tests/dist/raise_once.py, loaded on the nodes
    through a sitecustomize on PYTHONPATH) while train.timeout_s is 300: it aborts its process groups and exits at
    once, the attempt ends within seconds (not at the timeout), the script sees a crash (exit 1 with the failed
    rank's line), restarts the group, and the run resumes from its newest checkpoint to the uninterrupted result."""
    full_dir = uninterrupted[2]
    site, mark = tmp_path / "site", tmp_path / "fault_time"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('FAULT_AT') and os.environ.get('RANK') == os.environ.get('FAULT_RANK'):\n"
        "    import tests.dist.raise_once  # noqa: F401 - patches the engine; armed once (FAULT_MARK)\n")
    setup = [*DEFAULT_ENV_SETUP,
             f"export FAULT_AT=forward FAULT_RANK=1 FAULT_STEP=9 FAULT_MARK={mark} PYTHONPATH={site}:{ROOT}"]
    job_id, run_dir = submit(cluster, tmp_path, "raise", [*OVERRIDES, "train.timeout_s=300"],
                             *[a for line in setup for a in ("--env-setup", line)])
    out_file = tmp_path / "logs" / f"raise-{job_id}.out"
    wait_for("the fault", mark.exists, 400)
    raised = float(mark.read_text())
    wait_for("the restart", lambda: out_file.exists() and "restart 1 of" in out_file.read_text(), 120, 0.1)
    restarted_s = time.time() - raised
    record = wait_ended(cluster, job_id)
    out, err = logs(tmp_path, "raise", job_id)
    print(f"job {job_id}: the attempt ended and the script restarted {restarted_s:.1f} s after the exception "
          f"(train.timeout_s=300); {record['JobState']}")
    assert restarted_s < 30, (restarted_s, err[-3000:])
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "0", (str(record), err[-3000:])
    assert "[launch] rank 1 failed at step 9 in action F9.0@v8 (stage 1, microbatch 0, forward): RuntimeError: " \
           "injected fault" in out, out[-3000:]
    assert re.search(r"\[launch\] attempt 1 failed \(exit \d+\); restart 1 of 3", out), out[-3000:]
    assert sum(line.startswith("rank 1 failed at step 9") for line in err.splitlines()) == 1, err[-3000:]
    assert "resumed at step 8" in out + err  # checkpoint.every=4: the newest complete checkpoint before step 9
    assert losses(run_dir) == losses(full_dir)
