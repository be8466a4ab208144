"""Schedules as data: generators, their invariants, and the checker's own failure reports."""

from __future__ import annotations

import itertools

import pytest

from asyncpp.config import StalenessConfig
from asyncpp.schedules import (
    Action,
    DeadlockError,
    Op,
    ScheduleError,
    build_pipeline,
    build_schedule,
    check_schedules,
    max_versions_for,
    peak_in_flight,
    peak_versions,
)
from asyncpp.schedules.registry import step_delay

KINDS = ("gpipe", "1f1b", "sync", "2bw", "pipedream")
NUM_STEPS = 6
# (sync_start_steps, sync_cooldown_steps): all delayed, sync start 2, sync cooldown 2, both.
PATTERNS = ((0, 0), (2, 0), (0, 2), (1, 1))


def delays(
    kind: str, num_stages: int, start: int, cooldown: int, num_steps: int = NUM_STEPS
) -> list[list[int]]:
    """Per-stage delays exactly as the engine computes them (asyncpp.schedules.registry.step_delay)."""
    rule = StalenessConfig(sync_start_steps=start, sync_cooldown_steps=cooldown)
    return [
        [step_delay(kind, s, num_stages, t, num_steps, rule) for t in range(num_steps)]
        for s in range(num_stages)
    ]


def F(t: int, j: int, v: int) -> Action:
    return Action(Op.FORWARD, t, j, v)


def B(t: int, j: int, v: int) -> Action:
    return Action(Op.BACKWARD, t, j, v)


def U0(t: int) -> Action:
    return Action(Op.UPDATE_START, t)


def U(t: int) -> Action:
    return Action(Op.UPDATE, t, version=t + 1)


CASES = [
    (kind, p, m, pattern)
    for kind, p, pattern in itertools.product(KINDS, (1, 2, 3, 4), PATTERNS)
    for m in sorted({p, p + 1, 2 * p})
]


@pytest.mark.parametrize("kind,num_stages,m,pattern", CASES)
def test_generated_schedules_satisfy_invariants(
    kind: str, num_stages: int, m: int, pattern: tuple[int, int]
) -> None:
    d = delays(kind, num_stages, *pattern)
    schedules = build_pipeline(kind, num_stages, m, d)
    bounds = [max_versions_for(kind, s, num_stages) for s in range(num_stages)]
    check_schedules(schedules, m, bounds, step_delays=d, num_steps=NUM_STEPS)
    if kind != "pipedream":  # every stage runs b_t on one common version
        check_schedules(schedules, m, bounds)


@pytest.mark.parametrize("num_stages,m", [(2, 2), (3, 3), (4, 4), (4, 5), (4, 8), (8, 8)])
def test_2bw_never_holds_more_than_two_versions(num_stages: int, m: int) -> None:
    for pattern in PATTERNS:
        schedules = build_pipeline("2bw", num_stages, m, delays("2bw", num_stages, *pattern, num_steps=8))
        assert max(peak_versions(s) for s in schedules) == 2
        # The activation memory of 2BW is that of 1F1B: P-s stashed microbatches at stage s.
        assert [peak_in_flight(s) for s in schedules] == [num_stages - s for s in range(num_stages)]


def test_pipedream_holds_p_minus_s_versions_and_accepts_m_below_p() -> None:
    for m in (1, 2, 4, 8):
        schedules = build_pipeline("pipedream", 4, m, delays("pipedream", 4, 0, 0, num_steps=8))
        check_schedules(schedules, m, [4, 3, 2, 1], step_delays=delays("pipedream", 4, 0, 0, num_steps=8))
        assert [peak_versions(s) for s in schedules] == [4, 3, 2, 1]


def test_sync_kinds_accept_m_below_p() -> None:
    for kind in ("gpipe", "1f1b"):
        check_schedules(build_pipeline(kind, 4, 2, delays(kind, 4, 0, 0)), 2, 1)


def test_2bw_refuses_fewer_microbatches_than_stages() -> None:
    with pytest.raises(ValueError, match=r"num_microbatches=2 < parallel.pp=4"):
        build_schedule("2bw", 0, 4, 2, [1, 1, 1])


@pytest.mark.parametrize(
    "args,match",
    [
        (
            ("zb-h1", 0, 2, 2, [0]),
            r"schedule='zb-h1' is not one of \('sync', 'gpipe', '1f1b', '2bw', 'pipedream'\)",
        ),
        (("1f1b", 2, 2, 2, [0]), r"stage=2 is outside \[0, num_stages=2\)"),
        (("1f1b", -1, 2, 2, [0]), r"stage=-1"),
        (("1f1b", 0, 2, 2, [0, 1]), r"step_delays\[1\]=1 is not one of \(0,\)"),
        (("2bw", 0, 2, 2, [2]), r"step_delays\[0\]=2 is not one of \(0, 1\)"),
        (("pipedream", 1, 4, 2, [1]), r"step_delays\[0\]=1 is not one of \(0, 2\)"),
    ],
)
def test_bad_arguments_are_named(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_schedule(*args)


def test_1f1b_two_stages_three_microbatches_stage0() -> None:
    expected = [
        F(0, 0, 0), F(0, 1, 0), B(0, 0, 0), F(0, 2, 0), B(0, 1, 0), B(0, 2, 0), U0(0), U(0),
        F(1, 0, 1), F(1, 1, 1), B(1, 0, 1), F(1, 2, 1), B(1, 1, 1), B(1, 2, 1), U0(1), U(1),
    ]  # fmt: skip
    assert build_schedule("1f1b", 0, 2, 3, [0, 0]) == expected


def test_2bw_two_stages_two_microbatches_stage0_three_steps() -> None:
    # One stream over b_0..b_2 (warm-up of P-1-s = 1 forward); b_t runs on x_{t-1} (x_{-1} := x_0).
    # UPDATE(0) waits until the first forward on v1 (F2.0); UPDATE(1), UPDATE(2) are used by no one; UPDATE(1)
    # still precedes UPDATE_START(2) (x_2 exists when b_2's gradient is taken).
    expected = [
        F(0, 0, 0), F(0, 1, 0), B(0, 0, 0), F(1, 0, 0), B(0, 1, 0), U0(0),
        F(1, 1, 0), B(1, 0, 0), U(0), F(2, 0, 1), B(1, 1, 0), U0(1),
        F(2, 1, 1), B(2, 0, 1), B(2, 1, 1), U(1), U0(2), U(2),
    ]  # fmt: skip
    assert build_schedule("2bw", 0, 2, 2, [1, 1, 1]) == expected


def test_2bw_sync_steps_flush_and_update_eagerly() -> None:
    # Step 0 synchronous, steps 1-2 delayed, step 3 synchronous (stage 1 of 2: no warm-up). UPDATE(1) goes
    # before UPDATE_START(2), which directly precedes its anchor: x_2 exists when b_2's gradient is taken.
    got = build_schedule("2bw", 1, 2, 2, [0, 1, 1, 0])
    expected = [
        F(0, 0, 0), B(0, 0, 0), F(0, 1, 0), B(0, 1, 0), U0(0), U(0),
        F(1, 0, 0), B(1, 0, 0), F(1, 1, 0), B(1, 1, 0), U0(1),
        F(2, 0, 1), B(2, 0, 1), F(2, 1, 1), B(2, 1, 1), U(1), U0(2), U(2),
        F(3, 0, 3), B(3, 0, 3), F(3, 1, 3), B(3, 1, 3), U0(3), U(3),
    ]  # fmt: skip
    assert got == expected


@pytest.mark.parametrize("kind", ["1f1b", "2bw", "pipedream"])
def test_a_later_segment_uses_absolute_steps_and_versions(kind: str) -> None:
    """first_step=t0 equals the segment built from 0, renumbered: steps + t0, versions of b_t absolute."""
    t0, p, m = 3, 3, 3
    d = delays(kind, p, 0, 0, num_steps=t0 + 4)
    for s in range(p):
        got = build_schedule(kind, s, p, m, d[s][t0:], first_step=t0)
        assert all(a.step >= t0 for a in got)
        third = next(a for a in got if a.op is Op.FORWARD and a.step == t0 + 2)
        assert third.version == t0 + 2 - d[s][t0 + 2]
        ref = build_schedule(kind, s, p, m, d[s][:4])  # same shape from step 0; versions are clamped there
        assert [(a.op, a.step + t0, a.microbatch) for a in ref] == [(a.op, a.step, a.microbatch) for a in got]


def test_gpipe_stashes_all_microbatches() -> None:
    schedules = build_pipeline("gpipe", 3, 5, delays("gpipe", 3, 0, 0))
    assert [peak_in_flight(s) for s in schedules] == [5, 5, 5]


def test_swapped_actions_are_reported_as_deadlock() -> None:
    schedules = build_pipeline("gpipe", 2, 2, [[0], [0]])
    stage0 = list(schedules[0])
    assert stage0[1:3] == [F(0, 1, 0), B(0, 0, 0)]
    stage0[1], stage0[2] = stage0[2], stage0[1]  # stage 0 now waits for a gradient stage 1 cannot send yet
    with pytest.raises(DeadlockError) as err:
        check_schedules([stage0, schedules[1]], 2, 1)
    msg = str(err.value)
    assert "stage 0 stuck at #1 B0.0@v0 waiting for stage 1 B0.0@v0" in msg
    assert "stage 1 stuck at #1 F0.1@v0 waiting for stage 0 F0.1@v0" in msg


def test_fifo_violation_is_reported() -> None:
    schedules = build_pipeline("gpipe", 2, 2, [[0], [0]])
    stage1 = list(schedules[1])
    stage1[0], stage1[1] = stage1[1], stage1[0]  # consumes b0.1's activation before b0.0's
    with pytest.raises(ScheduleError, match=r"activation channel stage 0 -> 1 is FIFO"):
        check_schedules([schedules[0], stage1], 2, 1)


def test_checker_reports_missing_stale_and_early_actions() -> None:
    good = build_pipeline("1f1b", 2, 2, [[0, 0], [0, 0]])
    with pytest.raises(ScheduleError, match=r"stage 1: missing actions: B1.1"):
        check_schedules([good[0], [a for a in good[1] if a != B(1, 1, 1)]], 2, 1)
    stale = [F(1, 0, 0) if a == F(1, 0, 1) else a for a in good[0]]
    with pytest.raises(
        ScheduleError, match=r"stage 0: b1 runs on more than one version \(first v0\): F1.1@v1"
    ):
        check_schedules([stale, good[1]], 2, 1)
    with pytest.raises(ScheduleError, match=r"stage 0: b1 must run on v1 \(delay 0\): F1.0@v0"):
        check_schedules([stale, good[1]], 2, 1, step_delays=[[0, 0], [0, 0]])
    early = [a for a in good[0] if a != U(0)]
    early.insert(0, U(0))
    with pytest.raises(ScheduleError, match=r"stage 0: action #0 before its UPDATE_START: U0"):
        check_schedules([early, good[1]], 2, 1)


def test_version_bound_violation_is_reported() -> None:
    schedules = build_pipeline("2bw", 3, 3, delays("2bw", 3, 0, 0))
    with pytest.raises(ScheduleError, match=r"stage 0: more than 1 weight versions held"):
        check_schedules(schedules, 3, 1)


def test_2bw_is_deadlock_free_with_collective_updates() -> None:
    # UPDATE(t) waiting for every stage's UPDATE_START(t) (global clipping) must not deadlock.
    for p, m in ((2, 2), (4, 4), (4, 7), (8, 8)):
        check_schedules(build_pipeline("2bw", p, m, delays("2bw", p, 1, 1, 8)), m, 2, collective_updates=True)


@pytest.mark.parametrize("num_stages, m", [(2, 2), (3, 4), (4, 4)])
def test_2bw_applies_x_t_before_taking_the_gradient_of_b_t(num_stages: int, m: int) -> None:
    """On every stage UPDATE(t-1) (which writes x_t) precedes UPDATE_START(t): DC-ASGD corrects b_t's gradient
    with x_t - x_{t-1} when it is taken, so x_t must exist there."""
    for s in range(num_stages):
        actions = build_schedule("2bw", s, num_stages, m, [1] * 5)
        position = {(a.op, a.step): i for i, a in enumerate(actions)}
        for t in range(1, 5):
            assert position[(Op.UPDATE, t - 1)] < position[(Op.UPDATE_START, t)], (s, t)
