"""launch/: the rendered sbatch script, dry runs without slurm, the local launcher, the hydra slurm sweep
config, and that nothing in launch/ imports torch (it runs on login nodes)."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from asyncpp.job import cpu_threads
from launch import local, slurm

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = [
    "model=smollm2_135m",
    "parallel.pp=4",
    "schedule=2bw",
    "staleness.ef_lambda=1",
    'logging.run_name="sync vs 2bw"',
]


def _job(**kw) -> slurm.SlurmJob:
    defaults = {
        "nodes": 4,
        "gpus_per_node": 8,
        "partition": "gpu",
        "account": "proj",
        "qos": "high",
        "time": "12:00:00",
        "torchrun": "/venv/bin/torchrun",
        "workdir": "/shared/asyncpp",
        "overrides": OVERRIDES,
    }
    return slurm.SlurmJob(**{**defaults, **kw})


def _sbatch_options(script: str) -> list[str]:
    return re.findall(r"^#SBATCH (\S+)$", script, flags=re.MULTILINE)


def _command(script: str) -> list[str]:
    """The srun ... torchrun ... pretrain.py ... line, joined and split into words."""
    block = script[script.index("\nsrun ") : script.index("SRUN_PID=$!")]
    return block.replace("\\\n", " ").split()


def test_sbatch_for_4_nodes_x_8_gpus():
    script = slurm.render(_job())
    assert script.startswith("#!/bin/bash\n")
    opts = _sbatch_options(script)
    for expected in (
        "--job-name=asyncpp",
        "--nodes=4",
        "--ntasks-per-node=1",
        "--gpus-per-node=8",
        "--time=12:00:00",
        "--partition=gpu",
        "--account=proj",
        "--qos=high",
        "--exclusive",
        "--chdir=/shared/asyncpp",
        "--output=/shared/asyncpp/logs/slurm/%x-%j.out",
        "--error=/shared/asyncpp/logs/slurm/%x-%j.err",
        "--open-mode=append",
        "--requeue",
        "--signal=B:TERM@120",
    ):
        assert expected in opts, (expected, opts)
    # every #SBATCH line precedes the first command, or sbatch ignores it
    first_command = script.index("\nset -uo pipefail")
    assert all(m.start() < first_command for m in re.finditer(r"^#SBATCH", script, flags=re.MULTILINE))

    words = _command(script)
    assert words[:5] == ["srun", "--nodes=4", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--cpu-bind=none"]
    tr = words.index("/venv/bin/torchrun")
    entry = words.index("pretrain.py")
    assert words[tr + 1 : entry] == [
        "--nnodes=4",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=$HEAD_NODE:$RDZV_PORT",
        "--rdzv-id=$SLURM_JOB_ID",
        "--max-restarts=0",  # the script restarts (up to --max-restarts=3), not torchrun
    ]
    assert words[-2:] == ["checkpoint.every=500", "&"]  # a periodic checkpoint unless the overrides set one
    assert "RDZV_PORT=$(( 20000 + SLURM_JOB_ID % 20000 ))" in script  # one port per job
    assert "RDZV_PORT=29400\n" in slurm.render(_job(rdzv_port=29400))
    assert 'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    assert "cd /shared/asyncpp\n" in script


def test_overrides_pass_through_quoted_with_a_stable_run_dir_and_cuda():
    script = slurm.render(_job())
    block = script[script.index("pretrain.py") : script.index("SRUN_PID=$!")]
    for o in OVERRIDES[:-1]:
        assert f"    {o} \\\n" in block
    assert "'logging.run_name=\"sync vs 2bw\"'" in block  # one shell word, quotes kept for hydra
    assert '"hydra.run.dir=\'$RUN_DIR\'"' in block  # expanded by bash, quoted for hydra
    # named after the run (logging.run_name, made one safe word), not the job: a requeue and a resubmission resume
    assert "RUN_DIR=outputs/slurm/sync_vs_2bw\n" in script
    unnamed = slurm.render(_job(overrides=["schedule=2bw", "model=smollm2_135m"]))
    assert "RUN_DIR=outputs/slurm/model=smollm2_135m,schedule=2bw\n" in unnamed
    # What hydra gets on the node: one run directory, not a sweep over "model=..." and "schedule=..." (unquoted,
    # hydra refused it: "mismatched input '='", which the real cluster showed; tests/slurm)
    word = subprocess.run(["bash", "-c", 'RUN_DIR=outputs/slurm/model=smollm2_135m,schedule=2bw; printf %s '
                           + unnamed[unnamed.index('"hydra.run.dir='):].split()[0]], capture_output=True, text=True,
                          check=True).stdout
    parsed = OverridesParser.create().parse_override(word)
    assert parsed.value() == "outputs/slurm/model=smollm2_135m,schedule=2bw" and not parsed.is_sweep_override()
    assert "SLURM_JOB_ID" not in unnamed[unnamed.index("RUN_DIR="):unnamed.index("\n", unnamed.index("RUN_DIR="))]
    assert "train.device=cuda" in block
    assert "train.device=cuda" not in slurm.render(_job(overrides=["train.device=cpu"]))
    cpu = slurm.render(_job(gpus_per_node=0, nproc_per_node=4, overrides=[]))
    assert "--gpus-per-node" not in cpu and "train.device" not in cpu and "--nproc-per-node=4" in cpu


def test_a_rank_in_a_slurm_job_keeps_the_scripts_thread_count():
    """The script exports OMP_NUM_THREADS from the node's allocation (its CPUs / ranks per node); the rank must not
    replace it by the machine's cores // ranks: on the real cluster (tests/slurm: two 1-CPU nodes on one 2-core
    machine) each rank then ran 2 threads on its 1 CPU, and a step took 4 s instead of 0.15 s."""
    script = slurm.render(_job(gpus_per_node=0, nproc_per_node=1, overrides=[]))
    assert 'CPUS=${SLURM_CPUS_ON_NODE:-1}' in script and "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-" in script
    in_job = {"SLURM_JOB_ID": "7", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}
    assert cpu_threads(in_job, cores=2) == 1
    assert cpu_threads({**in_job, "OMP_NUM_THREADS": "6"}, cores=64) == 6
    # Outside slurm, the machine's cores shared by the node's ranks (torchrun sets OMP_NUM_THREADS=1 for several).
    assert cpu_threads({"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}, cores=16) == 8
    assert cpu_threads({"LOCAL_WORLD_SIZE": "4"}, cores=2) == 1 and cpu_threads({}, cores=2) == 2


def test_environment_and_preemption_handling():
    script = slurm.render(_job(env=["NCCL_SOCKET_IFNAME=ib0"], extra_sbatch=["--constraint=h100"]))
    for line in (
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
        "export NCCL_ASYNC_ERROR_HANDLING=1",
        "export NCCL_DEBUG=${NCCL_DEBUG:-WARN}",
        "export NCCL_SOCKET_IFNAME=ib0",
        "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=100",
        "#SBATCH --constraint=h100",
        "trap on_term TERM",
        'scancel --signal=TERM "$SLURM_JOB_ID"',
        'scontrol requeue "$SLURM_JOB_ID"',
    ):
        assert line in script, line
    assert re.search(r"^export OMP_NUM_THREADS=", script, flags=re.MULTILINE)
    no_requeue = slurm.render(_job(requeue=False))
    assert "#SBATCH --no-requeue" in no_requeue and "scontrol requeue" not in no_requeue


def test_rendered_script_is_valid_bash():
    for job in (_job(), _job(gpus_per_node=0, nproc_per_node=2, requeue=False, cpus_per_task=8, mem="0")):
        subprocess.run(["bash", "-n"], input=slurm.render(job), text=True, check=True)


def _fake_bin(tmp_path: Path) -> Path:
    """srun runs its command and, as the real one does (tests/slurm), answers SIGTERM by killing it; scancel
    --signal=TERM signals the step's processes (here: torchrun); scontrol answers and records; torchrun records
    its args and its SIGTERM."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "srun": 'while [[ "$1" == --* ]]; do shift; done\n"$@" &\nchild=$!\n'
        'trap \'echo "srun: forcing job termination" >> "$LOG"; kill -KILL $child\' TERM\n'
        # wait until the child has ended (a trapped SIGTERM interrupts `wait`); a child that ended before the
        # first `wait` still gives its status (`while kill -0` first exited 0 for it: a flaky rc 0)
        'while true; do wait $child; rc=$?; kill -0 $child 2>/dev/null || break; done\nexit $rc\n',
        "scancel": 'echo scancel "$@" >> "$LOG"\nkill -TERM "$(cat "$ARGS.pid")"\n',
        # `scontrol requeue` of a running job terminates it: slurm sends the batch shell SIGTERM again.
        "scontrol": 'if [[ "$1" == show ]]; then echo node-a; echo node-b; else echo "$@" >> "$LOG"; fi\n'
        '[[ "$1" == requeue ]] && kill -TERM $PPID\n',
        "torchrun": 'printf "%s\\n" "$@" > "$ARGS"\necho $$ > "$ARGS.pid"\ntrap \'echo TERM >> "$LOG"; exit 0\' TERM\n'
        "while true; do sleep 0.05; done\n",
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def _run_script(job, tmp_path: Path, bin_dir: Path, sigterm: bool, timeout: float = 10, **env: str) -> tuple[int, str]:
    """Run the rendered script with the fake commands first on PATH (LOG and ARGS in tmp_path, `env` on top);
    with `sigterm`, signal the batch shell once torchrun has started. Returns (exit code, stdout + stderr)."""
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(tmp_path / "log"),
           "ARGS": str(tmp_path / "args"), **env}
    proc = subprocess.Popen(["bash", "-c", slurm.render(job)], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    if sigterm:
        deadline = time.monotonic() + 10
        while not (tmp_path / "args").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def test_script_runs_forwards_sigterm_and_requeues(tmp_path):
    """Execute the rendered script with fake srun/scontrol/torchrun: words reach torchrun intact, SIGTERM
    to the batch shell reaches the ranks, then the job requeues itself."""
    bin_dir = _fake_bin(tmp_path)
    job = _job(torchrun=str(bin_dir / "torchrun"), workdir=str(tmp_path))
    rc, out = _run_script(job, tmp_path, bin_dir, sigterm=True, SLURM_JOB_NODELIST="node-[a-b]",
                          SLURM_JOB_ID="4242", SLURM_JOB_NAME="asyncpp", SLURM_CPUS_ON_NODE="64")
    args = (tmp_path / "args").read_text().splitlines()
    assert "--rdzv-endpoint=node-a:24242" in args and "--rdzv-id=4242" in args  # 20000 + 4242 % 20000
    assert args[args.index("pretrain.py") + 1 :] == [
        "hydra.run.dir='outputs/slurm/sync_vs_2bw'",
        *OVERRIDES,
        "train.device=cuda",
        "checkpoint.every=500",
    ]
    # SIGTERM goes to the step's processes through scancel, not to srun (which would kill them unsaved)
    assert (tmp_path / "log").read_text().splitlines() == ["scancel --signal=TERM 4242", "TERM", "requeue 4242"], out
    assert out.count("[launch] SIGTERM") == 1 and rc == 143, out  # the requeue's own SIGTERM is not handled again


def test_dry_run_prints_script_and_command_and_never_calls_sbatch(monkeypatch, capsys, tmp_path):
    def no_subprocess(*args, **kwargs):
        raise AssertionError("a dry run must not run anything")

    checked = []
    monkeypatch.setattr(slurm, "validate_config", lambda job: checked.append(job.world_size) or "ok")
    monkeypatch.setattr(subprocess, "run", no_subprocess)
    monkeypatch.setenv("PATH", str(tmp_path))  # no slurm here
    rc = slurm.main(
        [
            "--nodes",
            "2",
            "--gpus-per-node",
            "8",
            "--workdir",
            str(tmp_path),
            "--dry-run",
            "--",
            "parallel.pp=4",
            "schedule=2bw",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "#SBATCH --nodes=2" in out and "parallel.pp=4 \\\n" in out
    assert re.search(
        r"would write logs/slurm/asyncpp-\d{8}-\d{6}\.sbatch and run .*: sbatch --parsable logs/slurm/", out
    )
    assert not (tmp_path / "logs").exists()
    assert checked == [16]  # validated at the job's world size before rendering


def test_submit_writes_script_and_calls_sbatch(monkeypatch, capsys, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f'#!/bin/bash\necho "$@" > {tmp_path}/sbatch-args\necho "777;cluster"\n')
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    rc = slurm.main(
        ["--nodes", "1", "--gpus-per-node", "8", "--workdir", str(tmp_path), "--no-validate", "--", "train.steps=10"]
    )
    assert rc == 0 and "submitted job 777" in capsys.readouterr().out
    args = (tmp_path / "sbatch-args").read_text().split()
    assert args[0] == "--parsable" and args[1].startswith("logs/slurm/asyncpp-")
    assert "train.steps=10" in (tmp_path / args[1]).read_text()


def test_missing_sbatch_is_a_clear_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert slurm.main(["--nodes", "1", "--gpus-per-node", "8", "--workdir", str(tmp_path), "--no-validate"]) == 1
    assert "sbatch is not on PATH" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nodes", "0", "--gpus-per-node", "8"], "--nodes=0 must be >= 1"),
        (["--nodes", "1", "--gpus-per-node", "8", "--time", "soon"], "--time='soon'"),
        (["--nodes", "1", "--gpus-per-node", "8", "--env", "NOVALUE"], "KEY=VALUE"),
        (["--nodes", "1", "--gpus-per-node", "8", "--log-dir", "my logs"], "whitespace"),
    ],
)
def test_bad_launcher_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        slurm.main([*argv, "--dry-run"])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("world, overrides, message", [
    (8, ["trian.steps=10"], "trian.steps is not a config key; did you mean train.steps?"),
    (8, ["model=tiny_dense", "parallel.pp=8", "train.num_microbatches=8"], "more stages than model 'tiny_dense'"),
    (8, ["parallel.pp=2", "parallel.stage_layers=[3,3]"], "parallel.stage_layers=[3, 3]"),
    (6, ["parallel.pp=4"], "the job has 6 ranks, which is not divisible by parallel.tp=1 x parallel.pp=4"),
    (16, ["parallel.pp=4", "train.global_batch_size=40"], "train.micro_batch_size=8 x dp=4 = 32"),
])
def test_launch_validation_refuses_what_pretrain_would(world, overrides, message, capsys):
    """launch/validate.py composes and resolves like pretrain.py, at the job's world size (in-process here;
    launch.slurm runs it as a subprocess)."""
    from launch import validate

    assert validate.main(["--world-size", str(world), "--", *overrides]) == validate.EXIT_CONFIG_ERROR
    assert message in capsys.readouterr().err


def test_launch_validation_accepts_the_docs_layout(capsys):
    from launch import validate

    # Megatron's fixed global batch (the default, issue 47): at dp=4 the default mbs 8 x 4 = 32 would leave one
    # microbatch per replica, fewer than 2BW's 4 stages, so the job states its global batch, as a Megatron job does.
    layout = ["model=smollm2_135m", "parallel.pp=4", "train.device=cuda"]
    assert validate.main(["--world-size", "16", "--", *layout]) == 2
    assert "raise train.global_batch_size to 128" in capsys.readouterr().err
    assert validate.main(["--world-size", "16", "--", *layout, "train.global_batch_size=128"]) == 0
    assert "16 ranks: pp=4 dp=4" in capsys.readouterr().out


def test_slurm_refuses_a_typo_before_rendering(capsys, tmp_path):
    """End to end through the subprocess: nothing rendered, nothing submitted, exit code 2."""
    rc = slurm.main(["--nodes", "1", "--gpus-per-node", "8", "--workdir", str(tmp_path), "--dry-run", "--",
                     "trian.steps=10"])
    out, err = capsys.readouterr()
    assert rc == 2 and "#SBATCH" not in out
    assert "did you mean train.steps?" in err and "nothing submitted" in err


def test_environment_hook_and_bounded_requeues(tmp_path):
    default = slurm.render(_job())
    assert "if [ -f .venv/bin/activate ]; then source .venv/bin/activate; fi" in default  # relative to workdir
    assert "/venv/bin/torchrun" in default and "command -v /venv/bin/torchrun" in default
    hooked = slurm.render(_job(env_setup=["module load cuda/12.4", "source /shared/env/bin/activate"],
                               torchrun="apptainer exec --nv img.sif torchrun", gpu_bind="closest"))
    assert "module load cuda/12.4\nsource /shared/env/bin/activate\n" in hooked
    assert ".venv/bin/activate" not in hooked and "command -v apptainer" in hooked and "--gpu-bind=closest" in hooked
    for line in ("export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}", "export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-"):
        assert line in default
    # SLURM_RESTART_COUNT at the bound: the SIGTERM handler checkpoints the ranks but does not requeue.
    bin_dir = _fake_bin(tmp_path)
    job = _job(torchrun=str(bin_dir / "torchrun"), workdir=str(tmp_path), max_requeues=2)
    rc, out = _run_script(job, tmp_path, bin_dir, sigterm=True, SLURM_JOB_NODELIST="node-a", SLURM_JOB_ID="7",
                          SLURM_RESTART_COUNT="2")
    assert (tmp_path / "log").read_text().splitlines() == ["scancel --signal=TERM 7", "TERM"], out
    assert "not requeueing: job 7 was requeued 2 times" in out and rc == 143


@pytest.mark.parametrize("signalled", [False, True])
def test_the_job_exits_with_the_code_the_ranks_meant_and_a_divergence_is_not_requeued(tmp_path, signalled):
    """torchrun reports 1; the ranks left "3 training diverged ..." in $ASYNCPP_EXIT_FILE: the job fails with 3,
    says why, and a SIGTERM that finds the run already diverged does not requeue it."""
    bin_dir = _fake_bin(tmp_path)
    wait = 'while true; do sleep 0.05; done' if signalled else 'exit 1'
    (bin_dir / "torchrun").write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$ARGS"\n'
                                      'echo "3 training diverged: step 5" > "$ASYNCPP_EXIT_FILE"\n'
                                      f"trap 'exit 1' TERM\n{wait}\n")
    job = _job(torchrun=str(bin_dir / "torchrun"), workdir=str(tmp_path))
    rc, out = _run_script(job, tmp_path, bin_dir, sigterm=signalled, SLURM_JOB_NODELIST="node-a", SLURM_JOB_ID="9")
    assert rc == 3, out
    assert "the run exited 3: training diverged: step 5" in out
    assert not (tmp_path / "log").exists() or "requeue" not in (tmp_path / "log").read_text()


@pytest.mark.parametrize("exits, meant, runs, rc", [
    ([1, 0], [None, None], 2, 0),            # a crash: restarted, and the restart finishes
    ([1, 1, 1, 1, 1], [None] * 5, 4, 1),     # crashes: 1 + --max-restarts=3 attempts
    ([1], ["2 config error: bad field"], 1, 2),  # a config error: never retried, the job fails with 2
    # a rank stopped by slurm's teardown of the step after another rank failed (not by this script's trap)
    ([1, 0], ["143 signal 15 again: exiting 143 now, without a checkpoint", None], 2, 0),
])
def test_the_script_restarts_crashes_but_not_deliberate_exits(tmp_path, exits, meant, runs, rc):
    bin_dir = _fake_bin(tmp_path)
    count = tmp_path / "count"
    lines = ['n=$(( $(cat "$COUNT" 2>/dev/null || echo 0) + 1 )); echo $n > "$COUNT"']
    for i, (code, note) in enumerate(zip(exits, meant), start=1):
        write = f'echo "{note}" > "$ASYNCPP_EXIT_FILE"; ' if note else ""
        lines.append(f"if [ $n = {i} ]; then {write}exit {code}; fi")
    (bin_dir / "torchrun").write_text("#!/bin/bash\n" + "\n".join(lines) + "\nexit 99\n")
    job = _job(torchrun=str(bin_dir / "torchrun"), workdir=str(tmp_path))
    code, out = _run_script(job, tmp_path, bin_dir, sigterm=False, timeout=30, SLURM_JOB_NODELIST="node-a",
                            SLURM_JOB_ID="5", COUNT=str(count))
    assert int(count.read_text()) == runs, out
    assert code == rc, out
    if rc == 2:
        assert "the run exited 2: config error: bad field; not retried" in out


def test_a_missing_torchrun_on_the_node_is_a_clear_error(tmp_path):
    job = _job(torchrun="no-such-torchrun", workdir=str(tmp_path))
    proc = subprocess.run(["bash", "-c", slurm.render(job)], cwd=tmp_path, capture_output=True, text=True, check=False,
                          env={**os.environ, "SLURM_JOB_NODELIST": "n", "SLURM_JOB_ID": "1"}, timeout=30)
    assert proc.returncode == 2 and "no-such-torchrun not found" in proc.stderr and "--env-setup" in proc.stderr


def test_local_launcher_command_and_dry_run(capsys):
    cmd = local.command(2, ["parallel.pp=2", "schedule=2bw"], torchrun="torchrun")
    assert cmd == [
        "torchrun",
        "--standalone",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--max-restarts=0",
        "pretrain.py",
        "parallel.pp=2",
        "schedule=2bw",
    ]
    assert local.command(8, [], gpus=True, torchrun="torchrun")[-1] == "train.device=cuda"
    assert (
        local.main(["--nproc-per-node", "4", "--max-restarts", "2", "--dry-run", "--", "parallel.pp=4"]) == 0
    )
    out = capsys.readouterr().out
    # torchrun itself never restarts (it would retry config errors); launch.local does
    assert "--nproc-per-node=4 --max-restarts=0 pretrain.py parallel.pp=4" in out and out.startswith("cd ")
    assert "rerun up to 2 times" in out


def test_local_launcher_refuses_a_config_error_in_one_line_before_torchrun(capsys, monkeypatch):
    """A config error is said once, by the launcher, and no torchrun starts (whose failure report is ~30 lines)."""
    monkeypatch.setattr(local, "run_with_restarts", lambda *a, **k: pytest.fail("torchrun started"))
    assert local.main(["--nproc-per-node", "2", "--", "parallel.pp=2", "schedule=2bw", "train.num_microbatches=1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("[launch.local] config error: schedule=2bw needs at least parallel.pp=2")
    assert err[1] == "[launch.local] nothing started (exit 2)"


class _Attempts:
    """A fake subprocess.run: attempt i exits codes[i] (torchrun's 1 for any failed rank); `meant` maps an
    attempt to the (code, message) pretrain.py leaves in $ASYNCPP_EXIT_FILE when it exits on purpose."""

    def __init__(self, codes, meant=None):
        self.codes, self.meant, self.calls = list(codes), meant or {}, 0

    def __call__(self, cmd, cwd, env, check):
        from asyncpp.train.run_identity import EXIT_FILE_ENV, record_exit

        i, self.calls = self.calls, self.calls + 1
        if i in self.meant:
            record_exit(*self.meant[i], path=env[EXIT_FILE_ENV])
        return subprocess.CompletedProcess(cmd, self.codes[i])


CONFIG_ERROR = (2, "config error: train.device=cuda but ...")


@pytest.mark.parametrize("codes, meant, calls, rc", [
    ([1, 1, 0], None, 3, 0),                                  # a crash is retried and the run comes back
    ([1, 1, 1], None, 3, 1),                                  # ... at most 1 + max_restarts times
    ([1], {0: CONFIG_ERROR}, 1, 2),                           # a config error is not retried
    ([1, 1], {1: CONFIG_ERROR}, 2, 2),                        # ... not even when it shows up in a restart
    ([1], {0: (3, "training diverged: step 1: ...")}, 1, 3),  # nor is a divergence
    ([143], None, 1, 143),                                    # a stop on purpose (checkpointed) is not retried
    ([1], {0: (143, "stopped at step 12")}, 1, 143),          # ... also when torchrun re-raised the SIGTERM as 1
    ([1, 0], {}, 2, 0),                                       # the file of an earlier attempt is not reread
])
def test_local_launcher_restarts_crashes_but_not_deliberate_exits(codes, meant, calls, rc):
    fake, said = _Attempts(codes, meant), []
    assert local.run_with_restarts(["torchrun"], 2, run=fake, echo=said.append) == rc
    assert fake.calls == calls
    if meant and rc in (2, 3):
        assert "not retried" in said[-1] and meant[min(meant)][1] in said[-1]


def test_launch_imports_no_torch():
    code = (
        "import sys, launch, launch.slurm, launch.local, launch.torchrun; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_slurm_sweep_config_composes_for_every_arm():
    """`python pretrain.py -m +experiment=sync_vs_async hydra/launcher=slurm`: the launcher is submitit's
    slurm one, the sweep has three arms, and every arm's job config validates."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from asyncpp import job

    base = ["+experiment=sync_vs_async", "hydra/launcher=slurm"]
    with initialize_config_dir(config_dir=str(job.CONFIG_DIR), version_base="1.3"):
        cfg = compose("pretrain", overrides=base, return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (1, 1, 1)
    assert launcher.timeout_min > 0 and launcher.max_num_timeout > 0 and "partition" in launcher
    arms = cfg.hydra.sweeper.params["+experiment/arm"].split(",")
    assert arms == ["sync", "2bw", "2bw_ef"]

    from hydra.utils import instantiate

    assert type(instantiate(launcher)).__name__ == "SlurmLauncher"  # the plugin accepts every parameter

    seen = {}
    for arm in arms:
        run_cfg, model_cfg = job.resolve(job.compose([*base, f"+experiment/arm={arm}"]))
        seen[arm] = (run_cfg.schedule.name, run_cfg.staleness.ef_lambda)
        assert model_cfg.name == "smollm2_135m" and run_cfg.train.device == "cuda"
    assert seen == {"sync": ("sync", 0.0), "2bw": ("2bw", 0.0), "2bw_ef": ("2bw", 1.0)}
    # no timestamp: rerunning the sweep finds every job's directory (named after the job's overrides) again
    assert OmegaConf.select(cfg, "hydra.sweep.dir") == "multirun/sync_vs_async"
    assert "asyncpp.job_name" in OmegaConf.to_container(cfg.hydra.sweep)["subdir"]  # the job's overrides (issue 47)


# ---- torchrun's own stderr, condensed by launch.local (launch/torchrun_report.py) ----------------------------------
TORCHRUN = REPO / "tests" / "fixtures" / "torchrun"


def condensed(text: str) -> list[str]:
    from launch.torchrun_report import TorchrunReport

    report, out = TorchrunReport(), []
    for line in text.splitlines(keepends=True):
        out += report.feed(line)
    return "".join(out + report.close()).splitlines()


def test_torchrun_failure_report_is_one_line_and_the_ranks_lines_pass():
    recorded = (TORCHRUN / "child_failed.stderr").read_text()
    assert "ChildFailedError" in recorded and len(recorded.splitlines()) > 40
    assert condensed(recorded) == [
        "[torchrun] OMP_NUM_THREADS=1 for every rank (torchrun's default; set OMP_NUM_THREADS to change it)",
        "rank 0 says: config error: train.steps=-1 must be >= 1",
        "rank 1 says: config error: train.steps=-1 must be >= 1",
        ("[torchrun] fail.py failed: rank 0 exited with 2 first, rank 1 exit 2 (the ranks' own output is above; "
         "torchrun's ChildFailedError report left out)")]


def test_torchrun_signal_traceback_is_one_line():
    recorded = (TORCHRUN / "signal.stderr").read_text()
    assert "SignalException" in recorded
    assert condensed(recorded) == [
        "[torchrun] OMP_NUM_THREADS=1 for every rank (torchrun's default; set OMP_NUM_THREADS to change it)",
        "[torchrun] got signal 15: passed on to the ranks, waiting for them to stop",
        "rank 1: stopped at step 3, checkpointed",
        "rank 0: stopped at step 3, checkpointed",
        "[torchrun] exited on signal 15 after its ranks did (its SignalException traceback left out)"]


def test_a_ranks_own_traceback_passes_unchanged():
    rank = ('Traceback (most recent call last):\n  File "pretrain.py", line 3, in <module>\n    main()\n'
            "ValueError: boom\n[rank0]: more\n")
    torchrun_log = "W1129 12:17:16.085000 1089 torch/distributed/elastic/agent/server/api.py:1] something new\n"
    assert condensed(rank) == rank.splitlines()
    assert condensed(torchrun_log) == ["[torchrun] something new"]  # an unknown torchrun message: kept, shorter
    assert condensed("Traceback (most recent call last):\n  File ...\n") == ["Traceback (most recent call last):",
                                                                           "  File ..."]  # cut short: kept


@pytest.mark.parametrize("raw", [False, True])
def test_local_launcher_condenses_torchruns_report_and_keeps_its_exit_code(tmp_path, capfd, raw):
    """launch.local with a torchrun that writes the recorded failure report and exits 1, as torchrun does."""
    recorded = TORCHRUN / "child_failed.stderr"
    fake = tmp_path / "torchrun.py"
    fake.write_text(f"import sys\nsys.stderr.write(open({str(recorded)!r}).read())\nsys.exit(1)\n")
    argv = ["--nproc-per-node", "2", "--no-validate", "--torchrun", f"{sys.executable} {fake}",
            *(["--raw-torchrun-output"] if raw else []), "--", "train.steps=-1"]
    assert local.main(argv) == 1  # torchrun's code, not a made-up one
    err = capfd.readouterr().err
    if raw:
        assert err == recorded.read_text()
    else:
        assert err.splitlines() == condensed(recorded.read_text())
