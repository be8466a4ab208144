"""End to end through job.run on the embedded corpus: what `make train` does, at test size."""

from __future__ import annotations

import json
import math

import pytest

from asyncpp.job import compose, resolve, run

REQUIRED = {"step", "loss", "lr", "grad_norm", "update_norm", "tokens_per_s"}


def small_run(tmp_path, *extra: str) -> tuple[dict, list[dict]]:
    overrides = [
        f"out_dir={tmp_path}",
        "logging=disabled",
        "logging.progress=false",
        "train.steps=40",
        "train.eval_every=20",
        "train.eval_batches=4",
        "train.micro_batch_size=4",
        "train.num_microbatches=2",
        "train.seq_len=64",
        "optimizer.schedule.warmup_steps=5",
        *extra,
    ]
    cfg, model_cfg = resolve(compose(overrides))
    summary = run(cfg, model_cfg)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return summary, records


@pytest.mark.parametrize("model, optimizer", [("tiny_dense", "muon"), ("tiny_hybrid", "adamw")])
def test_training_run_writes_metrics_and_learns(tmp_path, model, optimizer):
    _, records = small_run(tmp_path, f"model={model}", f"optimizer={optimizer}", "schedule=2bw",
                           "staleness.ef_lambda=1.0")
    assert [r["step"] for r in records] == list(range(40))
    for r in records:
        assert REQUIRED <= r.keys()
        assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0
    evals = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(evals) == 2
    # an untrained model sits at ln(8192) = 9.0; 40 small steps must get well below it and keep falling
    assert evals[-1] < evals[0] < 8.0
    assert records[-1]["loss"] < records[0]["loss"] - 1.5
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["final_val_loss"] == pytest.approx(evals[-1])
    assert saved["steps"] == 40 and saved["skipped_steps"] == 0
    assert json.loads((tmp_path / "config.json").read_text())["model"]["name"] == model


def test_same_seed_same_losses_bitwise(tmp_path):
    """Runs are deterministic on CPU: the basis of every equivalence test."""
    _, a = small_run(tmp_path / "a", "model=tiny_dense", "train.steps=6", "train.eval_every=0")
    _, b = small_run(tmp_path / "b", "model=tiny_dense", "train.steps=6", "train.eval_every=0")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
