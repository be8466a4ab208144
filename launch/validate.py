"""Check a job's hydra overrides exactly as pretrain.py will read them, at the job's real world size, before
the job is queued (a typo, an impossible layout or a global batch that does not split fails on the login
node, not hours later on the compute nodes).

    python -m launch.validate --world-size 16 -- model=smollm2_135m parallel.pp=4 train.steps=1000

launch/slurm.py runs this as a subprocess (launch/ itself imports no torch); it imports pretrain.py and uses
its compose() and resolve(), so the check cannot drift from what the job will do. Exit code 2 and a
"config error: ..." line on stderr when the job would be refused, 0 and a one-line layout otherwise.
"""

from __future__ import annotations

import argparse
import sys

EXIT_CONFIG_ERROR = 2  # pretrain.py's (asyncpp/train/preflight.py): launchers never retry it


def check(overrides: list[str], world_size: int) -> str:
    """The resolved layout as one line; raises asyncpp.config.ConfigError (or hydra's errors) when refused."""
    from asyncpp import job

    cfg, _ = job.resolve(job.compose(overrides), world_size=world_size)
    p, t = cfg.parallel, cfg.train
    return (f"{world_size} ranks: pp={p.pp} dp={p.dp or 1} tp={p.tp} ep={p.ep}, model={cfg.model.name}, "
            f"schedule={cfg.schedule.name}, micro_batch={t.micro_batch_size} x m={t.num_microbatches} x dp "
            f"= global_batch={t.global_batch_size}, steps={t.steps}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    options, overrides = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m launch.validate")
    parser.add_argument("--world-size", type=int, required=True, help="nodes x ranks per node")
    args = parser.parse_args(options)
    from asyncpp.config import ConfigError

    try:
        print(f"[launch] config ok: {check(overrides, args.world_size)}")
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
