"""A corpus of bad configurations. Each is refused by asyncpp.config (or ParallelDims.for_world, for the
world size only torchrun knows) with a message naming the field, the value and the fix, before any
process group or model exists."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch.distributed as dist

from asyncpp import job
from asyncpp.config import ConfigError
from asyncpp.parallel.mesh import ParallelDims


class Bad(NamedTuple):
    overrides: list[str]
    field_value: str
    """The field and its value as the message spells them, e.g. "train.steps=0"."""
    fix: str
    """A fragment of what to do instead."""


CORPUS: dict[str, Bad] = {
    # unknown keys, at several depths
    "unknown-top-level": Bad(["+sed=1"], "unknown config key 'sed'", "did you mean 'seed'"),
    "unknown-section-key": Bad(["+train.stepz=10"], "'train.stepz'", "did you mean 'steps'"),
    "unknown-depth-3": Bad(
        ["+optimizer.schedule.warmup=5"], "'optimizer.schedule.warmup'", "did you mean 'warmup_steps'"
    ),
    "unknown-parallel-key": Bad(["+parallel.vpp=2"], "'parallel.vpp'", "known keys here: distributed_optimizer, dp, embedding, ep, head, pp"),
    "model-field-not-in-run-config": Bad(
        ["+model.hidden_size=256"], "'model.hidden_size'", "known keys here: name"
    ),
    "misspelt-staleness": Bad(["+staleness.ef_lamda=1"], "'staleness.ef_lamda'", "did you mean 'ef_lambda'"),
    "unknown-model": Bad(["model.name=gpt5"], "model.name='gpt5'", "choose one of: smollm2_135m"),
    # wrong types
    "str-for-int": Bad(["train.steps=abc"], "train.steps='abc'", "expected int"),
    "fraction-for-int": Bad(["train.micro_batch_size=2.5"], "train.micro_batch_size=2.5", "expected int"),
    "str-for-bool": Bad(["optimizer.nesterov=maybe"], "optimizer.nesterov='maybe'", "expected bool"),
    "int-for-bool": Bad(["logging.progress=1"], "logging.progress=1", "expected bool"),
    "scalar-for-list": Bad(["parallel.stage_layers=3"], "parallel.stage_layers=3", "must be a list"),
    "short-tuple": Bad(["optimizer.betas=[0.9]"], "optimizer.betas=[0.9]", "must have 2 entries"),
    "bad-literal": Bad(["logging.wandb_mode=cloud"], "logging.wandb_mode='cloud'", "'offline', 'online'"),
    # impossible parallel layouts
    "zero-stages": Bad(["parallel.pp=0"], "parallel.pp=0", ">= 1"),
    "zero-dp": Bad(["parallel.dp=0"], "parallel.dp=0", "leave it null"),
    "more-stages-than-layers": Bad(
        ["parallel.pp=8", "train.num_microbatches=8"], "parallel.pp=8", "parallel.pp<=4"
    ),
    "split-wrong-length": Bad(
        ["parallel.pp=2", "parallel.stage_layers=[1,1,2]"],
        "parallel.stage_layers=[1, 1, 2]",
        "parallel.pp=2 non-negative entries",
    ),
    "split-negative": Bad(
        ["parallel.pp=2", "parallel.stage_layers=[5,-1]"],
        "parallel.stage_layers=[5, -1]",
        "non-negative entries summing to the 4 layers",
    ),
    "tp-splits-heads": Bad(["model=tiny_dense", "parallel.tp=3"], "parallel.tp=3", "parallel.tp in [1, 2]"),
    "tp-splits-kv-groups": Bad(
        ["model=smollm2_135m", "parallel.tp=9", "train.num_microbatches=1", "schedule=sync"],
        "model.num_kv_heads=3",
        "parallel.tp in [1, 3]",
    ),
    "tp-splits-gdn-heads": Bad(
        ["model=tiny_hybrid", "+model.overrides.gdn.num_heads=3", "parallel.tp=2"],
        "model.gdn.num_heads=3", "parallel.tp in [1, 3]",
    ),
    "tp-splits-vocab": Bad(
        ["model=tiny_dense", "+model.overrides.vocab_size=8191", "parallel.tp=2"],
        "model.vocab_size=8191", "parallel.tp in [1, 8191]",
    ),
    "tp-splits-expert-ffn": Bad(
        ["model=tiny_moe", "+model.overrides.moe.expert_ffn_hidden_size=127", "parallel.tp=2"],
        "model.moe.expert_ffn_hidden_size=127", "parallel.tp in [1, 127]",
    ),
    "top-k-above-experts": Bad(
        ["model=tiny_moe", "+model.overrides.moe.top_k=9"], "model.moe.top_k=9", "lower top_k or raise num_experts",
    ),
    "sequence-parallel-splits-seq": Bad(
        ["model=tiny_dense", "parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=127"],
        "train.seq_len=127", "multiple of 2",
    ),
    "sequence-parallel-without-tp": Bad(  # megatron-core refuses it too (ModelParallelConfig)
        ["parallel.sequence_parallel=true"], "parallel.sequence_parallel=true with parallel.tp=1",
        "parallel.sequence_parallel=false",
    ),
    "negative-dry-run": Bad(["dry_run=-1"], "dry_run=-1", "dry_run=8"),
    "ep-on-dense": Bad(["model=tiny_dense", "parallel.ep=2"], "parallel.ep=2", "set parallel.ep=1"),
    "ep-splits-experts": Bad(
        ["model=tiny_moe", "parallel.ep=3"], "parallel.ep=3", "parallel.ep in [1, 2, 4, 8]"
    ),
    # inconsistent schedule options
    "ef-on-sync": Bad(["schedule=sync", "staleness.ef_lambda=1.0"], "schedule=sync", "use schedule=2bw"),
    "warm-start-on-1f1b": Bad(
        ["schedule=1f1b", "staleness.sync_start_steps=10"], "sync_start_steps=10", "or set them to 0"
    ),
    "cooldown-on-gpipe": Bad(
        ["schedule=gpipe", "staleness.sync_cooldown_steps=5"],
        "sync_cooldown_steps=5",
        "use schedule=2bw or schedule=pipedream",
    ),
    "pipedream-one-stage": Bad(["schedule=pipedream"], "parallel.pp=1", "parallel.pp=4"),
    "2bw-too-few-microbatches": Bad(
        ["parallel.pp=4", "train.num_microbatches=2"],
        "train.num_microbatches=2",
        "raise train.num_microbatches to 4",
    ),
    "sync-phases-longer-than-run": Bad(
        ["staleness.sync_start_steps=200", "staleness.sync_cooldown_steps=200"],
        "staleness.sync_start_steps=200",
        "shorten them",
    ),
    "negative-sync-start": Bad(["staleness.sync_start_steps=-1"], "staleness.sync_start_steps=-1", ">= 0"),
    "negative-ef": Bad(["staleness.ef_lambda=-0.5"], "staleness.ef_lambda=-0.5", "the paper uses 1"),
    # optimizer values
    "zero-lr": Bad(["optimizer.lr=0"], "optimizer.lr=0.0", "must be > 0"),
    "infinite-lr": Bad(["optimizer.lr=inf"], "optimizer.lr=inf", "the default optimizer.lr=0.01"),
    "nan-clip": Bad(["train.grad_clip=nan"], "train.grad_clip=nan", "finite number"),
    "negative-mmap-threshold": Bad(["train.host_mmap_threshold=-1"], "train.host_mmap_threshold=-1", "131072"),
    "huge-mmap-threshold": Bad(["train.host_mmap_threshold=1000000000"], "train.host_mmap_threshold=1000000000",
                               "or null to keep glibc's dynamic threshold"),
    "huge-trim-threshold": Bad(["train.host_trim_threshold=4294967296"], "train.host_trim_threshold=4294967296",
                               "use 2147483647 to never give the heap's top back"),
    "negative-adamw-lr": Bad(["optimizer.adamw_lr=-1"], "optimizer.adamw_lr=-1.0", "or null to reuse"),
    "negative-weight-decay": Bad(["optimizer.weight_decay=-0.1"], "optimizer.weight_decay=-0.1", ">= 0"),
    "beta-above-one": Bad(["optimizer.betas=[0.9,1.5]"], "optimizer.betas[1]=1.5", "in [0, 1)"),
    "momentum-one": Bad(["optimizer.momentum=1.0"], "optimizer.momentum=1.0", "in [0, 1)"),
    "zero-eps": Bad(["optimizer.eps=0"], "optimizer.eps=0.0", "optimizer.eps=1e-8"),
    "no-newton-schulz": Bad(["optimizer.ns_steps=0"], "optimizer.ns_steps=0", ">= 1"),
    # LR schedule
    "unknown-lr-schedule": Bad(
        ["optimizer.schedule.kind=linear"], "optimizer.schedule.kind='linear'", "'constant', 'cosine', 'wsd'"
    ),
    "warmup-longer-than-run": Bad(
        ["optimizer.schedule.warmup_steps=1000"],
        "optimizer.schedule.warmup_steps=1000",
        "[0, train.steps=300]",
    ),
    "negative-warmup": Bad(
        ["optimizer.schedule.warmup_steps=-1"], "optimizer.schedule.warmup_steps=-1", "[0, train.steps=300]"
    ),
    "min-lr-above-peak": Bad(
        ["optimizer.schedule.min_lr_ratio=1.5"], "optimizer.schedule.min_lr_ratio=1.5", "in [0, 1]"
    ),
    "no-decay-window": Bad(
        ["optimizer.schedule.kind=wsd", "optimizer.schedule.decay_fraction=0"],
        "optimizer.schedule.decay_fraction=0.0",
        "in (0, 1]",
    ),
    # train values
    "no-steps": Bad(["train.steps=0"], "train.steps=0", ">= 1"),
    "no-microbatches": Bad(["train.num_microbatches=0"], "train.num_microbatches=0", "microbatches per step"),
    "sequence-too-long": Bad(["train.seq_len=4096"], "train.seq_len=4096", "train.seq_len<=512"),
    "zero-timeout": Bad(["train.timeout_s=0"], "train.timeout_s=0.0", "> 0 (seconds)"),
    "negative-clip": Bad(["train.grad_clip=-1"], "train.grad_clip=-1.0", "0 disables clipping"),
    "negative-eval-every": Bad(["train.eval_every=-5"], "train.eval_every=-5", "0 disables evaluation"),
    "unknown-device": Bad(["train.device=gpu"], "train.device='gpu'", "train.device=cuda"),
    "no-skips-allowed": Bad(["train.max_consecutive_skips=0"], "train.max_consecutive_skips=0", ">= 1"),
    # data, logging, run
    "unknown-dataset": Bad(["data.name=c4"], "data.name='c4'", "choose one of: 'default'"),
    "bad-split": Bad(["data.split=abc"], "data.split='abc'", "data.split='98,2,0'"),
    "eval-without-validation-data": Bad(
        ["data.split='100,0,0'"], "data.split='100,0,0'", "train.eval_every=0"
    ),
    "log-every-zero": Bad(["logging.log_every=0"], "logging.log_every=0", ">= 1"),
    "empty-wandb-project": Bad(
        ["logging=online", "logging.wandb_project=''"], "logging.wandb_project=''", "logging=disabled"
    ),
    "negative-seed": Bad(["seed=-1"], "seed=-1", "seed=1234"),
    "empty-out-dir": Bad(["out_dir=' '"], "out_dir=' '", "give a directory"),
}

# The world size is known only under torchrun: ParallelDims.for_world(world, pp, tp, dp) checks it.
WORLD_CORPUS: dict[str, tuple[dict, str, str]] = {
    "world-not-divisible-by-pp": (
        {"world_size": 6, "pp": 4},
        "the job has 6 ranks",
        "launch a multiple of 4",
    ),
    "world-not-divisible-by-tp-pp": (
        {"world_size": 8, "pp": 4, "tp": 4},
        "parallel.tp=4 x parallel.pp=4",
        "launch a multiple of 16",
    ),
    "ep-does-not-divide-dp": (
        {"world_size": 8, "pp": 2, "ep": 3},
        "parallel.ep=3 does not divide the 4 data-parallel ranks",
        "parallel.ep in [1, 2, 4]",
    ),
    "dp-contradicts-world": ({"world_size": 8, "pp": 2, "dp": 3}, "parallel.dp=3", "set parallel.dp=null"),
}


@pytest.fixture(autouse=True)
def nothing_is_built(monkeypatch):
    """Validation must fail before a process group or a model exists: either would raise here."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a process group or model was created before validation finished")

    monkeypatch.setattr(dist, "init_process_group", forbidden)
    monkeypatch.setattr("model_zoo.transformer.CausalLM.__init__", forbidden)
    yield
    assert not dist.is_initialized()


def test_the_corpus_is_large():
    assert len(CORPUS) + len(WORLD_CORPUS) >= 30


@pytest.mark.parametrize("case", list(CORPUS.values()), ids=list(CORPUS))
def test_bad_config_names_field_value_and_fix(case: Bad):
    with pytest.raises(ConfigError) as err:
        job.resolve(job.compose(case.overrides))
    message = str(err.value)
    assert case.field_value in message, f"field/value {case.field_value!r} not in: {message}"
    assert case.fix in message, f"fix {case.fix!r} not in: {message}"


@pytest.mark.parametrize("case", list(WORLD_CORPUS.values()), ids=list(WORLD_CORPUS))
def test_bad_world_layout_names_field_value_and_fix(case):
    kwargs, field_value, fix = case
    with pytest.raises(ConfigError) as err:
        ParallelDims.for_world(kwargs.pop("world_size"), **kwargs)
    assert field_value in str(err.value) and fix in str(err.value), str(err.value)


def test_every_good_neighbour_of_the_corpus_passes():
    """The checks are not over-eager: the closest valid settings resolve."""
    for overrides in (
        ["model=tiny_dense", "parallel.tp=2"],
        ["model=tiny_moe", "parallel.ep=4"],
        ["train.device=cuda"],
        ["train.device=cuda:1"],
        ["data.split='99,1,0'"],
        ["logging=disabled", "logging.wandb_project=''"],
        ["seed=0"],
        ["optimizer.lr=1e-3"],
        ["model=smollm2_135m", "parallel.pp=5", "train.num_microbatches=5"],
    ):
        job.resolve(job.compose(overrides))
    assert ParallelDims.for_world(8, pp=2).dp == 4
