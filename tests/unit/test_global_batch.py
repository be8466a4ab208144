"""Megatron's global batch (issue 47): train.batch_scaling=fixed (configs/pretrain.yaml's default) or a given
train.global_batch_size (Megatron's --global-batch-size) keeps the step's batch when dp changes and each replica
runs num_microbatches / dp microbatches; per_replica, the former behaviour stated (4 on every replica), grows it with
dp. The simulator plays dp replicas as m x dp microbatches in the pipeline's global order, so a dp=1 and a dp=2 run
at one global batch read the same samples in the same order: bitwise the same losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncpp import job
from asyncpp.config import ConfigError
from asyncpp.core.batches import BatchPlan
from launch.megatron_flags import table, translate

SMALL = ["model=tiny_dense", "logging=disabled", "logging.progress=false", "train.eval_every=0", "train.steps=2",
         "train.micro_batch_size=2", "train.seq_len=32", "schedule=sync",
         "optimizer=adamw", "checkpoint.enabled=false"]


def resolved(*overrides: str):
    return job.resolve(job.compose([*SMALL, *overrides]))


def samples_of(cfg, step: int) -> range:
    plan = BatchPlan.of(cfg)
    b = cfg.train.micro_batch_size
    first = plan.first_microbatch(step)
    return range(first * b, (first + plan.microbatches(step) * plan.dp) * b)


def test_the_global_batch_is_fixed_by_default_and_per_replica_when_stated():
    one, _ = resolved("parallel.dp=1")
    two, _ = resolved("parallel.dp=2")
    assert one.train.batch_scaling == two.train.batch_scaling == "fixed"  # configs/pretrain.yaml's default
    assert one.train.global_batch_size == two.train.global_batch_size == 8  # mbs 2 x DEFAULT_MICROBATCHES 4
    assert (one.train.num_microbatches, two.train.num_microbatches) == (4, 2)
    assert [samples_of(one, t) for t in range(2)] == [samples_of(two, t) for t in range(2)] == [range(8), range(8, 16)]
    grown, _ = resolved("parallel.dp=2", "train.batch_scaling=per_replica")
    assert (grown.train.global_batch_size, grown.train.num_microbatches) == (16, 4)
    stated, _ = resolved("parallel.dp=2", "train.num_microbatches=4")  # a given m is per replica
    assert (stated.train.global_batch_size, stated.train.num_microbatches) == (16, 4)
    explicit, _ = resolved("parallel.dp=2", "train.global_batch_size=8")
    assert explicit.train == two.train  # Megatron's flag: the same
    with pytest.raises(ConfigError, match=r"train.global_batch_size=8 is not a multiple of .* dp=3"):
        resolved("parallel.dp=3")


def test_too_few_microbatches_per_replica_name_the_global_batch_and_its_fix():
    """The default global batch (mbs 2 x 4 = 8) at dp=4 leaves m=1 per replica, fewer than 2BW's 2 stages: the
    refusal names train.global_batch_size, its value and the one that serves, which then validates."""
    bad = ["schedule=2bw", "parallel.pp=2", "parallel.dp=4"]
    with pytest.raises(ConfigError, match=r"train.num_microbatches=1 = train.global_batch_size=8 / "
                       r"\(train.micro_batch_size=2 x dp=4\).*raise train.global_batch_size to 16"):
        resolved(*bad)
    fixed, _ = resolved(*bad, "train.global_batch_size=16")
    assert (fixed.train.num_microbatches, fixed.parallel.dp) == (2, 4)


def test_dp_1_and_dp_2_at_one_global_batch_train_alike(tmp_path):
    losses = {}
    for dp in (1, 2):
        cfg, model_cfg = resolved(f"parallel.dp={dp}", "train.global_batch_size=8", f"out_dir={tmp_path / str(dp)}")
        job.run(cfg, model_cfg)
        lines = (tmp_path / str(dp) / "metrics.jsonl").read_text().splitlines()
        losses[dp] = [json.loads(line)["loss"] for line in lines]
    assert len(losses[1]) == 2 and losses[1] == losses[2]


def test_megatron_flags_translate_to_overrides():
    flags = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size=4", "--global-batch-size", "512",
             "--micro-batch-size", "1", "--seq-length", "4096", "--train-iters", "1000", "--lr", "3e-4",
             "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "100", "--bf16",
             "--use-distributed-optimizer", "--sequence-parallel", "--clip-grad", "1.0", "--save-interval", "500",
             "--expert-model-parallel-size", "2", "--rampup-batch-size", "32", "32", "1000"]
    overrides, notes = translate(flags)
    assert overrides == [
        "parallel.tp=2", "parallel.pp=4", "train.global_batch_size=512", "train.micro_batch_size=1",
        "train.seq_len=4096", "train.steps=1000", "optimizer.lr=0.0003", "optimizer.schedule.min_lr_ratio=0.1",
        "optimizer.schedule.kind=cosine", "optimizer.schedule.warmup_steps=100", "train.precision=bf16",
        "parallel.distributed_optimizer=true", "parallel.sequence_parallel=true", "train.grad_clip=1.0",
        "checkpoint.every=500", "parallel.ep=2", "train.batch_rampup=[32,32,1000]"]
    assert notes == []
    overrides, notes = translate(["--num-layers", "24", "--no-such-flag"])
    assert overrides == [] and any("--num-layers" in n and "model=" in n for n in notes)
    assert any("--no-such-flag" in n and "not known" in n for n in notes)


def test_the_docs_hold_the_generated_table():
    """docs/launch.md's table is the helper's output, so it cannot drift from the translation."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "launch.md").read_text()
    held = docs.split("<!-- megatron-flags-table: generated by python -m launch.megatron_flags --table -->\n")[1]
    assert held.split("\n<!-- /megatron-flags-table -->")[0] == table()
