"""Cost model against the closed forms of the literature, and the timeline writers."""

from __future__ import annotations

import itertools
import json

import pytest

from asyncpp.schedules import DeadlockError, build_pipeline
from asyncpp.schedules.actions import Op
from asyncpp.schedules.costmodel import OpCosts, dp_allreduce_time, predict, simulate, steady_delays
from asyncpp.train.timeline import TimelineEvent, as_events, plot_gantt, write_chrome_trace

EQUAL = OpCosts(forward=1.0, backward=2.0)
GRID = [(p, m) for p in (1, 2, 3, 4) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", GRID)
def test_flushed_bubble_is_p_minus_1_over_m_plus_p_minus_1(kind: str, p: int, m: int) -> None:
    r = predict(kind, p, m, 6, EQUAL)
    want = (p - 1) / (m + p - 1)
    assert r["bubble_run"] == pytest.approx(want, abs=1e-9)
    assert r["bubble"] == pytest.approx(want, abs=1e-9)
    assert r["bubble_per_stage"] == pytest.approx([want] * p, abs=1e-9)
    assert r["step_time"] == pytest.approx((m + p - 1) * 3.0, abs=1e-9)


@pytest.mark.parametrize("collective", [False, True])
@pytest.mark.parametrize("p,m", GRID)
def test_2bw_steady_state_has_no_bubble(p: int, m: int, collective: bool) -> None:
    r = predict("2bw", p, m, 8, EQUAL, collective_updates=collective)
    assert r["bubble"] == pytest.approx(0.0, abs=1e-9)
    assert r["step_time"] == pytest.approx(m * 3.0, abs=1e-9)
    # Over the whole run only one warm-up and one cool-down remain.
    assert r["bubble_run"] == pytest.approx((p - 1) / (8 * m + p - 1), abs=1e-9)


def test_2bw_hides_collective_updates_and_eager_pipedream_does_not() -> None:
    # UPDATE(t) waiting for every stage's UPDATE_START(t) + comm (global clipping) costs 2BW nothing:
    # its lazy UPDATE sits >= 1 F/B pair after the last stage finishes b_t. Eager pipedream stalls.
    costs = OpCosts(1.0, 2.0, comm=0.05)
    for kind, hidden in (("2bw", True), ("1f1b", True), ("pipedream", False)):
        local = predict(kind, 4, 8, 12, costs)["step_time"]
        collective = predict(kind, 4, 8, 12, costs, collective_updates=True)["step_time"]
        assert (collective == pytest.approx(local, abs=1e-9)) is hidden, kind


def test_dp_allreduce_time_is_the_ring_formula() -> None:
    # 2 (D-1)/D of the fp32 buffer crosses each rank's link: 1e9 params, D=8, 50 GB/s -> 2*7/8*4e9/5e10 s.
    assert dp_allreduce_time(1e9, 8, 50e9) == pytest.approx(0.14)
    assert dp_allreduce_time(1e9, 1, 50e9) == 0.0  # one replica: nothing to reduce
    assert dp_allreduce_time(1e9, 2, 50e9, bytes_per_param=2) == pytest.approx(0.04)
    with pytest.raises(ValueError, match="bandwidth=0"):
        dp_allreduce_time(1e9, 8, 0)


DP_GRID = [(p, m) for p in (2, 3, 4, 8) for m in (p, 2 * p)]


@pytest.mark.parametrize("collective", [False, True])
@pytest.mark.parametrize("p,m", DP_GRID)
def test_1f1b_exposes_the_dp_allreduce(p: int, m: int, collective: bool) -> None:
    # The flush puts UPDATE(t) right after UPDATE_START(t): stage 0 waits out the whole all-reduce before
    # the first forward of b_{t+1}, and every other stage waits for that forward.
    for c in (0.5, 3.0, 10.0):
        r = predict("1f1b", p, m, 8, OpCosts(1.0, 2.0, dp_comm=c), collective_updates=collective)
        assert r["step_time"] == pytest.approx((m + p - 1) * 3.0 + c, abs=1e-9)
        assert r["dp_comm"] == c


@pytest.mark.parametrize("collective", [False, True])
@pytest.mark.parametrize("p,m", DP_GRID)
def test_2bw_hides_the_dp_allreduce_behind_m_minus_p_plus_1_microbatches(p: int, m: int, collective: bool) -> None:
    # Stage s has m - (P-1-s) microbatches of b_{t+1} between UPDATE_START(t) and UPDATE(t); stage 0 the
    # fewest. An all-reduce up to that window is free; beyond it, stage 0 (never idle in 2BW) waits the excess.
    window = (m - p + 1) * 3.0
    for c in (0.5, window, window + 0.5, window + 7.0):
        r = predict("2bw", p, m, 8, OpCosts(1.0, 2.0, dp_comm=c), collective_updates=collective)
        assert r["step_time"] == pytest.approx(m * 3.0 + max(0.0, c - window), abs=1e-9), c


def test_dp_allreduces_are_comm_events_beside_the_compute() -> None:
    dp = [0.5, 0.25, 1.0]
    tl = simulate(build_pipeline("2bw", 3, 3, steady_delays("2bw", 3, 4)), OpCosts(1.0, 2.0, dp_comm=dp))
    assert len(tl.comm_events) == 3 * 4
    for e in tl.comm_events:
        assert (e.kind, e.label) == ("comm", f"DP({e.step})") and e.duration == pytest.approx(dp[e.stage])
        start = next(x for x in tl.events if x.kind == "U0" and x.stage == e.stage and x.step == e.step)
        update = next(x for x in tl.events if x.kind == "U" and x.stage == e.stage and x.step == e.step)
        assert e.start == pytest.approx(start.end) and update.start >= e.end - 1e-12
    assert "comm" not in {e.kind for e in tl.events}  # compute only: the bubble does not count them as busy
    assert simulate(build_pipeline("2bw", 2, 2, steady_delays("2bw", 2, 2)), EQUAL).comm_events == ()


def test_memory_columns() -> None:
    p, m = 4, 8
    assert predict("gpipe", p, m, 4, EQUAL)["peak_activations"] == [m] * p
    for kind in ("1f1b", "2bw", "pipedream"):
        assert predict(kind, p, m, 4, EQUAL)["peak_activations"] == [p - s for s in range(p)]
    assert max(predict("2bw", p, m, 6, EQUAL)["weight_versions"]) == 2
    assert predict("pipedream", p, m, 6, EQUAL)["weight_versions"] == [p - s for s in range(p)]
    assert predict("1f1b", p, m, 6, EQUAL)["weight_versions"] == [1] * p


def test_slowest_stage_sets_the_2bw_step_time() -> None:
    costs = OpCosts(forward=[1.0, 1.5, 1.0], backward=[2.0, 3.0, 2.0], update=[0.0, 0.5, 0.0])
    r = predict("2bw", 3, 6, 8, costs)
    assert r["step_time"] == pytest.approx(6 * 4.5 + 0.5, abs=1e-9)
    assert r["bubble_per_stage"][1] == pytest.approx(0.0, abs=1e-9)
    assert costs.forward == (1.0, 1.5, 1.0)  # lists are frozen into tuples


def test_simulate_rejects_a_deadlocked_schedule() -> None:
    schedules = build_pipeline("gpipe", 2, 2, [[0], [0]])
    stage0 = list(schedules[0])
    stage0[1], stage0[2] = stage0[2], stage0[1]
    with pytest.raises(DeadlockError, match="stuck"):
        simulate([stage0, schedules[1]], EQUAL)


def test_events_are_sequential_per_stage_and_respect_comm() -> None:
    schedules = build_pipeline("2bw", 3, 3, steady_delays("2bw", 3, 3))
    tl = simulate(schedules, OpCosts(1.0, 2.0, comm=0.25))
    for s in range(3):
        evs = [e for e in tl.events if e.stage == s]
        assert all(a.end <= b.start + 1e-12 for a, b in itertools.pairwise(evs))
    first = {e.stage: e for e in tl.events if e.label == "F0.0@v0"}
    assert first[1].start == pytest.approx(first[0].end + 0.25)


def test_timeline_files(tmp_path) -> None:
    tl = simulate(build_pipeline("2bw", 2, 2, steady_delays("2bw", 2, 3)), OpCosts(1.0, 2.0, update=0.2))
    measured = [
        (0, "F0.0", 0.0, 0.001, "F"),
        (0, "idle", 0.001, 0.002, "idle"),
        (1, "send", 0.001, 0.0015, "comm"),
    ]
    for name, events in (("predicted", tl.events), ("measured", measured)):
        trace, png = tmp_path / f"{name}.json", tmp_path / f"{name}.png"
        write_chrome_trace(events, trace)
        plot_gantt(events, png, title=name)
        data = json.loads(trace.read_text())
        spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
        assert len(spans) == len(list(events))
        assert {e["tid"] for e in spans} == {e.stage for e in as_events(events)}
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    f00 = next(
        e for e in json.loads((tmp_path / "measured.json").read_text())["traceEvents"] if e["name"] == "F0.0"
    )
    assert (f00["ts"], f00["dur"]) == (0.0, pytest.approx(1000.0))  # microseconds


def test_timeline_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match=r"kind='X' is not one of"):
        as_events([TimelineEvent(0, "x", 0.0, 1.0, "X")])


def test_every_action_the_timer_records_is_a_timeline_kind(tmp_path) -> None:
    """The stage timer records an action under its op's letter (pipeline/timer.StageTimer.add): every op, the
    sharded embedding's E and G included, must render (they were refused by as_events until 2026-11-26)."""
    events = [TimelineEvent(0, f"{op.value}0.0", float(i), i + 0.5, op.value, 0, 0) for i, op in enumerate(Op)]
    assert {e.kind for e in as_events(events)} == {op.value for op in Op}
    plot_gantt(events, tmp_path / "ops.png")
