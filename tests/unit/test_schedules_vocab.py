"""A vocabulary-parallel head's passes as schedule actions (S and T on every stage, asyncpp/schedules): placed by
the cost model, checked by the invariants (one version per microbatch across the shards, F < S < T < B, the
collectives in one order on every stage), and under 2BW without a bubble in the steady state."""

from __future__ import annotations

import pytest

from asyncpp.schedules import ScheduleError, build_pipeline
from asyncpp.schedules.actions import Op
from asyncpp.schedules.costmodel import OpCosts, place_vocab_passes, predict, simulate, steady_delays
from asyncpp.schedules.invariants import check_collective_order, check_schedules, has_vocab_parallel

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
