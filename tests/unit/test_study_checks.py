"""tools.study_checks: which runs stand for the study, how they are shortened, and that each check can fail."""

from __future__ import annotations

import json
import os

import pytest

from tools import study, study_checks
from tools.study_checks import records, representatives, shortened


def run(name: str, *overrides: str) -> dict:
    return {"name": name, "overrides": [*overrides, "seed=1"]}


def test_one_run_per_mechanism_and_per_optimizer():
    runs = [run("a", "optimizer.lr=1", "optimizer=adamw", "schedule=sync"),
            run("b", "optimizer.lr=2", "optimizer=adamw", "schedule=sync"),  # same mechanism, same optimizer
            run("c", "optimizer=muon", "schedule=sync"),  # a new optimizer
            run("d", "optimizer=muon", "schedule=2bw", "staleness.ef_lambda=1.0"),  # a new mechanism
            run("e", "optimizer=adamw", "schedule=2bw", "staleness.ef_lambda=1.0"),
            run("f", "optimizer=muon", "schedule=pipedream", "parallel.pp=2"),
            run("g", "optimizer=muon", "optimizer.momentum=0.9", "schedule=sync")]
    assert representatives(runs) == ["a", "c", "d", "f", "g"]


def test_shortened_keeps_the_mechanism_and_fits_the_schedule_in_the_run():
    out = shortened(["train.steps=200", "train.eval_every=40", "checkpoint.every=50",
                     "optimizer.schedule.warmup_steps=20", "optimizer=muon", "staleness.sync_start_steps=20",
                     "seed=3"], 12)
    assert out == ["optimizer=muon", "staleness.sync_start_steps=4", "seed=3", "train.steps=12",
                   "train.eval_every=6", "checkpoint.every=6", "optimizer.schedule.warmup_steps=2"]


def test_records_keep_the_last_record_of_a_step(tmp_path):
    lines = [{"step": 0, "loss": 2.0, "step_time_s": 1}, {"step": 1, "loss": 1.5},
             {"step": 1, "loss": 1.4, "val_loss": 1.6}]  # step 1 written again after a resume
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in lines))
    assert records(tmp_path / "m.jsonl") == {0: {"loss": 2.0}, 1: {"loss": 1.4, "val_loss": 1.6}}


@pytest.mark.slow  # two pretrain.py runs of a 3-step smoke study (~30 s)
def test_resumed_finds_a_run_whose_records_differ_from_a_fresh_one(tmp_path, capsys):
    from tests.unit.test_study import SMOKE

    plan_file, out = tmp_path / "smoke.yaml", tmp_path / "study"
    plan_file.write_text(SMOKE.replace("      2bw: [schedule=2bw]\n", ""))
    assert study.main(["run", "--plan", str(plan_file), "--out", str(out), "--jobs", "1"]) == 0
    name = "muon__sync__seed1"
    status = json.loads((out / name / study.STATUS).read_text())
    status["attempts"] = [{"returncode": 143}, *status["attempts"]]  # as if stopped once and resumed
    (out / name / study.STATUS).write_text(json.dumps(status))
    threads = str(max(1, os.cpu_count() or 1))  # the study's --jobs 1
    argv = ["resumed", "--study", str(out), "--threads", threads, "--scratch", str(tmp_path / "scratch")]
    assert study_checks.main(argv) == 0
    assert f"{name} (attempts exited [143, 0]): same bits as an uninterrupted run over 3 steps" in capsys.readouterr().out

    metrics = out / name / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    last = json.loads(lines[-1])
    lines[-1] = json.dumps({**last, "loss": last["loss"] + 1e-7})  # one bit of one step off
    metrics.write_text("\n".join(lines) + "\n")
    assert study_checks.main([*argv[:-1], str(tmp_path / "scratch2")]) == 1
    assert "DIFFERENT from an uninterrupted run" in capsys.readouterr().out


def test_failure_causes_are_the_distinct_error_lines_without_the_harness_wrappers():
    lines = ["____ test_a ____", "E           RuntimeError: rank 1:", "E           Traceback (most recent call last):",
             "E           AttributeError: type object 'PipelineExecutor' has no attribute '_forward'",
             "E           RuntimeError: rank 0:",
             "E           AttributeError: type object 'PipelineExecutor' has no attribute '_forward'",
             "E   RuntimeError: ranks [0, 1] died without reporting",
             "E       AssertionError: assert 0.5 == 0.25", "tests/x.py:3: AssertionError"]
    assert study_checks.failure_causes(lines) == [
        "AttributeError: type object 'PipelineExecutor' has no attribute '_forward'",
        "RuntimeError: ranks [0, 1] died without reporting",  # a cause of its own, not a wrapper
        "AssertionError: assert 0.5 == 0.25"]


def test_a_recorded_check_is_printed_by_the_report_as_it_ran(tmp_path, monkeypatch):
    from tools import report_cost

    checks = tmp_path / "reproduction" / "checks.json"
    assert "No check recorded" in "\n".join(report_cost.checks_section(checks))
    monkeypatch.setattr(study_checks, "resumed", lambda *a: (study_checks.say("r1 (attempts exited [143, 0]): same"), 0)[1])
    assert study_checks.main(["resumed", "--study", "s", "--record", str(checks)]) == 0
    monkeypatch.setattr(study_checks, "equivalence", lambda *a: (study_checks.say("3 failed, 171 passed"), 1)[1])
    assert study_checks.main(["equivalence", "--commit", "abc", "--record", str(checks)]) == 1
    assert study_checks.main(["resumed", "--study", "s2", "--record", str(checks)]) == 0  # replaces the first
    assert study_checks.main(["resumed", "--study", "s3", "--record", str(checks), "--add"]) == 0  # added to it

    text = "\n".join(report_cost.checks_section(checks))
    assert text.count("**resumed**") == 1 and "--study s --record" not in text
    assert text.index("--study s2 --record") < text.index("--study s3 --record")
    assert text.index("**resumed**") < text.index("**equivalence**")  # the report's order, not the file's
    assert "exit 1" in text and "3 failed, 171 passed" in text and "r1 (attempts exited [143, 0]): same" in text


def test_a_rerun_takes_the_threads_the_study_recorded(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    study._write_status(run_dir, 143, 1.0, "cmd", 2.0, threads=4)
    study._write_status(run_dir, 0, 1.0, "cmd", 2.0, threads=2)  # resumed under another --jobs
    assert [a["threads"] for a in json.loads((run_dir / study.STATUS).read_text())["attempts"]] == [4, 2]
    assert study_checks.threads_of(run_dir / study.STATUS, None) == 2  # the attempt that finished it
    assert study_checks.threads_of(run_dir / study.STATUS, 3) == 3  # --threads wins
    (run_dir / study.STATUS).write_text(json.dumps({"attempts": [{"returncode": 0}]}))  # before it was recorded
    assert study_checks.threads_of(run_dir / study.STATUS, None) == 1


def test_a_run_killed_before_it_recorded_its_attempt_still_counts_as_resumed(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    study._write_status(run_dir, 0, 1.0, "cmd", 2.0)  # one recorded attempt: the one killed left no record
    assert not study_checks.was_resumed(run_dir)
    (run_dir / "train.log").write_text("$ pretrain.py ...\n$ pretrain.py ...\n[t] resumed at step 50\n")
    assert study_checks.was_resumed(run_dir)
    (run_dir / "train.log").write_text("$ pretrain.py ...\n$ pretrain.py ...\n")  # restarted from scratch
    assert not study_checks.was_resumed(run_dir)
    study._write_status(run_dir, 0, 1.0, "cmd", 2.0)
    assert study_checks.was_resumed(run_dir)  # two recorded attempts
