"""Study directories -> docs/reproduction.md: tables, plots and a computed comparison with the paper.

    python -m tools.report /root/asyncpp-study --out docs/reproduction.md
    python -m tools.report outputs/study outputs/study_extra --out docs/reproduction.md   # several sweeps

Every number in the report is computed from the study directories (tools.report_data reads them); the
paper's numbers are the only constants (tools.report_findings.PAPER_360M), and the verdicts comparing the
two are computed by a rule fixed in advance (tools.report_stats). The rerun plan's own cells (the LR grid,
AdamW's learning rate, the long gradient-level EF runs) have their sections in tools.report_cells; the cost,
hosts and commits in tools.report_cost. A planned run that has not finished is reported, never dropped,
and a finding whose runs have not all ended is pending: no verdict.
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

from tools import plots, report_cells
from tools.report_cost import checks_section, cost_section, scale_section
from tools.report_data import (
    MAIN_COLUMNS,
    Study,
    closes,
    columns_where,
    ended,
    fmt_diff,
    fmt_stat,
    is_plain_2bw,
    is_sync,
    load_study,
    paired,
    reference,
    stat,
    table,
)
from tools.report_findings import Finding, findings, reading
from tools.report_stats import MARGIN_FRACTION
from tools.study import PlanError, config_diff

OWN_SECTIONS = ("adamw_lr", "grad_ef_long")
"""Cells with their own section and figure (tools.report_cells) besides their table."""


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
        on_2bw = columns_where(study, name, row, lambda c: c["schedule"]["name"] == "2bw")
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


GAP_OVER_STEPS = ("momentum", "momentum_adamw_part", "dc_asgd")
"""Cells whose section also shows each arm's gap to sync at every evaluation: the momentum trend is a question of
when the gap closes, and DC-ASGD's correction of when it acts, which the final loss alone does not show."""


def gap_steps_table(study: Study, name: str) -> list[str]:
    """Per row and arm (every column but sync), the paired gap to sync (mean ± SD over seeds) at each evaluation."""
    rows, steps = [], []
    for row in study.cells[name]["rows"]:
        sync_col = reference(study, name, row, is_sync)
        for column in [c for c in study.cells[name]["columns"] if sync_col and c != sync_col]:
            at = [dict(zip(*c)) for c in gap_curves(study, name, row, column, sync_col)]
            steps = steps or (sorted(set.intersection(*(set(a) for a in at))) if at else [])
            rows.append([row, column, str(len(at)),
                         *(f"{statistics.fmean(g):+.3f} ± {statistics.stdev(g):.3f}" if len(g) > 1
                           else f"{g[0]:+.3f}" if g else "—"
                           for g in ([a[s] for a in at if s in a] for s in steps))])
    return [("Each arm's gap to sync at every evaluation (validation loss, paired by seed, mean ± SD): when it "
             "opens and how fast it closes."), "",
            table(["row", "column", "seeds", *(f"step {s}" for s in steps)], rows), ""]


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
    if study.cells.get("main", {}).get("rows"):  # no rows yet: the cell waits for the tune grid
        rows = study.cells["main"]["rows"]
        panels = {row: {c: curves(study, "main", row, c) for c in MAIN_COLUMNS} for row in rows}
        figures.append(("Validation loss, sync and async overlaid (mean over seeds; band: min to max)",
                        plots.curves_panels(panels, plot_dir / "loss_curves.png", "validation loss", "val loss")))
        gaps = {row: {c: gap_curves(study, "main", row, c, "sync") for c in MAIN_COLUMNS[1:]} for row in rows}
        figures.append(("Gap to sync over training, runs paired by seed (mean; band: min to max over seeds)",
                        plots.curves_panels(gaps, plot_dir / "gap_over_time.png", "val loss − sync (same seed)",
                                            "Δ val loss", zero_line=True)))
    grids = set(report_cells.tune_cells(study))
    for name, cell in study.cells.items():
        if not cell.get("x") or name in grids or name in OWN_SECTIONS:
            continue
        series, refs = sweep_points(study, name)
        xs = [p[0] for pts in series.values() for p in pts if p[0] > 0]
        log_x = bool(xs) and min(xs) > 0 and max(xs) / min(xs) > 50 and all(p[0] > 0 for v in series.values() for p in v)
        path = plots.gap_vs_x(series, refs, plot_dir / f"gap_vs_{name}.png", cell["title"], cell["x"],
                              "final val loss − sync (paired)", log_x=log_x)
        figures.append((f"{cell['title']}: gap to sync against {cell['x']}", path))
    return figures


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
        "- seeds per cell (chosen from the paired SD the old study measured: with n seeds a paired t-test at 95% "
        "detects |mean| / SD ≥ t(n−1)/√n; the plan file gives the table; a `<cell>_more_seeds` cell was added "
        "where a finding was undecided at its planned seeds, at the count this study's paired SD implies, its "
        "first seeds being the earlier runs; the plan file gives each one's figures): "
        + ", ".join(f"`{c['name']}` {len(c.get('seeds') or m['seeds'])}" for c in m["cells"]),
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
    if "pilot" not in labels:
        runs = {r.name: r.status for results in study.results.values() for _, r in results}
        done = sum(status not in ("pending", "interrupted") for status in runs.values())  # failed/diverged ended
        waiting = report_cells.waits_for_tune(study)
        if done == len(runs) and not waiting:
            return []
        more = " (and the cells that use the tune grid's winners, not planned until it ends)" if waiting else ""
        return [(f"> **The study is still running: {done} of {len(runs)} runs have ended{more}.** A cell whose runs have "
                 "not all ended is *pending* (n of N runs below) and gets no verdict. Rerunning the study command "
                 "resumes it; rerunning the report command updates this page."), ""]
    banner = (f"> **This is a {', '.join(sorted(labels))}, not the study.** Its runs are "
              f"{', '.join(str(m['steps']) for m in study.manifests)} steps long and prove that the pipeline works "
              "end to end (runs → tables → plots → verdicts); they are far too short to confirm or refute the "
              "paper. The study itself: `python -m tools.study run --plan rerun --out /root/asyncpp-study --jobs 2`, "
              "then `python -m tools.report /root/asyncpp-study --out docs/reproduction.md`.")
    return [banner, ""]


def cell_progress(study: Study) -> list[str]:
    """Runs ended per cell (n of N): the cells still pending are named, so no reader takes them as decided."""
    rows = []
    for name in study.cells:
        stats = [stat(study, c, r, k) for (c, r, k) in study.results if c == name]
        done, planned = ended(stats)
        state = "complete" if done == planned else "**pending**"
        rows.append([f"`{name}`", f"{done} of {planned}", state if planned else "**pending** (waits for the tune grid)"])
    return [table(["cell", "runs ended", "state"], rows)]


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
    """Runs that ended without a result (failed, diverged) or were cut off (interrupted) by name; runs not
    started yet as a count per cell (a study part-way through has hundreds)."""
    seen, rows, waiting = set(), [], Counter()
    for (cell, row, column), runs in study.results.items():
        for seed, r in runs:
            if r.status != "done" and r.name not in seen:
                seen.add(r.name)
                if r.status == "pending":
                    waiting[cell] += 1
                else:
                    rows.append([r.name, r.status, cell, f"{row} / {column} / seed {seed}"])
    if not rows and not waiting:
        return ["Every planned run finished."]
    out = [table(["run", "status", "first cell", "row / column / seed"], rows), ""] if rows else []
    if waiting:
        out.append(f"Not started yet: {sum(waiting.values())} runs (" + ", ".join(
            f"`{cell}` {n}" for cell, n in waiting.items()) + "; a run shared by cells counts in the first).")
    return out


def tally(found: list[Finding]) -> str:
    """One line that counts the verdicts, so a reader sees the balance before reading the rows."""
    counts = Counter(f.verdict.word for f in found)
    parts = ", ".join(f"{n} {verdict}" for verdict, n in counts.most_common())
    return (f"Verdicts over {len(found)} findings: {parts}. Magnitudes are not comparable with the paper's "
            "(a far smaller model, far fewer tokens); the findings compare directions and orderings.")


RULE = ("Each finding is decided on its per-seed paired differences once every planned run of its arms has ended: "
        "**agrees** / **disagrees** when a two-sided paired t-test gives p < 0.05; otherwise, where the finding has "
        f"an equivalence margin, a TOST at 90% against it (margins, fixed in tools/report_findings.py before the data: "
        f"{MARGIN_FRACTION:g} of the delay's gap of the same row, or of the paper's relative gap for the gap itself, "
        f"or of Muon's gap at momentum 0.95 for the momentum trend); an effect inside the margin is absent "
        "(a disagreement where the paper reports it). Otherwise **undecided at n seeds**, with the seed count the "
        "paired SD implies. **pending**: runs still to come; no verdict.")


def findings_table(found: list[Finding]) -> str:
    return table(["finding (the paper)", "the paper", "this study", "paired test", "verdict", "explanation"],
                 [[f.paper, f.paper_figure, f.ours, f.verdict.test, f.verdict.text(), f.explanation()] for f in found])


def _cell_sections(study: Study, plot_dir: Path) -> tuple[list[str], list[tuple[str, Path]]]:
    doc, figures = [], []
    grids = report_cells.tune_cells(study)
    for name in grids:
        text, figs = report_cells.lr_grid(study, name, plot_dir)
        doc += [f"## {study.cells[name]['title']} (`{name}`)", "", *text]
        figures += figs
    if "main" in study.cells:
        doc += ["## " + study.cells["main"]["title"], "", main_table(study), "",
                "Gap closed by EF = (async − async+EF) / (async − sync).", "", *report_cells.step_table(study, "main")]
        if text := reading("main"):
            doc += [text, ""]
    own = {"adamw_lr": report_cells.adamw_lr, "grad_ef_long": report_cells.grad_ef_long}
    for name, cell in study.cells.items():
        if name == "main" or name in grids:
            continue
        doc += [f"## {cell['title']} (`{name}`)", ""]
        if name in own:  # its own table replaces the generic one
            text, figs = own[name](study, plot_dir)
            doc += text
            figures += figs
        else:
            doc += [cell_table(study, name), ""]
        if name in GAP_OVER_STEPS:
            doc += gap_steps_table(study, name)
        if name in report_cells.STEP_DIAGNOSED:
            doc += report_cells.step_table(study, name)
        if text := reading(name):
            doc += [text, ""]
    return doc, figures


def render(study: Study, out: Path, argv: list[str]) -> str:
    plot_dir = out.parent / out.stem
    figures = draw(study, plot_dir)
    intro = ("Generated by `tools.report` from the run directories below; every number is computed from their "
             "`summary.json`/`metrics.jsonl`/`study_status.json`. Values are the final validation loss, mean ± std "
             "over seeds (n/planned when some are missing). Differences (Δ, gap) are paired by seed (same "
             "initialisation and data order) and marked (n.s.) when a paired t-test over seeds does not tell them "
             "from zero at 95%.")
    doc = ["# Reproduction: sync vs one-step-delayed (PipeDream-2BW) training", "", *_banner(study), intro, "",
           "## Setup", "", *_setup(study), "", *cell_progress(study), "", "## Commands", "", *_commands(study, argv), ""]
    sections, cell_figures = _cell_sections(study, plot_dir)
    found = findings(study)
    doc += sections + ["## Findings: the paper against this study", "", RULE, "", findings_table(found), "",
                       tally(found), "", "## What it cost, where it ran, on which commits", "", *cost_section(study), "",
                       *([cost_reading, ""] if (cost_reading := reading("cost")) else []),
                       "### Checks that tie the runs to the final code", "", *checks_section(plot_dir / "checks.json"), "",
                       *([checks_reading, ""] if (checks_reading := reading("checks")) else []),
                       "## What a CPU-scale study can and cannot say about the 360M and 10B results", "",
                       *scale_section(study), "", "## Figures", ""]
    doc += [f"**{caption}**\n\n![{path.stem}]({plot_dir.name}/{path.name})\n" for caption, path in figures + cell_figures]
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

