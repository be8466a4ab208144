"""Batch, warmup and stage-split defaults the way Megatron users set them (issue 20): a global batch size
with the microbatch count derived from micro_batch_size x dp, a warmup that fits any train.steps, and an
uneven default split."""

from __future__ import annotations

import pytest

from asyncpp.config import DEFAULT_MICROBATCHES, ConfigError
from asyncpp.core.layer_split import default_split
from asyncpp.core.partition import stage_split
from asyncpp.core.update import lr_multiplier_for
from asyncpp.job import compose, resolve
from model_zoo import get_model_config


def check(overrides: list[str], world_size: int = 1):
    return resolve(compose(overrides), world_size=world_size)[0]


def test_microbatches_default_without_a_global_batch():
    t = check([]).train
    assert t.num_microbatches == DEFAULT_MICROBATCHES
    assert t.global_batch_size == t.micro_batch_size * DEFAULT_MICROBATCHES  # filled in: what a step consumes


@pytest.mark.parametrize("overrides, world, m, dp", [
    (["train.global_batch_size=64", "train.micro_batch_size=8"], 1, 8, 1),
    (["train.global_batch_size=64", "train.micro_batch_size=8", "parallel.dp=2"], 1, 4, 2),  # simulated replicas
    (["train.global_batch_size=64", "train.micro_batch_size=4", "parallel.pp=2"], 4, 8, 2),  # torchrun: dp=4/2
    (["train.global_batch_size=32", "train.micro_batch_size=8", "train.num_microbatches=4"], 1, 4, 1),  # agrees
])
def test_global_batch_size_derives_the_microbatch_count(overrides, world, m, dp):
    cfg = check(overrides, world)
    assert (cfg.train.num_microbatches, cfg.parallel.dp or 1) == (m, dp)
    assert cfg.train.num_microbatches * cfg.train.micro_batch_size * dp == cfg.train.global_batch_size


@pytest.mark.parametrize("overrides, world, must_contain", [
    (["train.global_batch_size=60", "train.micro_batch_size=8"], 1,
     ["train.global_batch_size=60", "train.micro_batch_size=8 x dp=1 = 8", "train.global_batch_size=56 or 64"]),
    (["train.global_batch_size=48", "train.micro_batch_size=8", "parallel.pp=2"], 8,  # dp = 8 / 2 = 4
     ["train.global_batch_size=48", "dp=4 = 32", "train.global_batch_size=32 or 64"]),
    (["train.global_batch_size=32", "train.micro_batch_size=8", "train.num_microbatches=8"], 1,
     ["train.num_microbatches=8 disagrees", "= 4", "set only one"]),
    (["train.global_batch_size=0"], 1, ["train.global_batch_size=0", ">= 1"]),
])
def test_global_batch_size_errors_name_field_value_and_fix(overrides, world, must_contain):
    with pytest.raises(ConfigError) as err:
        check(overrides, world)
    for fragment in must_contain:
        assert fragment in str(err.value), (fragment, str(err.value))


def test_global_batch_below_the_pipeline_depth_is_refused_by_the_schedule_rule():
    # 2BW needs m >= pp: a global batch that derives m=1 at pp=2 is refused, naming the global batch that serves.
    with pytest.raises(ConfigError, match=r"at least parallel.pp=2 microbatches .* train.global_batch_size=16 .*"
                       r"raise train.global_batch_size to 32"):
        check(["train.global_batch_size=16", "train.micro_batch_size=8", "parallel.pp=2"], world_size=4)


def test_world_size_that_the_layout_cannot_use_is_refused():
    with pytest.raises(ConfigError, match="6 ranks, which is not divisible"):
        check(["parallel.pp=4"], world_size=6)


@pytest.mark.parametrize("steps", [1, 10, 300, 1000])
def test_default_warmup_fits_any_run_length(steps):
    cfg = check([f"train.steps={steps}"])
    assert cfg.optimizer.schedule.warmup_steps == round(0.1 * steps)
    lr = lr_multiplier_for(cfg)
    assert [lr(s) for s in range(steps)]  # the schedule accepts every step of the run


def test_warmup_fraction_and_explicit_warmup():
    assert check(["train.steps=200", "optimizer.schedule.warmup_fraction=0.25"]).optimizer.schedule.warmup_steps == 50
    assert check(["train.steps=200", "optimizer.schedule.warmup_steps=7"]).optimizer.schedule.warmup_steps == 7
    with pytest.raises(ConfigError) as err:
        check(["train.steps=10", "optimizer.schedule.warmup_steps=30"])
    assert "warmup_steps=30" in str(err.value) and "optimizer.schedule.warmup_steps=null" in str(err.value)
    with pytest.raises(ConfigError, match="warmup_fraction=1.5"):
        check(["optimizer.schedule.warmup_fraction=1.5"])


def test_the_default_warmup_is_the_old_default_at_300_steps():
    # configs used warmup_steps=30 with train.steps=300: `make train` keeps its LR schedule exactly.
    assert check([]).optimizer.schedule.warmup_steps == 30


@pytest.mark.parametrize("layers, pp, split", [(30, 4, [8, 8, 7, 7]), (4, 3, [2, 1, 1]), (8, 4, [2, 2, 2, 2]),
                                                (5, 5, [1] * 5)])
def test_default_split_is_even_with_the_extra_layers_first(layers, pp, split):
    assert default_split(layers, pp) == split


def test_uneven_model_on_a_pipeline_just_works():
    cfg = check(["model=smollm2_135m", "parallel.pp=4"])
    assert cfg.parallel.stage_layers == "auto"  # the hydra default: resolved at build time by stage_split
    split = stage_split(cfg, get_model_config("smollm2_135m"))
    assert len(split) == 4 and sum(split) == 30 and min(split) >= 1
    assert default_split(30, 4) == [8, 8, 7, 7]  # a config built without a split (stage_layers=None)
    with pytest.raises(ValueError, match="parallel.pp<=4"):
        default_split(4, 5)
