"""Event-driven cost model of a set of schedules: predicted timeline, step time, bubble, memory.

Each stage runs its list in order. An action starts when its stage is free and its inputs have
arrived; an input sent by another stage arrives `comm` after its producer ends (sends are
asynchronous: they occupy the link, not the stage). With collective_updates, UPDATE(t) also waits
for UPDATE_START(t) of every stage plus `comm` (the global grad norm / tied-embedding reduction).
UPDATE_START costs nothing on the stage: it only launches the reductions.

Data parallelism (`dp_comm`): UPDATE_START(t) starts the stage's gradient all-reduce over its DP
replicas, which runs beside the compute (its own stream and link) for `dp_comm` and is waited for only
in UPDATE(t). A stage's all-reduces run one after another on its link. The cross-stage norm reduction
follows the DP one, so with collective_updates UPDATE(t) waits for every stage's DP all-reduce of b_t
plus `comm`. A schedule hides the all-reduce when its UPDATE(t) comes late enough after UPDATE_START(t):
2BW leaves m - (P-1-s) microbatches of compute at stage s; 1F1B's flush leaves none, so it is exposed.
What is not modelled: the all-reduce slowing the compute it overlaps (shared SMs and memory bandwidth),
and DP and p2p traffic sharing a NIC.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from asyncpp.schedules.actions import Action, Op
from asyncpp.schedules.build import build_pipeline
from asyncpp.schedules.events import TimelineEvent
from asyncpp.schedules.invariants import dependencies, execution_order, peak_in_flight, peak_versions
from asyncpp.schedules.registry import stage_delay

Cost = float | Sequence[float]


@dataclass(frozen=True)
class OpCosts:
    """Durations per action; each a scalar or one value per stage (comm: per sending stage; dp_comm:
    the stage's gradient all-reduce over its DP replicas, see dp_allreduce_time; head: a head split's HEAD
    action on the helper, the forward and backward of its token share's LM head and loss)."""

    forward: Cost
    backward: Cost
    comm: Cost = 0.0
    update: Cost = 0.0
    dp_comm: Cost = 0.0
    head: Cost = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):  # lists -> tuples, so a frozen OpCosts really is immutable
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)):
                object.__setattr__(self, f.name, tuple(float(v) for v in value))

    def at(self, name: str, stage: int) -> float:
        value = getattr(self, name)
        return float(value) if isinstance(value, (int, float)) else value[stage]

    def duration(self, op: Op, stage: int) -> float:
        if op is Op.UPDATE_START:
            return 0.0
        return self.at({Op.FORWARD: "forward", Op.BACKWARD: "backward", Op.UPDATE: "update", Op.HEAD: "head"}[op],
                       stage)


def dp_allreduce_time(num_params: float, dp: int, bandwidth: float, bytes_per_param: int = 4) -> float:
    """Seconds of a ring all-reduce of `num_params` gradients over `dp` replicas: each rank sends and
    receives 2 (dp-1)/dp of the buffer at `bandwidth` bytes/s (the bus bandwidth of nccl-tests). fp32
    gradients by default: the engine reduces the fp32 sums (docs/gpu.md)."""
    if dp < 1 or bandwidth <= 0:
        raise ValueError(f"dp={dp} must be >= 1 and bandwidth={bandwidth} bytes/s > 0")
    return 2 * (dp - 1) / dp * num_params * bytes_per_param / bandwidth


@dataclass(frozen=True)
class Timeline:
    schedules: tuple[tuple[Action, ...], ...]
    events: tuple[TimelineEvent, ...]
    """Events in execution order; events of one stage are sequential."""
    comm_events: tuple[TimelineEvent, ...] = ()
    """DP all-reduces (kind "comm"): they overlap the stage's compute, so they are not in `events`."""

    @property
    def num_stages(self) -> int:
        return len(self.schedules)

    @property
    def num_steps(self) -> int:
        return 1 + max((a.step for s in self.schedules for a in s), default=-1)

    @property
    def makespan(self) -> float:
        return max((e.end for e in self.events), default=0.0)

    def step_done(self, step: int) -> float:
        """When b_step has finished on every stage (its last UPDATE_START)."""
        return max(e.end for e in self.events if e.kind == "U0" and e.step == step)

    def steady_window(self) -> tuple[int, int]:
        """Steps (t1, t2) bounding the middle of the run: a quarter of the steps cut at each end."""
        n = self.num_steps
        if n < 3:
            return (-1, n - 1)
        cut = max(n // 4, 1)
        return (cut - 1, n - 1 - cut)

    def _time(self, step: int) -> float:
        return 0.0 if step < 0 else self.step_done(step)

    def step_time(self) -> float:
        """Steady-state time per step: the spacing of step completions over the middle steps."""
        t1, t2 = self.steady_window()
        return (self._time(t2) - self._time(t1)) / (t2 - t1)

    def bubble_fraction(self, stage: int | None = None, *, steady: bool = False) -> float:
        """Idle / total for one stage (or averaged over stages), over the run or the steady window."""
        if stage is None:
            return (
                sum(self.bubble_fraction(s, steady=steady) for s in range(self.num_stages)) / self.num_stages
            )
        if steady:
            t1, t2 = self.steady_window()
            lo, hi = self._time(t1), self._time(t2)
        else:
            lo, hi = 0.0, self.makespan
        if hi <= lo:
            return 0.0
        busy = sum(max(0.0, min(e.end, hi) - max(e.start, lo)) for e in self.events if e.stage == stage)
        return 1.0 - busy / (hi - lo)

    def peak_activations(self) -> list[int]:
        return [peak_in_flight(s) for s in self.schedules]

    def weight_versions(self) -> list[int]:
        return [peak_versions(s) for s in self.schedules]


def simulate(
    schedules: Sequence[Sequence[Action]], costs: OpCosts, *, collective_updates: bool = False
) -> Timeline:
    """Predicted timeline; raises DeadlockError if the schedules cannot complete."""
    deps = dependencies(schedules, collective_updates=collective_updates)
    order = execution_order(schedules, collective_updates=collective_updates)
    # done[node]: when what the node produces is available to others: an F/B's output when it ends, an
    # UPDATE_START's reduced gradient when its DP all-reduce ends.
    done: dict[tuple[int, int], float] = {}
    reduced: dict[tuple[int, int], float] = {}  # (stage, step) -> its DP all-reduce has finished
    free, link = [0.0] * len(schedules), [0.0] * len(schedules)
    events, comm = [], []
    for s, i in order:
        a = schedules[s][i]
        # Producers on other stages: the message leaves when the producer is done and travels `comm`.
        ready = max((done[(r, j)] + costs.at("comm", r) for r, j in deps.get((s, i), ())), default=0.0)
        if a.op is Op.UPDATE:
            ready = max(ready, reduced[(s, a.step)])
        start = max(free[s], ready)
        free[s] = done[(s, i)] = start + costs.duration(a.op, s)
        events.append(TimelineEvent(s, _label(a), start, free[s], a.op.value, a.step, a.microbatch))
        if a.op is Op.UPDATE_START:
            begin = max(free[s], link[s])
            link[s] = done[(s, i)] = reduced[(s, a.step)] = begin + costs.at("dp_comm", s)
            if link[s] > begin:
                comm.append(TimelineEvent(s, f"DP({a.step})", begin, link[s], "comm", a.step))
    return Timeline(tuple(tuple(s) for s in schedules), tuple(events), tuple(comm))


def _label(a: Action) -> str:
    # Action.__str__ renders UPDATE_START(0) as "U00", too close to UPDATE(0)'s "U0" in a trace viewer.
    if a.op is Op.UPDATE_START:
        return f"U0({a.step})"
    return f"U({a.step})->v{a.version}" if a.op is Op.UPDATE else str(a)


def steady_delays(kind: str, num_stages: int, num_steps: int) -> list[list[int]]:
    """Per-stage delays of a run without sync start/cooldown (asyncpp.schedules.registry.stage_delay)."""

    return [[stage_delay(kind, s, num_stages)] * num_steps for s in range(num_stages)]


def predict(
    kind: str,
    num_stages: int,
    num_microbatches: int,
    num_steps: int,
    costs: OpCosts,
    *,
    collective_updates: bool = False,
    head_split: bool = False,
) -> dict:
    """Build the schedules of a steady run and report its predicted step time, bubble and memory."""
    schedules = build_pipeline(kind, num_stages, num_microbatches, steady_delays(kind, num_stages, num_steps),
                               head_split=head_split)
    tl = simulate(schedules, costs, collective_updates=collective_updates)
    return {
        "kind": kind,
        "num_stages": num_stages,
        "num_microbatches": num_microbatches,
        "num_steps": num_steps,
        "step_time": tl.step_time(),
        "bubble": tl.bubble_fraction(steady=True),
        "bubble_per_stage": [tl.bubble_fraction(s, steady=True) for s in range(num_stages)],
        "bubble_run": tl.bubble_fraction(),
        "makespan": tl.makespan,
        "dp_comm": max(costs.at("dp_comm", s) for s in range(num_stages)),
        "peak_activations": tl.peak_activations(),
        "weight_versions": tl.weight_versions(),
    }
