"""A study's runs as the report reads them: loading, per-cell statistics over seeds, table formatting.

Each study directory is one `python -m tools.study run` output: its study.json says which runs the plan asked
for and which cell/row/column/seed each serves; each run directory holds config.json, metrics.jsonl and
summary.json. A planned run that has not finished is kept with its status (pending, interrupted, failed,
diverged), never dropped. tools.report builds the document from these; tools.report_findings the verdicts.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from asyncpp.core.records import StepMetrics
from asyncpp.schedules.registry import SYNC_KINDS
from tools.report_stats import ALPHA, t_two_sided_p
from tools.study import PlanError, config_diff, read_manifest, run_status

MAIN_COLUMNS = ("sync", "2bw", "2bw_ef")


@dataclass
class RunResult:
    name: str
    status: str
    """done | failed | interrupted | pending (tools.study.run_status), or diverged: failed or finished
    with a non-finite loss or skipped (non-finite) steps."""
    config: dict
    final_val: float = math.nan
    curve: tuple[list[int], list[float]] = ((), ())
    """(step, validation loss) at each evaluation."""
    train_curve: tuple[list[int], list[float]] = ((), ())
    """(step, training loss) at every step (NaN where the loss was not finite)."""
    step_time_s: float = math.nan
    late: dict[str, float] = field(default_factory=dict)
    """Over the run's second half (finite steps): mean grad_norm and update_norm, and the fraction of steps whose
    grad norm (taken after any gradient correction, before clipping) exceeded train.grad_clip: what a gradient
    correction does to the step, where its final loss alone cannot say; and early_grad_norm, the mean grad_norm
    over the first EARLY_FRACTION of the steps."""


EARLY_FRACTION = 0.2
"""The run's first steps (warmup and just after) whose mean grad norm the step table shows beside the second
half's: a correction that scales with the gradient (DC-ASGD's g⊙g) acts there, and has faded by the end."""


def late_stats(records: list, grad_clip: float) -> dict[str, float]:
    half = [r for r in records[len(records) // 2:] if math.isfinite(r.grad_norm) and math.isfinite(r.update_norm)]
    if not half:
        return {}
    early = [r.grad_norm for r in records[:max(1, round(len(records) * EARLY_FRACTION))] if math.isfinite(r.grad_norm)]
    return {"grad_norm": statistics.fmean(r.grad_norm for r in half),
            "update_norm": statistics.fmean(r.update_norm for r in half),
            "clipped": sum(r.grad_norm > grad_clip for r in half) / len(half) if grad_clip > 0 else 0.0,
            "early_grad_norm": statistics.fmean(early) if early else math.nan}


@dataclass
class Stat:
    """Final validation loss of one (cell, row, column) over its planned seeds."""

    values: dict[int, float] = field(default_factory=dict)
    """seed -> final validation loss of the finished runs."""
    planned: int = 0
    statuses: dict[str, int] = field(default_factory=dict)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values.values()) if self.values else math.nan

    @property
    def std(self) -> float:
        return statistics.stdev(self.values.values()) if len(self.values) > 1 else math.nan


# ---- loading -------------------------------------------------------------------------------------------


def read_metrics(path: Path) -> list[StepMetrics]:
    """metrics.jsonl, one record per step: a resumed run rewrites the steps after its checkpoint, the last wins.
    A line of an older run reads as StepMetrics.from_json says (a missing metric is NaN)."""
    by_step: dict[int, StepMetrics] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                record = StepMetrics.from_json(json.loads(line))
                by_step[record.step] = record
    return [by_step[s] for s in sorted(by_step)]


def _num(value: object) -> float:
    """A summary.json value as a float: NaN/Inf are written as strings by asyncpp.train.metrics."""
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


def first_nonfinite(r: RunResult) -> int | None:
    """The first step (1-based, as the curves) whose training loss was not finite, if any."""
    return next((s for s, v in zip(*r.train_curve) if not math.isfinite(v)), None)


def load_run(out: Path, planned: dict) -> RunResult:
    d = out / planned["name"]
    status = run_status(out, planned["name"])
    result = RunResult(planned["name"], status, planned["config"])
    records = read_metrics(d / "metrics.jsonl")
    evals = [(r.step + 1, r.val_loss) for r in records if r.val_loss is not None]  # step+1: after the update
    result.curve = ([s for s, _ in evals], [v for _, v in evals])
    result.train_curve = ([r.step + 1 for r in records], [r.loss for r in records])
    result.late = late_stats(records, float(planned["config"].get("train", {}).get("grad_clip", 0.0) or 0.0))
    unstable = any(not math.isfinite(r.loss) or r.skipped for r in records)
    if status == "done":
        summary = json.loads((d / "summary.json").read_text())
        result.final_val = _num(summary.get("final_val_loss"))
        result.step_time_s = _num(summary.get("mean_step_time_s"))
        saved = json.loads((d / "config.json").read_text())
        diff = config_diff({k: v for k, v in saved.items() if k != "out_dir"}, planned["config"])
        if diff:  # tools.study refuses this; a hand-edited directory could still do it
            raise PlanError(f"{d}/config.json differs from the planned config of {out}/study.json in {diff[:5]}; "
                            "remove the run or report it from its own study directory")
    if unstable and status in ("done", "failed") or status == "done" and not math.isfinite(result.final_val):
        result.status = "diverged"
    return result


@dataclass
class Study:
    dirs: list[Path]
    manifests: list[dict]
    cells: dict[str, dict]
    """name -> {"title", "x", "rows": [...], "columns": [...]} (union over the manifests, plan order)."""
    results: dict[tuple[str, str, str], list[tuple[int, RunResult]]]
    """(cell, row, column) -> [(seed, result)] for every planned seed."""
    xs: dict[tuple[str, str, str], float | None]
    """(cell, row, column) -> the value of the cell's x-axis override there (None: not set)."""


def load_study(dirs: list[Path]) -> Study:
    manifests = [read_manifest(d) for d in dirs]
    cells: dict[str, dict] = {}
    results: dict[tuple[str, str, str], list[tuple[int, RunResult]]] = defaultdict(list)
    xs: dict[tuple[str, str, str], float | None] = {}
    for out, manifest in zip(dirs, manifests):
        for cell in manifest["cells"]:
            merged = cells.setdefault(cell["name"], {**cell, "rows": [], "columns": []})
            merged["rows"] += [r for r in cell["rows"] if r not in merged["rows"]]
            merged["columns"] += [c for c in cell["columns"] if c not in merged["columns"]]
        for planned in manifest["runs"]:
            result = load_run(out, planned)
            for m in planned["cells"]:
                key = (m["cell"], m["row"], m["column"])
                if any(seed == m["seed"] for seed, _ in results[key]):
                    raise PlanError(f"cell {key} seed {m['seed']} is planned in two study directories; report them "
                                    "separately or remove one")
                results[key].append((m["seed"], result))
                xs[key] = m["x"]
    return Study(dirs, manifests, cells, dict(results), xs)


def stat(study: Study, cell: str, row: str, column: str) -> Stat:
    s = Stat()
    for seed, r in study.results.get((cell, row, column), []):
        s.planned += 1
        s.statuses[r.status] = s.statuses.get(r.status, 0) + 1
        if r.status == "done":
            s.values[seed] = r.final_val
    return s


def paired(a: Stat, b: Stat) -> tuple[float, float, int]:
    """mean and std over seeds of a - b (both finished); seeds pair runs with the same init and data order."""
    diffs = [a.values[s] - b.values[s] for s in sorted(a.values.keys() & b.values.keys())]
    if not diffs:
        return math.nan, math.nan, 0
    return statistics.fmean(diffs), statistics.stdev(diffs) if len(diffs) > 1 else math.nan, len(diffs)


def paired_diffs(a: Stat, b: Stat) -> list[float]:
    """a − b per seed, on the seeds both finished (seed order)."""
    return [a.values[s] - b.values[s] for s in sorted(a.values.keys() & b.values.keys())]


def resolved(diff: tuple[float, float, int]) -> bool:
    """A paired difference is told apart from seed noise: a two-sided paired t-test at 95%, >= 2 pairs."""
    mean, std, n = diff
    if n < 2 or not math.isfinite(std):
        return False
    if std == 0:
        return mean != 0
    return t_two_sided_p(mean / (std / math.sqrt(n)), n - 1) < ALPHA


def ended(stats: list[Stat]) -> tuple[int, int]:
    """(runs ended, runs planned) over these arms: pending and interrupted runs have not ended."""
    planned = sum(s.planned for s in stats)
    return planned - sum(s.statuses.get(k, 0) for s in stats for k in ("pending", "interrupted")), planned


def is_sync(config: dict) -> bool:
    return config["schedule"]["name"] in SYNC_KINDS


def is_plain_2bw(config: dict) -> bool:
    return config["schedule"]["name"] == "2bw" and not any(config["staleness"].values())


def reference(study: Study, cell: str, row: str, test) -> str | None:
    """The column of (cell, row) whose runs satisfy `test` (is_sync, is_plain_2bw), if there is one."""
    for column in study.cells[cell]["columns"]:
        runs = study.results.get((cell, row, column), [])
        if runs and all(test(r.config) for _, r in runs):
            return column
    return None


# ---- formatting ----------------------------------------------------------------------------------------


def fmt_stat(s: Stat) -> str:
    shortfall: dict[str, int] = {}
    for status, count in s.statuses.items():  # pending and interrupted runs both have no result yet
        if status != "done":
            word = "missing" if status in ("pending", "interrupted") else status
            shortfall[word] = shortfall.get(word, 0) + count
    note = ", ".join(f"{v} {k}" for k, v in sorted(shortfall.items()))
    if not s.values:
        return f"**{note or 'missing'}** (0/{s.planned or '?'})"
    text = f"{s.mean:.4f} ± {s.std:.4f}" if len(s.values) > 1 else f"{s.mean:.4f}"
    return text + (f" ({len(s.values)}/{s.planned}; {note})" if note else "")


def fmt_diff(diff: tuple[float, float, int]) -> str:
    mean, std, n = diff
    if n == 0:
        return "—"
    text = f"{mean:+.4f}" + (f" ± {std:.4f}" if math.isfinite(std) else "")
    return text + ("" if resolved(diff) else " (n.s.)")


def closes(study: Study, cell: str, row: str, column: str, sync_col: str, async_col: str) -> str:
    """(async - column) / (async - sync) on the seeds all three finished: the fraction of the gap removed."""
    s, a, c = (stat(study, cell, row, k) for k in (sync_col, async_col, column))
    seeds = s.values.keys() & a.values.keys() & c.values.keys()
    if not seeds:
        return "—"
    ms, ma, mc = (statistics.fmean(st.values[k] for k in seeds) for st in (s, a, c))
    if ma == ms:
        return "—"
    note = "" if resolved(paired(a, s)) else " (gap n.s.)"
    return f"{(ma - mc) / (ma - ms):.0%}{note}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
def gap_stat(study: Study, cell: str, row: str, column: str, ref: str) -> Stat:
    """Per-seed final gap column - ref as a Stat (so gaps of two rows can be paired by seed in turn)."""
    a, b = stat(study, cell, row, column), stat(study, cell, row, ref)
    return Stat({s: a.values[s] - b.values[s] for s in a.values.keys() & b.values.keys()}, a.planned)

def columns_where(study: Study, cell: str, row: str, test) -> list[str]:
    return [c for c in study.cells[cell]["columns"]
            if study.results.get((cell, row, c)) and all(test(r.config) for _, r in study.results[(cell, row, c)])]

