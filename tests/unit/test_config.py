"""Bad input gets a clear error naming the field, the value and the fix, before anything is built."""

from __future__ import annotations

import pytest

from asyncpp.config import ConfigError, RunConfig
from asyncpp.job import compose, resolve


def check(overrides: list[str]):
    return resolve(compose(overrides))


def test_default_config_composes_and_validates():
    cfg, model_cfg = check([])
    assert isinstance(cfg, RunConfig)
    assert (cfg.model.name, cfg.optimizer.name, cfg.schedule.name) == ("tiny_hybrid", "muon", "2bw")
    assert cfg.optimizer.betas == (0.9, 0.95)
    assert model_cfg.name == "tiny_hybrid"


@pytest.mark.parametrize(
    "overrides, must_contain",
    [
        (["model=tiny_dense", "model.name=gpt5"], ["model.name", "gpt5", "tiny_dense"]),
        (["staleness.ef_lambda=-0.5"], ["staleness.ef_lambda=-0.5", ">= 0"]),
        (["train.num_microbatches=0"], ["train.num_microbatches=0", ">= 1"]),
        (["train.seq_len=4096"], ["train.seq_len=4096", "512", "train.seq_len<=512"]),
        (["parallel.pp=4", "train.num_microbatches=2"], ["num_microbatches=2", "parallel.pp=4", "raise"]),
        (["parallel.pp=8"], ["parallel.pp=8", "layers (4)"]),
        (["parallel.pp=2", "parallel.stage_layers=[3,2]"], ["parallel.stage_layers=[3, 2]", "summing to the 4 layers"]),
        (["+train.stepz=10"], ["train.stepz", "did you mean 'steps'"]),
        (["train.steps=abc"], ["train.steps='abc'", "expected int"]),
        (["optimizer.lr=-1"], ["optimizer.lr=-1.0", "> 0"]),
        (["optimizer.betas=[0.9,1.5]"], ["optimizer.betas[1]=1.5"]),
        (["optimizer.schedule.kind=linear"], ["optimizer.schedule.kind='linear'", "'cosine'", "'wsd'"]),
        (["schedule=sync", "staleness.ef_lambda=1.0"], ["schedule=sync", "schedule=2bw"]),
        (["staleness.sync_start_steps=200", "staleness.sync_cooldown_steps=200"], ["exceed train.steps=300"]),
        (["optimizer.schedule.warmup_steps=1000"], ["warmup_steps=1000", "train.steps=300"]),
        (["logging.wandb_mode=cloud"], ["logging.wandb_mode='cloud'", "'offline'"]),
    ],
)
def test_bad_config_is_refused_with_field_value_and_fix(overrides, must_contain):
    with pytest.raises(ConfigError) as err:
        check(overrides)
    message = str(err.value)
    for fragment in must_contain:
        assert fragment in message, (fragment, message)


def test_unknown_group_choice_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match=r"schedule=zero_bubble is not a config of group 'schedule'; choose one "
                                          r"of: 1f1b, 2bw, gpipe, pipedream, sync"):
        compose(["schedule=zero_bubble"])


def test_typed_values_are_converted_not_passed_through():
    cfg, _ = check(["optimizer.lr=1", "train.grad_clip=0", "optimizer.adamw_lr=0.002"])
    assert isinstance(cfg.optimizer.lr, float) and cfg.optimizer.lr == 1.0
    assert isinstance(cfg.train.grad_clip, float)
    assert cfg.optimizer.adamw_lr == 0.002


def test_a_gpu_backend_with_tensor_parallelism_is_refused_before_the_process_group():
    """Checked by check_pipeline_options, which resolve runs at more than one rank (so the dry run refuses it too),
    before init_process_group (it was a check after it)."""
    with pytest.raises(ConfigError, match=r"train.backend=te is not combined with tensor/expert parallelism yet "
                                          r"\(parallel.tp=2, parallel.ep=1\); use train.backend=local"):
        resolve(compose(["model=tiny_dense", "train.device=cuda", "train.backend=te", "parallel.tp=2"]), world_size=2)
