"""Run pretrain.py under torchrun on this machine: one process per rank, gloo on CPU, NCCL on GPUs.

    python -m launch.local --nproc-per-node 2 -- parallel.pp=2 schedule=2bw
    python -m launch.local --nproc-per-node 8 --gpus -- parallel.pp=4 schedule=2bw   # adds train.device=cuda
    python -m launch.local --nproc-per-node 4 --dry-run -- parallel.pp=4             # validate, print the command

No torch import here; torchrun does the work.

Restarts (`--max-restarts R`): after a failed attempt the same torchrun command runs again, up to R times.
The run directory is named after the command (configs/pretrain.yaml), so every attempt resumes from the
newest complete checkpoint there. This launcher restarts rather than torchrun's own `--max-restarts`,
because torchrun retries every failure alike, and reports 1 for any of them (a SIGTERM it forwarded too).
pretrain.py leaves the reason of a deliberate exit in $ASYNCPP_EXIT_FILE (asyncpp/train/run_identity.py):
a config error (2, before any process group) fails again at once and a divergence (3) again at the same
step, so neither is retried, and a stop on purpose (143: SIGTERM/Ctrl-C, checkpointed) returns 143.

Stops: a SIGTERM (or SIGINT, SIGUSR1) to this launcher is forwarded to torchrun, which forwards it to the ranks;
they checkpoint at a step boundary and exit, and the launcher waits for that, then says "stopped at step N,
checkpointed; rerun <command> to resume" and exits 143. torchrun runs with PR_SET_PDEATHSIG = SIGTERM: if the
launcher itself is killed (SIGKILL, an OOM kill) torchrun gets the same orderly stop instead of training on as an
orphan.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from asyncpp.train.run_identity import (
    EXIT_CONFIG_ERROR,
    EXIT_DIVERGED,
    EXIT_FILE_ENV,
    EXIT_NO_SPACE,
    EXIT_STOPPED,
    read_exit,
)
from launch.torchrun import (
    ENTRY,
    REPO,
    default_torchrun,
    split_overrides,
    torchrun_args,
    validate_overrides,
    with_device,
)
from launch.torchrun_report import TorchrunReport

STOPPED = (130, 143, -2, -15)  # Ctrl-C / SIGTERM: the run checkpointed and stopped on purpose


def command(
    nproc_per_node: int,
    overrides: list[str],
    *,
    max_restarts: int = 0,
    gpus: bool = False,
    torchrun: str | None = None,
) -> list[str]:
    """The torchrun command line of one attempt (run from the repository root). `max_restarts` is
    torchrun's own; main() passes 0 and restarts itself (see the module docstring)."""
    if nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node={nproc_per_node} must be >= 1")
    overrides = with_device(overrides, "cuda") if gpus else list(overrides)
    return [
        *shlex.split(torchrun or default_torchrun()),
        *torchrun_args(nproc_per_node=nproc_per_node, max_restarts=max_restarts),
        ENTRY,
        *overrides,
    ]


FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""Signals the launcher passes on to torchrun (which passes them to the ranks: a checkpointed stop)."""
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_launcher(launcher: int) -> Callable[[], None]:
    """preexec_fn for torchrun: SIGTERM when the launcher dies, however it dies (Linux; elsewhere a no-op)."""
    def arm() -> None:
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != launcher:  # the launcher died before the prctl: stop at once, as it would have
            os.kill(os.getpid(), signal.SIGTERM)
    return arm


class Forwarding:
    """subprocess.run's shape (cmd, cwd, env, check) -> CompletedProcess, with this process's stop signals passed
    on to the child while it runs and the child tied to this process's life. `stopped` records a forwarded stop.
    With `condense`, the child's stderr (torchrun's and its ranks') is passed on through TorchrunReport: torchrun's
    own reports in one line each, everything else as it came."""

    def __init__(self, condense: bool = True) -> None:
        self.stopped = False
        self.condense = condense

    def __call__(self, cmd: list[str], cwd, env, check: bool = False) -> subprocess.CompletedProcess:
        # A session of its own: a terminal's Ctrl-C reaches the launcher only, which passes it on once (torchrun
        # and the ranks would otherwise get it twice, and a second signal means "exit now, no checkpoint").
        with contextlib.ExitStack() as stack:
            stderr = StderrFile() if self.condense else None
            if stderr is not None:
                stack.callback(stderr.close)
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True,
                                    stderr=stderr.writer if stderr else None,
                                    preexec_fn=_die_with_launcher(os.getpid()))  # noqa: PLW1509 - no thread yet
            if stderr is not None:
                stderr.pass_on()
            return self._wait(cmd, proc, stderr)

    def _wait(self, cmd: list[str], proc: subprocess.Popen, stderr: StderrFile | None) -> subprocess.CompletedProcess:

        def forward(signum, frame) -> None:
            self.stopped = True
            if proc.poll() is None:
                proc.send_signal(signum)

        previous = {s: signal.signal(s, forward) for s in FORWARDED}
        try:
            while True:
                try:
                    rc = proc.wait()
                    break
                except InterruptedError:  # (PEP 475 retries the wait itself; kept for a handler that raises it)
                    continue
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        if stderr is not None:
            stderr.finish()  # torchrun waited for its ranks: what they wrote is in the file
        return subprocess.CompletedProcess(cmd, rc)


class StderrFile:
    """The child's stderr as an unlinked temporary file that a thread follows and passes on to ours through
    TorchrunReport. A file, not a pipe: if this launcher dies (SIGKILL), torchrun and the ranks stop in order
    (PR_SET_PDEATHSIG) and may still write; into a pipe without a reader that would fail (EPIPE) in the middle of
    their checkpoint, into the file it just lands. Unlinked at once, so nothing is left behind either way."""

    POLL_S = 0.05

    def __init__(self, out=None) -> None:
        self.out = out
        fd, path = tempfile.mkstemp(prefix="asyncpp-torchrun-stderr-")
        self.writer = os.fdopen(fd, "ab", buffering=0)
        self.reader = open(path, "rb")  # noqa: SIM115 - closed by close()
        os.unlink(path)
        self.report = TorchrunReport()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def close(self) -> None:
        self.finish()
        self.writer.close()
        self.reader.close()

    def pass_on(self) -> None:
        """Start following the file (after the child holds its own copy of the writer)."""
        self._thread = threading.Thread(target=self._follow, name="torchrun-stderr", daemon=True)
        self._thread.start()

    def finish(self) -> None:
        """The child has exited: pass on the rest and stop following."""
        self._done.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _follow(self) -> None:
        out = self.out or sys.stderr
        pending = b""
        while True:
            done = self._done.is_set()  # read before the last read: nothing written after it is missed
            chunk = self.reader.read(1 << 16)
            if chunk:
                *lines, pending = (pending + chunk).split(b"\n")
                out.write("".join(x for line in lines for x in self.report.feed(line.decode(errors="replace") + "\n")))
                out.flush()
            elif done:
                break
            else:
                time.sleep(self.POLL_S)
        rest = self.report.feed(pending.decode(errors="replace")) if pending else []
        out.write("".join(rest + self.report.close()))
        out.flush()


def stopped_line(meant: tuple[int, str] | None, rerun: str) -> str:
    """The launcher's last line after a checkpointed stop: the step (from pretrain.py's message) and the command."""
    found = re.search(r"step (\d+)", meant[1]) if meant is not None else None
    at = f"stopped at step {found.group(1)}, checkpointed" if found else "stopped (checkpointed at the last step boundary)"
    return f"[launch.local] {at}; rerun `{rerun}` to resume (exit {EXIT_STOPPED})"


def run_with_restarts(cmd: list[str], max_restarts: int, *, run: Callable | None = None,
                      echo: Callable[[str], None] = print, rerun: str = "the same command") -> int:
    """Run `cmd` until it succeeds, stops on purpose, fails with a config error or diverges, or has failed
    1 + `max_restarts` times. Returns the exit code pretrain.py meant (2, 3, 4, 143), else the last attempt's.
    `run` defaults to Forwarding() (stop signals passed on, no orphan); `rerun` is the command the stop line
    names."""
    run = Forwarding() if run is None else run
    with tempfile.TemporaryDirectory(prefix="asyncpp-launch-") as tmp:
        marker = Path(tmp) / "exit"
        env = {**os.environ, EXIT_FILE_ENV: str(marker)}
        rc = 0
        for attempt in range(max_restarts + 1):
            marker.unlink(missing_ok=True)
            rc = run(cmd, cwd=REPO, env=env, check=False).returncode
            if rc == 0:
                return 0
            meant = read_exit(marker)
            if meant is not None and meant[0] in (EXIT_CONFIG_ERROR, EXIT_DIVERGED, EXIT_NO_SPACE):
                echo(f"[launch.local] {meant[1]}\n[launch.local] exit {meant[0]}: not retried")
                return meant[0]
            if rc in STOPPED or (meant is not None and meant[0] == EXIT_STOPPED) or getattr(run, "stopped", False):
                echo(stopped_line(meant, rerun))
                return EXIT_STOPPED
            if attempt < max_restarts:
                echo(f"[launch.local] attempt {attempt + 1} failed (exit {rc}); restart {attempt + 1} of "
                     f"{max_restarts}: the run resumes from its newest checkpoint")
        return rc


def main(argv: list[str] | None = None) -> int:
    options, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog="python -m launch.local",
        usage="%(prog)s --nproc-per-node N [options] [-- hydra overrides]",
        description="Run pretrain.py under torchrun --standalone on this machine.",
    )
    p.add_argument("--nproc-per-node", type=int, required=True, help="ranks (processes) to start")
    p.add_argument(
        "--max-restarts", type=int, default=0,
        help="restarts of the whole job after a failure (resuming from its newest checkpoint); a config "
        "error (exit 2) is never retried",
    )
    p.add_argument("--gpus", action="store_true", help="one GPU per rank: adds train.device=cuda")
    p.add_argument(
        "--torchrun", default=None, help="torchrun executable (default: the one beside this python)"
    )
    p.add_argument("--dry-run", action="store_true",
                   help="validate the overrides at this world size (as launch.slurm does) and print the command")
    p.add_argument("--raw-torchrun-output", dest="condense", action="store_false",
                   help="pass torchrun's own stderr on unchanged (by default its reports are one line each)")
    p.add_argument("--no-validate", dest="check_config", action="store_false",
                   help="start (or with --dry-run print) the command without composing the config first")
    args = p.parse_args(options)
    try:
        if args.max_restarts < 0:
            raise ValueError(f"--max-restarts={args.max_restarts} must be >= 0")
        cmd = command(args.nproc_per_node, overrides, gpus=args.gpus, torchrun=args.torchrun)
    except ValueError as e:
        p.error(str(e))
    if args.dry_run:
        if args.check_config:
            try:
                print(validate_overrides(with_device(overrides, "cuda") if args.gpus else overrides,
                                         args.nproc_per_node), file=sys.stderr)
            except ValueError as e:
                print(f"{e}\nnothing started: fix the overrides (or pass --no-validate)", file=sys.stderr)
                return EXIT_CONFIG_ERROR
        print(f"cd {shlex.quote(str(REPO))} && {shlex.join(cmd)}")
        if args.max_restarts:
            print(f"# rerun up to {args.max_restarts} times after a failure (not after a config error, exit 2)")
        return 0
    if args.check_config:  # a config error in one line, before torchrun (whose failure report is ~30 lines)
        try:
            validate_overrides(with_device(overrides, "cuda") if args.gpus else overrides, args.nproc_per_node)
        except ValueError as e:
            print(f"[launch.local] {e}\n[launch.local] nothing started (exit {EXIT_CONFIG_ERROR})", file=sys.stderr)
            return EXIT_CONFIG_ERROR
    rerun = shlex.join([Path(sys.executable).name, "-m", "launch.local", *(sys.argv[1:] if argv is None else argv)])
    return run_with_restarts(cmd, args.max_restarts, run=Forwarding(condense=args.condense), rerun=rerun)


if __name__ == "__main__":
    sys.exit(main())
