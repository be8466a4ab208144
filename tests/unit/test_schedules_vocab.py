"""A vocabulary-parallel head's passes as schedule actions (S and T on every stage, asyncpp/schedules): placed by
the cost model, checked by the invariants (one version per microbatch across the shards, F < S < T < B, the
collectives in one order on every stage), and under 2BW without a bubble in the steady state."""

from __future__ import annotations

import pytest

from asyncpp.core.layer_costs import layer_costs
from asyncpp.core.vocab_split import plan_vocab_split, vocab_op_costs
from asyncpp.schedules import ScheduleError, build_pipeline
from asyncpp.schedules.actions import Op
from asyncpp.schedules.costmodel import (
    OpCosts,
    VocabPlacement,
    place_vocab_passes,
    predict,
    simulate,
    steady_delays,
)
from asyncpp.schedules.invariants import check_collective_order, check_schedules, has_vocab_parallel
from model_zoo import get_model_config

SLOT = 3.0


def costs(head_share: float, latency: float) -> OpCosts:
    """Stages of equal work per microbatch (SLOT), `head_share` of it the stage's vocabulary shard (S a third, T two
    thirds, like F and B), the head's collectives `latency` x SLOT (the all-reduce of 12 bytes per token a quarter)."""
    body = SLOT * (1 - head_share)
    return OpCosts(forward=body / 3, backward=2 * body / 3, vocab_forward=SLOT * head_share / 3,
                   vocab_backward=2 * SLOT * head_share / 3, vocab_broadcast=latency * SLOT,
                   vocab_allreduce=latency * SLOT / 4, vocab_reduce=latency * SLOT)


def placed(kind: str, P: int, m: int, steps: int, c: OpCosts, warmup: int = 1) -> list[list]:
    skeleton = build_pipeline(kind, P, m, steady_delays(kind, P, steps), vocab_warmup=warmup)
    return place_vocab_passes(skeleton, c)


@pytest.mark.parametrize("P", [2, 4, 8])
@pytest.mark.parametrize("head_share,latency", [(0.05, 0.02), (0.25, 0.05), (0.4, 0.1), (0.25, 0.3)])
def test_2bw_with_the_head_spread_has_no_bubble(P, head_share, latency):
    """The step takes m slots: the head's passes and their collectives fill time the stages would otherwise wait,
    at one or two more forwards of warm-up (the activation memory it costs). Without the S/T actions the same
    work on the last stage alone would take m x (SLOT + (P-1) x head) instead."""
    m = 2 * P
    c = costs(head_share, latency)
    r = predict("2bw", P, m, 6, c, collective_updates=True, vocab_parallel=True)
    assert r["step_time"] == pytest.approx(m * SLOT, rel=1e-9)
    assert r["bubble"] == pytest.approx(0.0, abs=1e-9)
    assert r["vocab_warmup"] in (1, 2)
    assert r["peak_activations"] == [P - s + r["vocab_warmup"] for s in range(P)]


@pytest.mark.parametrize("kind,versions", [("2bw", 2), ("1f1b", 1)])
@pytest.mark.parametrize("P", [2, 3, 4])
def test_placed_schedules_pass_every_invariant(kind, versions, P):
    """Complete (one S and one T per microbatch on every stage), on F's version, F < S < T < B < U0, deadlock-free
    with the collectives' dependencies, within the kind's weight-version bound, collectives in one order."""
    m, steps = 2 * P, 3
    schedules = placed(kind, P, m, steps, costs(0.25, 0.05))
    assert has_vocab_parallel(schedules)
    check_schedules(schedules, m, versions, num_steps=steps)
    for actions in schedules:
        for op in (Op.VOCAB_FORWARD, Op.VOCAB_BACKWARD):
            assert sum(a.op is op for a in actions) == m * steps


def test_the_collectives_latency_is_on_the_critical_path():
    """A broadcast longer than what the warm-up covers shows in the step time: the edges are really costed."""
    P, m = 4, 8
    fast = predict("2bw", P, m, 6, costs(0.25, 0.05), collective_updates=True, vocab_parallel=True)["step_time"]
    slow = predict("2bw", P, m, 6, costs(0.25, 2.0), collective_updates=True, vocab_parallel=True)["step_time"]
    assert fast == pytest.approx(m * SLOT) and slow > 1.05 * fast


def test_invariants_catch_a_misplaced_pass():
    P, m = 3, 6
    schedules = placed("2bw", P, m, 2, costs(0.25, 0.05))
    # Two S actions swapped on one stage: its broadcast/all-reduce order differs from the others'.
    swapped = [list(x) for x in schedules]
    i, j = [k for k, a in enumerate(swapped[1]) if a.op is Op.VOCAB_FORWARD][:2]
    swapped[1][i], swapped[1][j] = swapped[1][j], swapped[1][i]
    with pytest.raises(ScheduleError, match="out of order"):
        check_collective_order(swapped)
    # A T moved after the B that needs its partial gradient.
    late = [list(x) for x in schedules]
    t = next(k for k, a in enumerate(late[0]) if a.op is Op.VOCAB_BACKWARD)
    b = next(k for k, a in enumerate(late[0]) if a.op is Op.BACKWARD and (a.step, a.microbatch)
             == (late[0][t].step, late[0][t].microbatch))
    late[0].insert(b, late[0].pop(t))
    with pytest.raises(ScheduleError, match="must run after F"):
        check_schedules(late, m, 2, num_steps=2)


@pytest.mark.parametrize("kind", ["pipedream", "gpipe"])
def test_kinds_without_one_version_or_1f1b_order_are_refused(kind):
    with pytest.raises(ValueError, match="vocabulary-parallel head with schedule="):
        build_pipeline(kind, 2, 4, steady_delays(kind, 2, 2), vocab_warmup=1)


def test_the_simulator_runs_every_placed_pass():
    """simulate() of the placed lists runs every S and T (a timeline event each)."""
    P, m = 3, 6
    c = costs(0.25, 0.05)
    schedules = placed("2bw", P, m, 4, c)
    tl = simulate(schedules, c, collective_updates=True)
    heads = [e for e in tl.events if e.kind in ("S", "T")]
    assert len(heads) == 2 * P * m * 4


@pytest.mark.parametrize("kind,versions", [("2bw", 2), ("1f1b", 1)])
@pytest.mark.parametrize("P", [2, 4])
def test_a_slack_puts_every_t_after_the_stages_next_s(kind, versions, P):
    """VocabPlacement's slack: T(i) after the stage's own S(i + 1) wherever that cannot deadlock; where S(i + 1)
    needs T(i) first (1F1B's flush: the next step's forwards wait for this step's update), T(i) goes without it.
    The placed lists pass every invariant, and a stage holds two S->T passes at once in the steady state."""
    m, steps = 2 * P, 3
    lists = place_vocab_passes(build_pipeline(kind, P, m, steady_delays(kind, P, steps), vocab_warmup=2),
                               costs(0.25, 0.05), slack=1)
    check_schedules(lists, m, versions, num_steps=steps)
    for actions in lists:
        items = [(a.step, a.microbatch) for a in actions if a.op is Op.VOCAB_FORWARD]
        held = peak = 0
        for a in actions:
            if a.op is Op.VOCAB_FORWARD:
                held += 1
                peak = max(peak, held)
            elif a.op is Op.VOCAB_BACKWARD:
                i = items.index((a.step, a.microbatch))
                flush = kind == "1f1b" and a.microbatch == m - 1  # the step's last: its next S follows the update
                assert held >= 2 or i == len(items) - 1 or flush, (a, held)
                held -= 1
        assert peak == 2


def test_the_cost_model_takes_a_slack_only_where_it_is_free():
    """predict() tries VOCAB_PLACEMENTS in order (less warm-up, then a slack) and keeps the first as fast as the
    fastest: the paper's moe_2b at P=4 keeps one warm-up forward and no slack (a slack would need the second
    forward, one more microbatch of activations on every stage, for no time the model can see); equal stages whose
    head's collectives take 0.3 of a slot need the second forward anyway, and take the slack with it."""
    model = get_model_config("moe_2b")
    split = plan_vocab_split(layer_costs(model, 4096, 1, "cuda"), 4, model.vocab_size)
    assert predict("2bw", 4, 16, 4, vocab_op_costs(split), vocab_parallel=True)["vocab_placement"] == \
        VocabPlacement(1, 0)
    slow_collectives = predict("2bw", 2, 4, 6, costs(0.25, 0.3), collective_updates=True, vocab_parallel=True)
    assert slow_collectives["vocab_placement"] == VocabPlacement(2, 1)
    assert slow_collectives["bubble"] == pytest.approx(0.0, abs=1e-9)
