"""Render and submit an sbatch script: N nodes x G GPUs, srun starts one torchrun per node, the nodes
meet through a c10d rendezvous on the first node, and pretrain.py gets the hydra overrides.

    python -m launch.slurm --nodes 4 --gpus-per-node 8 --partition gpu --time 24:00:00 -- \
        model=smollm2_135m parallel.pp=4 schedule=2bw staleness.ef_lambda=1
    python -m launch.slurm --nodes 2 --gpus-per-node 8 --dry-run -- parallel.pp=4 schedule=2bw

Preemption and time limits: the job is `--requeue`d and gets SIGTERM 120 s before its end; the script
passes it to the ranks (which checkpoint) and requeues itself. Its run directory is named after the run
(logging.run_name, else the overrides: asyncpp/train/run_identity.py), not the job id, so a requeued job
and a resubmission of the same command both resume there. A rank that dies is restarted by
torchrun (`--max-restarts`). See docs/launch.md.

No torch import here: this runs on a login node.
"""

from __future__ import annotations

import argparse
import datetime
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import jinja2

from asyncpp.train.run_identity import explicit_name, run_name
from launch.torchrun import ENTRY, REPO, default_torchrun, split_overrides, torchrun_args, with_device

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
TEMPLATE = "sbatch.sh.j2"
_TIME = re.compile(r"(\d+-)?\d+(:\d\d){0,2}")  # sbatch --time: minutes, [D-]HH:MM[:SS], ...
_NAME = re.compile(r"[A-Za-z0-9_.+-]+")
_ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")


@dataclass(kw_only=True)
class SlurmJob:
    nodes: int
    gpus_per_node: int
    nproc_per_node: int | None = None
    """Ranks per node; None = gpus_per_node (1 on CPU nodes)."""
    job_name: str = "asyncpp"
    time: str = "24:00:00"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    cpus_per_task: int | None = None
    """CPUs per node for the one task that runs torchrun; None = whatever the node gives the job."""
    mem: str | None = None
    exclusive: bool = True
    requeue: bool = True
    signal_seconds: int = 120
    max_restarts: int = 3
    rdzv_port: int = 29500
    log_dir: str = "logs/slurm"
    run_root: str = "outputs/slurm"
    workdir: str = str(REPO)
    torchrun: str = field(default_factory=default_torchrun)
    env: list[str] = field(default_factory=list)
    """Extra KEY=VALUE exports (e.g. NCCL_SOCKET_IFNAME=ib0, WANDB_MODE=offline)."""
    extra_sbatch: list[str] = field(default_factory=list)
    """Extra sbatch options, e.g. --constraint=h100."""
    overrides: list[str] = field(default_factory=list)

    @property
    def run_dir(self) -> str:
        """<run_root>/<run name>: the same for every submission of the same overrides (or run name)."""
        return f"{self.run_root.rstrip('/')}/{run_name(explicit_name(self.overrides), self.overrides)}"

    @property
    def ranks_per_node(self) -> int:
        return self.nproc_per_node or max(self.gpus_per_node, 1)

    def validate(self) -> SlurmJob:
        """Raises ValueError naming the option, the value and the fix."""
        for name in ("nodes", "ranks_per_node", "signal_seconds"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be >= 1")
        if self.gpus_per_node < 0 or self.max_restarts < 0:
            raise ValueError("--gpus-per-node and --max-restarts must be >= 0")
        if not _TIME.fullmatch(self.time):
            raise ValueError(f"--time={self.time!r} is not an sbatch time; use e.g. 24:00:00 or 2-00:00:00")
        if not _NAME.fullmatch(self.job_name):
            raise ValueError(f"--job-name={self.job_name!r} may use letters, digits and _.+- only")
        if not 1024 <= self.rdzv_port <= 65535:
            raise ValueError(f"--rdzv-port={self.rdzv_port} must be in [1024, 65535]")
        for path in ("log_dir", "run_root", "workdir"):
            if re.search(r"\s", getattr(self, path)):
                raise ValueError(
                    f"--{path.replace('_', '-')}={getattr(self, path)!r} contains whitespace, which "
                    "#SBATCH lines cannot carry; pick a path without spaces"
                )
        bad = [e for e in self.env if not _ENV.fullmatch(e)]
        if bad:
            raise ValueError(f"--env {bad[0]!r} must be KEY=VALUE")
        return self


def render(job: SlurmJob, command_line: str = "python -m launch.slurm") -> str:
    """The sbatch script for `job` (validated)."""
    job.validate()
    overrides = with_device(job.overrides, "cuda") if job.gpus_per_node else list(job.overrides)
    quoted = [shlex.quote(o) for o in overrides]
    if not any(o.startswith("hydra.run.dir=") for o in overrides):
        quoted.insert(0, '"hydra.run.dir=$RUN_DIR"')  # expanded by the shell, not by hydra
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    return env.get_template(TEMPLATE).render(
        **{
            k: getattr(job, k)
            for k in (
                "job_name",
                "nodes",
                "gpus_per_node",
                "cpus_per_task",
                "mem",
                "time",
                "partition",
                "account",
                "qos",
                "exclusive",
                "requeue",
                "signal_seconds",
                "rdzv_port",
                "extra_sbatch",
            )
        },
        nproc_per_node=job.ranks_per_node,
        log_dir=str(Path(job.workdir) / job.log_dir),  # absolute: `sbatch <script>` works from anywhere
        run_dir=shlex.quote(job.run_dir),
        workdir=shlex.quote(job.workdir),
        shutdown_timeout=max(10, job.signal_seconds - 20),  # leave time to requeue after the ranks exit
        env=[(k, shlex.quote(v)) for k, v in (e.split("=", 1) for e in job.env)],
        torchrun=job.torchrun,
        torchrun_args=torchrun_args(
            nnodes=job.nodes,
            nproc_per_node=job.ranks_per_node,
            max_restarts=job.max_restarts,
            rdzv_endpoint=f"$HEAD_NODE:{job.rdzv_port}",
            rdzv_id="$SLURM_JOB_ID",
        ),
        entry=ENTRY,
        overrides=quoted,
        command_line=command_line,
    )


def script_path(job: SlurmJob, now: datetime.datetime | None = None) -> Path:
    """Where the rendered script is kept (next to the job's logs), relative to the work directory."""
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    return Path(job.log_dir) / f"{job.job_name}-{stamp}.sbatch"


def sbatch_command(path: Path) -> list[str]:
    return ["sbatch", "--parsable", str(path)]


def submit(job: SlurmJob, script: str) -> str:
    """Write the script, make the log directory (sbatch does not) and submit. Returns the job id."""
    if shutil.which("sbatch") is None:
        raise RuntimeError(
            "sbatch is not on PATH: run this on a slurm login node, or use --dry-run to print "
            "the script without submitting"
        )
    workdir = Path(job.workdir)
    path = script_path(job)
    (workdir / job.log_dir).mkdir(parents=True, exist_ok=True)
    (workdir / path).write_text(script)
    result = subprocess.run(sbatch_command(path), cwd=workdir, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"sbatch failed ({result.returncode}): {result.stderr.strip() or result.stdout.strip()}"
        )
    return result.stdout.strip().split(";")[0]  # --parsable prints "jobid[;cluster]"


def parse_args(argv: list[str]) -> tuple[SlurmJob, bool]:
    options, overrides = split_overrides(argv)
    p = argparse.ArgumentParser(
        prog="python -m launch.slurm",
        usage="%(prog)s --nodes N --gpus-per-node G [options] [-- hydra overrides]",
        description="Render and submit an sbatch script that runs pretrain.py under torchrun on N nodes.",
    )
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True, help="0 for CPU nodes")
    p.add_argument("--nproc-per-node", type=int, help="ranks per node (default: --gpus-per-node)")
    p.add_argument("--job-name", default="asyncpp")
    p.add_argument("--time", default="24:00:00", help="sbatch --time (default 24:00:00)")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--qos")
    p.add_argument("--cpus-per-task", type=int, help="CPUs per node (default: all the job gets)")
    p.add_argument("--mem", help="sbatch --mem, e.g. 0 (all) or 512G")
    p.add_argument("--no-exclusive", dest="exclusive", action="store_false", help="share nodes")
    p.add_argument(
        "--no-requeue",
        dest="requeue",
        action="store_false",
        help="do not requeue on preemption or at the time limit",
    )
    p.add_argument("--signal-seconds", type=int, default=120, help="SIGTERM this long before the time limit")
    p.add_argument(
        "--max-restarts", type=int, default=3, help="torchrun restarts of the group after a failure"
    )
    p.add_argument("--rdzv-port", type=int, default=29500)
    p.add_argument("--log-dir", default="logs/slurm", help="%%x-%%j.out/.err and the .sbatch go here")
    p.add_argument(
        "--run-root", default="outputs/slurm",
        help="run directories: <run-root>/<logging.run_name, else a name made of the overrides>"
    )
    p.add_argument("--workdir", default=str(REPO), help="the asyncpp checkout on the compute nodes")
    p.add_argument(
        "--torchrun", default=None, help="torchrun executable (default: the one beside this python)"
    )
    p.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="extra export (repeatable)"
    )
    p.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        dest="extra_sbatch",
        metavar="OPTION",
        help="extra #SBATCH option, e.g. --sbatch-arg=--constraint=h100 (repeatable)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the script and the sbatch command; submit nothing"
    )
    args = vars(p.parse_args(options))
    dry_run = args.pop("dry_run")
    if args["torchrun"] is None:
        args.pop("torchrun")
    try:
        job = SlurmJob(**args, overrides=overrides).validate()
    except ValueError as e:
        p.error(str(e))
    return job, dry_run


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job, dry_run = parse_args(argv)
    recorded = [a for a in argv if a != "--dry-run"]
    script = render(job, "python -m launch.slurm " + shlex.join(recorded))
    if dry_run:
        print(script, end="")
        print(
            f"# dry run: would write {script_path(job)} and run (in {job.workdir}): "
            f"{shlex.join(sbatch_command(script_path(job)))}"
        )
        return 0
    try:
        job_id = submit(job, script)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"submitted job {job_id}: logs {job.log_dir}/{job.job_name}-{job_id}.out, "
        f"run dir {job.run_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
