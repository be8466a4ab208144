"""asyncpp.pipeline.timer: the host clock's outputs, and the CUDA-event clock's logic on a stand-in event.

The stand-in has torch.cuda.Event's four methods and a device time the test moves by hand, so what is
checked here is what the CUDA path does with events: durations come from the device's times (not the
host's), the hot path never waits (no synchronize() while an event is unfinished), events resolve in
order, and reading the results waits only then. tests/gpu/test_gpu_timer.py checks real CUDA events.
"""

from __future__ import annotations

import time

import pytest
import torch

from asyncpp.pipeline.timer import MIN_IDLE_S, CudaClock, HostClock, StageTimer, clock_for, stage_timer
from asyncpp.schedules.actions import Action, Op

F0 = Action(Op.FORWARD, 0, 0, 0)
B0 = Action(Op.BACKWARD, 0, 0, 0)
F1 = Action(Op.FORWARD, 0, 1, 0)
U0 = Action(Op.UPDATE, 0, version=1)


class FakeDevice:
    """A device whose clock the test sets; events fire when the test says the device got there."""

    def __init__(self) -> None:
        self.now = 0.0
        self.reached = 0.0  # events recorded at device time <= reached have fired
        self.syncs = 0

    def event(self) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device, self.t = device, None

    def record(self, stream=None) -> None:
        self.t = self.device.now

    def query(self) -> bool:
        return self.t <= self.device.reached

    def synchronize(self) -> None:
        self.device.syncs += 1
        self.device.reached = max(self.device.reached, self.t)

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.query() and end.query()):
            raise RuntimeError("elapsed_time on an event that has not completed")  # as CUDA does
        return (end.t - self.t) * 1000.0


def fake_timer() -> tuple[StageTimer, FakeDevice]:
    dev = FakeDevice()
    return StageTimer(3, CudaClock(torch.device("cpu"), new_event=dev.event)), dev


def test_the_device_type_picks_the_clock() -> None:
    assert isinstance(clock_for(torch.device("cpu")), HostClock)
    assert isinstance(clock_for(torch.device("cuda", 1)), CudaClock)  # constructing touches no GPU
    assert isinstance(stage_timer(0, torch.device("cpu")).clock, HostClock)


def test_host_timer_outputs() -> None:
    timer = StageTimer(1)
    origin = timer.restart()
    start = timer.now()
    time.sleep(0.01)
    timer.add(F0, start, timer.now())
    with timer.span(B0):
        time.sleep(0.02)
    now = timer.now()
    timer.add(U0, now, now + 2 * MIN_IDLE_S, kind="idle")
    timer.add(U0, now, now + MIN_IDLE_S / 2, kind="idle")  # a wait that found its data ready: dropped
    kinds = [e.kind for e in timer.events]
    assert kinds == ["F", "B", "idle"]
    f, b = timer.events[:2]
    assert (f.stage, f.label, f.step, f.microbatch) == (1, "F0.0@v0", 0, 0)
    assert 0.0 <= f.start < f.end <= b.start < b.end
    assert f.duration >= 0.01 and b.duration >= 0.02
    assert timer.busy() == pytest.approx(f.duration + b.duration)
    means = timer.mean_durations()
    assert means["F"] == pytest.approx(f.duration) and means["idle"] == pytest.approx(2 * MIN_IDLE_S)
    assert timer.end_of(Op.BACKWARD, 0) == pytest.approx(origin + b.end)
    assert timer.elapsed() >= b.end
    with pytest.raises(KeyError, match="no B event for step 7"):
        timer.end_of(Op.BACKWARD, 7)


def test_cuda_timer_reports_device_time_not_host_time() -> None:
    timer, dev = fake_timer()
    dev.now = dev.reached = 1.0  # restart() waits until the device is idle (CudaClock.idle)
    origin = timer.restart()
    dev.now = 1.5
    start = timer.now()  # host returns at once; the device reaches the marks later
    dev.now = 2.25
    timer.add(F0, start, timer.now())
    dev.now = 2.25
    s = timer.now()
    dev.now = 3.0
    timer.add(B0, s, timer.now())
    assert dev.syncs == 0  # add() polls, never waits
    dev.reached = 3.0
    (f, b) = timer.events
    assert (f.start, f.end, b.start, b.end) == (0.5, 1.25, 1.25, 2.0)
    assert timer.busy() == pytest.approx(1.5)
    assert timer.mean_durations() == {"F": 0.75, "B": 0.75}
    assert timer.end_of(Op.FORWARD, 0) == pytest.approx(origin + 1.25)


def test_cuda_hot_path_never_waits_and_resolves_in_order() -> None:
    timer, dev = fake_timer()
    for k, action in enumerate((F0, F1, B0)):
        start = timer.now()
        dev.now += 1.0
        timer.add(action, start, timer.now())
        if k == 0:
            dev.reached = dev.now  # the device caught up with the first action only
    assert dev.syncs == 0
    assert [e.label for e in timer._done] == ["F0.0@v0"]  # resolved on the way, the rest still pending
    assert len(timer._pending) == 2
    assert timer.end_of(Op.FORWARD, 0) == pytest.approx(timer.origin_s + 2.0)  # the last F of step 0: F0.1
    assert dev.reached == 2.0 and len(timer._pending) == 1  # waited for F0.1's end only, not for B0.0
    assert [e.label for e in timer.events] == ["F0.0@v0", "F0.1@v0", "B0.0@v0"]  # reading waits
    assert dev.syncs > 0 and not timer._pending
    start = timer.now()
    dev.now += 1.0
    timer.add(F0, start, timer.now())
    syncs = dev.syncs
    timer.clear()  # the Megatron front-end keeps one call's events: dropping them must not wait
    assert dev.syncs == syncs and timer.events == []


def test_cuda_short_idle_is_dropped_after_resolution() -> None:
    timer, dev = fake_timer()
    a = timer.now()
    dev.now += MIN_IDLE_S / 10
    timer.add(U0, a, timer.now(), kind="idle")
    b = timer.now()
    dev.now += 0.5
    timer.add(U0, b, timer.now(), kind="idle")
    assert [(e.kind, e.duration) for e in timer.events] == [("idle", pytest.approx(0.5))]


@pytest.mark.parametrize("kind", ["host", "cuda"])
def test_restart_keeps_earlier_events_on_their_origin(kind: str) -> None:
    if kind == "host":
        timer, dev = StageTimer(0), None
    else:
        timer, dev = fake_timer()
    start = timer.now()
    if dev is not None:
        dev.now += 1.0
    timer.add(F0, start, timer.now())
    before = [(e.start, e.end) for e in timer.events]
    timer.restart()
    assert [(e.start, e.end) for e in timer.events] == before


def test_an_update_timed_in_pieces_costs_their_sum_per_step() -> None:
    """UPDATE_START's deferred reduction work is timed as a second U0 event of the same step
    (StageEngine._progress): the per-step cost the cost model reads is the sum, not the mean of pieces."""
    timer = StageTimer(0)
    t = timer.now()
    for step, pieces in ((0, (0.1, 0.3)), (1, (0.2, 0.2))):
        for d in pieces:
            timer.add(Action(Op.UPDATE_START, step), t, t + d)
            t += d
    timer.add(F0, t, t + 0.5)
    timer.add(F1, t + 0.5, t + 0.6)
    means = timer.mean_durations()
    assert means["U0"] == pytest.approx(0.4)  # (0.4 + 0.4) / 2 steps, not 0.2 per piece
    assert means["F"] == pytest.approx(0.3)  # per op, as before
    assert timer.busy() == pytest.approx(0.8 + 0.6)


def test_snapshot_counts_only_what_the_device_reached_and_never_waits() -> None:
    """The log line's bubble reads every stage's snapshot every logging.log_every steps: on CUDA it must not
    sync, so it covers the events the device has finished, up to the newest of them."""
    timer, dev = fake_timer()
    timer.restart()
    s = timer.now()
    dev.now = 1.0
    timer.add(F0, s, timer.now())  # F: 0 -> 1
    dev.now = 1.5
    s = timer.now()
    dev.now = 2.5
    timer.add(B0, s, timer.now())  # B: 1.5 -> 2.5, not reached yet
    dev.reached = 1.0
    assert timer.snapshot() == (1.0, 1.0) and dev.syncs == 0
    dev.reached = 2.5
    assert timer.snapshot() == (2.0, 2.5) and dev.syncs == 0  # busy 2 of 2.5: the idle 0.5 between them
    assert timer.busy() == 2.0


def test_snapshot_spans_to_the_latest_end_whatever_order_the_events_came_in() -> None:
    """engine._update adds U (its apply) and then the idle wait before it, which ends where U starts: the snapshot's
    elapsed is the latest end, so busy never exceeds it (it did: the log line's bubble went negative, -0.088, in a
    fresh-clone run of tests/dist/test_batch_rampup.py, when the wait was longer than MIN_IDLE_S)."""
    timer, dev = fake_timer()
    timer.restart()
    s = timer.now()
    dev.now = 1.0
    timer.add(F0, s, timer.now())  # F: 0 -> 1
    wait_start = timer.now()
    dev.now = 1.5
    start = timer.now()
    dev.now = 3.0
    timer.add(U0, start, timer.now())  # U: 1.5 -> 3
    timer.add(U0, wait_start, start, kind="idle")  # the wait: 1 -> 1.5, added last
    dev.reached = 3.0
    busy, elapsed = timer.snapshot()
    assert (busy, elapsed) == (2.5, 3.0) and busy <= elapsed
    assert timer.events[-1].kind == "idle" and timer.events[-1].end == 1.5  # the last-added event ends earlier
    timer.clear()
    assert timer.snapshot() == (0.0, 0.0)


def test_the_pipeline_bubble_of_every_ranks_rows() -> None:
    from asyncpp.pipeline.bubble import bubble_of

    # (stage, busy, elapsed) of 4 ranks: 2 stages x 2 DP replicas; idle shares 0.25, 0.75, 0.5, 0.5.
    rows = torch.tensor([[0, 3, 4], [1, 1, 4], [0, 2, 4], [1, 2, 4]], dtype=torch.float64)
    bubble = bubble_of(rows)
    assert bubble.mean == 0.5 and bubble.per_stage == (0.375, 0.625)
    assert bubble.as_metrics() == {"bubble_fraction": 0.5, "bubble_fraction_per_stage": [0.375, 0.625]}
