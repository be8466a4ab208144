"""Study directories -> docs/reproduction.md: tables, plots and a computed comparison with the paper.

    python -m tools.report outputs/study --out docs/reproduction.md
    python -m tools.report outputs/study outputs/study_extra --out docs/reproduction.md   # several sweeps

Each directory is one `python -m tools.study run` output: its study.json says which runs the plan asked
for and which cell/row/column/seed each serves; each run directory holds config.json, metrics.jsonl and
summary.json. A planned run that has not finished is reported as missing (or failed/diverged), never
dropped. Every number in the report is computed from those files; the paper's numbers are the only
constants here (PAPER_360M), and the verdicts comparing the two are computed too.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import shlex
import statistics
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from asyncpp.core.records import StepMetrics
from asyncpp.schedules.registry import SYNC_KINDS
from tools import plots
from tools.study import PlanError, config_diff, read_manifest, run_status

#: Table 1/2 of the paper, SmolLM2-360M final validation loss: (sync, async, async + EF). Digest §5.1-5.2.
PAPER_360M = {"muon": (2.578, 2.590, 2.583), "adamw": (2.612, 2.890, 2.640), "soap": (2.581, 2.608, 2.590)}
MAIN_COLUMNS = ("sync", "2bw", "2bw_ef")
NOT_RESOLVED = "not resolved (seed noise)"


@dataclass
class RunResult:
    name: str
    status: str
    """done | failed | interrupted | pending (tools.study.run_status), or diverged: failed or finished
    with a non-finite loss or skipped (non-finite) steps."""
    config: dict
    final_val: float = math.nan
    curve: tuple[list[int], list[float]] = ((), ())
    step_time_s: float = math.nan


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


def load_run(out: Path, planned: dict) -> RunResult:
    d = out / planned["name"]
    status = run_status(out, planned["name"])
    result = RunResult(planned["name"], status, planned["config"])
    records = read_metrics(d / "metrics.jsonl")
    evals = [(r.step + 1, r.val_loss) for r in records if r.val_loss is not None]  # step+1: after the update
    result.curve = ([s for s, _ in evals], [v for _, v in evals])
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


# Two-sided 95% quantiles of Student's t with 1..10 degrees of freedom (then ~normal): with three seeds a
# paired difference needs |mean| > 4.30 standard errors, not 2 -- the normal rule overstates few-seed evidence.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def resolved(diff: tuple[float, float, int]) -> bool:
    """A paired difference is told apart from seed noise: a two-sided paired t-test at 95%, >= 2 pairs."""
    mean, std, n = diff
    if n < 2 or not math.isfinite(std):
        return False
    t = _T975[n - 2] if n - 1 <= len(_T975) else 1.96
    return abs(mean) > t * std / math.sqrt(n)


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


def main_table(study: Study) -> str:
    rows = []
    for row in study.cells["main"]["rows"]:
        s, a, e = (stat(study, "main", row, c) for c in MAIN_COLUMNS)
        rows.append([row, fmt_stat(s), fmt_stat(a), fmt_stat(e), fmt_diff(paired(a, s)), fmt_diff(paired(e, s)),
                     closes(study, "main", row, "2bw_ef", "sync", "2bw")])
    return table(["optimizer", "sync", "2BW (async)", "2BW + EF", "gap async − sync", "gap async+EF − sync",
                  "gap closed by EF"], rows)


def cell_table(study: Study, name: str) -> str:
    """One line per (row, column): the loss and its paired differences to the row's sync and plain-2BW runs."""
    cell, rows = study.cells[name], []
    for row in cell["rows"]:
        sync_col, async_col = reference(study, name, row, is_sync), reference(study, name, row, is_plain_2bw)
        # "gap closed" describes a correction applied to 2BW, not another schedule (PipeDream at depth P)
        on_2bw = _columns(study, name, row, lambda c: c["schedule"]["name"] == "2bw")
        for column in cell["columns"]:
            st = stat(study, name, row, column)
            x = study.xs.get((name, row, column))
            vs_sync = fmt_diff(paired(st, stat(study, name, row, sync_col))) if sync_col and column != sync_col else "—"
            treated = bool(sync_col and async_col) and column not in (sync_col, async_col)
            vs_async = fmt_diff(paired(st, stat(study, name, row, async_col))) if treated else "—"
            frac = closes(study, name, row, column, sync_col, async_col) if treated and column in on_2bw else "—"
            xcol = ["—" if x is None else f"{x:g}"] if cell.get("x") else []
            rows.append([row, column, *xcol, fmt_stat(st), vs_sync, vs_async, frac])
    header = ["row", "column", *([cell["x"]] if cell.get("x") else []), "final val loss", "Δ vs sync", "Δ vs 2BW",
              "2BW gap closed"]
    return table(header, rows)


# ---- figures -------------------------------------------------------------------------------------------


def curves(study: Study, cell: str, row: str, column: str) -> list[plots.Curve]:
    return [r.curve for _, r in study.results.get((cell, row, column), []) if r.status == "done" and r.curve[0]]


def gap_curves(study: Study, cell: str, row: str, column: str, ref: str) -> list[plots.Curve]:
    """Per seed, val loss of `column` minus `ref` at the steps both evaluated (same seed: same data, init)."""
    refs = {seed: dict(zip(*r.curve)) for seed, r in study.results.get((cell, row, ref), []) if r.status == "done"}
    out = []
    for seed, r in study.results.get((cell, row, column), []):
        if r.status == "done" and seed in refs:
            steps = [s for s in r.curve[0] if s in refs[seed]]
            out.append((steps, [v - refs[seed][s] for s, v in zip(*r.curve) if s in refs[seed]]))
    return out


def gap_stat(study: Study, cell: str, row: str, column: str, ref: str) -> Stat:
    """Per-seed final gap column - ref as a Stat (so gaps of two rows can be paired by seed in turn)."""
    a, b = stat(study, cell, row, column), stat(study, cell, row, ref)
    return Stat({s: a.values[s] - b.values[s] for s in a.values.keys() & b.values.keys()}, a.planned)


def sweep_points(study: Study, name: str) -> tuple[dict[str, list[plots.Point]], dict[str, tuple[float, float]]]:
    """Gap to sync against the cell's x: a series per row when x varies over columns (lambda, P), a series
    per column when it varies over rows (momentum); columns without x become reference levels."""
    cell = study.cells[name]
    series: dict[str, list[plots.Point]] = defaultdict(list)
    refs: dict[str, tuple[float, float]] = {}
    for row in cell["rows"]:
        sync_col = reference(study, name, row, is_sync)
        if sync_col is None:
            continue
        row_xs = {study.xs.get((name, row, c)) for c in cell["columns"]}
        for column in cell["columns"]:
            if column == sync_col:
                continue
            x = study.xs.get((name, row, column))
            mean, std, _ = paired(stat(study, name, row, column), stat(study, name, row, sync_col))
            if x is None:
                refs[f"{column} ({row})"] = (mean, std)
            elif len(row_xs) == 1:
                series[column].append((x, mean, std))
            else:
                series[row].append((x, mean, std))
    return dict(series), refs


def draw(study: Study, plot_dir: Path) -> list[tuple[str, Path]]:
    figures = []
    if "main" in study.cells:
        rows = study.cells["main"]["rows"]
        panels = {row: {c: curves(study, "main", row, c) for c in MAIN_COLUMNS} for row in rows}
        figures.append(("Validation loss, sync and async overlaid (mean over seeds; band: min to max)",
                        plots.curves_panels(panels, plot_dir / "loss_curves.png", "validation loss", "val loss")))
        gaps = {row: {c: gap_curves(study, "main", row, c, "sync") for c in MAIN_COLUMNS[1:]} for row in rows}
        figures.append(("Gap to sync over training, runs paired by seed (mean; band: min to max over seeds)",
                        plots.curves_panels(gaps, plot_dir / "gap_over_time.png", "val loss − sync (same seed)",
                                            "Δ val loss", zero_line=True)))
    for name, cell in study.cells.items():
        if not cell.get("x"):
            continue
        series, refs = sweep_points(study, name)
        xs = [p[0] for pts in series.values() for p in pts if p[0] > 0]
        log_x = bool(xs) and min(xs) > 0 and max(xs) / min(xs) > 50 and all(p[0] > 0 for v in series.values() for p in v)
        path = plots.gap_vs_x(series, refs, plot_dir / f"gap_vs_{name}.png", cell["title"], cell["x"],
                              "final val loss − sync (paired)", log_x=log_x)
        figures.append((f"{cell['title']}: gap to sync against {cell['x']}", path))
    return figures


# ---- the paper's claims, checked against the data ------------------------------------------------------


def direction(diff: tuple[float, float, int], expected: int) -> str:
    """agrees / disagrees when the paired difference is resolved from seed noise, else says why not."""
    if diff[2] == 0:
        return "missing"
    if not resolved(diff):
        return NOT_RESOLVED
    return "agrees" if (diff[0] > 0) == (expected > 0) else "disagrees"


def _columns(study: Study, cell: str, row: str, test) -> list[str]:
    return [c for c in study.cells[cell]["columns"]
            if study.results.get((cell, row, c)) and all(test(r.config) for _, r in study.results[(cell, row, c)])]


def claims(study: Study) -> list[tuple[str, str, str]]:
    """(the paper's finding, ours as computed, verdict) for every cell the study ran."""
    out: list[tuple[str, str, str]] = []
    cells = study.cells
    main_rows = cells.get("main", {}).get("rows", [])
    for opt, (ps, pa, pe) in PAPER_360M.items():
        if opt not in main_rows:
            continue
        s, a, e = (stat(study, "main", opt, c) for c in MAIN_COLUMNS)
        gap = paired(a, s)
        out.append((f"{opt}: one-step delay raises the loss (360M: {ps:.3f} → {pa:.3f}, gap {pa - ps:+.3f})",
                    f"gap {fmt_diff(gap)}", direction(gap, +1)))
        ef = paired(e, a)
        closed = closes(study, "main", opt, "2bw_ef", "sync", "2bw")
        out.append((f"{opt}: EF lowers the delayed loss (360M: {pa:.3f} → {pe:.3f}, {(pa - pe) / (pa - ps):.0%} of the gap)",
                    f"async+EF − async {fmt_diff(ef)}; gap closed {closed}", direction(ef, -1)))
    ranked = [o for o in PAPER_360M if o in main_rows]
    if len(ranked) > 1:
        out.append(_gap_ordering(study, ranked))
    for row in cells.get("ef_lambda", {}).get("rows", []):
        out.append(_best_lambda(study, row))
    for name, finding, expected in (("grad_ef", "gradient-level EF diverges (Fig. 19)", +1),
                                    ("dc_asgd", "no DC-ASGD coefficient beats plain delay (Fig. 14)", 0)):
        for row in cells.get(name, {}).get("rows", []):
            out.append(_treatments_vs_2bw(study, name, row, finding, expected))
    for row in cells.get("sync_start", {}).get("rows", []):
        starts = _columns(study, "sync_start", row, lambda c: c["staleness"]["sync_start_steps"] > 0)
        efs = _columns(study, "sync_start", row, lambda c: c["staleness"]["ef_lambda"] > 0)
        diff = paired(stat(study, "sync_start", row, efs[0]), stat(study, "sync_start", row, starts[0])) \
            if starts and efs else (math.nan, math.nan, 0)
        out.append((f"{row}: EF beats synchronous start (Fig. 2)", f"EF − sync start {fmt_diff(diff)}", direction(diff, -1)))
    for row in cells.get("pipedream", {}).get("rows", []):
        out.append(_pipedream(study, row))
    if "momentum" in cells:
        out.append(_momentum(study))
    return out


def _gap_ordering(study: Study, ranked: list[str]) -> tuple[str, str, str]:
    """The paper's order of the gaps, checked pair by pair (per-seed gaps of neighbours, paired t-test)."""
    paper = sorted(ranked, key=lambda o: PAPER_360M[o][0] - PAPER_360M[o][1])  # largest gap first
    gaps = {o: gap_stat(study, "main", o, "2bw", "sync") for o in paper}
    if any(not g.values for g in gaps.values()):
        return "gap ordering " + " > ".join(paper), "—", "missing"
    steps = [paired(gaps[hi], gaps[lo]) for hi, lo in itertools.pairwise(paper)]
    ours = " > ".join(f"{o} ({gaps[o].mean:+.4f})" for o in sorted(paper, key=lambda o: -gaps[o].mean))
    ours += "; " + ", ".join(f"{hi} − {lo} {fmt_diff(d)}" for (hi, lo), d in zip(itertools.pairwise(paper), steps))
    verdicts = [direction(d, +1) for d in steps]
    verdict = "disagrees" if "disagrees" in verdicts else "agrees" if set(verdicts) == {"agrees"} else NOT_RESOLVED
    return "gap ordering " + " > ".join(paper), ours, verdict


def _best_lambda(study: Study, row: str) -> tuple[str, str, str]:
    """The claim is about where the optimum lies, so the best arm at λ ≥ 1 is paired (over seeds) with the
    best arm at λ < 1: which λ has the lowest mean is not evidence until that difference is resolved.
    Picking each group's best before the test slightly favours resolving (a selection effect); with a
    handful of arms and seeds that is kept rather than a multiple-comparison correction."""
    cols = [c for c in study.cells["ef_lambda"]["columns"] if study.xs.get(("ef_lambda", row, c)) is not None]
    stats = {c: stat(study, "ef_lambda", row, c) for c in cols}
    finding = f"{row}: the best λ is ≥ 1 (Fig. 15: AdamW, Muon, SOAP best somewhat above 1)"
    lam = {c: study.xs[("ef_lambda", row, c)] for c in cols}
    high, low = [c for c in cols if lam[c] >= 1], [c for c in cols if lam[c] < 1]
    if not (high and low) or any(not stats[c].values for c in cols):
        return finding, "some λ missing", "missing"
    best = min(cols, key=lambda c: stats[c].mean)
    best_high, best_low = (min(group, key=lambda c: stats[c].mean) for group in (high, low))
    diff = paired(stats[best_low], stats[best_high])  # > 0: the best λ ≥ 1 is lower
    ours = (f"best λ = {lam[best]:g} ({stats[best].mean:.4f}); "
            f"λ={lam[best_low]:g} − λ={lam[best_high]:g} {fmt_diff(diff)}")
    return finding, ours, direction(diff, +1)


def _treatments_vs_2bw(study: Study, cell: str, row: str, finding: str, expected: int) -> tuple[str, str, str]:
    """expected +1: every treatment is worse than plain 2BW (or diverges); 0: none is better."""
    base = _columns(study, cell, row, is_plain_2bw)
    treat = [c for c in study.cells[cell]["columns"] if c not in base + _columns(study, cell, row, is_sync)]
    if not base or not treat:
        return f"{row}: {finding}", "—", "missing"
    parts, verdicts = [], []
    for c in treat:
        st = stat(study, cell, row, c)
        diverged = st.statuses.get("diverged", 0)
        diff = paired(st, stat(study, cell, row, base[0]))
        parts.append(f"{c}: " + (f"{diverged}/{st.planned} diverged" if diverged else f"vs 2BW {fmt_diff(diff)}"))
        if expected > 0:
            verdicts.append("agrees" if diverged == st.planned else direction(diff, +1))
        else:
            # "none is better" is only supported once a better treatment could have been detected (>= 2 pairs)
            verdicts.append("missing" if diff[2] == 0 else "disagrees" if resolved(diff) and diff[0] < 0
                            else "agrees" if diff[2] >= 2 else NOT_RESOLVED)
    verdict = next((v for v in ("missing", "disagrees") if v in verdicts), None) or (
        "agrees" if all(v == "agrees" for v in verdicts) else NOT_RESOLVED)
    return f"{row}: {finding}", "; ".join(parts), verdict


def _pipedream(study: Study, row: str) -> tuple[str, str, str]:
    finding = f"{row}: original PipeDream degrades as P grows, 2BW does not (Fig. 6)"
    sync_col, base = reference(study, "pipedream", row, is_sync), reference(study, "pipedream", row, is_plain_2bw)
    pds = sorted((study.xs[("pipedream", row, c)], c) for c in study.cells["pipedream"]["columns"]
                 if study.xs.get(("pipedream", row, c)) is not None)
    if not (sync_col and base and pds):
        return finding, "—", "missing"
    gaps = [paired(stat(study, "pipedream", row, c), stat(study, "pipedream", row, sync_col)) for _, c in pds]
    worst = paired(stat(study, "pipedream", row, pds[-1][1]), stat(study, "pipedream", row, base))
    ours = ", ".join(f"P={p:g}: {fmt_diff(g)}" for (p, _), g in zip(pds, gaps)) + f"; P={pds[-1][0]:g} vs 2BW {fmt_diff(worst)}"
    if any(g[2] == 0 for g in gaps) or worst[2] == 0:
        return finding, ours, "missing"
    rising = all(a[0] <= b[0] for a, b in itertools.pairwise(gaps))
    if rising and resolved(worst) and worst[0] > 0:
        return finding, ours, "agrees"
    return finding, ours, "disagrees" if resolved(worst) and worst[0] < 0 or not rising and resolved(worst) \
        else NOT_RESOLVED


def _momentum(study: Study) -> tuple[str, str, str]:
    finding = "higher momentum, smaller sync-async gap (Fig. 4)"
    rows = study.cells["momentum"]["rows"]
    keyed = []
    for row in rows:
        sync_col, base = reference(study, "momentum", row, is_sync), reference(study, "momentum", row, is_plain_2bw)
        x = study.xs.get(("momentum", row, base)) if base else None
        if sync_col and base and x is not None:
            keyed.append((x, gap_stat(study, "momentum", row, base, sync_col)))
    if len(keyed) < 2:
        return finding, "—", "missing"
    keyed.sort(key=lambda t: t[0])
    diff = paired(keyed[-1][1], keyed[0][1])  # gap at the highest momentum minus gap at the lowest, per seed
    ours = ", ".join(f"{x:g}: {g.mean:+.4f}" if g.values else f"{x:g}: —" for x, g in keyed)
    ours += f"; highest − lowest {fmt_diff(diff)}"
    return finding, ours, direction(diff, -1)


# ---- the document --------------------------------------------------------------------------------------


def _setup(study: Study) -> list[str]:
    m = study.manifests[0]
    runs = [r for rs in study.results.values() for _, r in rs]
    cfg = runs[0].config if runs else {}
    t = cfg.get("train", {})
    tokens = t.get("micro_batch_size", 0) * t.get("num_microbatches", 0) * t.get("seq_len", 0)
    done = {r.name: r for r in runs if r.status == "done"}
    step_times = [r.step_time_s for r in done.values() if math.isfinite(r.step_time_s)]
    main = [r for (cell, _, _), rs in study.results.items() if cell == "main" for _, r in rs] or runs
    opts = {r.config["optimizer"]["name"]: r.config["optimizer"] for r in main}
    lines = [
        f"- plan `{m['plan']}` ({m['label']}): {m['description']}",
        (f"- model `{cfg.get('model', {}).get('name')}`, {m['steps']} steps of {tokens} tokens "
         f"({t.get('micro_batch_size')} × {t.get('num_microbatches')} microbatches × {t.get('seq_len')} tokens"
         + (f"; after a batch rampup {t['batch_rampup']}, the per-step record's global_batch_size"
            if t.get("batch_rampup") else "") + "), "
         f"seeds {m['seeds']}; validation every {t.get('eval_every')} steps on {t.get('eval_batches')} batches"),
        f"- runs: {len({r.name for r in runs})} planned, {len(done)} finished; mean step time "
        + (f"{statistics.fmean(step_times):.3f} s" if step_times else "—"),
        "- optimizers (the same settings for every arm): " + "; ".join(
            f"{n} lr {o['lr']:g} wd {o['weight_decay']:g} betas {tuple(o['betas'])} momentum {o['momentum']:g}"
            for n, o in sorted(opts.items())),
        "- what differs between the columns of a row (same seed), read from every run's config.json: "
        + (", ".join(f"`{k}`" for k in arm_differences(study)) or "nothing"),
    ]
    return lines


def arm_differences(study: Study) -> list[str]:
    """Config keys that differ between runs of one (cell, row, seed): the arms must differ in nothing else."""
    keys: set[str] = set()
    for cell, spec in study.cells.items():
        for row in spec["rows"]:
            by_seed: dict[int, list[dict]] = defaultdict(list)
            for column in spec["columns"]:
                for seed, r in study.results.get((cell, row, column), []):
                    by_seed[seed].append(r.config)
            for configs in by_seed.values():
                keys.update(k for c in configs[1:] for k in config_diff(configs[0], c))
    return sorted(keys)


def _banner(study: Study) -> list[str]:
    labels = {m["label"] for m in study.manifests}
    if labels == {"study"}:
        runs = {r.name: r.status for results in study.results.values() for _, r in results}
        ended = sum(status not in ("pending", "interrupted") for status in runs.values())  # failed/diverged ended
        if ended == len(runs):
            return []
        return [(f"> **The study is still running: {ended} of {len(runs)} runs have ended.** Runs go seed by "
                "seed, so most cells have fewer seeds than planned (n/planned below) and their verdicts are "
                "provisional; with one seed no difference can be called significant. Rerunning the study command "
                "resumes it; rerunning the report command updates this page."), ""]
    banner = (f"> **This is a {', '.join(sorted(labels))}, not the study.** Its runs are "
              f"{', '.join(str(m['steps']) for m in study.manifests)} steps long and prove that the pipeline works "
              "end to end (runs → tables → plots → verdicts); they are far too short to confirm or refute the "
              "paper. The study itself: `python -m tools.study run --plan full --out outputs/study --jobs 2`, "
              "then `python -m tools.report outputs/study --out docs/reproduction.md`.")
    return [banner, ""]


def _commands(study: Study, argv: list[str]) -> list[str]:
    lines = ["```bash"]
    for out, m in zip(study.dirs, study.manifests):
        lines += [f"# {out}: {inv['time']}" + "\n" + inv["command"] for inv in m["invocations"]]
        first = m["runs"][0]
        lines.append(f"# one of its runs by hand:\npython pretrain.py +experiment={m['experiment']} "
                     + " ".join(shlex.quote(o) for o in first["overrides"]) + f" hydra.run.dir={out}/{first['name']}")
    lines += ["python -m tools.report " + shlex.join(argv), "```"]
    return lines


def _not_done(study: Study) -> list[str]:
    seen, rows = set(), []
    for (cell, row, column), runs in study.results.items():
        for seed, r in runs:
            if r.status != "done" and r.name not in seen:
                seen.add(r.name)
                rows.append([r.name, r.status, cell, f"{row} / {column} / seed {seed}"])
    if not rows:
        return ["Every planned run finished."]
    return [table(["run", "status", "first cell", "row / column / seed"], rows)]


def tally(found: list[tuple[str, str, str]]) -> str:
    """One line that counts the verdicts, so a reader sees the balance before reading the rows."""
    counts = Counter(verdict for _, _, verdict in found)
    parts = ", ".join(f"{n} {verdict}" for verdict, n in counts.most_common())
    return (f"Verdicts over {len(found)} findings: {parts}. Magnitudes are not comparable with the paper's "
            "(a far smaller model, far fewer tokens); the findings compare directions and orderings.")


def render(study: Study, out: Path, argv: list[str]) -> str:
    plot_dir = out.parent / out.stem
    figures = draw(study, plot_dir)
    intro = ("Generated by `tools.report` from the run directories below; every number is computed from their "
             "`summary.json`/`metrics.jsonl`. Values are the final validation loss, mean ± std over seeds (n/planned "
             "when some are missing). Differences (Δ, gap) are paired by seed (same initialisation and data order) "
             "and marked (n.s.) when a paired t-test over seeds does not tell them from zero at 95%.")
    doc = ["# Reproduction: sync vs one-step-delayed (PipeDream-2BW) training", "", *_banner(study), intro, "",
           "## Setup", "", *_setup(study), "", "## Commands", "", *_commands(study, argv), ""]
    if "main" in study.cells:
        doc += ["## " + study.cells["main"]["title"], "", main_table(study), "",
                "Gap closed by EF = (async − async+EF) / (async − sync).", ""]
    for name, cell in study.cells.items():
        if name != "main":
            doc += [f"## {cell['title']} (`{name}`)", "", cell_table(study, name), ""]
    found = claims(study)
    doc += ["## Comparison with the paper (SmolLM2-360M and its ablations)", "",
            ("The paper's findings as reported (digest of arXiv 2606.30634); ours computed from this study. "
             "A verdict needs the difference to pass the paired t-test above; otherwise it is not resolved."), "",
            table(["paper", "this study", "verdict"], [list(c) for c in found]), "",
            tally(found), "", "## Figures", ""]
    doc += [f"**{caption}**\n\n![{path.stem}]({plot_dir.name}/{path.name})\n" for caption, path in figures]
    doc += ["## Runs not finished", "", *_not_done(study), ""]
    return "\n".join(doc)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m tools.report", description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", type=Path, help="study directories (each with a study.json)")
    p.add_argument("--out", type=Path, default=Path("docs/reproduction.md"), help="the Markdown file; figures go "
                   "to a directory beside it with its stem (docs/reproduction/)")
    args = p.parse_args(argv)
    try:
        study = load_study(args.dirs)
    except PlanError as e:
        print(f"report error: {e}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(study, args.out, argv))
    print(f"[report] wrote {args.out} and its figures in {args.out.parent / args.out.stem}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
