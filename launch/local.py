"""Run pretrain.py under torchrun on this machine: one process per rank, gloo on CPU, NCCL on GPUs.

    python -m launch.local --nproc-per-node 2 -- parallel.pp=2 schedule=2bw
    python -m launch.local --nproc-per-node 8 --gpus -- parallel.pp=4 schedule=2bw   # adds train.device=cuda
    python -m launch.local --nproc-per-node 4 --dry-run -- parallel.pp=4             # print the command only

No torch import here; torchrun does the work.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

from launch.torchrun import ENTRY, REPO, default_torchrun, split_overrides, torchrun_args, with_device


def command(
    nproc_per_node: int,
    overrides: list[str],
    *,
    max_restarts: int = 0,
    gpus: bool = False,
    torchrun: str | None = None,
) -> list[str]:
    """The torchrun command line (run from the repository root)."""
    if nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node={nproc_per_node} must be >= 1")
    overrides = with_device(overrides, "cuda") if gpus else list(overrides)
    return [
        *shlex.split(torchrun or default_torchrun()),
        *torchrun_args(nproc_per_node=nproc_per_node, max_restarts=max_restarts),
        ENTRY,
        *overrides,
    ]


def main(argv: list[str] | None = None) -> int:
    options, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog="python -m launch.local",
        usage="%(prog)s --nproc-per-node N [options] [-- hydra overrides]",
        description="Run pretrain.py under torchrun --standalone on this machine.",
    )
    p.add_argument("--nproc-per-node", type=int, required=True, help="ranks (processes) to start")
    p.add_argument(
        "--max-restarts", type=int, default=0, help="torchrun restarts of the group after a failure"
    )
    p.add_argument("--gpus", action="store_true", help="one GPU per rank: adds train.device=cuda")
    p.add_argument(
        "--torchrun", default=None, help="torchrun executable (default: the one beside this python)"
    )
    p.add_argument("--dry-run", action="store_true", help="print the command; run nothing")
    args = p.parse_args(options)
    try:
        cmd = command(
            args.nproc_per_node,
            overrides,
            max_restarts=args.max_restarts,
            gpus=args.gpus,
            torchrun=args.torchrun,
        )
    except ValueError as e:
        p.error(str(e))
    if args.dry_run:
        print(f"cd {shlex.quote(str(REPO))} && {shlex.join(cmd)}")
        return 0
    return subprocess.run(cmd, cwd=REPO, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
