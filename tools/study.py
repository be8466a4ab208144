"""The reproduction study as one command: expand a plan into runs, skip the finished ones, run the rest.

    python -m tools.study run --plan full --out outputs/study --jobs 2                  # this machine
    python -m tools.study run --plan full --out outputs/study --launcher slurm --partition cpu
    python -m tools.study run --plan pilot --out outputs/pilot --steps 20               # shorter runs
    python -m tools.study plan --plan full                                           # list the runs only
    python -m tools.report outputs/study --out docs/reproduction.md                     # then the report
    python -m tools.study archive --out outputs/study --to docs/reproduction/runs       # keep finished runs in git
    python -m tools.study restore --from docs/reproduction/runs --out outputs/study     # ... and bring them back

A plan (configs/experiment/study_plans/<name>.yaml) is cells of rows x columns x seeds; each run is
`pretrain.py +experiment=<experiment> <plan overrides> <row> <column> seed=<s>`. Every run's config is
composed and validated before anything starts, and two cells asking for the same resolved config share
one run. `<out>/study.json` records the runs, the cells each belongs to and every command that ran the
study; tools.report reads it. Rerunning a command resumes: finished runs are skipped, interrupted ones
continue from their last checkpoint, and a run directory whose config differs from the plan's stops the
study before anything runs (a different plan or --steps needs another --out).

A cell may set its own `seeds` and a `priority` (runs go in (priority, seed) order). A plan with
`tune: {key: optimizer.lr, cells: [<grid>]}` runs in two phases within one command: the grid cells first,
then every other cell with `key` set to its optimizer's winner (the grid value with the lowest mean final
validation loss), recorded in study.json's "tune". `archive`/`restore` keep the finished runs' small files in
git (tools/study_archive.py), for a study whose directory does not outlive the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tools import study_archive

REPO = Path(__file__).resolve().parent.parent
PLANS_DIR = REPO / "configs" / "experiment" / "study_plans"
MANIFEST = "study.json"
STATUS = "study_status.json"
PREEMPTED = 143  # pretrain.py's exit code after a SIGTERM checkpoint: the run is resumable, not failed
_TEMPLATE = re.compile(r"\{([^{}]*)\}")
_NAMED = re.compile(r"(steps|tuned)(?:\*([0-9]*\.?[0-9]+))?")


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
    seeds: list[int] | None = None
    """This cell's seeds (None: the plan's)."""
    priority: int = 0
    """Runs go in (priority, seed) order: a lower priority finishes all its seeds first."""


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
    tune: Tune | None = None


@dataclass(frozen=True)
class Tune:
    """Two phases: the `cells` (phase 1, a grid of `key` on sync) run first; then every other cell runs with
    `key` set to its optimizer's winner, the grid value with the lowest mean final validation loss."""
    key: str
    cells: list[str]


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
                overrides=[str(o) for o in raw.get("overrides", [])], cells=cells,
                tune=_load_tune(raw.get("tune"), cells, where))


def _load_tune(raw: dict | None, cells: list[Cell], where: str) -> Tune | None:
    if raw is None:
        return None
    names = [c.name for c in cells]
    if not isinstance(raw, dict) or not raw.get("key") or not raw.get("cells") or set(raw["cells"]) - set(names):
        raise PlanError(f"{where}: tune must be {{key: <override>, cells: [<grid cells>]}} with cells among {names}; "
                        f"got {raw}")
    if set(names) == set(raw["cells"]):
        raise PlanError(f"{where}: tune.cells {raw['cells']} are every cell; nothing would use the winners")
    return Tune(key=str(raw["key"]), cells=[str(c) for c in raw["cells"]])


def _load_cell(name: str, body: dict, where: str) -> Cell:
    rows = body.get("rows")
    blocks = rows if isinstance(rows, list) else [rows]  # a list of blocks: different rows per optimizer
    if not rows or not all(isinstance(b, dict) and b and all(isinstance(v, list) and v for v in b.values())
                           for b in blocks):
        raise PlanError(f"{where}: cells.{name}.rows must map override keys to non-empty lists, "
                        "e.g. rows: {optimizer: [muon, adamw]}, or be a list of such maps")
    columns = body.get("columns")
    if not isinstance(columns, dict) or not columns:
        raise PlanError(f"{where}: cells.{name}.columns must map column names to override lists, "
                        "e.g. columns: {sync: [schedule=sync]}")
    product_rows = []
    for block in blocks:
        product = [[]]
        for key in block:  # a block's rows are the product of the listed values, in the order written
            product = [p + [str(v)] for p in product for v in block[key]]
        product_rows += [dict(zip(block, p)) for p in product]
    seeds = body.get("seeds")
    return Cell(name=name, title=str(body.get("title", name)), rows=product_rows,
                columns={str(c): [str(o) for o in ov] for c, ov in columns.items()}, x=body.get("x"),
                seeds=None if seeds is None else [int(x) for x in seeds], priority=int(body.get("priority", 0)))


def fill(text: str, steps: int, tuned: str | None = None) -> str:
    """Replace `{steps}` and `{steps*F}` (round(F * steps), at least 1) in an override, and in a cell after a
    tune grid `{tuned}` and `{tuned*F}` (the run's optimizer's winner, times F to 3 significant digits)."""
    def one(match: re.Match) -> str:
        m = _NAMED.fullmatch(match.group(1).replace(" ", ""))
        if m is None:
            raise PlanError(f"override {text!r}: {{{match.group(1)}}} is not a template; use {{steps}}, "
                            "{steps*F}, {tuned} or {tuned*F}")
        factor = None if m.group(2) is None else float(m.group(2))
        if m.group(1) == "steps":
            return str(steps if factor is None else max(1, round(factor * steps)))
        if tuned is None:
            raise PlanError(f"override {text!r}: {{tuned}} means the tune grid's winner; use it only in a plan with "
                            "a tune: section, in a cell that is not one of tune.cells")
        return tuned if factor is None else f"{float(tuned) * factor:.3g}"
    return _TEMPLATE.sub(one, text)


def row_slug(row: dict[str, str]) -> str:
    """{"optimizer": "muon", "optimizer.momentum": "0.9"} -> "muon-momentum0.9" (a directory name part; a list
    value's brackets and commas, which a hydra override cannot carry in a path, become "_":
    "optimizer.betas": "[0.98,0.95]" -> "betas_0.98_0.95")."""
    parts = (v if k == "optimizer" else f"{k.rsplit('.', 1)[-1]}{v}" for k, v in row.items())
    return "-".join(re.sub(r"[^\w.]+", "_", p).strip("_") for p in parts)


def override_value(overrides: list[str], key: str) -> str | None:
    """The value the last `key=...` override sets, or None."""
    values = [o.split("=", 1)[1] for o in overrides if o.lstrip("+~").split("=", 1)[0] == key]
    return values[-1] if values else None


# ---- expansion -----------------------------------------------------------------------------------------


def expand(plan: Plan, extra: list[str] | None = None, winners: dict[str, str] | None = None) -> list[Run]:
    """Every run of the plan, configs composed and validated, runs with the same resolved config merged
    (the first cell that asks for one names it). A plan with a tune grid: without `winners` (optimizer ->
    value) only the grid's cells; with them every cell, the others with tune.key set to their optimizer's winner
    (before the row's and column's overrides, which may still set it, e.g. to `{tuned*0.5}`)."""
    base = [fill(o, plan.steps) for o in plan.overrides] + list(extra or [])
    tune = plan.tune
    cells = [c for c in plan.cells if tune is None or winners is not None or c.name in tune.cells]
    runs: dict[str, Run] = {}
    by_config: dict[str, str] = {}
    with _composer(plan.experiment) as resolve:
        for cell in cells:
            tuned_cell = tune is not None and cell.name not in tune.cells
            for raw_row in cell.rows:
                for column, col_overrides in cell.columns.items():
                    winner = _winner_for(cell, raw_row, col_overrides, winners) if tuned_cell else None
                    row = {k: fill(v, plan.steps, winner) for k, v in raw_row.items()}
                    overrides = ([f"{tune.key}={winner}"] if tuned_cell else []) + [f"{k}={v}" for k, v in row.items()]
                    overrides += [fill(o, plan.steps, winner) for o in col_overrides]
                    config = resolve(base + overrides)
                    x = override_value(overrides, cell.x) if cell.x else None
                    for seed in cell.seeds or plan.seeds:
                        run = _claim(runs, by_config, f"{row_slug(row)}__{column}__seed{seed}",
                                     base + overrides + [f"seed={seed}"], {**config, "seed": seed})
                        run.cells.append({"cell": cell.name, "row": row_slug(row), "column": column, "seed": seed,
                                          "x": None if x is None else float(x)})
    # (priority, seed) order, seed-major within a priority (a stable sort keeps the cells' order within a
    # seed): a study stopped part-way has every cell of a priority at its first seed before any gets a second.
    seeds = list(dict.fromkeys([*plan.seeds, *(s for c in plan.cells for s in c.seeds or [])]))
    priority = {c.name: c.priority for c in plan.cells}
    return sorted(runs.values(), key=lambda run: (priority[run.cells[0]["cell"]], seeds.index(run.config["seed"])))


def _winner_for(cell: Cell, row: dict[str, str], col_overrides: list[str], winners: dict[str, str]) -> str:
    optimizer = override_value([f"{k}={v}" for k, v in row.items()] + col_overrides, "optimizer")
    if optimizer not in winners:
        raise PlanError(f"cells.{cell.name} row {row}: its optimizer {optimizer!r} has no tune grid winner "
                        f"(the grid tuned {sorted(winners)}); set optimizer= in the row to one of them")
    return winners[optimizer]


def cell_rows(plan: Plan, cell: Cell, winners: dict[str, str] | None) -> list[str]:
    """The cell's row names in plan order, templates filled ([] for a cell still waiting for the tune grid)."""
    tuned_cell = plan.tune is not None and cell.name not in plan.tune.cells
    if tuned_cell and winners is None:
        return []
    first_column = next(iter(cell.columns.values()))
    return [row_slug({k: fill(v, plan.steps, _winner_for(cell, row, first_column, winners) if tuned_cell else None)
                      for k, v in row.items()}) for row in cell.rows]


def tuned_winners(plan: Plan, out: Path, runs: list[Run]) -> tuple[dict[str, str] | None, dict[str, dict]]:
    """optimizer -> the tune grid's value with the lowest mean final validation loss over its seeds (a failed
    or non-finite run counts as +inf), once every grid run has ended (None before), and the table of means."""
    losses: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        if not any(m["cell"] in plan.tune.cells for m in run.cells):
            continue
        status = run_status(out, run.name)
        if status in ("pending", "interrupted"):
            return None, {}
        value = override_value(run.overrides, plan.tune.key)
        if value is None:
            raise PlanError(f"tune grid run {run.name} does not set {plan.tune.key}; every grid row must")
        loss = float((_read_json(out / run.name / "summary.json") or {}).get("final_val_loss", "inf"))
        loss = loss if status == "done" and math.isfinite(loss) else math.inf
        losses.setdefault(run.config["optimizer"]["name"], {}).setdefault(value, []).append(loss)
    means = {opt: {v: statistics.fmean(ls) for v, ls in values.items()} for opt, values in losses.items()}
    return {opt: min(values, key=values.get) for opt, values in means.items()}, means


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


def write_manifest(out: Path, plan: Plan, runs: list[Run], extra: list[str], argv: list[str] | None,
                   tune: dict | None = None) -> dict:
    """<out>/study.json: the plan, its runs (overrides, config, cells), the tune grid's outcome and every
    command run on it (argv None: the same command's second phase, not another invocation)."""
    old = _read_json(out / MANIFEST) or {}
    invocation = [] if argv is None else [{"command": shlex.join(["python", "-m", "tools.study", *argv]),
                                           "time": datetime.datetime.now().isoformat(timespec="seconds"),
                                           "commit": code_commit(), "host": os.uname().nodename}]
    manifest = {
        "plan": plan.name, "label": plan.label, "description": plan.description, "experiment": plan.experiment,
        "steps": plan.steps, "seeds": plan.seeds, "extra_overrides": extra,
        "cells": [{"name": c.name, "title": c.title, "x": c.x, "rows": cell_rows(plan, c, (tune or {}).get("winners")),
                   "columns": list(c.columns), "seeds": c.seeds or plan.seeds, "priority": c.priority}
                  for c in plan.cells],
        "tune": tune,
        "runs": [dataclasses.asdict(r) for r in runs],
        "invocations": [*old.get("invocations", []), *invocation],
    }
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / MANIFEST)  # a reader never sees half a manifest
    return manifest


def code_commit() -> str | None:
    """The commit the runs' code is at (`+dirty` when tracked files differ from it); None outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout
    try:
        return git("rev-parse", "HEAD").strip() + ("+dirty" if git("status", "--porcelain", "-uno").strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return None


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
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        _CHILDREN.add(proc)
        if _STOPPING.is_set():  # the SIGTERM came between the pool's check and the start: it checkpoints at once
            proc.send_signal(signal.SIGTERM)
        _, wait_status, usage = os.wait4(proc.pid, 0)  # the child's own CPU time: the study's CPU-hours
        proc.returncode = os.waitstatus_to_exitcode(wait_status)
        _CHILDREN.discard(proc)
    _write_status(run_dir, proc.returncode, time.time() - started, shlex.join(cmd), usage.ru_utime + usage.ru_stime)
    return proc.returncode


_CHILDREN: set[subprocess.Popen] = set()
_STOPPING = threading.Event()  # set by SIGTERM: no new run starts


def _forward_sigterm() -> Callable | int | None:
    """SIGTERM (slurm's time limit or preemption, or `kill`) goes on to the running pretrain.py processes,
    which checkpoint and exit 143; their runs resume on the next study command."""
    def forward(signum: int, frame: object) -> None:
        _STOPPING.set()
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


def _write_status(run_dir: Path, rc: int, seconds: float, cmd: str, cpu_s: float | None = None) -> None:
    """The outcome of one attempt; `cpu_s` is the process's user+system CPU time (summed over attempts by the
    report: each attempt's file replaces the last, so it is appended to the run's attempts list too)."""
    old = _read_json(run_dir / STATUS) or {}
    now = {"returncode": rc, "seconds": round(seconds, 1), "cpu_s": None if cpu_s is None else round(cpu_s, 1),
           "command": cmd, "finished": datetime.datetime.now().isoformat(timespec="seconds"),
           "host": os.uname().nodename}
    attempts = [*old.get("attempts", []), {k: now[k] for k in ("returncode", "seconds", "cpu_s", "finished", "host")}]
    (run_dir / STATUS).write_text(json.dumps({**now, "attempts": attempts}))


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
        if _STOPPING.is_set():  # SIGTERM: the pool's remaining runs stay pending
            return
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


def cmd_run(args: argparse.Namespace, argv: list[str]) -> int:
    """Run what is pending; with a tune grid, the grid first, then (same command) the cells using its winners."""
    out = Path(args.out)
    plan = load_plan(args.plan, args.steps)
    runs, tune = expand(plan, args.set), None
    if plan.tune is not None:
        runs, tune = _tuned(plan, out, runs, args.set)
    rc = _run_phase(plan, runs, out, args, argv, tune)
    if plan.tune is not None and tune["winners"] is None and not args.dry_run and not _STOPPING.is_set():
        runs, tune = _tuned(plan, out, runs, args.set)
        if tune["winners"] is not None:
            print(f"[study] tune grid done: {plan.tune.key} = {tune['winners']}; composing the other cells")
            rc = max(rc, _run_phase(plan, runs, out, args, None, tune), key=lambda c: (c == 1, c == PREEMPTED))
    return rc


def _tuned(plan: Plan, out: Path, grid_runs: list[Run], extra: list[str]) -> tuple[list[Run], dict]:
    """Every run once the tune grid has ended (its winners recorded), else the grid's runs alone."""
    winners, means = tuned_winners(plan, out, grid_runs)
    tune = {"key": plan.tune.key, "cells": plan.tune.cells, "winners": winners, "means": means}
    return (grid_runs if winners is None else expand(plan, extra, winners)), tune


def _run_phase(plan: Plan, runs: list[Run], out: Path, args: argparse.Namespace, argv: list[str] | None,
               tune: dict | None) -> int:
    check_existing(out, runs)
    states = {r.name: run_status(out, r.name) for r in runs}
    todo = [n for n, s in states.items() if s in ("pending", "interrupted") or s == "failed" and args.retry_failed]
    counts = {s: list(states.values()).count(s) for s in ("done", "failed", "interrupted", "pending")}
    waiting = " (then the cells that use the tune grid's winners)" if tune and tune["winners"] is None else ""
    print(f"[study] plan {plan.name}: {len(runs)} runs{waiting} in {out}: {counts}; running {len(todo)}")
    if args.dry_run:  # print what would run; write nothing
        if args.launcher == "slurm":
            print(slurm_script(out, out / "slurm" / "runs-<date>.txt", len(todo), args))
        for name in todo if args.launcher != "slurm" else []:
            run = next(r for r in runs if r.name == name)
            print(shlex.join(command(plan.experiment, run.overrides, (out / name).resolve())))
        return 0
    manifest = write_manifest(out, plan, runs, list(args.set), argv, tune)
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
    return 1 if failed else PREEMPTED if stopped or _STOPPING.is_set() else 0


def cmd_plan(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan, args.steps)
    runs = expand(plan, args.set)
    if plan.tune is not None:  # compose the later cells too, with the grid's first value standing for each winner
        first = {}
        for run in runs:
            first.setdefault(run.config["optimizer"]["name"], override_value(run.overrides, plan.tune.key))
        print(f"tune grid {plan.tune.cells}: {len(runs)} runs first; the other cells below are composed with "
              f"{plan.tune.key} = {first} standing for the winners")
        runs = expand(plan, args.set, first)
    seeds = list(dict.fromkeys([*plan.seeds, *(s for c in plan.cells for s in c.seeds or [])]))
    for cell in plan.cells:
        mine = [r for r in runs if any(c["cell"] == cell.name for c in r.cells)]
        own = [r for r in mine if r.cells[0]["cell"] == cell.name]
        print(f"{cell.name:12s} {len(cell.rows)} rows x {len(cell.columns)} columns x {len(cell.seeds or plan.seeds)} "
              f"seeds = {len(mine)} runs, {len(own)} not shared with an earlier cell (priority {cell.priority})")
    print(f"total: {len(runs)} runs, {sum(r.config['train']['steps'] for r in runs)} steps; seeds {seeds}")
    return 0


def cmd_archive(args: argparse.Namespace) -> int:
    out = Path(args.out)
    runs = [r["name"] for r in read_manifest(out)["runs"]]
    done = [n for n in runs if run_status(out, n) == "done"]
    study_archive.archive(out, Path(args.to), done)
    print(f"[study] archived {len(done)} finished runs of {len(runs)} from {out} into {args.to}")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    try:
        restored, kept = study_archive.restore(Path(getattr(args, "from")), Path(args.out))
    except study_archive.ArchiveError as e:
        raise PlanError(str(e)) from None
    print(f"[study] restored {len(restored)} finished runs into {args.out} ({len(kept)} were already there)")
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
    arc = sub.add_parser("archive", help="copy the finished runs' small files (not checkpoints) into a folder")
    arc.add_argument("--out", required=True, help="the study directory")
    arc.add_argument("--to", required=True, help="the archive folder, e.g. docs/reproduction/runs")
    res = sub.add_parser("restore", help="copy an archive's runs into a study directory, where they count as done")
    res.add_argument("--from", required=True, help="the archive folder")
    res.add_argument("--out", required=True, help="the study directory")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if getattr(args, "jobs", 1) < 1:
        parser().error(f"--jobs {args.jobs} must be >= 1")
    _STOPPING.clear()
    previous = _forward_sigterm()
    try:
        if args.command == "run":
            return cmd_run(args, argv)
        commands = {"plan": cmd_plan, "run-one": cmd_run_one, "archive": cmd_archive, "restore": cmd_restore}
        return commands[args.command](args)
    except PlanError as e:
        print(f"study error: {e}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
