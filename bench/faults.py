"""Fault injection around the training loop (issue 18): each fault, what the run does, and whether the next
run, with the fault gone, recovers. Every run goes through pretrain.py's real entry point, one process.

    .venv/bin/python bench/faults.py                       # all faults; table on stdout, JSON in bench/results/
    .venv/bin/python bench/faults.py --only cuda,async_crash
    .venv/bin/python bench/faults.py --repo /tmp/old-checkout   # the same faults against another checkout
    .venv/bin/python bench/faults.py --only raise_forward_2ranks,raise_checkpoint_4ranks   # issue 44's fail-fast table

Faults that need more than an override are injected in-process (`--inject NAME -- overrides` runs
pretrain.py's main under NAME): a full disk at start (shutil.disk_usage reports 1 MiB free), a full disk
while a checkpoint is written (DCP's file writer raises ENOSPC), and a kill -9 of the process right after
step `--kill-at` (SIGKILL to itself: no cleanup, no atexit).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAULT_POINTS = ("forward", "reduction", "checkpoint")
"""Where tests/dist/raise_once.py raises (raise_* scenarios)."""
TINY = ["model=tiny_dense", "logging=disabled", "logging.progress=false", "train.eval_every=0",
        "train.micro_batch_size=2", "train.num_microbatches=2", "train.seq_len=32",
        "optimizer.schedule.warmup_steps=0"]


# ---- injection (runs inside the pretrain process) -------------------------------------------------
def _inject(name: str, kill_at: int) -> None:
    if name == "no_space_at_start":
        real = shutil.disk_usage
        shutil.disk_usage = lambda path: real(path)._replace(free=1 << 20)
    elif name == "no_space_while_saving":
        import torch.distributed.checkpoint.filesystem as fs

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        fs._write_item = full
    elif name == "kill_after_step":
        from asyncpp.reference.simulator import DelayedUpdateSimulator

        step = DelayedUpdateSimulator.step

        def dying(self, t, batches):
            out = step(self, t, batches)
            if t == kill_at:
                time.sleep(1.0)  # a background save of an earlier step has long finished by now
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        DelayedUpdateSimulator.step = dying
    else:
        raise SystemExit(f"--inject {name}: unknown fault")


def run_injected(name: str, kill_at: int, overrides: list[str]) -> None:
    sys.path.insert(0, os.getcwd())  # the checkout under test (cwd), not the installed one
    _inject(name, kill_at)
    import runpy

    sys.argv = ["pretrain.py", *overrides]
    runpy.run_path("pretrain.py", run_name="__main__")


# ---- scenarios -----------------------------------------------------------------------------------
@dataclass
class Attempt:
    what: str
    exit_code: int
    said: str
    """The config error, else the last error line, else the last line."""
    resumed: str
    """The run's 'resumed ... at step N' line, if it resumed."""
    seconds: float
    stop_steps: list[int] = field(default_factory=list)
    """Per rank that got the signal: the step it was in when it saw it (its 'signal N in step t' line)."""
    ended: float = 0.0
    """time.time() when the job had exited."""


@dataclass
class Outcome:
    fault: str
    attempts: list[Attempt] = field(default_factory=list)
    checks: dict[str, bool] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(self.checks.values())


class Bench:
    def __init__(self, repo: Path, work: Path, kill_at: int, fault_timeout: float = 300.0):
        self.repo, self.work, self.kill_at, self.fault_timeout = repo, work, kill_at, fault_timeout

    def pretrain(self, out: Outcome, what: str, run_dir: Path, *overrides: str, inject: str | None = None) -> Attempt:
        args = [f"hydra.run.dir={run_dir}", *TINY, *overrides]
        if inject is None:
            cmd = [sys.executable, "pretrain.py", *args]
        else:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--inject", inject, "--kill-at", str(self.kill_at),
                   "--", *args]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=self.repo, capture_output=True, text=True, timeout=900, check=False,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        text = proc.stdout + proc.stderr
        resumed = next((line.strip() for line in text.splitlines() if "resumed at step" in line), "")
        attempt = Attempt(what, proc.returncode, _key_line(text), resumed, time.perf_counter() - t0)
        out.attempts.append(attempt)
        return attempt

    def scenarios(self) -> dict:
        return {
            "no_space_at_start": self.no_space_at_start, "no_space_while_saving": self.no_space_while_saving,
            "read_only_checkpoint_dir": self.read_only, "garbage_bin": self.garbage_bin, "cuda": self.cuda,
            "other_model": self.other("model=tiny_hybrid"), "other_optimizer": self.other("optimizer=adamw"),
            "missing_resume_path": self.missing_resume, "steps_at_checkpoint": self.steps_at_checkpoint,
            "async_crash": self.async_crash, "rerun_without_checkpoint": self.rerun_without_checkpoint,
            "huge_lr": self.huge_lr, "sigterm_pipeline": self.sigterm_pipeline,
            "kill9_torchrun_restarts": self.kill9_torchrun_restarts,
            **{f"raise_{at}_{n}ranks": self.raise_in(at, n) for n in (2, 4) for at in FAULT_POINTS},
        }

    def no_space_at_start(self, out: Outcome, d: Path) -> None:
        a = self.pretrain(out, "1 MiB free", d, "train.steps=4", inject="no_space_at_start")
        out.checks["refused before training (exit 2)"] = a.exit_code == 2 and not (d / "metrics.jsonl").exists()
        b = self.pretrain(out, "space again", d, "train.steps=4")
        out.checks["next run recovers"] = b.exit_code == 0 and _steps(d) == list(range(4))

    def no_space_while_saving(self, out: Outcome, d: Path) -> None:
        self.pretrain(out, "first 4 steps", d, "train.steps=4")
        a = self.pretrain(out, "ENOSPC in the save of step 8", d, "train.steps=8", inject="no_space_while_saving")
        ck = d / "checkpoints"
        out.checks["fails clearly, partial save removed"] = (
            a.exit_code != 0 and "No space left" in a.said and not list(ck.glob(".tmp-step_*")))
        out.checks["last good checkpoint kept"] = _checkpoints(ck) == ["step_00000004"]
        b = self.pretrain(out, "space again", d, "train.steps=8")
        out.checks["next run resumes and finishes"] = b.exit_code == 0 and _checkpoints(ck)[-1] == "step_00000008"
        out.checks["metrics hold each step once"] = _steps(d) == list(range(8))

    def read_only(self, out: Outcome, d: Path) -> None:
        ro = Path("/sys/asyncpp-checkpoints")  # read-only even for root
        a = self.pretrain(out, f"checkpoint.dir={ro}", d, "train.steps=4", f"checkpoint.dir={ro}")
        out.checks["refused before training (exit 2)"] = a.exit_code == 2 and not (d / "metrics.jsonl").exists()
        b = self.pretrain(out, "default checkpoint.dir", d, "train.steps=4")
        out.checks["next run recovers"] = b.exit_code == 0

    def garbage_bin(self, out: Outcome, d: Path) -> None:
        sys.path.insert(0, str(self.repo))
        from data.default import default_prefix

        good = default_prefix()
        d.mkdir(parents=True, exist_ok=True)
        bad = d / "garbage"
        for suffix in (".idx", ".json"):
            shutil.copy(f"{good}{suffix}", f"{bad}{suffix}")
        size = Path(f"{good}.bin").stat().st_size
        Path(f"{bad}.bin").write_bytes(os.urandom(size))  # same size: the header checks cannot tell
        data = ["data.name=indexed", f"data.cache_dir={d / 'cache'}"]
        a = self.pretrain(out, "random .bin", d / "run", "train.steps=3", *data, f"data.blend=[{bad}]")
        out.checks["refused before training, naming the file (exit 2)"] = (
            a.exit_code == 2 and "garbage.bin" in a.said and not (d / "run" / "metrics.jsonl").exists())
        b = self.pretrain(out, "the real .bin", d / "run", "train.steps=3", *data, f"data.blend=[{good}]")
        out.checks["next run recovers"] = b.exit_code == 0

    def cuda(self, out: Outcome, d: Path) -> None:
        a = self.pretrain(out, "train.device=cuda", d, "train.steps=3", "train.device=cuda")
        out.checks["refused before training (exit 2)"] = a.exit_code == 2 and "train.device=cuda" in a.said
        b = self.pretrain(out, "train.device=cpu", d, "train.steps=3")
        out.checks["next run recovers"] = b.exit_code == 0

    def other(self, change: str):
        def scenario(out: Outcome, d: Path) -> None:
            self.pretrain(out, "4 steps", d, "train.steps=4")
            a = self.pretrain(out, f"4 more with {change}", d, "train.steps=8", change)
            out.checks["refused before training (exit 2)"] = a.exit_code == 2 and "Differences" in a.said
            out.checks["no step was trained by it"] = _steps(d) == list(range(4))
            b = self.pretrain(out, "4 more, the checkpoint's config", d, "train.steps=8")
            out.checks["next run resumes and finishes"] = (
                b.exit_code == 0 and "at step 4" in b.resumed and _steps(d) == list(range(8)))
        return scenario

    def missing_resume(self, out: Outcome, d: Path) -> None:
        a = self.pretrain(out, "resume=<missing>", d, "train.steps=3", f"checkpoint.resume={d}/none/step_00000005")
        out.checks["refused before training (exit 2)"] = a.exit_code == 2 and "does not exist" in a.said
        b = self.pretrain(out, "resume=auto", d, "train.steps=3")
        out.checks["next run recovers"] = b.exit_code == 0

    def steps_at_checkpoint(self, out: Outcome, d: Path) -> None:
        self.pretrain(out, "complete run", d, "train.steps=3")
        a = self.pretrain(out, "the same command again", d, "train.steps=3")
        out.checks["refused (exit 2): already complete"] = a.exit_code == 2 and "already complete" in a.said
        b = self.pretrain(out, "train.steps=5", d, "train.steps=5")
        out.checks["raising train.steps trains on"] = b.exit_code == 0 and _steps(d) == list(range(5))

    def async_crash(self, out: Outcome, d: Path) -> None:
        args = ["train.steps=16", "checkpoint.every=5", "checkpoint.async_save=true"]
        self.pretrain(out, f"kill -9 after step {self.kill_at}", d, *args, inject="kill_after_step")
        ck = d / "checkpoints"
        newest = (self.kill_at + 1) // 5 * 5
        out.checks[f"step {newest} committed before the kill"] = (_checkpoints(ck) or [""])[-1] == f"step_{newest:08d}"
        b = self.pretrain(out, "rerun", d, *args)
        out.checks[f"rerun resumes at step {newest}"] = f"at step {newest}" in b.resumed
        out.checks["metrics hold each step once"] = b.exit_code == 0 and _steps(d) == list(range(16))

    def rerun_without_checkpoint(self, out: Outcome, d: Path) -> None:
        for what in ("first run", "the same command again"):
            self.pretrain(out, what, d, "train.steps=4", "checkpoint.enabled=false")
        out.checks["metrics hold each step once"] = _steps(d) == list(range(4))


    def huge_lr(self, out: Outcome, d: Path) -> None:
        """optimizer.lr=1e30: the weights go non-finite at once; no such state may reach a checkpoint."""
        a = self.pretrain(out, "optimizer.lr=1e30", d, "train.steps=6", "checkpoint.every=2",
                          "checkpoint.keep_last=2", "optimizer.lr=1e30")
        ck = d / "checkpoints"
        out.checks["exits non-zero with a clear message"] = a.exit_code != 0 and any(
            clear in a.said for clear in ("NaN/Inf", "training diverged"))
        out.checks["no checkpoint holds a non-finite tensor"] = all(_finite_checkpoint(ck / c) for c in _checkpoints(ck))
        out.checks["no partial save left"] = not list(ck.glob(".tmp-step_*"))


    # ---- a real pipeline under torchrun (P=2), default checkpoint settings ---------------------------
    def torchrun(self, out: Outcome, what: str, run_dir: Path, *overrides: str, script: str = "pretrain.py",
                 restarts: int = 0, env: dict | None = None, sigterm_after: int | None = None,
                 nproc: int = 2) -> Attempt:
        """`sigterm_after` k: SIGTERM to torchrun (which forwards it to every worker) once k steps are logged."""
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        cmd = [torchrun, "--standalone", f"--nproc_per_node={nproc}", f"--max-restarts={restarts}", script,
               f"hydra.run.dir={run_dir}", *TINY, f"parallel.pp={nproc}", "schedule=2bw", *overrides]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=self.repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(self.repo), **(env or {})})
        signalled = None
        if sigterm_after is not None:
            while proc.poll() is None and len(_steps(run_dir)) < sigterm_after:
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            signalled = time.perf_counter()
        text, _ = proc.communicate(timeout=900)
        ended = time.time()
        took = f"; {time.perf_counter() - signalled:.1f} s from SIGTERM to torchrun's exit" if signalled else ""
        stops = re.findall(r"stop requested \(.*?took [\d.]+ s from the signal|stop requested \(another[^\n]*", text)
        said = (stops[0] + f" [x{len(stops)} ranks]" if stops else _key_line(text)) + took
        resumed = next((line.strip() for line in text.splitlines() if "resumed at step" in line), "")
        # "signal 15 in step t": the step whose backward was running on that rank when it saw the request.
        seen = [int(x) for x in re.findall(r"signal \d+ in step (\d+)", text)]
        attempt = Attempt(what, proc.returncode, said, resumed, time.perf_counter() - t0, seen, ended)
        out.attempts.append(attempt)
        return attempt

    def sigterm_pipeline(self, out: Outcome, d: Path) -> None:
        """SIGTERM at a random step of a 2BW pipeline with the default checkpoint settings (no periodic save
        within this short run): a checkpoint at the agreed step, exit 143, the rerun ends bit-identical."""
        import random

        steps = 40
        k = random.Random(os.getpid()).randint(3, 25)
        self.torchrun(out, "uninterrupted", d / "full", f"train.steps={steps}")
        exit_file = d / "exit"  # what launch.local reads: the code the ranks meant (run_identity.record_exit)
        a = self.torchrun(out, f"SIGTERM after {k} logged steps", d / "part", f"train.steps={steps}",
                          sigterm_after=k, env={"ASYNCPP_EXIT_FILE": str(exit_file)})
        saved = _checkpoints(d / "part" / "checkpoints")
        stopped = int(saved[-1].split("_")[1]) if saved else -1
        # The ranks exit 143; torchrun's agent re-raises the SIGTERM it got after shutting them down, so torchrun
        # itself exits 1 (torch.distributed.elastic). The ranks leave 143 in $ASYNCPP_EXIT_FILE, and launch.local
        # returns that: the check is what the launcher exits with, torchrun's own code is shown beside it.
        meant = exit_file.read_text().split(" ", 1)[0] if exit_file.exists() else "nothing"
        out.checks[f"the launcher gets exit 143 (torchrun itself: {a.exit_code})"] = meant == "143"
        out.checks["every rank said it stopped, with the time"] = "[x2 ranks]" in a.said and "took" in a.said
        seen = a.stop_steps
        out.checks[f"checkpoint at the step of the signal or the next (in steps {sorted(set(seen))}, saved "
                   f"at {stopped})"] = bool(seen) and all(0 < stopped - t <= 2 for t in seen)
        b = self.torchrun(out, "the same command again", d / "part", f"train.steps={steps}")
        out.checks["rerun resumes at that step"] = b.exit_code == 0 and f"at step {stopped}" in b.resumed
        out.checks["metrics hold each step once"] = _steps(d / "part") == list(range(steps))
        out.checks["final weights bit-identical to the uninterrupted run"] = _same_checkpoint(
            d / "full" / "checkpoints" / f"step_{steps:08d}", d / "part" / "checkpoints" / f"step_{steps:08d}")

    def raise_in(self, at: str, nproc: int):
        """Rank 1 raises a RuntimeError at `at` (tests/dist/raise_once.py: a forward, the gradient-norm reduction,
        a checkpoint write) in a pp=`nproc` 2BW run with train.timeout_s=--fault-timeout: the seconds from the
        exception to torchrun's exit, what the exit file says, and the rerun (the fault gone) resuming from the
        last complete checkpoint and ending with the uninterrupted run's losses and weights."""
        def scenario(out: Outcome, d: Path) -> None:
            steps, every = 12, 3
            full = self.torchrun(out, "uninterrupted", d / "full", *self.raise_args(), nproc=nproc)
            a, step = self.raise_once(out, d, at, nproc)
            said = (d / "exit").read_text() if (d / "exit").exists() else ""
            out.checks["the job failed (exit != 0)"] = a.exit_code != 0 and (d / "fault_time").exists()
            out.checks["exit file names rank 1, the step and the action"] = (
                "rank 1" in said and f"step {step}" in said and "action" in said and "injected fault" in said)
            newest = (step - 1) // every * every
            out.checks[f"last complete checkpoint is step {newest}"] = (
                _checkpoints(d / "crash" / "checkpoints")[-1:] == [f"step_{newest:08d}"])
            b = self.torchrun(out, "the same command again", d / "crash", *self.raise_args(), nproc=nproc)
            out.checks[f"rerun resumes at step {newest}"] = b.exit_code == 0 and f"at step {newest}" in b.resumed
            out.checks["losses equal the uninterrupted run's"] = full.exit_code == 0 and (
                _losses(d / "full") == _losses(d / "crash") and len(_losses(d / "full")) == steps)
            out.checks["final weights bit-identical"] = _same_checkpoint(
                d / "full" / "checkpoints" / f"step_{steps:08d}", d / "crash" / "checkpoints" / f"step_{steps:08d}")
        return scenario

    def raise_args(self) -> list[str]:
        """The raise_* runs: 12 steps, a checkpoint every 3, train.timeout_s=--fault-timeout."""
        return ["train.steps=12", "checkpoint.every=3", "train.num_microbatches=4",
                f"train.timeout_s={self.fault_timeout:g}"]

    def raise_once(self, out: Outcome, d: Path, at: str, nproc: int) -> tuple[Attempt, int]:
        """The faulty run of raise_in in d/crash (exit file d/exit): (its attempt, whose `seconds` run from the
        exception to torchrun's exit; the step of the fault)."""
        step, mark = (6 if at == "checkpoint" else 5), d / "fault_time"
        a = self.torchrun(out, f"rank 1 raises in {at} at step {step}", d / "crash", *self.raise_args(), nproc=nproc,
                          script=str(REPO / "tests" / "dist" / "raise_once.py"),
                          env={"FAULT_AT": at, "FAULT_RANK": "1", "FAULT_STEP": str(step),
                               "FAULT_MARK": str(mark), "ASYNCPP_EXIT_FILE": str(d / "exit")})
        if mark.exists():
            a.seconds = a.ended - float(mark.read_text())  # from the exception, not from the start
            a.what += f": {a.seconds:.1f} s from the exception to the job's exit"
        return a, step

    def kill9_torchrun_restarts(self, out: Outcome, d: Path) -> None:
        """Rank 1 dies mid-run (os._exit, like kill -9: tests/dist/crash_once.py) under torchrun --max-restarts=2,
        default settings: torchrun restarts the
        job by itself in the same run directory, and it ends with the uninterrupted run's weights."""
        steps = 30
        self.torchrun(out, "uninterrupted", d / "full", f"train.steps={steps}")
        a = self.torchrun(out, f"rank 1 dies at step {self.kill_at}, no cleanup (first attempt)", d / "crash",
                          f"train.steps={steps}", script="tests/dist/crash_once.py", restarts=2,
                          env={"CRASH_RANK": "1", "CRASH_STEP": str(self.kill_at)})
        out.checks["the job comes back by itself and exits 0"] = a.exit_code == 0
        out.checks["metrics hold each step once"] = _steps(d / "crash") == list(range(steps))
        out.checks["final weights equal the uninterrupted run's"] = _same_checkpoint(
            d / "full" / "checkpoints" / f"step_{steps:08d}", d / "crash" / "checkpoints" / f"step_{steps:08d}")


def _load_checkpoint(path: Path) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(path), f"{tmp}/all.pt")
        return torch.load(f"{tmp}/all.pt", weights_only=False)


def _same_checkpoint(a: Path, b: Path) -> bool:
    """Every tensor of two checkpoints equal, bit for bit (weights, both versions, optimizer state)."""
    import torch

    if not (a.is_dir() and b.is_dir()):
        return False
    x, y = _load_checkpoint(a), _load_checkpoint(b)
    tensors = [k for k, v in x.items() if torch.is_tensor(v)]
    return bool(tensors) and all(torch.is_tensor(y.get(k)) and torch.equal(x[k], y[k]) for k in tensors)


def _finite_checkpoint(path: Path) -> bool:
    import torch

    state = _load_checkpoint(path)
    return all(torch.isfinite(t).all() for t in state.values() if torch.is_tensor(t) and t.is_floating_point())


def _key_line(text: str) -> str:
    """What a user would read first: the config error, or the last error line of a traceback."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if line.startswith("config error:"):
            return line
    errors = [line for line in lines if re.match(r"(?:[a-z_]\w*\.)*[A-Z]\w*: ", line)]  # `pkg.mod.SomeError: ...`
    return (errors or lines or [""])[-1][:400]


def _steps(d: Path) -> list[int]:
    path = d / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def _losses(d: Path) -> list[float]:
    """The logged loss of every step, in step order (a rerun rewinds the metrics to its checkpoint's step)."""
    path = d / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [r["loss"] for r in sorted(records, key=lambda r: r["step"])]


def _checkpoints(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("step_*") if (p / "manifest.json").is_file()) if root.is_dir() else []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Path, default=REPO, help="the checkout whose pretrain.py runs")
    p.add_argument("--only", default="", help="comma-separated fault names")
    p.add_argument("--kill-at", type=int, default=11, help="kill_after_step: SIGKILL after this step")
    p.add_argument("--fault-timeout", type=float, default=300.0,
                   help="raise_*: train.timeout_s of the runs (the 'before' figures used 60 on the old code)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "faults.json")
    p.add_argument("--inject", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    if args.inject:
        run_injected(args.inject, args.kill_at, [a for a in rest if a != "--"])
        return 0
    work = Path(tempfile.mkdtemp(prefix="asyncpp-faults-"))
    bench = Bench(args.repo.resolve(), work, args.kill_at, args.fault_timeout)
    chosen = [n for n in args.only.split(",") if n] or list(bench.scenarios())
    results = []
    for name in chosen:
        out = Outcome(name)
        bench.scenarios()[name](out, work / name)
        results.append(out)
        print(_row(out), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps([{**asdict(r), "ok": r.ok} for r in results], indent=2))
    print(f"{sum(r.ok for r in results)}/{len(results)} faults handled; details in {args.out}; runs in {work}")
    return 0 if all(r.ok for r in results) else 1


def _row(out: Outcome) -> str:
    runs = " | ".join(f"{a.what}: exit {a.exit_code} ({a.said[:160]})" for a in out.attempts)
    checks = ", ".join(f"{'ok' if v else 'FAILED'}: {k}" for k, v in out.checks.items())
    return f"{out.fault}: {checks}\n    {runs}"


if __name__ == "__main__":
    sys.exit(main())
