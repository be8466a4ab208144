"""What a pipeline stage did and when, timed on the device that did it.

On CUDA, `time.perf_counter()` around asynchronous kernel launches measures the launch, not the work:
the host runs ahead of the GPU, so F/B/U durations, the bubble and tokens/s read from it would all be
wrong. A StageTimer therefore takes its timestamps from a *clock* chosen by the device type, the one
switch (`stage_timer(stage, device)`):

    cpu    HostClock: a mark is perf_counter(); resolved at once.
    cuda   CudaClock: a mark is a torch.cuda.Event recorded on the current stream; it is resolved later
           (Event.query() is polled, never waited for, on the hot path), so timing adds no host
           synchronisation to a step. Reading the results (busy(), events, end_of(), elapsed()) resolves
           what is still pending and may wait for those events: do it at logging time or the end of a run.

Either way the outputs are the same: TimelineEvents in seconds since the origin (the timeline, the
Chrome trace), busy(), mean_durations() (the cost model's per-op costs), end_of() in host-clock
seconds (tokens/s) and elapsed() (the wall time the bubble fraction divides by).

Device times are mapped onto the host clock through one pair of readings taken together at restart():
origin_s = perf_counter() and an origin mark recorded right after the device went idle. An event's
time is origin_s + (device seconds from the origin mark to it). Invariant: every mark belongs to
this timer's clock, and events of one stage are added in execution order.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from asyncpp.schedules.actions import Action, Op
from asyncpp.schedules.events import TimelineEvent

PER_STEP_KINDS = ("U0", "U")
"""Kinds whose cost is per step, not per event (mean_durations)."""

NOT_BUSY = ("idle", "comm")
"""Event kinds that are not the stage's own work: waiting for a reduction, a transfer in flight."""

MIN_IDLE_S = 1e-4
"""An "idle" span shorter than this is the clock's own noise (a wait that found its data ready), not a
wait: it is dropped, so the timeline shows real stalls only."""

Mark = Any
"""A timestamp of a clock: a float (HostClock) or a recorded event (CudaClock); opaque to callers."""


class Clock(Protocol):
    def mark(self) -> Mark:
        """A timestamp of 'now' in the device's order of work (does not block)."""

    def ready(self, mark: Mark) -> bool:
        """Whether `mark` can be read without waiting."""

    def seconds(self, origin: Mark, mark: Mark) -> float:
        """Seconds from `origin` to `mark` (may wait until `mark` has happened on the device)."""

    def idle(self) -> None:
        """Wait until the device has finished all work queued so far."""

    def origin(self) -> tuple[Mark, float]:
        """A mark and the host's perf_counter() taken together: the pair that maps device time to host time."""


class HostClock:
    """The CPU's clock: work is done when the call returns, so a mark is ready at once."""

    def mark(self) -> float:
        return time.perf_counter()

    def ready(self, mark: float) -> bool:
        return True

    def seconds(self, origin: float, mark: float) -> float:
        return mark - origin

    def idle(self) -> None:
        return None

    def origin(self) -> tuple[float, float]:
        t = time.perf_counter()
        return t, t


class CudaClock:
    """CUDA events on the current stream of `device`. `new_event` makes an event with timing enabled
    (torch.cuda.Event by default; a stand-in with the same four methods in the CPU tests)."""

    def __init__(self, device: torch.device, new_event: Callable[[], Any] | None = None):
        self.device = device
        self._new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))

    def mark(self) -> Any:
        event = self._new_event()
        event.record(torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None)
        return event

    def ready(self, mark: Any) -> bool:
        return bool(mark.query())  # a host-side status read: never blocks, never syncs the stream

    def seconds(self, origin: Any, mark: Any) -> float:
        if not mark.query():
            mark.synchronize()  # waits for this event only (not for the rest of the stream)
        return origin.elapsed_time(mark) / 1000.0  # elapsed_time is in milliseconds

    def idle(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def origin(self) -> tuple[Any, float]:
        # Called right after idle(): the event fires at once, so it and perf_counter() name the same moment.
        return self.mark(), time.perf_counter()


def clock_for(device: torch.device) -> Clock:
    """The one switch: CUDA devices are timed with CUDA events, everything else with perf_counter."""
    return CudaClock(device) if torch.device(device).type == "cuda" else HostClock()


class StageTimer:
    """The events of one stage. F/B/U0/U are busy time; "idle" spans (waiting for a reduction) are not, nor
    are "comm" spans (a transfer in flight while the stage computes: the distributed optimizer's broadcast).

    Hot path: `start = timer.now(); ...; timer.add(action, start, timer.now())` or
    `with timer.span(action): ...`. Neither blocks; on CUDA, finished events are resolved on the way.
    """

    def __init__(self, stage: int, clock: Clock | None = None):
        self.stage = stage
        self.clock: Clock = clock if clock is not None else HostClock()
        self._origin_mark, self.origin_s = self.clock.origin()
        self._done: list[TimelineEvent] = []
        self._busy_s = 0.0  # sum of the resolved busy events' durations, in resolution order (busy())
        # The latest end of a resolved event: not the last-resolved one's, as events are added out of end order (an
        # UPDATE's idle wait is added after its U, and ends where U starts).
        self._latest_s = 0.0
        # (action, start mark, end mark, kind) not resolved yet, in the order they were added.
        self._pending: deque[tuple[Action, Mark, Mark, str]] = deque()

    # ---- hot path -------------------------------------------------------------------------------
    def now(self) -> Mark:
        return self.clock.mark()

    def add(self, action: Action, start: Mark, end: Mark, kind: str | None = None) -> None:
        """Record that `action` ran from `start` to `end` (marks of this timer's clock)."""
        self._pending.append((action, start, end, kind or action.op.value))
        self._resolve(block=False)

    @contextlib.contextmanager
    def span(self, action: Action, kind: str | None = None) -> Iterator[None]:
        start = self.now()
        yield
        self.add(action, start, self.now(), kind)

    # ---- reading (may wait for pending device events) --------------------------------------------
    def restart(self) -> float:
        """Make 'now' the time origin (after the device finished its queued work); returns the origin
        in host perf_counter seconds. Events recorded so far keep their times against the old origin."""
        self._resolve(block=True)
        self.clock.idle()
        self._origin_mark, self.origin_s = self.clock.origin()
        return self.origin_s

    @property
    def events(self) -> list[TimelineEvent]:
        self._resolve(block=True)
        return self._done

    def clear(self) -> None:
        """Forget every event recorded so far, pending ones too (without waiting for them)."""
        self._done.clear()
        self._pending.clear()
        self._busy_s = self._latest_s = 0.0

    def elapsed(self) -> float:
        """Seconds from the origin to now on this clock: on CUDA, until the work queued so far is done."""
        return self.clock.seconds(self._origin_mark, self.clock.mark())

    def busy(self) -> float:
        self._resolve(block=True)
        return self._busy_s

    def snapshot(self) -> tuple[float, float]:
        """(busy seconds, seconds from the origin to the end of the newest resolved event) without waiting: on
        CUDA only the events the device has already reached count, so reading it every few steps syncs
        nothing. Their ratio is the stage's busy share so far (up to that event)."""
        self._resolve(block=False)
        return self._busy_s, self._latest_s

    def mean_durations(self) -> dict[str, float]:
        """Mean duration of each kind of event (F, B, U0, U, idle): per-op costs for the cost model. An update
        may be timed in pieces (UPDATE_START's deferred reduction work, StageEngine._progress): U0 and U are
        summed per step first, so their means stay the cost of one step's update."""
        sums: dict[str, list[float]] = {}
        per_step: dict[tuple[str, int], float] = {}
        for e in self.events:
            if e.kind in PER_STEP_KINDS:
                per_step[e.kind, e.step] = per_step.get((e.kind, e.step), 0.0) + e.duration
            else:
                sums.setdefault(e.kind, []).append(e.duration)
        for (kind, _), d in per_step.items():
            sums.setdefault(kind, []).append(d)
        return {kind: sum(v) / len(v) for kind, v in sums.items()}

    def end_of(self, op: Op, step: int) -> float:
        """Host-clock (perf_counter) time at which the last `op` of `step` finished on the device. Waits
        for that event only, never for later ones (logging reads a step that is two updates old)."""
        last = max((i for i, (a, _, _, kind) in enumerate(self._pending) if kind == op.value and a.step == step),
                   default=-1)
        self._resolve(block=True, count=last + 1)
        for e in reversed(self._done):
            if e.kind == op.value and e.step == step:
                return e.end + self.origin_s
        raise KeyError(f"no {op.value} event for step {step}")

    def _resolve(self, block: bool, count: int | None = None) -> None:
        """Turn pending marks into events, oldest first (at most `count` of them); without `block`, stop
        at the first mark the device has not reached (so the hot path never waits)."""
        while self._pending and (count is None or count > 0):
            if count is not None:
                count -= 1
            action, start, end, kind = self._pending[0]
            if not block and not self.clock.ready(end):
                return
            self._pending.popleft()
            t0 = self.clock.seconds(self._origin_mark, start)
            t1 = self.clock.seconds(self._origin_mark, end)
            if kind == "idle" and t1 - t0 < MIN_IDLE_S:
                continue
            self._done.append(TimelineEvent(self.stage, str(action), t0, t1, kind, action.step, action.microbatch))
            self._latest_s = max(self._latest_s, t1)
            if kind not in NOT_BUSY:
                self._busy_s += t1 - t0


def stage_timer(stage: int, device: torch.device) -> StageTimer:
    """A StageTimer on the clock of `device`'s type (see clock_for)."""
    return StageTimer(stage, clock_for(device))
