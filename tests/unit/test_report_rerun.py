"""tools.report on a synthetic study shaped like the `rerun` plan: the LR grid with its recorded winner, AdamW's
learning-rate cell, gradient-level EF over a longer horizon, the momentum trend's equivalence test, the cost
from each run's attempts, and pending cells. Expected values are computed here, not by tools.report."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tools import report, report_findings, study

SEEDS = (1, 2, 3)
STEPS, LONG = 30, 60
DIVERGE_AT = 40  # grad_ef1_long's loss is non-finite from this step (0-based) on, in every seed
GRID = {0.001: 5.7, 0.002: 5.4, 0.004: 5.5}  # adamw lr -> final val loss (seed 1); the winner is 0.002
WINNER = "0.002"
# (cell, row, column) -> final val loss per seed; None: never ran; "nan": diverged
FINAL = {
    ("main", "adamw", "sync"): (5.4, 5.5, 5.6),
    ("main", "adamw", "2bw"): (5.9, 6.05, 6.1),
    ("main", "adamw", "2bw_ef"): (5.5, 5.6, None),      # the main cell is pending: 8 of 9 runs
    ("adamw_lr", "adamw-lr0.001", "sync"): (5.7, 5.8, 5.75),
    ("adamw_lr", "adamw-lr0.001", "2bw"): (5.8, 5.95, 5.85),
    ("adamw_lr", "adamw-lr0.001", "2bw_ef"): (5.72, 5.83, 5.76),
    ("adamw_lr", "adamw-lr0.004", "sync"): (5.5, 5.6, 5.55),
    ("adamw_lr", "adamw-lr0.004", "2bw"): (6.5, 6.6, 6.7),
    ("adamw_lr", "adamw-lr0.004", "2bw_ef"): (6.0, 6.1, 6.3),
    ("grad_ef_long", "adamw", "sync_long"): (5.0, 5.1, 5.2),
    ("grad_ef_long", "adamw", "2bw_long"): (5.3, 5.4, 5.5),
    ("grad_ef_long", "adamw", "grad_ef1_long"): ("nan",) * 3,
    # the momentum trend: every gap ~0.21, highest − lowest per seed +0.005, −0.005, 0 (inside 1/4 of 0.21)
    ("momentum", "muon-momentum0.9", "sync"): (4.70, 4.80, 4.90),
    ("momentum", "muon-momentum0.9", "2bw"): (4.90, 5.02, 5.11),
    ("momentum", "muon-momentum0.95", "sync"): (4.70, 4.80, 4.90),
    ("momentum", "muon-momentum0.95", "2bw"): (4.90, 5.01, 5.12),
    ("momentum", "muon-momentum0.98", "sync"): (4.70, 4.80, 4.90),
    ("momentum", "muon-momentum0.98", "2bw"): (4.905, 5.015, 5.11),
}
CPU_S = 90.0  # each attempt's CPU time; one run has two attempts on two hosts
COMMITS = ("a" * 40, "b" * 40)


def config(opt: str, lr: float, schedule: str, seed: int, steps: int = STEPS, ef: float = 0.0, gef: float = 0.0,
           momentum: float = 0.95) -> dict:
    """The fields tools.report reads from a run's config.json (a real one has more; the report compares all)."""
    return {"seed": seed, "model": {"name": "tiny_dense"},
            "train": {"steps": steps, "micro_batch_size": 8, "num_microbatches": 2, "seq_len": 128, "eval_every": 10,
                      "eval_batches": 8},
            "optimizer": {"name": opt, "lr": lr, "weight_decay": 0.1, "betas": [0.9, 0.95], "momentum": momentum},
            "schedule": {"name": schedule},
            "staleness": {"ef_lambda": ef, "grad_ef_lambda": gef, "dc_lambda": 0.0, "sync_start_steps": 0}}


def arm(cell: str, row: str, column: str, seed: int) -> dict:
    lr = float(row.split("lr")[1]) if "-lr" in row else float(WINNER)
    momentum = float(row.split("momentum")[1]) if "momentum" in row else 0.95
    steps = LONG if column.endswith("_long") else STEPS
    return config("muon" if row.startswith("muon") else "adamw", lr, "sync" if column.startswith("sync") else "2bw",
                  seed, steps, ef=1.0 if column == "2bw_ef" else 0.0, gef=1.0 if column == "grad_ef1_long" else 0.0,
                  momentum=momentum)


def write_run(out: Path, name: str, cfg: dict, final: float | str, attempts: list[dict]) -> None:
    d = out / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**cfg, "out_dir": str(d)}))
    steps, diverged = cfg["train"]["steps"], final == "nan"
    lines = []
    for step in range(steps):
        record = {"step": step, "loss": "nan" if diverged and step >= DIVERGE_AT else
                  5.0 if diverged else final + (steps - step - 1) / 200,  # falls to the final val loss
                  "skipped": diverged and step >= DIVERGE_AT}
        if (step + 1) % 10 == 0 and not (diverged and step >= DIVERGE_AT):
            # diverged runs: the val loss falls, then rises before the loss goes non-finite
            record["val_loss"] = (6.0 - step / 100 if step < 25 else 6.0 + step / 100) if diverged else \
                final + (steps - step - 1) / 100
        lines.append(json.dumps(record))
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    rc = 1 if diverged else 0
    (d / study.STATUS).write_text(json.dumps({"returncode": rc, "attempts": attempts}))
    (d / "summary.json").write_text("{}" if diverged else json.dumps({"final_val_loss": final, "stopped_at": None,
                                                                      "mean_step_time_s": 0.5}))


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rerun")
    runs: dict[str, dict] = {}

    def plan_run(name: str, cfg: dict, membership: dict, final) -> None:
        run = runs.setdefault(name, {"name": name, "overrides": [f"seed={cfg['seed']}"], "config": cfg, "cells": []})
        run["cells"].append(membership)
        if final is not None and not (out / name).exists():
            attempts = [{"returncode": 0, "cpu_s": CPU_S, "host": "hostA"}]
            if name == "adamw__2bw__seed2":  # killed once, resumed elsewhere
                attempts = [{"returncode": -9, "cpu_s": CPU_S, "host": "hostA"},
                            {"returncode": 0, "cpu_s": CPU_S, "host": "hostB"}]
            write_run(out, name, cfg, final, attempts)

    for lr, final in GRID.items():
        plan_run(f"adamw-lr{lr:g}__sync__seed1", config("adamw", lr, "sync", 1),
                 {"cell": "lr_grid", "row": f"adamw-lr{lr:g}", "column": "sync", "seed": 1, "x": lr}, final)
    for (cell, row, column), finals in FINAL.items():
        for seed, final in zip(SEEDS, finals):
            cfg = arm(cell, row, column, seed)
            x = {"adamw_lr": cfg["optimizer"]["lr"], "momentum": cfg["optimizer"]["momentum"],
                 "grad_ef_long": 1.0 if column == "grad_ef1_long" else None}.get(cell)
            grid = cell != "momentum" and column == "sync" and seed == 1 and cfg["optimizer"]["lr"] in GRID
            name = (f"{row if cell != 'main' else 'adamw-lr' + WINNER}__sync__seed1" if grid
                    else f"{row}__{column}__seed{seed}" if cell != "main" else f"adamw__{column}__seed{seed}")
            plan_run(name, cfg, {"cell": cell, "row": row, "column": column, "seed": seed, "x": x}, final)
    cells = [{"name": "lr_grid", "title": "LR grid", "x": "optimizer.lr", "rows": [f"adamw-lr{lr:g}" for lr in GRID],
              "columns": ["sync"], "seeds": [1]}]
    for name, title, x in (("main", "Main", None), ("adamw_lr", "AdamW lr", "optimizer.lr"),
                           ("grad_ef_long", "Gradient EF, long", "staleness.grad_ef_lambda"),
                           ("momentum", "Momentum", "optimizer.momentum")):
        keys = [k for k in FINAL if k[0] == name]
        cells.append({"name": name, "title": title, "x": x, "rows": list(dict.fromkeys(k[1] for k in keys)),
                      "columns": list(dict.fromkeys(k[2] for k in keys))})
    manifest = {"plan": "rerun", "label": "rerun", "description": "synthetic", "experiment": "study", "steps": STEPS,
                "seeds": list(SEEDS), "extra_overrides": [], "cells": cells,
                "tune": {"key": "optimizer.lr", "cells": ["lr_grid"], "winners": {"adamw": WINNER},
                         "means": {"adamw": {f"{lr:g}": v for lr, v in GRID.items()}}},
                "runs": list(runs.values()),
                "invocations": [{"command": "python -m tools.study run --plan rerun", "time": f"t{i}", "commit": c,
                                 "host": "hostA"} for i, c in enumerate(COMMITS)]}
    (out / study.MANIFEST).write_text(json.dumps(manifest))
    return out


@pytest.fixture(scope="module")
def report_path(study_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "reproduction.md"
    assert report.main([str(study_dir), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def rendered(report_path) -> str:
    return report_path.read_text()


def test_the_rerun_figures_are_drawn(report_path, rendered):
    for name in ("lr_grid", "adamw_gap_vs_lr", "grad_ef_long"):
        png = report_path.parent / "reproduction" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
        assert f"![{name}](reproduction/{name}.png)" in rendered
    # their cells' generic sweep plots are not drawn besides them
    assert not (report_path.parent / "reproduction" / "gap_vs_adamw_lr.png").exists()


def test_adamw_lr_reads_the_training_loss_where_each_arm_stalls(report_path, rendered):
    rows = rows_after(rendered, "Training loss (10-step trailing mean", "0.00")
    # lr 0.004's 2BW: finals 6.5, 6.6, 6.7; the loss at step s (1-based) is final + (30 - s) / 200, so steps 11-20
    # average to final + 0.0725; a 30-step run has no step 60 onwards
    assert ["0.004", "2bw", "6.67", "—", "—", "—", "—"] in rows
    assert ["0.001", "sync", "5.82", "—", "—", "—", "—"] in rows
    assert len(rows) == 3 * 3  # every lr (the adamw_lr rows, the main row's lr among them) x sync, 2BW, 2BW + EF
    png = report_path.parent / "reproduction" / "adamw_train_loss_vs_lr.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "](reproduction/adamw_train_loss_vs_lr.png)" in rendered


def test_momentum_shows_the_gap_at_every_evaluation(rendered):
    rows = rows_after(rendered, "Each arm's gap to sync at every evaluation", "muon-momentum")
    # every run's val loss falls to its final by the same amount, so each seed's gap is the same at every
    # evaluation (steps 10, 20, 30): 0.20, 0.22, 0.21 at μ = 0.9
    assert rows[0] == ["muon-momentum0.9", "2bw", "3", *["+0.210 ± 0.010"] * 3]
    assert len(rows) == 3 and "| row | column | seeds | step 10 | step 20 | step 30 |" in rendered


def rows_after(markdown: str, heading: str, first: str) -> list[list[str]]:
    section = markdown[markdown.index(heading):]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in section.splitlines() if ln.startswith(f"| {first}")]


def test_lr_grid_table_marks_the_recorded_winner(rendered):
    rows = rows_after(rendered, "(`lr_grid`)", "0.00")[:3]
    assert rows == [[f"{lr:g}", f"{v:.4f}", "**winner**" if f"{lr:g}" == WINNER else ""] for lr, v in GRID.items()]
    assert "**adamw** (winner 0.002, as study.json records it)" in rendered
    assert "the report and the study disagree" not in rendered
    assert "![lr_grid](reproduction/lr_grid.png)" in rendered
    assert "- seeds per cell " in rendered and "`lr_grid` 1, `main` 3," in rendered


def test_adamw_gap_and_ef_closure_per_learning_rate(rendered):
    rows = {r[0]: r for r in rows_after(rendered, "(`adamw_lr`)", "0.00")[:3]}
    assert list(rows) == ["0.001", "0.002", "0.004"]  # the main table's AdamW (the tuned lr) between the two
    assert rows["0.002"][1] == "`main`" and rows["0.001"][1] == "`adamw_lr`"
    s, a, e = (FINAL[("adamw_lr", "adamw-lr0.004", c)] for c in ("sync", "2bw", "2bw_ef"))
    gaps = [x - y for x, y in zip(a, s)]
    assert rows["0.004"][5].startswith(f"{sum(gaps) / 3:+.4f}")
    closed = (sum(a) - sum(e)) / (sum(a) - sum(s))
    assert rows["0.004"][7] == f"{closed:.0%}"
    assert "![adamw_gap_vs_lr](reproduction/adamw_gap_vs_lr.png)" in rendered


def test_gradient_level_ef_long_horizon_says_when_and_the_finding_reads_it(rendered):
    row = rows_after(rendered, "(`grad_ef_long`)", "adamw | grad_ef1_long")[0]
    assert row[2] == "**3 diverged** (0/3)"
    assert row[-1] == "; ".join(f"seed {s}: non-finite at step {DIVERGE_AT + 1}" for s in SEEDS)
    sync = rows_after(rendered, "(`grad_ef_long`)", "adamw | sync_long")[0]
    assert sync[3:] == ["—", "—"] + ["; ".join(f"seed {s}: lowest val at step 60, final − lowest +0.0000" for s in SEEDS)]
    delayed = rows_after(rendered, "(`grad_ef_long`)", "adamw | 2bw_long")[0]
    assert delayed[3:5] == ["+0.3000 ± 0.0000", "—"]
    finding = rows_after(rendered, "## Findings", "adamw: gradient-level EF diverges (grad_ef1_long)")[0]
    assert finding[3:5] == ["3 of 3 runs diverged", "agrees"]
    assert finding[2].startswith(f"3 of 3 diverged (non-finite at step {DIVERGE_AT + 1}, {DIVERGE_AT + 1}, ")
    assert "![grad_ef_long](reproduction/grad_ef_long.png)" in rendered


def test_momentum_trend_is_decided_by_the_equivalence_margin(rendered):
    finding = rows_after(rendered, "## Findings", "higher momentum")[0]
    gap095 = sum(b - a for a, b in zip(*(FINAL[("momentum", "muon-momentum0.95", c)] for c in ("sync", "2bw")))) / 3
    margin = 0.25 * gap095
    assert f"TOST ±{margin:.4f}" in finding[3]
    assert finding[4] == f"disagrees, because the effect is absent here: within ±{margin:.4f} (TOST, 90%)"
    assert finding[5] == report_findings.EXPLANATIONS["momentum/muon"]  # a disagreement shows its explanation


def test_pending_cells_are_named_and_get_no_verdict(rendered):
    assert "> **The study is still running: " in rendered
    assert "| `main` | 8 of 9 | **pending** |" in rendered
    assert "| `momentum` | 18 of 18 | complete |" in rendered
    ef = rows_after(rendered, "## Findings", "adamw: EF lowers the delayed loss")[0]
    assert ef[4] == "pending (8 of 9 runs)"
    gap = rows_after(rendered, "## Findings", "adamw: one-step delay raises the loss")[0]
    assert gap[4] == "agrees"  # its own arms have all ended
    assert "Initialization changed" not in rendered and "not the study" not in rendered


def test_cost_hosts_and_commits(rendered, study_dir):
    attempts = [a for d in study_dir.iterdir() if (d / study.STATUS).is_file()
                for a in json.loads((d / study.STATUS).read_text())["attempts"]]
    assert len(attempts) == sum(v is not None for vs in FINAL.values() for v in vs) - 3 + len(GRID) + 1  # 3 shared
    assert f"Spent so far: **{len(attempts) * CPU_S / 3600:.2f} CPU-hours** over {len(attempts)} attempts" in rendered
    assert f"(attempts per host): `hostA` {len(attempts) - 1}, `hostB` 1; on `hostB`: adamw__2bw__seed2\n" in rendered
    for commit in COMMITS:
        assert f"`{commit}`" in rendered
    assert "## What a CPU-scale study can and cannot say about the 360M and 10B results" in rendered


def test_an_explanation_replaces_its_slot(study_dir, monkeypatch):
    monkeypatch.setitem(report_findings.EXPLANATIONS, "momentum/muon", "at 200 steps momentum's horizon is short")
    found = {f.key: f for f in report_findings.findings(report.load_study([study_dir]))}
    assert found["momentum/muon"].explanation() == "at 200 steps momentum's horizon is short"
    assert found["main/adamw/ef"].verdict.word == "pending" and found["main/adamw/ef"].explanation() == ""


def test_complete_data_has_a_verdict_for_every_finding(study_dir, tmp_path):
    """With the last missing run written, no finding is pending and each is agrees, disagrees or undecided."""
    import shutil

    out = tmp_path / "complete"
    shutil.copytree(study_dir, out)
    manifest = json.loads((out / study.MANIFEST).read_text())
    missing = next(r for r in manifest["runs"] if r["name"] == "adamw__2bw_ef__seed3")
    write_run(out, missing["name"], missing["config"], 5.65, [{"returncode": 0, "cpu_s": CPU_S, "host": "hostA"}])
    loaded = report.load_study([out])
    found = report_findings.findings(loaded)
    assert {f.verdict.word for f in found} <= {"agrees", "disagrees", "undecided"}
    assert {f.key: f.verdict.word for f in found}["main/adamw/ef"] == "agrees"  # EF − 2BW -0.40, -0.45, -0.45
    assert report._banner(loaded) == []


def test_while_the_tune_grid_runs_the_other_cells_are_pending(study_dir, tmp_path):
    """Before the grid ends, study.json plans the grid alone (the other cells have no rows): nothing reads as
    complete, no figure of an empty cell is drawn, and the cost projection says it covers the grid only."""
    import shutil

    out = tmp_path / "grid"
    shutil.copytree(study_dir, out)
    manifest = json.loads((out / study.MANIFEST).read_text())
    manifest["tune"]["winners"] = None
    for cell in manifest["cells"][1:]:
        cell["rows"] = []
    manifest["runs"] = [{**r, "cells": [m for m in r["cells"] if m["cell"] == "lr_grid"]} for r in manifest["runs"]
                        if any(m["cell"] == "lr_grid" for m in r["cells"])]
    (out / study.MANIFEST).write_text(json.dumps(manifest))
    doc = tmp_path / "docs" / "reproduction.md"
    assert report.main([str(out), "--out", str(doc)]) == 0
    markdown = doc.read_text()
    assert f"> **The study is still running: {len(GRID)} of {len(GRID)} runs have ended (and the cells" in markdown
    assert "| `main` | 0 of 0 | **pending** (waits for the tune grid) |" in markdown
    assert "**adamw** (winner pending: the grid has not ended)" in markdown
    assert "this projection covers the grid alone" in markdown
    assert "pending (its runs wait for the tune grid)" in markdown  # the momentum finding


def test_a_main_row_with_more_seeds_is_decided_on_them(study_dir, tmp_path):
    """A `main_more_seeds` cell repeats a main row at more seeds (its first seeds are main's runs, shared): that
    row's findings pair all of its seeds, and say which cell decided them."""
    import shutil

    out = tmp_path / "more"
    shutil.copytree(study_dir, out)
    manifest = json.loads((out / study.MANIFEST).read_text())
    runs = {r["name"]: r for r in manifest["runs"]}
    extra = {"sync": (5.45, 5.5), "2bw": (6.0, 6.1), "2bw_ef": (5.6, 5.7)}  # seeds 4 and 5
    missing = runs["adamw__2bw_ef__seed3"]
    write_run(out, missing["name"], missing["config"], 5.65, [{"returncode": 0, "cpu_s": CPU_S, "host": "hostA"}])
    for column, finals in extra.items():
        for seed in (1, 2, 3):
            runs[f"adamw-lr{WINNER}__sync__seed1" if (column, seed) == ("sync", 1) else f"adamw__{column}__seed{seed}"][
                "cells"].append({"cell": "main_more_seeds", "row": "adamw", "column": column, "seed": seed, "x": None})
        for seed, final in zip((4, 5), finals):
            cfg, name = arm("main", "adamw", column, seed), f"adamw__{column}__seed{seed}"
            runs[name] = {"name": name, "overrides": [f"seed={seed}"], "config": cfg,
                          "cells": [{"cell": "main_more_seeds", "row": "adamw", "column": column, "seed": seed,
                                     "x": None}]}
            write_run(out, name, cfg, final, [{"returncode": 0, "cpu_s": CPU_S, "host": "hostA"}])
    manifest["runs"] = list(runs.values())
    manifest["cells"].append({"name": "main_more_seeds", "title": "Main, more seeds", "x": None, "rows": ["adamw"],
                              "columns": ["sync", "2bw", "2bw_ef"], "seeds": [1, 2, 3, 4, 5]})
    (out / study.MANIFEST).write_text(json.dumps(manifest))
    found = {f.key: f for f in report_findings.findings(report.load_study([out]))}
    assert "main/adamw/ef" not in found and "main/adamw/gap" not in found
    ef = found["main_more_seeds/adamw/ef"]
    assert ef.verdict.test.startswith("paired t(4)"), ef.verdict.test  # 5 paired seeds, not main's 3
    assert "(`main_more_seeds`)" in ef.ours and ef.verdict.word == "agrees"
    assert found["main_more_seeds/adamw/gap"].verdict.test.startswith("paired t(4)")


def test_a_cells_reading_is_shown_under_its_section_and_a_missing_one_by_name(study_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(report_findings.READINGS, "adamw_lr", "the gap grows with the learning rate")
    monkeypatch.delitem(report_findings.READINGS, "grad_ef_long")  # a cell that needs one and has none
    doc = tmp_path / "reproduction.md"
    assert report.main([str(study_dir), "--out", str(doc)]) == 0
    markdown = doc.read_text()
    section = markdown[markdown.index("(`adamw_lr`)"):]
    section = section[:section.index("\n## ")]
    assert "**Reading.** the gap grows with the learning rate" in section
    long = markdown[markdown.index("(`grad_ef_long`)"):]
    assert "*to write: READINGS['grad_ef_long'] in tools/report_findings.py*" in long[:long.index("\n## ")]
    momentum = markdown[markdown.index("(`momentum`)"):]
    assert "READINGS" not in momentum[:momentum.index("\n## ")]  # not every cell needs one


def test_late_stats_read_the_second_half_and_count_clipped_steps():
    from types import SimpleNamespace

    from tools.report_data import late_stats

    recs = [SimpleNamespace(grad_norm=g, update_norm=u) for g, u in
            [(9.0, 9.0), (9.0, 9.0), (0.5, 0.2), (1.5, 0.4), (float("nan"), 1.0), (2.5, 0.6)]]
    # the second half is the last 3; its nan step is skipped; the first half (9.0, 0.5) is not read, except its
    # first 20% (round(1.2) = 1 step) for the early grad norm
    assert late_stats(recs, 1.0) == {"grad_norm": 2.0, "update_norm": 0.5, "clipped": 1.0, "early_grad_norm": 9.0}
    recs[3].grad_norm = 0.9
    assert late_stats(recs, 1.0)["clipped"] == 0.5
    assert late_stats(recs, 0.0)["clipped"] == 0.0  # no clipping configured
    assert late_stats([], 1.0) == {}


def test_correction_cells_show_what_each_arm_did_to_the_step(rendered):
    section = rendered[rendered.index("(`grad_ef_long`)"):]
    section = section[:section.index("\n## ")]
    assert "| row | column | grad norm, first 20% | grad norm | steps clipped | update norm | seeds |" in section
    assert "| adamw | grad_ef1_long | — | — | — | — | 0 |" in section  # the synthetic runs log no norms
    momentum = rendered[rendered.index("(`momentum`)"):]
    assert "steps clipped" not in momentum[:momentum.index("\n## ")]
    main = rendered[rendered.index("## Main\n"):]
    assert "| adamw | 2bw_ef | — | — | — | — | 0 |" in main[:main.index("\n## ")]  # EF corrects the update: shown too


def test_the_cost_section_says_by_how_much_the_projection_is_over_the_budget(study_dir, monkeypatch):
    from tools import report_cost

    loaded = report.load_study([study_dir])
    text = "\n".join(report_cost.cost_section(loaded))
    assert "% over it**" not in text  # a few synthetic runs are far under 8 CPU-hours
    projected = float(text.split("CPU-hours** against")[0].rsplit("**", 1)[1])
    monkeypatch.setattr(report_cost, "BUDGET_CPU_HOURS", projected / 2)
    over = re.search(rf"against the budget of {projected / 2:g}: \*\*(\d+)% over it\*\*\.",
                     "\n".join(report_cost.cost_section(loaded)))
    assert over and 98 <= int(over.group(1)) <= 102  # twice the budget (the projection is printed rounded)
