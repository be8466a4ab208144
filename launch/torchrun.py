"""The torchrun command line both launchers share. Pure string building: no torch import here.

torchrun is the one process manager: it starts `--nproc-per-node` ranks per node, meets the other nodes
through a c10d rendezvous (or `--standalone` on one machine) and restarts the whole group up to
`--max-restarts` times when a rank dies; the run then resumes from its last checkpoint.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENTRY = "pretrain.py"


def default_torchrun(python: str | None = None) -> str:
    """torchrun next to `python` (a venv's), else the one on PATH, else `python -m torch.distributed.run`."""
    python = python or sys.executable
    beside = Path(python).with_name("torchrun")
    if beside.exists():
        return str(beside)
    return shutil.which("torchrun") or f"{python} -m torch.distributed.run"


def torchrun_args(
    *,
    nproc_per_node: int,
    max_restarts: int,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
) -> list[str]:
    """torchrun's own options. Without `rdzv_endpoint` the job is one machine (`--standalone`)."""
    if rdzv_endpoint is None:
        return [
            "--standalone",
            "--nnodes=1",
            f"--nproc-per-node={nproc_per_node}",
            f"--max-restarts={max_restarts}",
        ]
    args = [
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
    ]
    if rdzv_id is not None:
        args.append(f"--rdzv-id={rdzv_id}")
    return [*args, f"--max-restarts={max_restarts}"]


def with_device(overrides: list[str], device: str) -> list[str]:
    """Add `train.device=<device>` unless the user chose one (pretrain.py's default is cpu)."""
    if any(o.lstrip("+~").startswith("train.device=") for o in overrides):
        return list(overrides)
    return [*overrides, f"train.device={device}"]


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """`launcher options -- hydra overrides` -> (options, overrides)."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def validate_overrides(overrides: list[str], world_size: int, python: str = sys.executable) -> str:
    """Compose and validate the job's overrides as pretrain.py will, at its world size, in a subprocess
    (`python -m launch.validate`; the launchers import no torch). Returns the resolved layout line; raises
    ValueError with pretrain's 'config error: ...' message when the job would be refused."""
    cmd = [python, "-m", "launch.validate", "--world-size", str(world_size), "--", *overrides]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.startswith("config error:")]
        raise ValueError(lines[-1] if lines else result.stderr.strip()[-2000:])
    return result.stdout.strip()
