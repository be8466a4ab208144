"""A stop inside a segment (asyncpp/pipeline/stopping.py): a rank learns at UPDATE(t) that step t's agreement
said "stop"; it has executed its actions up to there and posted no receive beyond (receives_ahead). It then
runs what the stream of [t0, s) still has to do, s = t + stop_lookahead. On every stage of every kind: the
executed prefix belongs to the [t0, s) stream, the stages' resulting streams together are deadlock-free and
FIFO, and each stage runs exactly the [t0, s) stream's actions."""

from __future__ import annotations

import pytest

from asyncpp.pipeline.executor import segment_actions
from asyncpp.pipeline.stopping import ActionStream, receives_ahead, stop_lookahead
from asyncpp.schedules.actions import Op
from asyncpp.schedules.invariants import ScheduleError, check_fifo, execution_order
from asyncpp.schedules.registry import KINDS, kind_of, stage_delay

T = 9


def fixed_at_update(actions, step: int) -> int:
    """What the engine's run loop has fixed when it yields after UPDATE(step): it replays the engine's
    receive posting (receives_ahead) action by action up to there."""
    scan, posted = 0, -1
    for i, a in enumerate(actions):
        scan, newly = receives_ahead(actions, i, scan, posted)
        posted = newly[-1] if newly else posted
        if a.op is Op.UPDATE and a.step == step:
            return max(i + 1, posted + 1)
    raise AssertionError(f"no UPDATE({step})")


def cases(kinds=KINDS):
    for kind in kinds:
        for P in (1, 2, 3, 4):
            for m in (1, 2, 3, 4, 5):
                if not kind_of(kind).serves(P, m):
                    continue
                for sync in ((0, 0), (1, 1), (2, 0)):
                    yield kind, P, m, sync


def delays_of(kind: str, stage: int, P: int, sync: tuple[int, int]) -> list[int]:
    start, cooldown = sync
    return [0 if t < start or t >= T - cooldown else stage_delay(kind, stage, P) for t in range(T)]


def stop_streams(kind, P, m, sync, t0, t, s):
    """Every stage's stream after learning of a stop at UPDATE(t) and cutting to [t0, s); raises RuntimeError
    if a stage's executed prefix cannot be cut there."""
    out = []
    for stage in range(P):
        delays = delays_of(kind, stage, P, sync)
        stream = ActionStream(segment_actions(kind, stage, P, m, delays, t0, T))
        stream.fixed = fixed_at_update(stream.actions, t)
        shorter = segment_actions(kind, stage, P, m, delays, t0, s)
        stream.cut(shorter)
        assert sorted(stream.actions, key=repr) == sorted(shorter, key=repr)  # the same work, to the action
        out.append(stream.actions)
    return out


def violations(lookahead_for, kinds=KINDS) -> list:
    bad = []
    for kind, P, m, sync in cases(kinds):
        for t0 in (0, 2):
            for t in range(t0, T):
                s = t + lookahead_for(kind, P)
                if s >= T:
                    continue
                try:
                    streams = stop_streams(kind, P, m, sync, t0, t, s)
                    execution_order(streams)
                    check_fifo(streams)
                except (RuntimeError, ScheduleError) as e:
                    bad.append((kind, P, m, sync, t0, t, str(e)[:80]))
    return bad


def test_the_stop_streams_are_complete_deadlock_free_and_fifo_for_every_kind_stage_and_P():
    assert violations(stop_lookahead) == []


def test_one_step_less_lookahead_would_break_it_for_every_kind():
    """The lookahead is tight: the check above can fail, and does with one step less, for each kind. (A
    synchronous kind stops right after the step whose UPDATE(t) said so: s = t + 1, the least possible.)"""
    bad = violations(lambda kind, P: stop_lookahead(kind, P) - 1)
    assert {case[0] for case in bad} == set(KINDS)
    assert all(stop_lookahead(k, 4) == 1 for k in KINDS if not kind_of(k).delayed)


def test_2bw_stops_the_step_after_the_one_that_learned_it():
    """The issue's bound: a checkpoint at the step of the request or the next."""
    assert stop_lookahead("2bw", 8) == 2


def test_the_engine_posts_no_receive_past_an_update_it_has_not_run():
    for kind, P, m, sync in cases():
        for stage in range(P):
            actions = segment_actions(kind, stage, P, m, delays_of(kind, stage, P, sync), 0, T)
            for t in range(T):
                u = next(i for i, a in enumerate(actions) if a.op is Op.UPDATE and a.step == t)
                assert fixed_at_update(actions, t) == u + 1


def test_the_stop_stream_ends_drained_with_every_update_before_the_stop_step():
    for kind, P, m, sync in cases():
        for stage in range(P):
            cut = segment_actions(kind, stage, P, m, delays_of(kind, stage, P, sync), 0, 5)
            assert [a.step for a in cut if a.op is Op.UPDATE] == list(range(5))
            assert {(a.step, a.microbatch) for a in cut if a.op is Op.FORWARD} == \
                {(a.step, a.microbatch) for a in cut if a.op is Op.BACKWARD}


def test_a_cut_that_would_drop_an_executed_computation_is_refused():
    full = segment_actions("2bw", 0, 2, 2, [1] * T, 0, T)
    stream = ActionStream(full)
    stream.fixed = fixed_at_update(full, 5)  # stage 0 has run b_6's forwards
    with pytest.raises(RuntimeError, match="cannot cut the stream"):
        stream.cut(segment_actions("2bw", 0, 2, 2, [1] * T, 0, 6))
    stream.cut(segment_actions("2bw", 0, 2, 2, [1] * T, 0, 5 + stop_lookahead("2bw", 2)))
