"""Render and submit an sbatch script: N nodes x G GPUs, srun starts one torchrun per node, the nodes
meet through a c10d rendezvous on the first node, and pretrain.py gets the hydra overrides.

    python -m launch.slurm --nodes 4 --gpus-per-node 8 --partition gpu --time 24:00:00 -- \
        model=smollm2_135m parallel.pp=4 schedule=2bw staleness.ef_lambda=1
    python -m launch.slurm --nodes 2 --gpus-per-node 8 --dry-run -- parallel.pp=4 schedule=2bw

Before anything is rendered, the overrides are composed and validated exactly as pretrain.py will
(launch/validate.py, a subprocess: asyncpp.job.compose + resolve at the job's world size, nodes x ranks per
node), so a typo or an impossible layout fails here and not after the job has queued (`--no-validate`
skips it).

On the node, the script cds to --workdir, runs the environment hook (`--env-setup`, repeatable: `module
load ...`, `source <venv>/bin/activate`, ...; default: activate .venv of the checkout, relative to the
job's working directory) and finds torchrun on PATH (or `--torchrun`, e.g. a container prefix). The
rendezvous port is derived from the job id (or `--rdzv-port`), NCCL/InfiniBand and CPU binding variables
get defaults that the submitting environment or `--env KEY=VALUE` override, and the run checkpoints every
`--checkpoint-every` steps unless the overrides set checkpoint.every.

Preemption and time limits: the job is `--requeue`d and gets SIGTERM 120 s before its end; the script
passes it to the ranks (which checkpoint) and requeues itself, at most `--max-requeues` times
(SLURM_RESTART_COUNT). Its run directory is named after the run (logging.run_name, else the overrides:
asyncpp/train/run_identity.py), not the job id, so a requeued job and a resubmission of the same command
both resume there. A rank that dies restarts the group (`--max-restarts`; the script restarts, not torchrun,
so a config error or a divergence is not retried). See docs/launch.md.

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
from launch.torchrun import ENTRY, REPO, split_overrides, torchrun_args, validate_overrides, with_device

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
TEMPLATE = "sbatch.sh.j2"
_TIME = re.compile(r"(\d+-)?\d+(:\d\d){0,2}")  # sbatch --time: minutes, [D-]HH:MM[:SS], ...
_NAME = re.compile(r"[A-Za-z0-9_.+-]+")
_ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")


def check_time(text: str) -> None:
    """sbatch --time: M, M:S, H:M:S, D-H, D-H:M or D-H:M:S; minutes and seconds below 60 after a larger unit,
    hours below 24 after days. Raises ValueError naming the value and the fix."""
    fix = "use e.g. 24:00:00 (H:MM:SS) or 2-00:00:00 (D-HH:MM:SS)"
    if not _TIME.fullmatch(text):
        raise ValueError(f"--time={text!r} is not an sbatch time; {fix}")
    days, _, rest = text.rpartition("-")
    parts = [int(x) for x in rest.split(":")]
    if days:  # D-H, D-H:M, D-H:M:S
        units = ["hours", "minutes", "seconds"][: len(parts)]
    else:  # M, M:S, H:M:S
        units = {1: ["minutes"], 2: ["minutes", "seconds"], 3: ["hours", "minutes", "seconds"]}[len(parts)]
    limits = {"hours": 24 if days else None, "minutes": 60 if len(parts) > 1 or days else None, "seconds": 60}
    for unit, value in zip(units, parts):
        if unit == units[0] and not days:
            continue  # the leading unit may be as large as it likes (90 = 90 minutes, 25:00:00 = 25 hours)
        if limits[unit] is not None and value >= limits[unit]:
            raise ValueError(f"--time={text!r}: {value} {unit} is out of range (below {limits[unit]}); {fix}")
    if all(v == 0 for v in parts) and not (days and int(days)):
        raise ValueError(f"--time={text!r} is no time at all; {fix}")


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
    max_requeues: int = 10
    """Requeues after SIGTERM (time limit, preemption) before the job stops for good (SLURM_RESTART_COUNT)."""
    rdzv_port: int | None = None
    """None: 20000 + SLURM_JOB_ID mod 20000, so two jobs sharing a head node do not collide."""
    log_dir: str = "logs/slurm"
    run_root: str = "outputs/slurm"
    workdir: str = str(REPO)
    torchrun: str = "torchrun"
    """The torchrun command on the node (found on PATH after env_setup), e.g. a container prefix
    `apptainer exec --nv img.sif torchrun`."""
    env_setup: list[str] | None = None
    """Shell lines that make the environment on the node; None = activate .venv of the work directory."""
    env: list[str] = field(default_factory=list)
    """Extra KEY=VALUE exports, after the defaults (e.g. NCCL_SOCKET_IFNAME=ib0, WANDB_MODE=offline)."""
    cpu_bind: str = "none"
    """srun --cpu-bind: one task per node runs torchrun and all its ranks, so it must not be pinned to a core."""
    gpu_bind: str | None = None
    """srun --gpu-bind (None: slurm's default)."""
    checkpoint_every: int = 500
    """checkpoint.every for the run unless the overrides set it (a requeue loses at most this many steps)."""
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
        check_time(self.time)
        if self.gpus_per_node and self.ranks_per_node > self.gpus_per_node:
            raise ValueError(f"--nproc-per-node={self.nproc_per_node} starts more ranks than --gpus-per-node="
                             f"{self.gpus_per_node} GPUs on each node (one rank per GPU); set --nproc-per-node="
                             f"{self.gpus_per_node}, or leave it out")
        if not _NAME.fullmatch(self.job_name):
            raise ValueError(f"--job-name={self.job_name!r} may use letters, digits and _.+- only")
        if self.max_requeues < 0 or self.checkpoint_every < 0:
            raise ValueError("--max-requeues and --checkpoint-every must be >= 0")
        if self.rdzv_port is not None and not 1024 <= self.rdzv_port <= 65535:
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

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def job_overrides(self) -> list[str]:
        """What pretrain.py gets: the overrides, train.device=cuda on GPU nodes, a periodic checkpoint."""
        overrides = with_device(self.overrides, "cuda") if self.gpus_per_node else list(self.overrides)
        if self.checkpoint_every and not any(o.lstrip("+~").startswith("checkpoint.every=") for o in overrides):
            overrides.append(f"checkpoint.every={self.checkpoint_every}")
        return overrides


DEFAULT_ENV_SETUP = [
    "# the checkout's own environment, relative to the job's working directory (not the login node's path)",
    "if [ -f .venv/bin/activate ]; then source .venv/bin/activate; fi",
]


def validate_config(job: SlurmJob, python: str = sys.executable) -> str:
    """Compose and validate the job's overrides as pretrain.py will, at its world size, in a subprocess
    (this module imports no torch). Returns the resolved layout line; raises ValueError with pretrain's
    'config error: ...' message when the job would be refused."""
    return validate_overrides(job.job_overrides(), job.world_size, python)


def render(job: SlurmJob, command_line: str = "python -m launch.slurm") -> str:
    """The sbatch script for `job` (validated)."""
    job.validate()
    overrides = job.job_overrides()
    quoted = [shlex.quote(o) for o in overrides]
    if not any(o.startswith("hydra.run.dir=") for o in overrides):
        # Expanded by the shell, then quoted for hydra: a run name has '=' and ',' (model=x,schedule=y), which
        # hydra's override grammar reads as a sweep or refuses ("mismatched input '='") unless quoted.
        quoted.insert(0, '"hydra.run.dir=\'$RUN_DIR\'"')
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
                "max_requeues",
                "max_restarts",
                "cpu_bind",
                "gpu_bind",
            )
        },
        env_setup=DEFAULT_ENV_SETUP if job.env_setup is None else job.env_setup,
        torchrun_exe=shlex.split(job.torchrun)[0],
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
            max_restarts=0,  # the script restarts, telling a deliberate exit from a crash (sbatch.sh.j2)
            rdzv_endpoint="$HEAD_NODE:$RDZV_PORT",
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


def parse_args(argv: list[str]) -> tuple[SlurmJob, bool, bool]:
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
        "--max-restarts", type=int, default=3,
        help="restarts of the group after a crash (not after a config error or a divergence)"
    )
    p.add_argument("--rdzv-port", type=int, help="default: 20000 + SLURM_JOB_ID mod 20000 (one per job)")
    p.add_argument("--max-requeues", type=int, default=10,
                   help="requeues after SIGTERM (time limit, preemption) before the job stops (default 10)")
    p.add_argument("--env-setup", action="append", default=None, metavar="LINE",
                   help="shell line run on the node before torchrun, e.g. 'module load cuda/12.4' or "
                        "'source /shared/venv/bin/activate' (repeatable; default: source .venv/bin/activate "
                        "of --workdir if present)")
    p.add_argument("--cpu-bind", default="none", help="srun --cpu-bind (default none: torchrun's ranks share the node)")
    p.add_argument("--gpu-bind", help="srun --gpu-bind (default: slurm's)")
    p.add_argument("--checkpoint-every", type=int, default=500,
                   help="checkpoint.every unless the overrides set it (default 500; 0 = leave it)")
    p.add_argument("--no-validate", dest="check_config", action="store_false",
                   help="do not compose and validate the overrides on this node before rendering")
    p.add_argument("--log-dir", default="logs/slurm", help="%%x-%%j.out/.err and the .sbatch go here")
    p.add_argument(
        "--run-root", default="outputs/slurm",
        help="run directories: <run-root>/<logging.run_name, else a name made of the overrides>"
    )
    p.add_argument("--workdir", default=str(REPO), help="the asyncpp checkout on the compute nodes")
    p.add_argument(
        "--torchrun", default="torchrun",
        help="torchrun command on the node (default: torchrun on PATH after --env-setup; may be a container "
             "prefix such as 'apptainer exec --nv img.sif torchrun')"
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
    dry_run, check_config = args.pop("dry_run"), args.pop("check_config")
    try:
        job = SlurmJob(**args, overrides=overrides).validate()
    except ValueError as e:
        p.error(str(e))
    return job, dry_run, check_config


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job, dry_run, check_config = parse_args(argv)
    if check_config:
        try:
            print(validate_config(job), file=sys.stderr)
        except ValueError as e:
            print(f"{e}\nnothing submitted: fix the overrides (or pass --no-validate)", file=sys.stderr)
            return 2
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
