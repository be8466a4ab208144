"""The rerun plan's own sections of the report: the learning-rate grid, AdamW's gap against the learning rate,
and gradient-level EF over the longer horizon (tables as Markdown, figures through tools.plots)."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path

from tools import plots
from tools.report_data import (
    EARLY_FRACTION,
    MAIN_COLUMNS,
    RunResult,
    Stat,
    Study,
    closes,
    first_nonfinite,
    fmt_diff,
    fmt_stat,
    is_plain_2bw,
    is_sync,
    paired,
    reference,
    stat,
    table,
)

SMOOTH_STEPS = 10
"""Training-loss curves are shown as a trailing mean over this many steps (one step's loss is one batch's)."""


def _tune(study: Study) -> dict:
    return next((m["tune"] for m in study.manifests if m.get("tune")), {})


def waits_for_tune(study: Study) -> bool:
    """The plan has a tune grid that has not ended: its other cells have no runs planned yet."""
    return any(m.get("tune") and m["tune"].get("winners") is None for m in study.manifests)


def tune_cells(study: Study) -> list[str]:
    """The tune grid's cells (study.json "tune"), in plan order."""
    grids = _tune(study).get("cells", [])
    return [name for name in study.cells if name in grids]


def _grid_points(study: Study, name: str) -> dict[str, list[tuple[float, Stat]]]:
    """optimizer -> [(lr, the grid cell's Stat there)] in lr order."""
    by_opt: dict[str, list[tuple[float, Stat]]] = defaultdict(list)
    for row in study.cells.get(name, {}).get("rows", []):
        for column in study.cells[name]["columns"]:
            runs = study.results.get((name, row, column), [])
            if runs:
                by_opt[runs[0][1].config["optimizer"]["name"]].append((study.xs[(name, row, column)],
                                                                       stat(study, name, row, column)))
    return {opt: sorted(points, key=lambda p: p[0]) for opt, points in by_opt.items()}


def lr_grid(study: Study, name: str, plot_dir: Path) -> tuple[list[str], list[tuple[str, Path]]]:
    """Per optimizer: lr -> final validation loss on sync, the recorded winner (study.json "tune") marked; the
    report checks the recorded winner against the lowest mean it computes. One figure: loss against lr."""
    winners = _tune(study).get("winners") or {}
    out: list[str] = []
    points = _grid_points(study, name)
    for opt, stats in points.items():
        best = min(stats, key=lambda p: p[1].mean)[0] if all(s.values for _, s in stats) else None
        won = winners.get(opt)
        rows = [[f"{lr:g}", fmt_stat(s), "**winner**" if won is not None and math.isclose(lr, float(won)) else ""]
                for lr, s in stats]
        note = f"winner {won}, as study.json records it" if won is not None else "winner pending: the grid has not ended"
        if won is not None and best is not None and not math.isclose(best, float(won)):
            note += f"; **the lowest mean here is at {best:g}**: the report and the study disagree"
        out += [f"**{opt}** ({note})", "", table(["lr", "final val loss", ""], rows), ""]
    series = {opt: [(lr, s.mean, s.std) for lr, s in stats] for opt, stats in points.items()}
    path = plots.gap_vs_x(series, {}, plot_dir / f"{name}.png", study.cells[name]["title"], "optimizer.lr",
                          "final val loss (sync)", log_x=True, zero_line=False)
    return out, [(f"{study.cells[name]['title']}: final validation loss against the learning rate", path)]


def _lr_arms(study: Study) -> list[tuple[float, str, str]]:
    """(lr, cell, row) of AdamW's learning-rate arms: the adamw_lr cell's rows and the main table's AdamW row."""
    arms = []
    for cell, rows in (("adamw_lr", study.cells.get("adamw_lr", {}).get("rows", [])),
                       ("main", [r for r in study.cells.get("main", {}).get("rows", []) if r == "adamw"])):
        for row in rows:
            runs = study.results.get((cell, row, "sync"), [])
            if runs:
                arms.append((runs[0][1].config["optimizer"]["lr"], cell, row))
    return sorted(arms)


def adamw_lr(study: Study, plot_dir: Path) -> tuple[list[str], list[tuple[str, Path]]]:
    """AdamW's 2BW gap and EF's closure per learning rate, and their plot against the learning rate."""
    arms = _lr_arms(study)
    if not arms:
        return [], []
    rows, gap_pts, ef_pts = [], [], []
    for lr, cell, row in arms:
        s, a, e = (stat(study, cell, row, c) for c in MAIN_COLUMNS)
        gap, ef_gap = paired(a, s), paired(e, s)
        rows.append([f"{lr:g}", f"`{cell}`", fmt_stat(s), fmt_stat(a), fmt_stat(e), fmt_diff(gap), fmt_diff(ef_gap),
                     closes(study, cell, row, "2bw_ef", "sync", "2bw")])
        gap_pts.append((lr, gap[0], gap[1]))
        ef_pts.append((lr, ef_gap[0], ef_gap[1]))
    text = [table(["lr", "from", "sync", "2BW", "2BW + EF", "gap 2BW − sync", "gap 2BW+EF − sync", "gap closed by EF"],
                  rows), "", *_training_loss_table(study, arms)]
    path = plots.gap_vs_x({"2BW − sync": gap_pts, "2BW + EF − sync": ef_pts}, {}, plot_dir / "adamw_gap_vs_lr.png",
                          "AdamW: the delay's gap and EF's against the learning rate", "optimizer.lr",
                          "final val loss − sync (paired)", log_x=True)
    panels = {f"lr {lr:g}: training loss ({SMOOTH_STEPS}-step mean)": {c: _smoothed_runs(study, cell, row, c)
                                                                       for c in MAIN_COLUMNS}
              for lr, cell, row in arms}
    curves = plots.curves_panels(panels, plot_dir / "adamw_train_loss_vs_lr.png",
                                 "AdamW: training loss per learning rate", "loss")
    caption = ("AdamW: training loss of sync, 2BW and 2BW + EF at each learning rate (mean over seeds; band: min to "
               "max)")
    return text, [("AdamW: gap to sync of 2BW and of 2BW + EF against the learning rate (mean ± SD over seeds)", path),
                  (caption, curves)]


TRAINING_LOSS_STEPS = (20, 60, 100, 140, 200)
"""Where the AdamW table reads the training loss: the end of warmup, then every 40 steps (when the delayed run
stalls, and for how long, is what explains its gap)."""


def _smoothed_runs(study: Study, cell: str, row: str, column: str) -> list[plots.Curve]:
    return [smoothed(r.train_curve) for _, r in study.results.get((cell, row, column), [])
            if r.status == "done" and len(r.train_curve[0]) >= SMOOTH_STEPS]


def _training_loss_table(study: Study, arms: list[tuple[float, str, str]]) -> list[str]:
    """Per learning rate and arm: the smoothed training loss (mean over seeds) at TRAINING_LOSS_STEPS."""
    rows = []
    for lr, cell, row in arms:
        for column in MAIN_COLUMNS:
            steps, mean, _, _ = plots.mean_curve(_smoothed_runs(study, cell, row, column))
            at = dict(zip(steps, mean))
            rows.append([f"{lr:g}", column, *(f"{at[s]:.2f}" if s in at else "—" for s in TRAINING_LOSS_STEPS)])
    return [(f"Training loss ({SMOOTH_STEPS}-step trailing mean, mean over seeds) at chosen steps: where each arm "
             "stalls, and for how long."), "",
            table(["lr", "column", *(f"step {s}" for s in TRAINING_LOSS_STEPS)], rows), ""]


def smoothed(curve: tuple, window: int = SMOOTH_STEPS) -> plots.Curve:
    """Trailing mean of a per-step curve over `window` steps (NaN once a non-finite loss is inside the window)."""
    steps, values = curve
    return (list(steps)[window - 1:], [statistics.fmean(values[i - window + 1:i + 1])
                                       for i in range(window - 1, len(values))])


def when(r: RunResult) -> str:
    """When a run diverged (its first non-finite training loss), or where its validation loss bottomed out."""
    bad = first_nonfinite(r)
    if bad is not None:
        return f"non-finite at step {bad}"
    if r.status != "done" or not r.curve[0]:
        return r.status
    low = min(range(len(r.curve[1])), key=lambda i: r.curve[1][i])
    return f"lowest val at step {r.curve[0][low]}, final − lowest {r.curve[1][-1] - r.curve[1][low]:+.4f}"


def grad_ef_long(study: Study, plot_dir: Path) -> tuple[list[str], list[tuple[str, Path]]]:
    """Each arm of grad_ef_long: final loss, Δ to 2BW, and per seed when it diverged; the loss curves."""
    cell = study.cells.get("grad_ef_long")
    if not cell or not cell["rows"]:  # no rows yet: the cell waits for the tune grid
        return [], []
    rows, panels = [], {}
    for row in cell["rows"]:
        base, sync_col = reference(study, "grad_ef_long", row, is_plain_2bw), reference(study, "grad_ef_long", row, is_sync)
        train, val = {}, {}
        for column in cell["columns"]:
            runs = study.results.get(("grad_ef_long", row, column), [])
            st = stat(study, "grad_ef_long", row, column)
            # Δ vs sync for every other arm; Δ vs 2BW for the treatments only (not for sync itself)
            vs = [fmt_diff(paired(st, stat(study, "grad_ef_long", row, ref))) if ref and column not in skip else "—"
                  for ref, skip in ((sync_col, {sync_col}), (base, {sync_col, base}))]
            rows.append([row, column, fmt_stat(st), *vs,
                         "; ".join(f"seed {seed}: {when(r)}" for seed, r in runs)])
            train[column] = [smoothed(r.train_curve) for _, r in runs if len(r.train_curve[0]) >= SMOOTH_STEPS]
            val[column] = [r.curve for _, r in runs if r.curve[0]]
        panels[f"{row}: training loss ({SMOOTH_STEPS}-step mean)"] = train
        panels[f"{row}: validation loss"] = val
    path = plots.curves_panels(panels, plot_dir / "grad_ef_long.png", "gradient-level EF over the longer horizon", "loss")
    text = [table(["row", "column", "final val loss", "Δ vs sync", "Δ vs 2BW", "per seed"], rows), ""]
    return text, [("Gradient-level EF over the longer horizon: loss curves per arm (mean over seeds; band: min to max)",
                   path)]


STEP_DIAGNOSED = ("main", "main_more_seeds", "ef_lambda", "ef_lambda_more_seeds", "grad_ef", "grad_ef_long",
                  "grad_ef_long_more_seeds", "dc_asgd")
"""Cells of corrections (of the update or of the gradient): their section also shows what each arm did to the
step, where a final loss alone cannot say why a correction helped or hurt."""


def step_table(study: Study, name: str) -> list[str]:
    """Per arm, over each run's second half, mean over the finished seeds: the grad norm (after the correction,
    before clipping), the share of steps clipped to train.grad_clip, and the update's norm."""
    rows = []
    for row in study.cells[name]["rows"]:
        for column in study.cells[name]["columns"]:
            late = [r.late for _, r in study.results.get((name, row, column), []) if r.status == "done" and r.late]
            if not late:
                rows.append([row, column, "—", "—", "—", "—", "0"])
                continue
            mean = {k: statistics.fmean(x[k] for x in late)
                    for k in ("early_grad_norm", "grad_norm", "clipped", "update_norm")}
            rows.append([row, column, f"{mean['early_grad_norm']:.3f}", f"{mean['grad_norm']:.3f}",
                         f"{mean['clipped']:.0%}", f"{mean['update_norm']:.4f}", str(len(late))])
    return [("What each arm did to the step, over each run's second half (mean over seeds): the gradient's norm "
             "as the optimizer received it (after any gradient correction, before clipping), the share of steps "
             "whose norm exceeded train.grad_clip (clipped to it), and the update's norm ‖x_{t+1} − x_t‖ (after "
             f"any update correction); and the gradient's norm over the first {EARLY_FRACTION:.0%} of the steps, "
             "where a correction that grows with the gradient acts most."), "",
            table(["row", "column", f"grad norm, first {EARLY_FRACTION:.0%}", "grad norm", "steps clipped",
                   "update norm", "seeds"], rows), ""]
