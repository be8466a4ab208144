"""tools.study: plan expansion (cells, shared runs, shared hyperparameters), templates, resumability."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tools import study
from tools.study import PlanError, config_diff, expand, fill, load_plan, run_status

# What may differ between the columns of one row: the schedule and its staleness options, and (PipeDream's
# depth) the simulated layout. Everything else -- optimizer, lr, betas, model, data, steps -- must not.
ARM_KEYS = ("schedule.", "staleness.", "parallel.pp", "parallel.stage_layers")

SMOKE = """
label: smoke
experiment: study
steps: 3
seeds: [1]
overrides:
  - train.steps={steps}
  - train.micro_batch_size=2
  - train.num_microbatches=2
  - train.seq_len=32
  - train.eval_batches=1
  - train.eval_every={steps}
  - optimizer.schedule.warmup_steps=1
  - checkpoint.enabled=false
cells:
  main:
    title: smoke
    rows: {optimizer: [muon]}
    columns:
      sync: [schedule=sync]
      2bw: [schedule=2bw]
"""


@pytest.fixture(scope="module")
def full_runs() -> list[study.Run]:
    return expand(load_plan("full"))


def memberships(runs: list[study.Run]) -> dict[tuple[str, str, str, int], study.Run]:
    return {(c["cell"], c["row"], c["column"], c["seed"]): r for r in runs for c in r.cells}


@pytest.mark.slow  # re-tiered (session 8, the default suite's budget): 11 s (composes every run of the plan)
def test_full_plan_has_every_cell_and_shares_runs(full_runs):
    cells = memberships(full_runs)
    # 5 optimizers x {sync, 2bw, 2bw_ef} x 3 seeds
    main = {k for k in cells if k[0] == "main"}
    assert {(o, c) for _, o, c, _ in main} == {(o, c) for o in ("adamw", "muon", "normuon", "soap", "lion")
                                              for c in ("sync", "2bw", "2bw_ef")}
    assert {s for *_, s in main} == {1, 2, 3}
    lam = {k[2] for k in cells if k[0] == "ef_lambda"}
    assert lam == {"sync", "ef0", "ef0.5", "ef1", "ef1.5", "ef2"}
    assert {k[1] for k in cells if k[0] == "ef_lambda"} == {"muon", "adamw"}
    # the same experiment asked for by two cells runs once: lambda=0 is 2BW, lambda=1 is 2BW+EF, momentum
    # 0.95 is Muon's default, and PipeDream's references are the main cell's runs
    assert cells[("ef_lambda", "muon", "ef0", 2)] is cells[("main", "muon", "2bw", 2)]
    assert cells[("ef_lambda", "adamw", "ef1", 1)] is cells[("main", "adamw", "2bw_ef", 1)]
    assert cells[("momentum", "muon-momentum0.95", "sync", 3)] is cells[("main", "muon", "sync", 3)]
    assert cells[("pipedream", "muon", "2bw", 1)] is cells[("main", "muon", "2bw", 1)]
    assert cells[("momentum", "muon-momentum0.9", "2bw", 1)] is not cells[("main", "muon", "2bw", 1)]
    # 45 main + 6 lambda + 2 grad-EF + 3 DC + 2 sync-start + 3 PipeDream + 4 momentum cells, 3 seeds each
    assert len(full_runs) == (45 + 3 * (6 + 2 + 3 + 2 + 3 + 4))
    assert len({json.dumps(r.config, sort_keys=True) for r in full_runs}) == len(full_runs)


def test_arms_share_every_hyperparameter(full_runs):
    cells = memberships(full_runs)
    for (cell, row, column, seed), run in cells.items():
        sync = cells[(cell, row, "sync", seed)]
        differing = config_diff(run.config, sync.config)
        assert all(d.startswith(ARM_KEYS) for d in differing), (cell, row, column, differing)
        other_seed = cells[(cell, row, column, 1 if seed != 1 else 2)]
        assert config_diff(run.config, other_seed.config) == ["seed"]
    momentum = {row: cells[("momentum", row, "2bw", 1)].config["optimizer"]["momentum"]
                for row in ("muon-momentum0.9", "muon-momentum0.95", "muon-momentum0.98")}
    assert momentum == {"muon-momentum0.9": 0.9, "muon-momentum0.95": 0.95, "muon-momentum0.98": 0.98}
    p8 = cells[("pipedream", "muon", "pipedream_p8", 1)].config
    assert (p8["schedule"]["name"], p8["parallel"]["pp"], p8["parallel"]["stage_layers"]) == ("pipedream", 8, [1, 0, 1, 0, 1, 0, 1, 0])
    start = cells[("sync_start", "adamw", "sync_start", 1)].config
    assert start["staleness"]["sync_start_steps"] == 60 and start["train"]["steps"] == 600


def test_steps_rescale_the_templated_overrides():
    plan = load_plan("full", steps=100)
    assert plan.steps == 100
    filled = [fill(o, plan.steps) for o in plan.overrides]
    assert "optimizer.schedule.warmup_steps=10" in filled and "train.eval_every=5" in filled
    assert fill("a={steps*0.001}", 100) == "a=1"  # never 0: eval_every=0 would turn evaluation off
    with pytest.raises(PlanError, match=r"\{stepz\} is not a template"):
        fill("a={stepz}", 10)


def test_plan_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("experiment: study\nsteps: 3\n")
    with pytest.raises(PlanError, match=r"lacks \['seeds', 'cells'\]"):
        load_plan(str(bad))
    with pytest.raises(PlanError, match="is not a plan"):
        load_plan("no_such_plan")
    typo = tmp_path / "typo.yaml"
    typo.write_text(SMOKE.replace("[schedule=2bw]", "[schedule=2bw, staleness.ef_lamda=1.0]"))
    with pytest.raises(PlanError, match="ef_lamda"):
        expand(load_plan(str(typo)))
    # Every bad point is named, not only the first (issue 44: the points after a bad one were never looked at).
    two_bad = tmp_path / "two_bad.yaml"
    two_bad.write_text(SMOKE.replace("rows: {optimizer: [muon]}", "rows: {optimizer: [muon, sgd, lion]}")
                       .replace("[schedule=2bw]", "[schedule=2bw, staleness.ef_lambda=-1]"))
    with pytest.raises(PlanError, match=r"^4 point\(s\) of the plan are refused, so nothing ran") as refused:
        expand(load_plan(str(two_bad)))
    lines = [line for line in str(refused.value).splitlines() if line.startswith("  cells.")]  # (hydra's are long)
    assert [line.split(":")[0].strip() for line in lines] == [
        "cells.main row muon column 2bw", "cells.main row sgd column sync", "cells.main row sgd column 2bw",
        "cells.main row lion column 2bw"], lines


def test_runs_resume_and_skip_what_is_done(tmp_path, capsys):
    plan_file, out = tmp_path / "smoke.yaml", tmp_path / "study"
    plan_file.write_text(SMOKE)
    argv = ["run", "--plan", str(plan_file), "--out", str(out), "--launcher", "inprocess"]
    assert study.main(argv) == 0
    names = ["muon__sync__seed1", "muon__2bw__seed1"]
    assert [run_status(out, n) for n in names] == ["done", "done"]
    manifest = json.loads((out / "study.json").read_text())
    assert [r["name"] for r in manifest["runs"]] == names
    saved = json.loads((out / names[1] / "config.json").read_text())
    assert saved["schedule"]["name"] == "2bw" and saved["optimizer"]["name"] == "muon" and saved["train"]["steps"] == 3

    stamp = (out / names[0] / "summary.json").stat().st_mtime_ns
    (out / names[1] / "summary.json").unlink()  # as if killed before the end
    capsys.readouterr()
    assert study.main(argv) == 0
    printed = capsys.readouterr().out
    assert "running 1" in printed
    assert re.search(r"\[study\] 1/1 muon__2bw__seed1: exit 0 after \d+ s; elapsed 0h\d\dm, about 0h00m left", printed)
    assert (out / names[0] / "summary.json").stat().st_mtime_ns == stamp  # the finished run was not rerun
    assert run_status(out, names[1]) == "done"
    assert len(json.loads((out / "study.json").read_text())["invocations"]) == 2

    # a deterministic failure is not retried by default
    (out / names[1] / "summary.json").unlink()
    (out / names[1] / study.STATUS).write_text(json.dumps({"returncode": 1}))
    assert run_status(out, names[1]) == "failed"
    assert study.main(argv) == 0 and run_status(out, names[1]) == "failed"
    assert study.main([*argv, "--retry-failed"]) == 0 and run_status(out, names[1]) == "done"

    # the same directory with another run length is refused before anything runs
    assert study.main([*argv, "--steps", "4"]) == 2
    assert "holds a run of another config" in capsys.readouterr().err


def test_local_launcher_runs_pretrain_py(tmp_path):
    """The real path: one pretrain.py process per run, its command recorded with the outcome."""
    plan_file, out = tmp_path / "smoke.yaml", tmp_path / "study"
    plan_file.write_text(SMOKE.replace("      2bw: [schedule=2bw]\n", ""))
    assert study.main(["run", "--plan", str(plan_file), "--out", str(out), "--jobs", "1"]) == 0
    status = json.loads((out / "muon__sync__seed1" / study.STATUS).read_text())
    assert status["returncode"] == 0 and "pretrain.py +experiment=study" in status["command"]
    summary = json.loads((out / "muon__sync__seed1" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["final_val_loss"] < 9.1  # ln(8192) = 9.01 at initialisation


def test_slurm_dry_run_renders_an_array_of_pending_runs(tmp_path, capsys):
    plan_file = tmp_path / "smoke.yaml"
    plan_file.write_text(SMOKE)
    out = tmp_path / "study"
    assert study.main(["run", "--plan", str(plan_file), "--out", str(out), "--launcher", "slurm", "--dry-run",
                       "--partition", "cpu", "--time", "00:30:00"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --array=0-1%64" in script and "#SBATCH --partition=cpu" in script
    assert "#SBATCH --time=00:30:00" in script and "-m tools.study run-one --out" in script
    assert not out.exists()  # a dry run submits and writes nothing


def test_command_is_a_pretrain_invocation(tmp_path):
    cmd = study.command("study", ["optimizer=muon", "seed=1"], tmp_path / "r")
    assert cmd[1].endswith("pretrain.py") and cmd[2:] == ["+experiment=study", "optimizer=muon", "seed=1",
                                                          f"hydra.run.dir={tmp_path / 'r'}"]
    with pytest.raises(PlanError, match="letters, digits"):
        study.command("study", [], Path("/tmp/a b/r"))


TUNED = SMOKE.replace("""cells:
  main:""", """tune: {key: optimizer.lr, cells: [lr_grid]}
cells:
  lr_grid:
    title: lr on sync
    seeds: [1]
    rows:
      - {optimizer: [muon], optimizer.lr: [0.001, 0.1]}
    columns:
      sync: [schedule=sync]
  half_lr:
    title: the winner halved
    priority: 1
    rows: {optimizer: [muon], optimizer.lr: ["{tuned*0.5}"]}
    columns:
      2bw: [schedule=2bw]
  main:""").replace("seeds: [1]\noverrides", "seeds: [1, 2]\noverrides")


def test_per_cell_seeds_priority_and_row_blocks(tmp_path):
    plan_file = tmp_path / "tuned.yaml"
    plan_file.write_text(TUNED)
    plan = load_plan(str(plan_file))
    grid = expand(plan)  # phase 1: the grid alone, its own seeds
    assert [r.name for r in grid] == ["muon-lr0.001__sync__seed1", "muon-lr0.1__sync__seed1"]
    runs = expand(plan, winners={"muon": "0.1"})
    cells = memberships(runs)
    # the tuned lr reaches every later run; the main sync run at seed 1 is the grid winner's run
    assert cells[("main", "muon", "sync", 1)] is cells[("lr_grid", "muon-lr0.1", "sync", 1)]
    assert {r.config["optimizer"]["lr"] for k, r in cells.items() if k[0] == "main"} == {0.1}
    assert cells[("half_lr", "muon-lr0.05", "2bw", 2)].config["optimizer"]["lr"] == 0.05
    # priority 0 (grid and main) before priority 1, seed-major within each
    order = [(r.cells[0]["cell"], r.config["seed"]) for r in runs]
    assert order == [("lr_grid", 1), ("lr_grid", 1), ("main", 1), ("main", 2), ("main", 2),
                     ("half_lr", 1), ("half_lr", 2)]
    with pytest.raises(PlanError, match="has no tune grid winner"):
        expand(plan, winners={"adamw": "0.1"})
    with pytest.raises(PlanError, match=r"\{tuned\} means the tune grid's winner"):
        fill("optimizer.lr={tuned}", 10)


@pytest.mark.slow  # 7 in-process runs of 3 tiny steps, ~30 CPU-s
def test_tune_grid_then_winners_in_one_command(tmp_path, capsys):
    plan_file, out = tmp_path / "tuned.yaml", tmp_path / "study"
    plan_file.write_text(TUNED)
    argv = ["run", "--plan", str(plan_file), "--out", str(out), "--launcher", "inprocess"]
    assert study.main(argv) == 0
    manifest = json.loads((out / "study.json").read_text())
    losses = {lr: json.loads((out / f"muon-lr{lr}__sync__seed1" / "summary.json").read_text())["final_val_loss"]
              for lr in ("0.001", "0.1")}
    best = min(losses, key=losses.get)
    assert losses["0.001"] != losses["0.1"]  # the grid really ran two learning rates
    assert manifest["tune"]["winners"] == {"muon": best}
    assert manifest["tune"]["means"] == {"muon": losses}
    assert len(manifest["runs"]) == 7 and all(run_status(out, r["name"]) == "done" for r in manifest["runs"])
    main_2bw = json.loads((out / "muon__2bw__seed2" / "config.json").read_text())
    assert main_2bw["optimizer"]["lr"] == float(best) and main_2bw["seed"] == 2
    assert len(manifest["invocations"]) == 1  # the second phase is the same command
    rows = {c["name"]: c["rows"] for c in manifest["cells"]}
    assert rows == {"lr_grid": ["muon-lr0.001", "muon-lr0.1"], "half_lr": [f"muon-lr{float(best) / 2:.3g}"], "main": ["muon"]}
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", manifest["invocations"][0]["commit"])  # the code's commit

    # archive the finished runs, restore them into a fresh directory: nothing is left to run there
    capsys.readouterr()
    assert study.main(["archive", "--out", str(out), "--to", str(tmp_path / "archive")]) == 0
    assert not (tmp_path / "archive" / "muon__2bw__seed2" / "checkpoints").exists()
    fresh = tmp_path / "fresh"
    assert study.main(["restore", "--from", str(tmp_path / "archive"), "--out", str(fresh)]) == 0
    assert "restored 7 finished runs" in capsys.readouterr().out
    for r in manifest["runs"]:
        for f in ("metrics.jsonl", "summary.json", "config.json"):
            assert (fresh / r["name"] / f).read_bytes() == (out / r["name"] / f).read_bytes()
    assert study.main([*argv[:-4], "--out", str(fresh), "--launcher", "inprocess"]) == 0
    assert "running 0" in capsys.readouterr().out
    archived = (tmp_path / "archive" / "muon__2bw__seed2" / "metrics.jsonl.gz").read_bytes()
    assert study.main(["archive", "--out", str(out), "--to", str(tmp_path / "archive")]) == 0
    assert (tmp_path / "archive" / "muon__2bw__seed2" / "metrics.jsonl.gz").read_bytes() == archived  # byte-stable


@pytest.mark.slow  # composes ~225 configs (~25 CPU-s)
def test_rerun_plan_tunes_every_arm_and_orders_grid_and_main_first():
    plan = load_plan("rerun")
    grid = expand(plan)
    assert {r.cells[0]["cell"] for r in grid} == {"lr_grid"} and len(grid) == 20
    assert all(r.config["schedule"]["name"] == "sync" for r in grid)
    winners = {"adamw": "0.002", "muon": "0.02", "normuon": "0.01", "soap": "0.006", "lion": "0.0005"}
    runs = expand(plan, winners=winners)
    cells = memberships(runs)
    for (cell, row, column, seed), run in cells.items():
        if cell in ("lr_grid", "adamw_lr"):
            continue
        assert run.config["optimizer"]["lr"] == float(winners[run.config["optimizer"]["name"]]), (cell, row, column)
        sync = next(cells[(cell, row, c, seed)] for c in ("sync", "sync_long") if (cell, row, c, seed) in cells)
        assert all(d.startswith(ARM_KEYS) for d in config_diff(run.config, sync.config)), (cell, row, column)
    assert cells[("main", "adamw", "sync", 1)] is cells[("lr_grid", "adamw-lr0.002", "sync", 1)]
    assert {k[3] for k in cells if k[0] == "main"} == {1, 2, 3, 4, 5}
    assert {k[3] for k in cells if k[0] == "sync_start"} == {1, 2, 3, 4, 5, 6}
    assert {cells[("adamw_lr", r, "2bw", 1)].config["optimizer"]["lr"] for r in ("adamw-lr0.001", "adamw-lr0.004")} \
        == {0.001, 0.004}
    assert cells[("grad_ef_long", "adamw", "grad_ef0.5_long", 3)].config["train"]["steps"] == 2 * plan.steps
    # every run's directory can be a hydra override (a list-valued row, optimizer.betas, included)
    assert all(re.fullmatch(r"[\w.-]+", r.name) for r in runs)
    assert ("momentum_adamw_part", "muon-momentum0.98-betas_0.98_0.95", "sync", 1) in cells
    # the main table's 5 seeds finish before any ablation run starts
    first = [r.cells[0]["cell"] for r in runs]
    assert set(first[:first.index("sync_start")]) == {"lr_grid", "main"} and "main" not in first[first.index("sync_start"):]


def test_archive_keeps_finished_runs_small_and_restore_brings_them_back(tmp_path, capsys):
    out, archive, fresh = tmp_path / "study", tmp_path / "archive", tmp_path / "fresh"
    files = {"config.json": json.dumps({"seed": 1, "out_dir": "x"}), "summary.json": json.dumps(
        {"final_val_loss": 4.5, "stopped_at": None}), study.STATUS: json.dumps({"returncode": 0, "cpu_s": 12.5}),
        "metrics.jsonl": json.dumps({"step": 0, "loss": 9.0}) + "\n"}
    for name, done in (("a__sync__seed1", True), ("a__2bw__seed1", False)):
        (out / name / "checkpoints").mkdir(parents=True)
        (out / name / "checkpoints" / "step_1.pt").write_bytes(b"big")
        for f, text in files.items():
            if done or f == "metrics.jsonl":
                (out / name / f).write_text(text)
    (out / "study.json").write_text(json.dumps({"runs": [{"name": "a__sync__seed1"}, {"name": "a__2bw__seed1"}],
                                                "invocations": [{"command": "run 1", "time": "t1"}]}))
    assert study.main(["archive", "--out", str(out), "--to", str(archive)]) == 0
    assert sorted(p.name for p in archive.iterdir()) == ["a__sync__seed1", "study.json"]  # the finished run only
    kept = sorted(p.name for p in (archive / "a__sync__seed1").iterdir())
    assert kept == ["config.json", "metrics.jsonl.gz", "study_status.json", "summary.json"]  # no checkpoints
    gz = (archive / "a__sync__seed1" / "metrics.jsonl.gz").read_bytes()
    assert study.main(["archive", "--out", str(out), "--to", str(archive)]) == 0
    assert (archive / "a__sync__seed1" / "metrics.jsonl.gz").read_bytes() == gz  # byte-stable: git sees no change

    assert study.main(["restore", "--from", str(archive), "--out", str(fresh)]) == 0
    assert run_status(fresh, "a__sync__seed1") == "done" and not (fresh / "a__2bw__seed1").exists()
    for f in files:
        assert (fresh / "a__sync__seed1" / f).read_bytes() == (out / "a__sync__seed1" / f).read_bytes()
    assert json.loads((fresh / "study.json").read_text())["invocations"] == [{"command": "run 1", "time": "t1"}]
    capsys.readouterr()
    assert study.main(["restore", "--from", str(archive), "--out", str(fresh)]) == 0
    assert "restored 0 finished runs" in capsys.readouterr().out  # already there: left alone

    other = tmp_path / "other" / "a__sync__seed1"  # an unfinished run of another config is not overwritten
    other.mkdir(parents=True)
    (other / "config.json").write_text(json.dumps({"seed": 2}))
    assert study.main(["restore", "--from", str(archive), "--out", str(other.parent)]) == 2
    assert "another config" in capsys.readouterr().err
