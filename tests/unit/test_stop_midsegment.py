"""A stop inside a segment (asyncpp/pipeline/stopping.py): when a rank learns at UPDATE(t + STOP_LAG) that step
t's agreement said "stop", what it has executed or posted must be a prefix of the stream of [t0, s) with
s = t + stop_lookahead, on every stage of every kind, so that it can switch to that stream's drain."""

from __future__ import annotations

import pytest

from asyncpp.pipeline.executor import segment_actions
from asyncpp.pipeline.stopping import STOP_LAG, ActionStream, is_compute, stop_lookahead
from asyncpp.schedules.actions import Op
from asyncpp.schedules.registry import KINDS, kind_of, stage_delay

T = 9


def fixed_at_update(actions, step: int) -> int:
    """What the engine's run loop has fixed when it yields after UPDATE(step): everything up to that action
    and the receive of the next compute action (posted one compute action ahead)."""
    i = next(k for k, a in enumerate(actions) if a.op is Op.UPDATE and a.step == step)
    nxt = next((k for k in range(i + 1, len(actions)) if is_compute(actions[k])), None)
    return i + 1 if nxt is None else nxt + 1


def cases():
    for kind in KINDS:
        for P in (1, 2, 3, 4):
            for m in (1, 2, 3, 4, 5):
                if not kind_of(kind).serves(P, m):
                    continue
                for sync in ((0, 0), (1, 1), (2, 0)):
                    yield kind, P, m, sync


def delays_of(kind: str, stage: int, P: int, sync: tuple[int, int]) -> list[int]:
    start, cooldown = sync
    return [0 if t < start or t >= T - cooldown else stage_delay(kind, stage, P) for t in range(T)]


def violations(lookahead_for) -> list:
    bad = []
    for kind, P, m, sync in cases():
        for stage in range(P):
            delays = delays_of(kind, stage, P, sync)
            for t0 in (0, 2):
                full = segment_actions(kind, stage, P, m, delays, t0, T)
                for t in range(t0, T - STOP_LAG):
                    s = t + lookahead_for(kind, P)
                    if s >= T:
                        continue
                    fixed = fixed_at_update(full, t + STOP_LAG)
                    cut = segment_actions(kind, stage, P, m, delays, t0, s)
                    if cut[:fixed] != full[:fixed]:
                        bad.append((kind, P, m, sync, stage, t0, t))
    return bad


def test_the_executed_prefix_is_a_prefix_of_the_stop_stream_for_every_kind_stage_and_P():
    assert violations(stop_lookahead) == []


def test_one_step_less_lookahead_would_break_the_prefix_for_every_kind():
    """The lookahead is tight: the check above can fail, and does with one step less, for each kind."""
    bad = violations(lambda kind, P: stop_lookahead(kind, P) - 1)
    assert {case[0] for case in bad} == set(KINDS)


def test_the_stop_stream_ends_drained_with_every_update_before_the_stop_step():
    for kind, P, m, sync in cases():
        for stage in range(P):
            cut = segment_actions(kind, stage, P, m, delays_of(kind, stage, P, sync), 0, 5)
            assert [a.step for a in cut if a.op is Op.UPDATE] == list(range(5))
            assert {(a.step, a.microbatch) for a in cut if a.op is Op.FORWARD} == \
                {(a.step, a.microbatch) for a in cut if a.op is Op.BACKWARD}


def test_a_cut_that_disagrees_with_the_fixed_prefix_is_refused():
    full = segment_actions("2bw", 0, 2, 2, [1] * T, 0, T)
    stream = ActionStream(full)
    stream.fixed = fixed_at_update(full, 5)
    with pytest.raises(RuntimeError, match="cannot cut the stream"):
        stream.cut(segment_actions("2bw", 0, 2, 2, [1] * T, 0, 5))
    stream.cut(segment_actions("2bw", 0, 2, 2, [1] * T, 0, 5 - STOP_LAG + stop_lookahead("2bw", 2)))
