"""train.batch_rampup (issue 20): Megatron's --rampup-batch-size rule, the per-step microbatch count and data
position it gives (asyncpp/core/batches.py), the segment cuts, and the config errors."""

from __future__ import annotations

import pytest
import torch

from asyncpp.config import ConfigError
from asyncpp.core.batches import BatchPlan, rampup_global_batch
from asyncpp.job import build_from_config, compose, resolve
from asyncpp.reference.executor import ReferenceExecutor
from asyncpp.train.trainer import Trainer, segment_bounds
from model_zoo import build_model, get_model_config
from tests.dist.workers import Collect, SyntheticData, make_config


def check(overrides: list[str], world_size: int = 1):
    return resolve(compose(overrides), world_size=world_size)[0]


def test_megatron_rule_by_hand():
    # start 2, increment 2, 10 samples, global 8: three increments, one every 10 / 3 = 3.33 samples.
    # consumed 0, 2 -> 2; 4 (4 / 3.33 = 1.2) -> 4; 8 (2.4) -> 6; 10 (3.0) -> 8; beyond 10 samples -> 8.
    got = [rampup_global_batch(c, 2, 2, 10, 8) for c in (0, 2, 3, 4, 8, 10, 11, 10_000)]
    assert got == [2, 2, 2, 4, 6, 8, 8, 8]


def test_megatron_rule_keeps_its_float_division():
    # 9 samples over 7 increments: 9 / (9 / 7) is 6.999999999999999 in doubles, so Megatron's batch at 9 consumed
    # samples is start + 6 increments, not the exact 7; the ramp steps up where Megatron's does.
    assert rampup_global_batch(9, 1, 1, 9, 8) == 7
    assert rampup_global_batch(10, 1, 1, 9, 8) == 8  # past the ramp: the global batch


def test_plan_of_a_ramp_by_hand():
    # micro batch 2, dp 1, global 8 (m=4), ramp [2, 2, 10]: the batch at the samples consumed before each step.
    # step:      0  1  2  3   4   5
    # consumed:  0  2  4  8  14  22
    # batch:     2  2  4  6   8   8     (14 > 10 samples: the ramp is over)
    plan = BatchPlan(steps=6, micro_batch_size=2, dp=1, num_microbatches=4, rampup=(2, 2, 10))
    assert [plan.microbatches(t) for t in range(6)] == [1, 1, 2, 3, 4, 4]
    assert [plan.samples_before(t) for t in range(7)] == [0, 2, 4, 8, 14, 22, 30]
    assert [plan.first_microbatch(t) for t in range(6)] == [0, 1, 2, 4, 7, 11]
    assert [plan.global_batch(t) for t in range(6)] == [2, 2, 4, 6, 8, 8]
    assert plan.changes() == [2, 3, 4]
    assert plan.describe() == "m=1..4 (batch rampup until step 4)"


def test_the_ramp_is_in_samples_so_dp_changes_m_but_not_the_batches():
    one = BatchPlan(steps=8, micro_batch_size=2, dp=1, num_microbatches=8, rampup=(4, 4, 24))
    two = BatchPlan(steps=8, micro_batch_size=2, dp=2, num_microbatches=4, rampup=(4, 4, 24))
    assert [one.global_batch(t) for t in range(8)] == [two.global_batch(t) for t in range(8)]
    assert [one.microbatches(t) for t in range(8)] == [2 * two.microbatches(t) for t in range(8)]
    # Replica r reads its m_t microbatches after those of replicas < r: the same global indices as one replica
    # with dp x m_t microbatches (DP=2 with m equals DP=1 with 2m).
    for t in range(8):
        m = two.microbatches(t)
        indices = [two.microbatch_index(t, r, j) for r in range(2) for j in range(m)]
        assert indices == [one.microbatch_index(t, 0, j) for j in range(2 * m)]


def test_without_a_ramp_the_index_is_the_old_one():
    plan = BatchPlan(steps=5, micro_batch_size=3, dp=2, num_microbatches=4)
    assert plan.changes() == [] and plan.describe() == "m=4"
    for t in range(5):
        for r in range(2):
            assert [plan.microbatch_index(t, r, j) for j in range(4)] == [(t * 2 + r) * 4 + j for j in range(4)]
    with pytest.raises(IndexError):
        plan.microbatch_index(0, 0, 4)


def test_a_segment_across_a_change_is_refused_and_the_trainer_cuts_there():
    plan = BatchPlan(steps=6, micro_batch_size=2, dp=1, num_microbatches=4, rampup=(2, 2, 10))
    assert plan.constant(3, 4) == 3
    with pytest.raises(ValueError, match=r"a segment must be cut at \[3\]"):
        plan.constant(2, 4)
    assert segment_bounds(6, 0, 5, at=plan.changes()) == [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6)]


def test_the_simulator_reads_each_steps_microbatches_once_in_order():
    """Every step of a ramped run reads its m_t x dp microbatches, contiguous over the run (no sample skipped or
    read twice), and the records and the summary count the real batch."""
    # dp 2 (simulated), micro batch 2, global 12 (m=3), ramp [4, 4, 12]: one increment every 6 samples;
    # consumed 0, 4, 8, 16 -> batches 4, 4, 8, 12, 12 -> m = 1, 1, 2, 3, 3 per replica.
    cfg = make_config(train={"steps": 5, "micro_batch_size": 2, "num_microbatches": 3, "batch_rampup": [4, 4, 12]},
                      parallel={"dp": 2})
    model_cfg = get_model_config(cfg.model.name)
    cfg = cfg.validate(model_cfg)
    read: list[int] = []

    class Recording(SyntheticData):
        def train_microbatch(self, index: int):
            read.append(index)
            return super().train_microbatch(index)

    torch.manual_seed(cfg.seed)
    model = build_model(model_cfg)
    executor = ReferenceExecutor(cfg, model, build_from_config(model, cfg.optimizer),
                                 Recording(model_cfg.vocab_size, cfg.train.seq_len, 2, cfg.seed))
    sink = Collect()
    summary = Trainer(cfg, executor, sink).run()
    assert read == list(range(2 * (1 + 1 + 2 + 3 + 3)))
    assert [r["global_batch_size"] for r in sink.records] == [4, 4, 8, 12, 12]
    assert [r["consumed_tokens"] for r in sink.records] == [n * cfg.train.seq_len for n in (4, 8, 16, 28, 40)]
    assert summary["tokens"] == 40 * cfg.train.seq_len


def test_a_ramp_composes_from_the_command_line():
    cfg = check(["train.global_batch_size=64", "train.micro_batch_size=8", "train.batch_rampup=[16,16,6400]"])
    assert cfg.train.batch_rampup == (16, 16, 6400)
    plan = BatchPlan.of(cfg)
    assert plan.microbatches(0) == 2 and plan.microbatches(cfg.train.steps - 1) == 8
    assert check([]).train.batch_rampup is None  # off by default


@pytest.mark.parametrize("overrides, world, must_contain", [
    (["train.batch_rampup=[12,16,100]"], 1,  # micro batch 8 x dp 1
     ["train.batch_rampup=[12, 16, 100]", "start=12 is not a multiple of", "= 8", "start=8 or 16"]),
    (["train.batch_rampup=[16,16,100]", "parallel.pp=2"], 4,  # dp = 4 / 2 = 2: 16 per microbatch row
     ["train.batch_rampup=[16, 16, 100]", "start=16", "m=1", "parallel.pp=2", "raise start to 32"]),
    (["train.batch_rampup=[8,12,100]"], 1, ["increment=12 is not a multiple of", "increment=8 or 16"]),
    (["train.batch_rampup=[32,8,100]"], 1, ["start=32 must be below train.global_batch_size=32",
                                             "train.batch_rampup=null"]),
    (["train.global_batch_size=64", "train.batch_rampup=[8,16,100]"], 1,
     ["64 - start=8 = 56 is not a multiple of increment=16"]),
    (["train.batch_rampup=[8,8,0]"], 1, ["samples=0 must be >= 1"]),
    (["train.batch_rampup=[8,8]"], 1, ["train.batch_rampup", "must have 3 entries"]),
])
def test_rampup_errors_name_field_value_and_fix(overrides, world, must_contain):
    with pytest.raises(ConfigError) as err:
        check(overrides, world)
    for fragment in must_contain:
        assert fragment in str(err.value), (fragment, str(err.value))


@pytest.mark.slow
def test_the_plan_equals_megatron_cores_calculator():
    """Against megatron-core's own RampupBatchsizeNumMicroBatchesCalculator (a dependency: data/ reads through
    its GPTDataset), stepped the way Megatron's training loop steps it (update before each step with the samples
    consumed so far)."""
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    for mbs, dp, final, ramp in [(2, 1, 8, (2, 2, 10)), (1, 1, 8, (1, 1, 9)), (4, 2, 96, (8, 8, 1000)),
                                 (2, 4, 64, (16, 8, 333)), (1, 3, 30, (3, 9, 7))]:
        plan = BatchPlan(steps=400, micro_batch_size=mbs, dp=dp, num_microbatches=final // (mbs * dp), rampup=ramp)
        calc = RampupBatchsizeNumMicroBatchesCalculator(final, mbs, dp, False, 0, *ramp)
        consumed = 0
        for t in range(400):
            calc.update(consumed, consistency_check=True)
            assert (plan.microbatches(t), plan.global_batch(t)) == (calc.get(), calc.get_current_global_batch_size())
            assert plan.samples_before(t) == consumed
            consumed += calc.get_current_global_batch_size()
