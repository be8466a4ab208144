"""Continuing a finished run (issue 47): train.steps is not part of the run's directory, so the same command with
a larger train.steps resumes it there; the samples already read are the ones the longer run reads (the data
order is checked by digest); a rerun of a finished command is one line and exit 0; checkpoint.resume takes a run
directory as printed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncpp import job
from asyncpp.train import checkpoint as ckpt
from asyncpp.train import preflight
from asyncpp.train.run_identity import derived_name, run_name

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model=tiny_dense", "logging=disabled", "logging.progress=false", "train.eval_every=0",
         "train.micro_batch_size=2", "train.num_microbatches=2", "train.seq_len=32", "schedule=2bw",
         "parallel.pp=2", "staleness.ef_lambda=1.0", "optimizer=adamw", "optimizer.schedule.kind=constant",
         "optimizer.schedule.warmup_steps=0"]


def train(out: Path, steps: int, *extra: str) -> list[dict]:
    cfg, model_cfg = job.resolve(job.compose([*SMALL, f"train.steps={steps}", f"out_dir={out}", *extra]))
    preflight.check(cfg, model_cfg)
    job.run(cfg, model_cfg)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_steps_is_not_part_of_a_runs_name_but_of_a_sweep_jobs():
    a = ["model=tiny_dense", "schedule=2bw"]
    assert derived_name([*a, "train.steps=4"]) == derived_name([*a, "train.steps=8"]) == derived_name(a)
    assert derived_name([*a, "train.steps=4"], sweep=True) != derived_name([*a, "train.steps=8"], sweep=True)
    assert run_name(None, [*a, "train.steps=8"], sweep=True).endswith("train.steps=8")


def test_extending_4_to_8_steps_equals_a_straight_8_step_run(tmp_path, capsys):
    """Bitwise: the simulator resumed at step 4 (weights, both versions, u_{t-1}, AdamW state, RNG, data position)
    continues as the uninterrupted run, and the first 4 steps read the samples the 8-step run reads (one epoch of
    the embedded corpus either way: megatron-core's indices then order the samples alike). The LR schedule is
    constant: a decaying one is a function of train.steps, so its first 4 steps would differ on purpose."""
    run = tmp_path / "run"
    first = train(run, 4)
    assert [r["step"] for r in first] == [0, 1, 2, 3] and ckpt.latest(run / "checkpoints").name == "step_00000004"
    manifest = ckpt.read_manifest(ckpt.latest(run / "checkpoints"))
    assert manifest["data"]["order"]  # the digest of the samples read, which the extension checks
    capsys.readouterr()
    extended = train(run, 8)
    said = capsys.readouterr()
    assert "resumed at step 4" in said.out + said.err
    assert "warning: the data stream differs" not in said.out + said.err
    assert "span another number of epochs" not in said.out + said.err
    straight = train(tmp_path / "straight", 8)
    assert [r["step"] for r in extended] == list(range(8))  # one metrics file, one lineage
    assert [r["loss"] for r in extended] == [r["loss"] for r in straight]
    assert [r["grad_norm"] for r in extended] == [r["grad_norm"] for r in straight]
    assert [p.name for p in ckpt.list_checkpoints(run / "checkpoints")] == ["step_00000004", "step_00000008"]


def test_a_longer_run_over_more_epochs_says_its_first_samples_differ(tmp_path):
    """The digest is what tells: the same stream built for a sample count past one epoch orders even its first
    samples differently (megatron-core shuffles over every epoch), and the resume says so; the run's start says
    how many epochs it reads (job.warn_data_repeats)."""
    cfg, model_cfg = job.resolve(job.compose([*SMALL, "train.steps=4", f"out_dir={tmp_path}"]))
    short = job.build_data(cfg, model_cfg)
    epoch = len(short.datasets()[0])
    steps = epoch // (2 * 2) * 3  # three epochs' worth of microbatches
    long_cfg, _ = job.resolve(job.compose([*SMALL, f"train.steps={steps}", f"out_dir={tmp_path}"]))
    longer = job.build_data(long_cfg, model_cfg)
    assert short.order_digest(16) == job.build_data(cfg, model_cfg).order_digest(16)
    assert short.order_digest(16) != longer.order_digest(16)
    warned: list[str] = []
    manifest = {"data": {"identity": short.identity(), "consumed_samples": 16, "order": short.order_digest(16)}}
    ckpt.check_data_position(manifest, longer, long_cfg, warn=warned.append)
    assert len(warned) == 1 and "span another number of epochs" in warned[0]
    said: list[str] = []  # the start of a run says how many times it reads its data (once: nothing)
    assert job.warn_data_repeats(cfg, short, said.append) == 1 and said == []
    assert job.warn_data_repeats(long_cfg, longer, said.append) == 3
    assert len(said) == 1 and f"reads its training data 3 times over (3 epochs: train.steps={steps} x" in said[0]


def test_a_rerun_of_a_finished_run_is_one_line_and_exit_0(tmp_path):
    run = tmp_path / "model=tiny_dense,train.steps=2"  # a run directory's name as printed: '=' and ','
    train(run, 2)
    cfg, model_cfg = job.resolve(job.compose([*SMALL, "train.steps=2", f"out_dir={run}"]))
    preflight.check(cfg, model_cfg)  # not a config error any more
    with pytest.raises(preflight.RunComplete, match=r"run complete: .* is at step 2 = train.steps"):
        job.run(cfg, model_cfg)
    shorter, _ = job.resolve(job.compose([*SMALL, "train.steps=1", f"out_dir={run}"]))
    with pytest.raises(preflight.ConfigError, match="a run cannot be shortened"):
        preflight.check(shorter, model_cfg)
    # checkpoint.resume=<the run directory as printed>: quoted for hydra, resolved to its newest checkpoint
    other = tmp_path / "other"
    resumed, _ = job.resolve(job.compose([*SMALL, "train.steps=2", f"out_dir={other}", f"checkpoint.resume={run}"]))
    assert resumed.checkpoint.resume == str(run / "checkpoints" / "step_00000002")
    proc = subprocess.run([sys.executable, "pretrain.py", *SMALL, "train.steps=2", f"hydra.run.dir={run}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines[-1].startswith("run complete: ") and "Traceback" not in proc.stderr
