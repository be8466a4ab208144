"""tools.report on a synthetic study whose table values are computed independently here."""

from __future__ import annotations

import copy
import json
import math
import statistics
from pathlib import Path

import pytest

from tools import report, report_data, report_findings, study

SEEDS = (1, 2, 3)
# final validation loss per (row, column) and seed; None = the run never finished (no directory)
FINAL = {
    ("adamw", "sync"): (3.00, 3.10, 3.20),
    ("adamw", "2bw"): (3.30, 3.42, 3.48),
    ("adamw", "2bw_ef"): (3.05, 3.16, 3.27),
    ("muon", "sync"): (2.90, 2.95, 3.01),
    ("muon", "2bw"): (2.80, 2.86, 2.90),      # delay *helps* here: the verdict must say "disagrees"
    ("muon", "2bw_ef"): (2.85, 2.91, None),   # one seed missing
}
EVAL_STEPS = (10, 20, 30)


@pytest.fixture(scope="module")
def base_config() -> dict:
    from asyncpp import job

    cfg, _ = job.resolve(job.compose(["+experiment=study", "train.steps=30", "optimizer.schedule.warmup_steps=3"]))
    d = json.loads(json.dumps(cfg.to_dict()))
    d.pop("out_dir")
    return d


def arm_config(base: dict, optimizer: str, column: str, seed: int) -> dict:
    cfg = copy.deepcopy(base)
    cfg["optimizer"]["name"], cfg["seed"] = optimizer, seed
    cfg["schedule"]["name"] = "sync" if column == "sync" else "2bw"
    cfg["staleness"]["ef_lambda"] = 1.0 if column == "2bw_ef" else 0.0
    cfg["staleness"]["grad_ef_lambda"] = 1.0 if column == "grad_ef1" else 0.0
    return cfg


def write_run(out: Path, run: study.Run, final: float, diverged: bool = False) -> None:
    """A run directory as pretrain.py leaves it: config.json, metrics.jsonl (a resumed run repeats a step),
    summary.json; a diverged run has a NaN loss, skipped steps, a failed status and an empty summary."""
    d = out / run.name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({**run.config, "out_dir": str(d)}))
    lines = []
    for step in range(EVAL_STEPS[-1]):
        record = {"step": step, "loss": "nan" if diverged and step > 3 else 4.0, "skipped": diverged and step > 3}
        if step + 1 in EVAL_STEPS and not diverged:
            # the curve ends at the final value; earlier points are offset by a per-step constant
            record["val_loss"] = final + 0.1 * (EVAL_STEPS[-1] - step - 1) / 10
        lines.append(json.dumps(record))
    lines.insert(15, json.dumps({"step": 19, "loss": 9.9, "val_loss": 99.0}))  # superseded by the resumed line
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if diverged:
        (d / "summary.json").write_text("{}")
        (d / study.STATUS).write_text(json.dumps({"returncode": 1}))
    else:
        (d / "summary.json").write_text(json.dumps({"final_val_loss": final, "stopped_at": None,
                                                    "mean_step_time_s": 0.5}))


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory, base_config) -> Path:
    out = tmp_path_factory.mktemp("study")
    cells = [study.Cell("main", "Main", [{"optimizer": "adamw"}, {"optimizer": "muon"}],
                        {c: [] for c in ("sync", "2bw", "2bw_ef")}),
             study.Cell("grad_ef", "Gradient EF", [{"optimizer": "muon"}], {c: [] for c in ("sync", "2bw", "grad_ef1")})]
    plan = study.Plan("synthetic", "study", "synthetic runs", "study", 30, list(SEEDS), [], cells)
    runs: dict[str, study.Run] = {}
    for cell in cells:
        for row in cell.rows:
            opt = row["optimizer"]
            for column in cell.columns:
                for i, seed in enumerate(SEEDS):
                    name = f"{opt}__{column}__seed{seed}"
                    run = runs.setdefault(name, study.Run(name, [], arm_config(base_config, opt, column, seed)))
                    run.cells.append({"cell": cell.name, "row": opt, "column": column, "seed": seed, "x": None})
                    if (out / name).exists():
                        continue  # shared with an earlier cell
                    if column == "grad_ef1":
                        if seed != 3:  # seeds 1, 2 diverge; seed 3 never ran
                            write_run(out, run, math.nan, diverged=True)
                    elif FINAL[(opt, column)][i] is not None:
                        write_run(out, run, FINAL[(opt, column)][i])
    study.write_manifest(out, plan, list(runs.values()), [], ["run", "--plan", "synthetic", "--out", str(out)])
    return out


def table_row(markdown: str, first_cell: str, after: str) -> list[str]:
    section = markdown[markdown.index(after):]
    line = next(ln for ln in section.splitlines() if ln.startswith(f"| {first_cell} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def expected_main_row(opt: str) -> list[str]:
    """The main table's row, computed here without tools.report."""
    s, a, e = ([v for v in FINAL[(opt, c)] if v is not None] for c in ("sync", "2bw", "2bw_ef"))
    fmt = lambda xs: f"{statistics.mean(xs):.4f} ± {statistics.stdev(xs):.4f}"
    gap = [x - y for x, y in zip(FINAL[(opt, "2bw")], FINAL[(opt, "sync")])]
    ef_pairs = [(x, y) for x, y in zip(FINAL[(opt, "2bw_ef")], FINAL[(opt, "sync")]) if x is not None]
    ef_gap = [x - y for x, y in ef_pairs]
    seeds = [i for i, v in enumerate(FINAL[(opt, "2bw_ef")]) if v is not None]
    m = {c: statistics.mean(FINAL[(opt, c)][i] for i in seeds) for c in ("sync", "2bw", "2bw_ef")}
    closed = (m["2bw"] - m["2bw_ef"]) / (m["2bw"] - m["sync"])

    def significant(xs: list[float]) -> bool:  # paired t-test, two-sided 95%: t(1) = 12.706, t(2) = 4.303
        return abs(statistics.mean(xs)) > {2: 12.706, 3: 4.303}[len(xs)] * statistics.stdev(xs) / math.sqrt(len(xs))

    def diff(xs: list[float]) -> str:
        return f"{statistics.mean(xs):+.4f} ± {statistics.stdev(xs):.4f}" + ("" if significant(xs) else " (n.s.)")

    ef_text = fmt(e) + ("" if len(e) == 3 else f" ({len(e)}/3; {3 - len(e)} missing)")
    gap_resolved = significant(gap)
    return [opt, fmt(s), fmt(a), ef_text, diff(gap), diff(ef_gap), f"{closed:.0%}" + ("" if gap_resolved else " (gap n.s.)")]


@pytest.fixture(scope="module")
def rendered(study_dir, tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("docs") / "reproduction.md"
    assert report.main([str(study_dir), "--out", str(out)]) == 0
    return out.read_text(), out


@pytest.mark.parametrize("opt", ["adamw", "muon"])
def test_main_table_values(rendered, opt):
    markdown, _ = rendered
    assert table_row(markdown, opt, "## Main") == expected_main_row(opt)


def test_missing_and_diverged_runs_are_reported_not_dropped(rendered):
    markdown, _ = rendered
    # runs not started are counted per cell (muon__2bw_ef__seed3 in main, grad_ef1's seed 3), not listed
    assert "Not started yet: 2 runs (`main` 1, `grad_ef` 1; a run shared by cells counts in the first)." in markdown
    assert "| muon__2bw_ef__seed3 |" not in markdown
    grad = next(r for r in markdown.splitlines() if r.startswith("| muon | grad_ef1 |"))
    # seed 3 has no directory: missing, not diverged; no loss, no differences
    assert grad == "| muon | grad_ef1 | **2 diverged, 1 missing** (0/3) | — | — | — |"
    assert "| muon__grad_ef1__seed1 | diverged | grad_ef |" in markdown
    # never-run: the missing main seed and grad_ef1's seed 3; diverged runs have ended
    total, pending = len(FINAL) * len(SEEDS) + len(SEEDS), sum(v is None for vs in FINAL.values() for v in vs) + 1
    assert f"**The study is still running: {total - pending} of {total} runs have ended.**" in markdown


def test_paper_comparison_is_computed(rendered):
    markdown, _ = rendered
    findings = markdown.split("## Findings")[1]
    claims = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:7]] for r in findings.splitlines()
              if r.startswith(("| adamw", "| muon"))}
    assert claims["adamw: one-step delay raises the loss"][::3] == ["2.612 → 2.890 (gap +0.278)", "agrees"]
    assert claims["adamw: EF lowers the delayed loss"][::3] == ["2.890 → 2.640 (90% of the gap)", "agrees"]
    # muon's 2BW is lower on every seed: the paper's sign reversed, at p < 0.05 (t(2) = -17.3)
    assert claims["muon: one-step delay raises the loss"][3].startswith("disagrees, because the sign is reversed: -0.1000")
    assert claims["muon: one-step delay raises the loss"][2].startswith("paired t(2) = -17.32, p = 0.00332")
    assert claims["muon: one-step delay raises the loss"][4].startswith("*to write: EXPLANATIONS['main/muon/gap']")
    assert claims["muon: EF lowers the delayed loss"][3] == "pending (8 of 9 runs)"  # its seed 3 never ran
    assert claims["adamw's sync-async gap is larger than muon's"][3] == "agrees"
    # grad_ef1: 2 diverged + 1 never ran; 2BW and sync (the margin's gap) ended: 8 of 9
    assert claims["muon: gradient-level EF diverges (grad_ef1)"][3] == "pending (8 of 9 runs)"
    assert "PILOT" not in markdown.upper().split("## SETUP")[0]  # label "study": no pilot banner


def test_the_verdicts_are_tallied_from_the_table(rendered):
    markdown, _ = rendered
    verdicts = [r.split("|")[5].strip().split(",")[0].split(" (")[0] for r in markdown.split("## Findings")[1]
                .split("Verdicts over")[0].splitlines() if r.startswith("| ") and not r.startswith("| finding")]
    line = next(r for r in markdown.splitlines() if r.startswith("Verdicts over"))
    head, counts = line.split(". ")[0].split(": ")
    assert head == f"Verdicts over {len(verdicts)} findings"
    assert dict(c.split(" ", 1)[::-1] for c in counts.split(", ")) == {v: str(verdicts.count(v)) for v in verdicts}
    assert {"agrees", "disagrees", "pending"} <= set(verdicts)  # the fixture has both, so the counts are not trivially one kind


def test_figures_are_written(rendered):
    markdown, out = rendered
    for name in ("loss_curves", "gap_over_time"):
        png = out.parent / "reproduction" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
        assert f"(reproduction/{name}.png)" in markdown


def test_curves_take_the_last_record_of_a_step(study_dir):
    records = report_data.read_metrics(study_dir / "adamw__sync__seed1" / "metrics.jsonl")
    assert [r.step for r in records] == list(range(EVAL_STEPS[-1]))
    assert records[19].val_loss == pytest.approx(3.00 + 0.1 * 10 / 10)
    curves = report.gap_curves(report.load_study([study_dir]), "main", "adamw", "2bw", "sync")
    assert [c[0] for c in curves] == [list(EVAL_STEPS)] * 3
    assert curves[0][1] == pytest.approx([0.30] * 3)  # same per-step offsets: the gap is the final gap


def test_a_run_that_does_not_match_its_plan_is_refused(study_dir, tmp_path):
    import shutil

    copy_dir = tmp_path / "copy"
    shutil.copytree(study_dir, copy_dir)
    cfg_path = copy_dir / "adamw__sync__seed1" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["optimizer"]["lr"] *= 2
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(study.PlanError, match=r"optimizer\.lr"):
        report.load_study([copy_dir])


def test_the_report_lists_what_the_arms_differ_in(rendered):
    markdown, _ = rendered
    line = next(ln for ln in markdown.splitlines() if ln.startswith("- what differs between the columns"))
    assert line.endswith("`schedule.name`, `staleness.ef_lambda`, `staleness.grad_ef_lambda`")


def lambda_study(finals: dict[float, tuple[float | None, ...]]) -> report_data.Study:
    """A Study with one ef_lambda row whose arms have these final losses per seed (None: not run yet)."""
    def run(lam: float, seed: int, v: float | None) -> report_data.RunResult:
        config = {"schedule": {"name": "2bw"}, "staleness": {"ef_lambda": lam}}
        return report_data.RunResult(f"ef{lam:g}_{seed}", "pending" if v is None else "done", config,
                                     math.nan if v is None else v)

    cols = [f"ef{lam:g}" for lam in finals]
    results = {("ef_lambda", "muon", f"ef{lam:g}"): [(seed, run(lam, seed, v)) for seed, v in enumerate(values, 1)]
               for lam, values in finals.items()}
    return report_data.Study([], [], {"ef_lambda": {"rows": ["muon"], "columns": cols}}, results,
                             {("ef_lambda", "muon", f"ef{lam:g}"): lam for lam in finals})


@pytest.mark.parametrize("finals, verdict", [
    # λ=1.5 is best on every seed by a margin far above the seed-to-seed spread of the difference
    ({0.0: (3.5, 3.6, 3.7), 0.5: (3.4, 3.5, 3.6), 1.0: (3.3, 3.4, 3.5), 1.5: (3.2, 3.31, 3.4)}, "agrees"),
    ({0.0: (3.5, 3.6, 3.7), 0.5: (3.1, 3.2, 3.31), 1.0: (3.3, 3.4, 3.5), 1.5: (3.4, 3.5, 3.6)}, "disagrees"),
    # the lowest mean is at λ=1.5, but one seed cannot tell it from λ=0.5
    ({0.0: (3.5,), 0.5: (3.4,), 1.0: (3.3,), 1.5: (3.2,)}, "undecided"),
    # the lowest mean is at λ=1.5, but seeds disagree on the sign of the difference
    ({0.5: (3.40, 3.10, 3.30), 1.5: (3.20, 3.25, 3.15)}, "undecided"),
])
def test_best_lambda_verdict_needs_a_resolved_difference(finals, verdict):
    found = report_findings._best_lambda(lambda_study(finals), "muon")
    assert found.verdict.word == verdict, found
    assert found.paper.startswith("muon: the best EF λ is ≥ 1")


def test_best_lambda_is_decided_on_the_rows_more_seeds_cell():
    """ef_lambda's row undecided at 3 seeds; ef_lambda_more_seeds repeats it at 8 (the first 3 shared): the finding
    pairs the 8 and names the cell it was decided on."""
    three = {0.5: (3.40, 3.10, 3.30), 1.5: (3.20, 3.25, 3.15)}
    eight = {0.5: (3.40, 3.10, 3.30, 3.45, 3.48, 3.50, 3.47, 3.52), 1.5: (3.20, 3.25, 3.15, 3.20, 3.21, 3.19, 3.22, 3.2)}
    study = lambda_study(three)
    assert report_findings._best_lambda(study, "muon").verdict.word == "undecided"
    more = lambda_study(eight)
    for (_, row, col), runs in more.results.items():
        study.results[("ef_lambda_more_seeds", row, col)] = runs
        study.xs[("ef_lambda_more_seeds", row, col)] = more.xs[("ef_lambda", row, col)]
    study.cells["ef_lambda_more_seeds"] = dict(more.cells["ef_lambda"])
    found = report_findings._best_lambda(study, "muon")
    assert found.key == "ef_lambda_more_seeds/muon" and found.ours.endswith("(`ef_lambda_more_seeds`)")
    assert found.verdict.word == "agrees" and found.verdict.test.startswith("paired t(7)"), found


def test_best_lambda_with_an_unfinished_arm_is_pending():
    found = report_findings._best_lambda(lambda_study({0.5: (3.4, 3.5), 1.5: (3.3, None)}), "muon")
    assert found.verdict.text() == "pending (3 of 4 runs)"


def dc_study(finals: dict[str, tuple[float, ...]]) -> report_data.Study:
    """A Study with one dc_asgd row: sync, plain-2BW and DC-ASGD columns with these losses per seed."""
    def config(column: str) -> dict:
        return {"schedule": {"name": "sync" if column == "sync" else "2bw"},
                "staleness": {"dc_lambda": 100.0 if column.startswith("dc") else 0.0}}

    results = {("dc_asgd", "muon", c): [(seed, report_data.RunResult(f"{c}_{seed}", "done", config(c), v))
                                        for seed, v in enumerate(values, 1)] for c, values in finals.items()}
    return report_data.Study([], [], {"dc_asgd": {"rows": ["muon"], "columns": list(finals)}}, results, {})


SYNC, DELAYED = (3.5, 3.6, 3.7), (3.9, 4.0, 4.1)  # the delay's gap 0.4: the margin is 0.1


@pytest.mark.parametrize("finals, verdict", [
    # within the margin: diffs +0.05, -0.02, +0.02, 90% CI [-0.044, +0.077] inside ±0.1
    ({"sync": SYNC, "2bw": DELAYED, "dc100": (3.95, 3.98, 4.12)}, "agrees"),
    ({"sync": SYNC, "2bw": DELAYED, "dc100": (3.80, 3.91, 4.00)}, "disagrees"),     # better on every seed
    ({"sync": SYNC[:1], "2bw": DELAYED[:1], "dc100": (3.95,)}, "undecided"),        # one seed shows nothing
    # noisy: neither a gain at p < 0.05 nor a CI inside the margin
    ({"sync": SYNC, "2bw": DELAYED, "dc100": (3.7, 4.1, 4.0)}, "undecided"),
])
def test_a_no_gain_claim_needs_an_equivalence_margin_or_a_resolved_difference(finals, verdict):
    [got] = report_findings._treatments(dc_study(finals), "dc_asgd", "muon", "no DC-ASGD coefficient beats plain delay",
                                        "Fig. 14", 0)
    assert got.verdict.word == verdict, got
    if verdict == "undecided" and len(finals["sync"]) > 1:
        assert "seeds; the paired SD" in got.verdict.reason


def test_a_treatment_row_is_decided_on_its_more_seeds_cell():
    """findings() hands a gradient correction's row to its `<cell>_more_seeds` cell where that cell holds it."""
    study = dc_study({"sync": SYNC[:1], "2bw": DELAYED[:1], "dc100": (3.95,)})
    more = dc_study({"sync": SYNC, "2bw": DELAYED, "dc100": (3.80, 3.91, 4.00)})
    for (_, row, col), runs in more.results.items():
        study.results[("dc_asgd_more_seeds", row, col)] = runs
    study.cells["dc_asgd_more_seeds"] = dict(more.cells["dc_asgd"])
    found = {f.key: f for f in report_findings.findings(study)}
    assert "dc_asgd/muon/dc100" not in found
    assert found["dc_asgd_more_seeds/muon/dc100"].verdict.word == "disagrees"  # 3 seeds: better on every one


def test_pending_and_interrupted_runs_are_counted_together_as_missing():
    s = report_data.Stat(planned=3, statuses={"interrupted": 1, "pending": 2})
    assert report_data.fmt_stat(s) == "**3 missing** (0/3)"
    s = report_data.Stat(values={1: 3.5}, planned=3, statuses={"done": 1, "interrupted": 1, "failed": 1})
    assert report_data.fmt_stat(s) == "3.5000 (1/3; 1 failed, 1 missing)"


def test_gap_closed_is_shown_for_corrections_of_2bw_only():
    """PipeDream at depth P is compared with 2BW, but it closes no gap: only a 2BW run with a correction does."""
    arms = {"sync": ("sync", 0.0, (3.0, 3.1)), "2bw": ("2bw", 0.0, (3.4, 3.5)),
            "2bw_ef": ("2bw", 1.0, (3.2, 3.3)), "pipedream_p4": ("pipedream", 0.0, (3.6, 3.7))}
    results = {("pd", "muon", c): [(seed, report_data.RunResult(f"{c}_{seed}", "done",
                                                           {"schedule": {"name": sched}, "staleness": {"ef_lambda": ef}}, v))
                                   for seed, v in enumerate(values, 1)] for c, (sched, ef, values) in arms.items()}
    study_ = report_data.Study([], [], {"pd": {"rows": ["muon"], "columns": list(arms)}}, results, {})
    lines = {ln.split("|")[2].strip(): [c.strip() for c in ln.strip("|").split("|")]
             for ln in report.cell_table(study_, "pd").splitlines()[2:]}
    assert lines["2bw_ef"][-1] == "50%"                 # (3.45 - 3.25) / (3.45 - 3.05)
    assert lines["pipedream_p4"][-1] == "—"
    assert lines["pipedream_p4"][-2].startswith("+0.2000")  # its Δ vs 2BW is still shown
