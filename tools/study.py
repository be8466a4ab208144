"""The reproduction study as one command: expand a plan into runs, skip the finished ones, run the rest.

    python -m tools.study run --plan full --out outputs/study --jobs 2                  # this machine
    python -m tools.study run --plan full --out outputs/study --launcher slurm --partition cpu
    python -m tools.study run --plan pilot --out outputs/pilot --steps 20               # shorter runs
    python -m tools.study plan --plan full                                           # list the runs only
    python -m tools.report outputs/study --out docs/reproduction.md                     # then the report

A plan (configs/experiment/study_plans/<name>.yaml) is cells of rows x columns x seeds; each run is
`pretrain.py +experiment=<experiment> <plan overrides> <row> <column> seed=<s>`. Every run's config is
composed and validated before anything starts, and two cells asking for the same resolved config share
one run. `<out>/study.json` records the runs, the cells each belongs to and every command that ran the
study; tools.report reads it. Rerunning a command resumes: finished runs are skipped, interrupted ones
continue from their last checkpoint, and a run directory whose config differs from the plan's stops the
study before anything runs (a different plan or --steps needs another --out).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
PLANS_DIR = REPO / "configs" / "experiment" / "study_plans"
MANIFEST = "study.json"
STATUS = "study_status.json"
PREEMPTED = 143  # pretrain.py's exit code after a SIGTERM checkpoint: the run is resumable, not failed
_TEMPLATE = re.compile(r"\{([^{}]*)\}")
_STEPS = re.compile(r"steps(?:\*([0-9]*\.?[0-9]+))?")


class PlanError(ValueError):
    """A plan file or a study directory is inconsistent; the message names what and the fix."""


@dataclass(frozen=True)
class Cell:
    name: str
    title: str
    rows: list[dict[str, str]]
    """Each row: override key -> value (e.g. {"optimizer": "muon", "optimizer.momentum": "0.9"})."""
    columns: dict[str, list[str]]
    """Column name -> hydra overrides (templated)."""
    x: str | None = None
    """The override key whose value is this cell's x axis in the report (None: no x axis)."""


@dataclass(frozen=True)
class Plan:
    name: str
    label: str
    description: str
    experiment: str
    steps: int
    seeds: list[int]
    overrides: list[str]
    cells: list[Cell]


@dataclass
class Run:
    name: str
    overrides: list[str]
    """What follows `pretrain.py +experiment=<experiment>`: plan, row, column overrides and the seed."""
    config: dict = field(repr=False)
    """The resolved RunConfig as a dict, out_dir removed: the run's identity."""
    cells: list[dict[str, Any]] = field(default_factory=list)
    """{"cell", "row", "column", "seed", "x"} for every cell this run serves."""


# ---- plans ---------------------------------------------------------------------------------------------


def plan_path(plan: str) -> Path:
    """A plan name (configs/experiment/study_plans/<name>.yaml) or a path to a plan file."""
    path = Path(plan)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise PlanError(f"--plan {plan}: no such file")
        return path
    path = PLANS_DIR / f"{plan}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in PLANS_DIR.glob("*.yaml"))
        raise PlanError(f"--plan {plan} is not a plan; choose one of {known} or give a .yaml path")
    return path


def load_plan(plan: str, steps: int | None = None) -> Plan:
    path = plan_path(plan)
    raw = yaml.safe_load(path.read_text())
    where = f"plan {path}"
    missing = [k for k in ("experiment", "steps", "seeds", "cells") if k not in raw]
    if missing:
        raise PlanError(f"{where} lacks {missing}; see configs/experiment/study_plans/full.yaml for the format")
    steps = int(raw["steps"]) if steps is None else steps
    if steps < 1:
        raise PlanError(f"--steps {steps} must be >= 1")
    cells = [_load_cell(name, body, where) for name, body in raw["cells"].items()]
    return Plan(name=path.stem, label=str(raw.get("label", path.stem)), description=str(raw.get("description", "")),
                experiment=str(raw["experiment"]), steps=steps, seeds=[int(s) for s in raw["seeds"]],
                overrides=[str(o) for o in raw.get("overrides", [])], cells=cells)


def _load_cell(name: str, body: dict, where: str) -> Cell:
    rows = body.get("rows")
    if not isinstance(rows, dict) or not rows or not all(isinstance(v, list) and v for v in rows.values()):
        raise PlanError(f"{where}: cells.{name}.rows must map override keys to non-empty lists, "
                        "e.g. rows: {optimizer: [muon, adamw]}")
    columns = body.get("columns")
    if not isinstance(columns, dict) or not columns:
        raise PlanError(f"{where}: cells.{name}.columns must map column names to override lists, "
                        "e.g. columns: {sync: [schedule=sync]}")
    keys = list(rows)
    product = [[]]
    for key in keys:  # the rows are the product of the listed values, in the order written
        product = [p + [str(v)] for p in product for v in rows[key]]
    return Cell(name=name, title=str(body.get("title", name)), rows=[dict(zip(keys, p)) for p in product],
                columns={str(c): [str(o) for o in ov] for c, ov in columns.items()}, x=body.get("x"))


def fill(text: str, steps: int) -> str:
    """Replace `{steps}` and `{steps*F}` (round(F * steps), at least 1) in an override."""
    def one(match: re.Match) -> str:
        m = _STEPS.fullmatch(match.group(1).replace(" ", ""))
        if m is None:
            raise PlanError(f"override {text!r}: {{{match.group(1)}}} is not a template; use {{steps}} or {{steps*F}}")
        return str(steps if m.group(1) is None else max(1, round(float(m.group(1)) * steps)))
    return _TEMPLATE.sub(one, text)


def row_slug(row: dict[str, str]) -> str:
    """{"optimizer": "muon", "optimizer.momentum": "0.9"} -> "muon-momentum0.9" (a directory name part)."""
    return "-".join(v if k == "optimizer" else f"{k.rsplit('.', 1)[-1]}{v}" for k, v in row.items())


def override_value(overrides: list[str], key: str) -> str | None:
    """The value the last `key=...` override sets, or None."""
    values = [o.split("=", 1)[1] for o in overrides if o.lstrip("+~").split("=", 1)[0] == key]
    return values[-1] if values else None


# ---- expansion -----------------------------------------------------------------------------------------


def expand(plan: Plan, extra: list[str] | None = None) -> list[Run]:
    """Every run of the plan, configs composed and validated, runs with the same resolved config merged
    (the first cell that asks for one names it)."""
    base = [fill(o, plan.steps) for o in plan.overrides] + list(extra or [])
    runs: dict[str, Run] = {}
    by_config: dict[str, str] = {}
    refused: list[str] = []  # every bad point, not only the first: one fix-and-rerun, not one per point
    with _composer(plan.experiment) as resolve:
        for cell in plan.cells:
            for row in cell.rows:
                for column, col_overrides in cell.columns.items():
                    overrides = [f"{k}={v}" for k, v in row.items()] + [fill(o, plan.steps) for o in col_overrides]
                    try:
                        config = resolve(base + overrides)
                    except PlanError as e:
                        refused.append(f"cells.{cell.name} row {row_slug(row)} column {column}: {e}")
                        continue
                    x = override_value(overrides, cell.x) if cell.x else None
                    for seed in plan.seeds:
                        run = _claim(runs, by_config, f"{row_slug(row)}__{column}__seed{seed}",
                                     base + overrides + [f"seed={seed}"], {**config, "seed": seed})
                        run.cells.append({"cell": cell.name, "row": row_slug(row), "column": column, "seed": seed,
                                          "x": None if x is None else float(x)})
    if refused:
        raise PlanError(f"{len(refused)} point(s) of the plan are refused, so nothing ran: " + "\n  ".join(["", *refused]))
    # Seed-major order (a stable sort keeps the cells' order within a seed): a study stopped part-way
    # has every cell at its first seed before any cell gets a second one.
    order = {seed: i for i, seed in enumerate(plan.seeds)}
    return sorted(runs.values(), key=lambda run: order[run.config["seed"]])


def _claim(runs: dict[str, Run], by_config: dict[str, str], name: str, overrides: list[str], config: dict) -> Run:
    """The run with this config (an earlier cell's), or a new one called `name`."""
    key = json.dumps(config, sort_keys=True)
    if key in by_config:
        return runs[by_config[key]]
    if name in runs:
        raise PlanError(f"run name {name} is made by two different configs ({runs[name].overrides} and "
                        f"{overrides}); give the columns of one of those cells different names")
    runs[name] = Run(name, overrides, config)
    by_config[key] = name
    return runs[name]


@contextlib.contextmanager
def _composer(experiment: str) -> Iterator[Callable[[list[str]], dict]]:
    """A function overrides -> resolved config dict (out_dir removed), composed and validated by pretrain.py's
    own functions inside one hydra context (entering hydra once per run would cost ~0.1 s each)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from asyncpp import job
    from asyncpp.config import ConfigError

    def resolve(overrides: list[str]) -> dict:
        full = [f"+experiment={experiment}", *overrides, "out_dir=outputs/study-plan"]
        try:
            container = OmegaConf.to_container(compose(config_name="pretrain", overrides=full), resolve=True)
            cfg, _ = job.resolve(container)
        except ConfigError as e:
            raise PlanError(f"overrides {overrides}: {e}") from None
        except Exception as e:  # noqa: BLE001 -- hydra's own errors (unknown group, bad syntax) name the override
            raise PlanError(f"overrides {overrides}: {type(e).__name__}: {e}") from None
        d = json.loads(json.dumps(cfg.to_dict()))  # as config.json holds it (tuples -> lists)
        d.pop("out_dir")
        return d

    with initialize_config_dir(config_dir=str(job.CONFIG_DIR), version_base="1.3"):
        yield resolve


# ---- the study directory -------------------------------------------------------------------------------


def run_status(out: Path, name: str) -> str:
    """done | failed | interrupted | pending, from what the run directory holds."""
    d = out / name
    summary = _read_json(d / "summary.json")
    if summary and "final_val_loss" in summary and summary.get("stopped_at") is None:
        return "done"
    status = _read_json(d / STATUS)
    if status and status.get("returncode") not in (0, PREEMPTED, None):
        return "failed"  # deterministic runs fail again: retried only with --retry-failed
    return "interrupted" if (d / "metrics.jsonl").exists() else "pending"


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def check_existing(out: Path, runs: list[Run]) -> None:
    """Refuse to resume into run directories that were made with a different config."""
    for run in runs:
        saved = _read_json(out / run.name / "config.json")
        if saved is None:
            continue
        saved.pop("out_dir", None)
        diff = sorted(config_diff(saved, run.config))[:5]
        if diff:
            raise PlanError(f"{out / run.name} holds a run of another config (differs in {diff}); this plan/--steps/"
                            f"--set does not match the study in {out}: use another --out, or the original options")


def config_diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ. A key only one side has is a config field added or removed by a code
    change between the two (its default applies), not a different run, so it is not a difference."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in a.keys() & b.keys() for d in config_diff(a[k], b[k], f"{prefix}{k}.")]
    return [] if a == b else [prefix.rstrip(".")]


def write_manifest(out: Path, plan: Plan, runs: list[Run], extra: list[str], argv: list[str]) -> dict:
    """<out>/study.json: the plan, its runs (overrides, config, cells) and every command run on it."""
    old = _read_json(out / MANIFEST) or {}
    invocation = {"command": shlex.join(["python", "-m", "tools.study", *argv]),
                  "time": datetime.datetime.now().isoformat(timespec="seconds")}
    manifest = {
        "plan": plan.name, "label": plan.label, "description": plan.description, "experiment": plan.experiment,
        "steps": plan.steps, "seeds": plan.seeds, "extra_overrides": extra,
        "cells": [{"name": c.name, "title": c.title, "x": c.x, "rows": [row_slug(r) for r in c.rows],
                   "columns": list(c.columns)} for c in plan.cells],
        "runs": [dataclasses.asdict(r) for r in runs],
        "invocations": [*old.get("invocations", []), invocation],
    }
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / MANIFEST)  # a reader never sees half a manifest
    return manifest


def read_manifest(out: Path) -> dict:
    manifest = _read_json(Path(out) / MANIFEST)
    if manifest is None:
        raise PlanError(f"{out} has no {MANIFEST}; make it with `python -m tools.study run --plan ... --out {out}`")
    return manifest


# ---- running -------------------------------------------------------------------------------------------


def command(experiment: str, overrides: list[str], run_dir: Path) -> list[str]:
    """The pretrain.py command line of one run (run from the repository root)."""
    if not re.fullmatch(r"[\w./-]+", str(run_dir)):
        raise PlanError(f"--out {run_dir.parent}: use a path of letters, digits and ._-/ only (it becomes a hydra "
                        "override, hydra.run.dir=...)")
    return [sys.executable, str(REPO / "pretrain.py"), f"+experiment={experiment}", *overrides,
            f"hydra.run.dir={run_dir}"]


def execute(experiment: str, run: dict, out: Path, threads: int) -> int:
    """Run one planned run as a pretrain.py process; log to <run>/train.log, the outcome to study_status.json."""
    run_dir = out / run["name"]
    cmd = command(experiment, run["overrides"], run_dir.resolve())
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    started = time.time()
    with open(run_dir / "train.log", "a") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT) as proc:
            _CHILDREN.add(proc)
            rc = proc.wait()
            _CHILDREN.discard(proc)
    _write_status(run_dir, rc, time.time() - started, shlex.join(cmd))
    return rc


_CHILDREN: set[subprocess.Popen] = set()


def _forward_sigterm() -> Callable | int | None:
    """SIGTERM (slurm's time limit or preemption, or `kill`) goes on to the running pretrain.py processes,
    which checkpoint and exit 143; their runs resume on the next study command."""
    def forward(signum: int, frame: object) -> None:
        for proc in list(_CHILDREN):
            proc.send_signal(signum)

    return signal.signal(signal.SIGTERM, forward)


def execute_inprocess(experiment: str, run: dict, out: Path, threads: int) -> int:
    """The same run inside this process (tests, smoke plans): no interpreter start-up, no isolation."""
    import traceback

    from asyncpp import job

    run_dir = out / run["name"]
    run_dir.mkdir(parents=True, exist_ok=True)
    started, rc = time.time(), 0
    try:
        job.run(*job.resolve({**run["config"], "out_dir": str(run_dir)}))
    except Exception:  # noqa: BLE001 -- a failed run is recorded and reported, like a failed process
        (run_dir / "train.log").write_text(traceback.format_exc())
        rc = 1
    _write_status(run_dir, rc, time.time() - started, "in-process: " + " ".join(run["overrides"]))
    return rc


def _write_status(run_dir: Path, rc: int, seconds: float, cmd: str) -> None:
    (run_dir / STATUS).write_text(json.dumps({"returncode": rc, "seconds": round(seconds, 1), "command": cmd,
                                              "finished": datetime.datetime.now().isoformat(timespec="seconds")}))


Executor = Callable[[str, dict, Path, int], int]


def _hms(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{minutes // 60}h{minutes % 60:02d}m"


def run_local(manifest: dict, out: Path, names: list[str], jobs: int, executor: Executor = execute) -> dict[str, int]:
    """Run `names` `jobs` at a time; each gets cpu_count // jobs threads. Returns name -> exit code."""
    threads = max(1, (os.cpu_count() or 1) // jobs)
    runs = {r["name"]: r for r in manifest["runs"]}
    codes: dict[str, int] = {}
    begun = time.time()

    def one(name: str) -> None:
        started = time.time()
        codes[name] = executor(manifest["experiment"], runs[name], out, threads)
        done, now = len(codes), time.time()
        left = (now - begun) / done * (len(names) - done)  # wall time per finished run so far, jobs included
        print(f"[study] {done}/{len(names)} {name}: exit {codes[name]} after {now - started:.0f} s; "
              f"elapsed {_hms(now - begun)}, about {_hms(left)} left", flush=True)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(one, names))
    return codes


# ---- slurm: one array task per pending run ----------------------------------------------------------------

_SBATCH = """#!/bin/bash
# asyncpp study {out}: {n} runs, one array task each. Rendered by `python -m tools.study run --launcher slurm`.
# Resubmitting the study command submits only what is still pending; a task that is preempted or hits its
# time limit checkpoints (SIGTERM), requeues itself and resumes.
#SBATCH --job-name=asyncpp-study
#SBATCH --array=0-{last}%{max_parallel}
#SBATCH --ntasks=1
#SBATCH --cpus-per-task={cpus}
#SBATCH --mem={mem}
#SBATCH --time={time}
#SBATCH --chdir={repo}
#SBATCH --output={logs}/%x-%A_%a.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:TERM@120
{extra}
set -uo pipefail
export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK PYTHONUNBUFFERED=1
NAME=$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" {names})
{python} -m tools.study run-one --out {out} --name "$NAME" &
CHILD=$!
on_term() {{
    kill -TERM "$CHILD" 2>/dev/null; wait "$CHILD"
    scontrol requeue "${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}"
    exit 143
}}
trap on_term TERM
wait "$CHILD"
"""


def slurm_script(out: Path, names_file: Path, n: int, args: argparse.Namespace) -> str:
    extra = [f"--partition={args.partition}"] * bool(args.partition) + [f"--account={args.account}"] * bool(args.account)
    extra += [f"--gpus-per-task={args.gpus_per_task}"] * bool(args.gpus_per_task) + list(args.sbatch_arg)
    return _SBATCH.format(out=out.resolve(), n=n, last=n - 1, max_parallel=args.max_parallel, cpus=args.cpus_per_task,
                          mem=args.mem, time=args.time, repo=REPO, logs=(out / "slurm").resolve(),
                          extra="\n".join(f"#SBATCH {e}" for e in extra), names=names_file.resolve(),
                          python=sys.executable)


def submit_slurm(out: Path, names: list[str], args: argparse.Namespace) -> int:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    names_file, script_file = out / "slurm" / f"runs-{stamp}.txt", out / "slurm" / f"study-{stamp}.sbatch"
    script = slurm_script(out, names_file, len(names), args)
    names_file.parent.mkdir(parents=True, exist_ok=True)
    names_file.write_text("\n".join(names) + "\n")
    script_file.write_text(script)
    try:
        job = subprocess.run(["sbatch", "--parsable", str(script_file)], check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise PlanError(f"sbatch is not on PATH; submit {script_file} from a slurm login node") from None
    print(f"[study] submitted array job {job.stdout.strip()}: {len(names)} runs; logs in {out / 'slurm'}")
    return 0


# ---- CLI ---------------------------------------------------------------------------------------------------


def _plan_and_runs(args: argparse.Namespace) -> tuple[Plan, list[Run]]:
    plan = load_plan(args.plan, args.steps)
    return plan, expand(plan, args.set)


def cmd_run(args: argparse.Namespace, argv: list[str]) -> int:
    out = Path(args.out)
    plan, runs = _plan_and_runs(args)
    check_existing(out, runs)
    states = {r.name: run_status(out, r.name) for r in runs}
    todo = [n for n, s in states.items() if s in ("pending", "interrupted") or s == "failed" and args.retry_failed]
    counts = {s: list(states.values()).count(s) for s in ("done", "failed", "interrupted", "pending")}
    print(f"[study] plan {plan.name}: {len(runs)} runs of {plan.steps} steps in {out}: {counts}; running {len(todo)}")
    if args.dry_run:  # print what would run; write nothing
        if args.launcher == "slurm":
            print(slurm_script(out, out / "slurm" / "runs-<date>.txt", len(todo), args))
        for name in todo if args.launcher != "slurm" else []:
            run = next(r for r in runs if r.name == name)
            print(shlex.join(command(plan.experiment, run.overrides, (out / name).resolve())))
        return 0
    manifest = write_manifest(out, plan, runs, list(args.set), argv)
    if not todo:
        return 0
    if args.launcher == "slurm":
        return submit_slurm(out, todo, args)
    executor = execute_inprocess if args.launcher == "inprocess" else execute
    codes = run_local(manifest, out, todo, args.jobs, executor)
    stopped = sorted(n for n, c in codes.items() if c == PREEMPTED)
    failed = sorted(n for n, c in codes.items() if c not in (0, PREEMPTED))
    if stopped:
        print(f"[study] {len(stopped)} runs stopped at a checkpoint; the same command resumes them: {stopped}")
    if failed:
        print(f"[study] {len(failed)} runs failed (see <run>/train.log): {failed}")
    return 1 if failed else PREEMPTED if stopped else 0


def cmd_plan(args: argparse.Namespace) -> int:
    plan, runs = _plan_and_runs(args)
    for cell in plan.cells:
        mine = [r for r in runs if any(c["cell"] == cell.name for c in r.cells)]
        own = [r for r in mine if r.cells[0]["cell"] == cell.name]
        print(f"{cell.name:12s} {len(cell.rows)} rows x {len(cell.columns)} columns x {len(plan.seeds)} seeds = "
              f"{len(mine)} runs, {len(own)} not shared with an earlier cell")
    print(f"total: {len(runs)} runs x {plan.steps} steps = {len(runs) * plan.steps} steps")
    return 0


def cmd_run_one(args: argparse.Namespace) -> int:
    out = Path(args.out)
    manifest = read_manifest(out)
    run = next((r for r in manifest["runs"] if r["name"] == args.name), None)
    if run is None:
        raise PlanError(f"--name {args.name} is not a run of {out / MANIFEST}")
    if run_status(out, args.name) == "done":
        print(f"[study] {args.name} is done; nothing to do")
        return 0
    return execute(manifest["experiment"], run, out, int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.study", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("run", "plan"):
        s = sub.add_parser(name)
        s.add_argument("--plan", required=True, help="a plan in configs/experiment/study_plans/ or a .yaml path")
        s.add_argument("--steps", type=int, default=None, help="train.steps of every run (default: the plan's)")
        s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="an extra hydra override for every run, e.g. --set train.device=cuda (repeatable)")
    r = sub.choices["run"]
    r.add_argument("--out", required=True, help="the study directory (one subdirectory per run)")
    r.add_argument("--jobs", type=int, default=1, help="runs at a time on this machine (each gets cpus/jobs threads)")
    r.add_argument("--launcher", choices=("local", "slurm", "inprocess"), default="local",
                   help="local: pretrain.py processes here; slurm: an sbatch array; inprocess: sequential, this process")
    r.add_argument("--retry-failed", action="store_true", help="run again the runs that failed")
    r.add_argument("--dry-run", action="store_true", help="print the commands (or the sbatch script); run nothing")
    for flag, default, help_ in (("--partition", None, "slurm partition"), ("--account", None, "slurm account"),
                                 ("--time", "01:00:00", "slurm time limit per run"), ("--mem", "8G", "memory per run"),
                                 ("--cpus-per-task", 2, "CPUs per run"), ("--gpus-per-task", 0, "GPUs per run"),
                                 ("--max-parallel", 64, "array tasks at a time")):
        r.add_argument(flag, default=default, type=type(default) if default is not None else str, help=help_)
    r.add_argument("--sbatch-arg", action="append", default=[], help="a raw #SBATCH option (repeatable)")
    one = sub.add_parser("run-one", help="run one planned run (what each slurm array task does)")
    one.add_argument("--out", required=True)
    one.add_argument("--name", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if getattr(args, "jobs", 1) < 1:
        parser().error(f"--jobs {args.jobs} must be >= 1")
    previous = _forward_sigterm()
    try:
        if args.command == "run":
            return cmd_run(args, argv)
        return cmd_plan(args) if args.command == "plan" else cmd_run_one(args)
    except PlanError as e:
        print(f"study error: {e}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
