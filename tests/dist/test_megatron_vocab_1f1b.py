"""The flushed 1F1B baseline with the output layer spread over the stages (VocabSpreadStage / VocabPipeline2BW,
get_forward_backward_func("1f1b")) equals the simulator with no delay on the unsplit GPTModel.

Every call is one flushed step: the head's placed stream of that one step with delay 0 (core/vocab_split.
vocab_pipeline("1f1b", m, [0], ...) made absolute at step k, as a synchronous start step of 2BW), so b_k runs on x_k
and its update is applied in call k. The reference is DelayedUpdateSimulator with every step synchronous
(x_{t+1} = x_t - U(g(x_t))). Losses, grad norms, every weight at the front-end's RTOL (its derivation:
test_megatron_core.py's module docstring: the same per-shard softmax and partial-gradient sums as the 2BW cases, the
same kernels otherwise). The mechanism checks are the other spread-head cases' (rows per stage moved, S passes =
steps x m, megatron's whole output_layer frozen, evaluation and checkpoint equal to the reference's), and the
flush itself: call k applied b_k's update and the stage kept one weight version (a 2BW stream would lag by two calls
and keep two).
"""

from __future__ import annotations

import pytest

from examples.megatron_2bw import parse_args as parse_example_args
from tests.dist.megatron_core_workers import Case
from tests.dist.test_megatron_core import (
    check_equals_reference,
    check_megatron_ran,
    check_spread_head,
    run_cases,
)

pytestmark = [pytest.mark.dist, pytest.mark.equivalence]

CASES = [Case("vocab_head_1f1b", schedule="1f1b", vocab=True, drain_after=3),
         Case("vocab_head_and_embedding_tied_1f1b", schedule="1f1b", vocab=True, vocab_embedding=True, tied=True)]


@pytest.fixture(scope="module")
def runs():
    return run_cases(CASES)


def check_flushed(ranks: list[dict]) -> None:
    """Each call applied its own step's update (a drain in between changes nothing), on one weight version."""
    case = Case(**ranks[0]["case"])
    expected = list(range(case.steps))
    if case.drain_after is not None:  # the drain after call drain_after - 1 reports the same newest update
        expected.insert(case.drain_after, case.drain_after - 1)
    for r in ranks:
        assert r["applied"] == expected, (case.name, r["stage"], r["applied"])
        assert r["evidence"]["corrections"]["num_buffers"] == 1, (case.name, r["evidence"]["corrections"])


@pytest.mark.slow  # one reference and one two-process run of two cases: ~30 s on a loaded 2-core box
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_spread_head_1f1b_equals_the_undelayed_reference(runs, name):
    refs, got = runs
    ranks, ref = got[name], refs[name]
    check_equals_reference(ranks, ref)
    check_megatron_ran(ranks, tp=1)
    check_spread_head(ranks, ref)
    check_flushed(ranks)


def test_example_refuses_delayed_options_with_1f1b(capsys):
    """examples/megatron_2bw.py --schedule 1f1b refuses the options that act on delayed updates, by name, before any
    process group exists (Pipeline2BW would refuse them only once built), and drops 2BW's m >= P rule."""
    with pytest.raises(SystemExit):
        parse_example_args(["--schedule", "1f1b", "--ef-lambda", "1", "--weight-prediction"])
    err = capsys.readouterr().err
    assert "--ef-lambda, --weight-prediction act on delayed updates; --schedule 1f1b has none" in err
    assert parse_example_args(["--schedule", "1f1b", "--num-microbatches", "1"]).schedule == "1f1b"
    with pytest.raises(SystemExit):
        parse_example_args(["--num-microbatches", "1"])
    assert "the 2BW schedule needs at least" in capsys.readouterr().err
