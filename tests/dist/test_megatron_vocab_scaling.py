"""fp16 loss scaling (config.grad_scale_func) and synchronous start steps with the output layer spread over the
stages (VocabSpreadStage / VocabPipeline2BW) equal the delayed simulator on the unsplit GPTModel, as they do for
plain Pipeline2BW (test_megatron_core.py's loss_scale_overflow and *_sync_start cases).

The loss is the head's (its T passes), so the scale seeds the backward there (VocabHead.loss_scale) and the step's
reduction divides b_t's summed gradient by m x scale; a step whose gradient overflows (scale inf, as the reference's
gradient times inf) is skipped on every rank by the global norm (semantics.md). A synchronous step runs the head's
stream of that one step with delay 0 (b_t on x_t), flushed. Losses, grad norms, every weight at the front-end's
RTOL (its derivation: test_megatron_core.py's module docstring; the scale is a power of two, so scaling and
unscaling are exact).
"""

from __future__ import annotations

import math

import pytest

from tests.dist.megatron_core_workers import Case
from tests.dist.test_megatron_core import (
    check_corrections_acted,
    check_equals_reference,
    check_megatron_ran,
    check_vocab_head_evaluates,
    check_vocab_head_ran,
    run_cases,
)

pytestmark = [pytest.mark.dist, pytest.mark.equivalence]

CASES = [Case("vocab_head_loss_scale_overflow", vocab=True, loss_scale=1024.0, overflow_step=1, sync_start_steps=2),
         Case("vocab_head_and_embedding_tied_sync_start_ef", vocab=True, vocab_embedding=True, tied=True,
              sync_start_steps=2, ef_lambda=1.0, drain_after=4)]


@pytest.fixture(scope="module")
def runs():
    return run_cases(CASES)


def check_vocab_loss_scaling(ranks: list[dict], ref: dict) -> None:
    """The scale was divided out with 1/m (the reduction's factor 1/(m x scale); 0 at the overflowing step), the
    overflowing step skipped on every rank as in the reference, and a new scale inside an open stream refused."""
    case = Case(**ranks[0]["case"])
    bad = case.overflow_step
    assert ref["skipped"] == [t == bad for t in range(case.steps)] and not math.isfinite(ref["grad_norms"][bad])
    for r in ranks:
        assert r["grad_scales"] == [0.0 if t == bad else 1 / (case.num_microbatches * case.loss_scale)
                                    for t in range(case.steps)]
        assert r["skipped"] == {t: t == bad for t in range(case.steps)}
        assert not math.isfinite(r["grad_norms"][bad])
        assert "loss scale changed from 1024.0 to 2048.0" in r["scale_refusal"] and "drain()" in r["scale_refusal"]


def check_sync_steps(ranks: list[dict]) -> None:
    """The synchronous steps were flushed: after call k < sync_start_steps the update of b_k was applied."""
    case = Case(**ranks[0]["case"])
    for r in ranks:
        assert r["applied"][:case.sync_start_steps] == list(range(case.sync_start_steps)), r["applied"]
        assert r["applied"][case.sync_start_steps] == case.sync_start_steps - 1  # then the 2BW stream's delay


@pytest.mark.slow  # two processes, two cases: ~30 s on a loaded 2-core box
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_spread_head_loss_scaling_and_sync_start_equal_delayed_reference(runs, name):
    refs, got = runs
    ranks, ref = got[name], refs[name]
    check_equals_reference(ranks, ref)
    check_megatron_ran(ranks, tp=1)
    check_vocab_head_ran(ranks)
    check_vocab_head_evaluates(ranks, ref)
    check_corrections_acted(ranks, ref)
    check_sync_steps(ranks)
    if Case(**ranks[0]["case"]).loss_scale is not None:
        check_vocab_loss_scaling(ranks, ref)
