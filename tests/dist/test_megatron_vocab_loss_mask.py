"""pretrain_gpt's loss_mask with the output layer spread over the stages (VocabPipeline2BW's loss_mask hook) equals
the simulator on the unsplit GPTModel with megatron's masked loss, sum(loss * mask) / sum(mask) per microbatch.

The head's T passes weight each token's cross entropy and its logits' gradient by mask / sum(mask)
(vocab_head.token_weights) where the unmasked head takes 1/N; every stage reads the mask of the call's j-th sample
after its forward (the hook, like input_ids) and its S keeps it for T. The mask (megatron_core_workers.masked_loss_mask)
masks 4 positions of every sample, where depends on the sample. Losses and grad norms at the front-end's RTOL; every
weight at RTOL or, where larger, four times the case's own rounding floor (the masked reference's distance from
itself with each step's microbatches summed in reverse: test_megatron_vocab_moe.rounding_floor's rule): the pipeline
changes four float orders of that size (the head's per-shard softmax from gathered statistics, the stages' partial
input gradients' sum, the tied rows' all-stage reduction, the sharded embedding's summed lookup). The mask makes the
problem worse conditioned than the unmasked one (its floor: 1.2e-5 against 1.6e-6 for the 1F1B case here; 1/24
per token is inexact where 1/32 was a power of two, and the masked positions' parameters get smaller gradients that
AdamW-style normalisations amplify). The reported token counts are sum(mask); the reference without the mask ends
ACTED away from the masked one, so the match could not come from ignoring it. One 2BW case with a drain, one 1F1B
case tied with the sharded embedding.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.dist.harness import run_ranks
from tests.dist.megatron_core_workers import MICRO_BATCH, SEQ, Case, reference_rank
from tests.dist.test_megatron_core import (
    ACTED,
    RTOL,
    check_equals_reference,
    check_megatron_ran,
    check_spread_head,
    run_cases,
)
from tests.dist.test_pipeline_equivalence import relative_error

pytestmark = [pytest.mark.dist, pytest.mark.equivalence]

CASES = [Case("vocab_head_loss_mask", vocab=True, loss_mask=True, drain_after=3),
         Case("vocab_head_and_embedding_tied_loss_mask_1f1b", schedule="1f1b", vocab=True, vocab_embedding=True,
              tied=True, loss_mask=True)]
TWINS = [dataclasses.replace(c, name=c.name + suffix, **change) for c in CASES
         for suffix, change in (("_unmasked", {"loss_mask": False}), ("_reversed", {"reversed_sums": True}))]


@pytest.fixture(scope="module")
def runs():
    return run_cases(CASES, run_ranks(reference_rank, 1, [dataclasses.asdict(c) for c in CASES + TWINS])[0])


@pytest.mark.slow  # one reference process (six runs) and one two-process run of two cases: ~40 s on this box
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_spread_head_loss_mask_equals_the_masked_reference(runs, name):
    refs, got = runs
    ranks, ref = got[name], refs[name]
    floor = max(relative_error(refs[name + "_reversed"]["params"][n], ref["params"][n]) for n in ref["params"])
    print(f"{name}: rounding floor {floor:.2e}")
    bound = max(RTOL, 4 * floor)
    check_equals_reference(ranks, ref, weights_rtol=bound)
    check_megatron_ran(ranks, tp=1)
    check_spread_head(ranks, ref, weights_rtol=bound)
    unmasked = refs[name + "_unmasked"]
    moved = max(relative_error(ref["params"][n], unmasked["params"][n]) for n in ref["params"])
    assert moved > ACTED, (name, moved)  # the mask changed the trajectory
    print(f"{name}: the mask moved the reference's weights by up to {moved:.2e} (relative)")
    case = Case(**ranks[0]["case"])
    reported = [r["mask_tokens"] for r in ranks if r["mask_tokens"] is not None]  # the last stage's
    assert reported == [[float(MICRO_BATCH * (SEQ - 4))] * (case.steps * case.num_microbatches)]
