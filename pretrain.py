"""asyncpp's entry point: hydra's app, the signals and the exit codes. The job itself is asyncpp/job.py.

    python pretrain.py                                  # the embedded default (tiny_hybrid, Muon, 2BW)
    python pretrain.py model=tiny_dense optimizer=adamw schedule=sync train.steps=100
    python pretrain.py staleness.ef_lambda=1.0 parallel.pp=4 schedule=pipedream
    torchrun --standalone --nproc_per_node=2 pretrain.py parallel.pp=2 schedule=2bw   # a real pipeline

Run as one process, every schedule is simulated (asyncpp.reference.simulator); under torchrun each rank runs
one pipeline stage (asyncpp.pipeline.executor) and computes the same numbers. Nothing imports this file: tests,
tools, bench and the launchers use asyncpp.job.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from asyncpp import job
from asyncpp.config import ConfigError
from asyncpp.core.update import NonFiniteUpdate
from asyncpp.host.allocator import set_mmap_threshold, set_trim_threshold
from asyncpp.parallel import failfast
from asyncpp.train import preflight
from asyncpp.train.checkpoint import NoSpaceLeft
from asyncpp.train.preemption import EXIT_CODE as PREEMPTED_EXIT_CODE
from asyncpp.train.preemption import StopFlag
from asyncpp.train.run_identity import EXIT_CRASHED, EXIT_DIVERGED, EXIT_NO_SPACE, record_exit
from asyncpp.train.trainer import TrainingAborted

PEER_SAYS_S = 60.0  # how long a rank > 0 waits for rank 0 to say a config error they share (let_rank_zero_say_it)
STARTED = False  # main was entered (hydra resets its own HydraConfig after a failed job, so it cannot tell)
SWEEP_FAILED: list[tuple[int, str]] = []  # a multirun's points refused or diverged: (code, why), reported at the end
STOP = StopFlag()  # set by SIGTERM/SIGINT/SIGUSR1 (preemption, Ctrl-C); the loops checkpoint and stop at a step boundary


@hydra.main(config_path=str(job.CONFIG_DIR), config_name="pretrain", version_base="1.3")
def main(dcfg: DictConfig) -> float:
    global STARTED
    STARTED = True  # hydra composed the config; an error from here on is the run's (run_main)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    try:
        cfg, model_cfg = job.resolve(job.to_container(dcfg), world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:  # every rank resolves the same command line alike, so one of them says it (rank 0)
        let_rank_zero_say_it()
        return point_failed(preflight.EXIT_CONFIG_ERROR, f"config error: {e}", quiet=not is_rank_zero())
    try:
        if cfg.dry_run:
            preflight.check_dry_run(cfg, model_cfg)  # what the real run would refuse, the dry run refuses
            job.run_dry(cfg, model_cfg)
            return float("nan")
        preflight.check(cfg, model_cfg, rank=int(os.environ.get("RANK", "0")),
                        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        # Before the data and the model: the heap policy is process-wide (asyncpp/host/allocator.py).
        set_mmap_threshold(cfg.train.host_mmap_threshold)
        set_trim_threshold(cfg.train.host_trim_threshold)
        summary = (job.run_distributed if distributed else job.run)(cfg, model_cfg, STOP)
    except preflight.RunComplete as e:  # a rerun of a finished command: one line, exit 0
        if int(os.environ.get("RANK", "0")) == 0:
            print(e, flush=True)
        return float("nan")
    except ConfigError as e:  # raised before any model or process group exists
        return point_failed(preflight.EXIT_CONFIG_ERROR, f"config error: {e}")  # distinct from a crash (1)
    except (TrainingAborted, NonFiniteUpdate) as e:  # every rank raises it at the same step: no hang, no traceback
        return point_failed(EXIT_DIVERGED, f"training diverged: {e}")
    except NoSpaceLeft as e:  # every rank (the save agrees on failures); a restart would hit the same full disk
        leave(EXIT_NO_SPACE, str(e))
    except failfast.RankFailed as e:  # its process groups are aborted already (asyncpp/parallel/failfast.py)
        if e.first:  # the job's first failure: its traceback and its one line, in the console and the exit file
            print(e.trace, end="", file=sys.stderr)
        leave(EXIT_CRASHED, str(e), record=e.first)
    if summary.get("stopped_at") is not None:  # checkpointed; let the scheduler requeue the job
        leave(PREEMPTED_EXIT_CODE, f"stopped at step {summary['stopped_at']} (checkpointed); rerun to resume",
              quiet=True)
    if not math.isfinite(summary.get("final_loss", 0.0)):
        leave(EXIT_DIVERGED, f"training diverged: the final loss is {summary['final_loss']} (summary.json has the "
              "run's record); lower optimizer.lr and rerun from an earlier checkpoint")
    return float(summary.get("final_val_loss", float("nan")))  # the value hydra sweepers optimize


def point_failed(code: int, message: str, quiet: bool = False) -> float:
    """A run that cannot go on: leave with `code`; in a multirun (-m), only this point fails: it is reported and
    the sweep's other points still run (leaving at once dropped every point after it), and run_main exits with
    the code once the sweep is done. `quiet`: another rank prints the same message."""
    if not in_multirun():
        leave(code, message, quiet=quiet)
    point = " ".join(HydraConfig.get().overrides.task)
    print(f"sweep point [{point}] failed: {message}", file=sys.stderr, flush=True)
    SWEEP_FAILED.append((code, f"[{point}] {message}"))
    return float("nan")


def is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def let_rank_zero_say_it() -> None:
    """A config error every rank finds alike is said once, by rank 0 (one line per run, not per rank). Another rank
    that left first would have torchrun stop rank 0 before it said anything, so it waits: torchrun (or srun's
    --kill-on-bad-exit) ends it once rank 0 has left, by a SIGTERM whose default action still holds (the stop
    handler is armed only when training starts); PEER_SAYS_S bounds the wait should nobody end it."""
    if not is_rank_zero() and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not in_multirun():
        time.sleep(PEER_SAYS_S)


def in_multirun() -> bool:
    try:
        return HydraConfig.get().mode == RunMode.MULTIRUN
    except ValueError:  # no hydra app running (a test calling main's pieces)
        return False


def leave(code: int, message: str, quiet: bool = False, record: bool = True) -> None:
    """Exit now with `code`: say why (unless already said), and tell the launcher through $ASYNCPP_EXIT_FILE,
    since torchrun reports 1 whatever the ranks' codes were (run_identity.record_exit; `record`=False: a rank
    whose failure follows another rank's leaves that rank's record in place)."""
    if not quiet:
        print(message, file=sys.stderr, flush=True)
    if record:
        record_exit(code, message)
    exit_now(code)


def exit_now(code: int) -> None:
    """Everything the run owes is written by now (the checkpoint committed, metrics, summary and wandb closed,
    the process group destroyed). What sys.exit would add is the interpreter's teardown: module and tensor
    finalizers that took 2.5-4 s per rank on 2 cores after a preemption signal (py-spy: no Python frame
    left), and that count against the grace period under torchrun and slurm. Leave without it."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()  # hydra's log file
    os._exit(code)


def check_environment() -> None:
    """torchrun's rank variables left in the environment of a process torchrun did not start (preflight)."""
    try:
        preflight.check_environment(os.environ)
    except ConfigError as e:
        leave(preflight.EXIT_CONFIG_ERROR, f"config error: {e}")


def check_command_line(argv: list[str]) -> None:
    """hydra reports a command line it cannot compose (a misspelt key, a missing group option, a '+' on an
    existing key) with exit code 1, which a launcher retries as a crash. Compose it first, the way the app will,
    and leave with EXIT_CONFIG_ERROR and the fix. Only plain overrides: hydra's own flags (-m, --cfg, ...)
    and sweeps (a,b) are hydra's to parse."""
    if any(a.startswith("-") for a in argv):
        return
    try:
        job.compose(argv)
    except ConfigError as e:  # the same on every rank: rank 0 says it
        let_rank_zero_say_it()
        leave(preflight.EXIT_CONFIG_ERROR, f"config error: {e}", quiet=not is_rank_zero())


def _quiet_hydra_on_other_ranks() -> None:
    """Under torchrun only rank 0 keeps a hydra run directory (the one metrics go to)."""
    if int(os.environ.get("RANK", "0")) > 0:
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled",
                     "hydra.run.dir=."]


def install_stop(stop: StopFlag = STOP) -> StopFlag:
    """SIGTERM, SIGINT and SIGUSR1 set the flag (no KeyboardInterrupt traceback on every rank). Test hook:
    ASYNCPP_STOP_AT_STEP=k requests a stop at step k as if signalled then, on ASYNCPP_STOP_RANK only if set."""
    at = os.environ.get("ASYNCPP_STOP_AT_STEP")
    only = os.environ.get("ASYNCPP_STOP_RANK")
    if at is not None and (only is None or only == os.environ.get("RANK", "0")):
        stop.at_step = int(at)
    return stop.install()


def run_main() -> None:
    """main(), with hydra's own refusals counted as config errors: an override hydra cannot apply (`trian.steps=3`:
    "Could not override", a missing config group) ends in hydra's sys.exit(1) before main runs, which torchrun and
    the launchers would take for a crash and retry (the real slurm cluster did, 3 times; tests/slurm)."""
    try:
        main()
    except SystemExit as e:
        if e.code == 1 and not STARTED:  # main never ran: hydra failed to compose the config (and said why)
            leave(preflight.EXIT_CONFIG_ERROR, "config error: hydra could not compose the config from the overrides "
                  "(its message is above); fix that override")
        raise
    if SWEEP_FAILED:  # every point ran; the refused or diverged ones decide the exit code (a config error first)
        code = min(code for code, _ in SWEEP_FAILED)
        leave(code, f"sweep: {len(SWEEP_FAILED)} point(s) failed (the others ran): "
              + "; ".join(why for _, why in SWEEP_FAILED))
    # The run (or every point of a sweep) ended and closed what it wrote. A completed run leaves as promptly as a
    # stopped one: the teardown held each rank for seconds, and the job with it (a 2-rank torchrun --standalone
    # at load 22-36: main's return -> torchrun's exit 8.9 and 10.0 s with it, 2.1 and 2.5 s without).
    exit_now(0)


if __name__ == "__main__":
    check_environment()
    sys.argv[1:] = job.quote_paths(sys.argv[1:])  # a run directory as printed, for checkpoint.resume=
    check_command_line(sys.argv[1:])
    _quiet_hydra_on_other_ranks()
    install_stop()
    run_main()
