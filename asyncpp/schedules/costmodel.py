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
from asyncpp.schedules.invariants import (
    DeadlockError,
    ScheduleError,
    check_schedules,
    dependencies,
    execution_order,
    max_versions_for,
    peak_in_flight,
    peak_versions,
)
from asyncpp.schedules.registry import stage_delay

Cost = float | Sequence[float]


@dataclass(frozen=True)
class OpCosts:
    """Durations per action; each a scalar or one value per stage (comm: per sending stage; dp_comm:
    the stage's gradient all-reduce over its DP replicas, see dp_allreduce_time; vocab_forward and
    vocab_backward: a vocabulary-parallel head's S and T on each stage, its shard's logits with their statistics,
    and their gradients). The head's collectives are latencies on the edges they carry, beside the compute (their
    own stream and link): vocab_broadcast from the last stage's F to every S, vocab_allreduce from every S to
    every T, vocab_reduce from every T to the last stage's B (asyncpp.core.vocab_split.vocab_comm_time). A sharded
    embedding's E and G on each stage (embed_forward, embed_backward), its collectives' latencies: embed_reduce from
    every E to the first stage's F, embed_broadcast from the first stage's B to every G."""

    forward: Cost
    backward: Cost
    comm: Cost = 0.0
    update: Cost = 0.0
    dp_comm: Cost = 0.0
    vocab_forward: Cost = 0.0
    vocab_backward: Cost = 0.0
    vocab_broadcast: float = 0.0
    vocab_allreduce: float = 0.0
    vocab_reduce: float = 0.0
    embed_forward: Cost = 0.0
    embed_backward: Cost = 0.0
    embed_reduce: float = 0.0
    embed_broadcast: float = 0.0

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
        return self.at({Op.FORWARD: "forward", Op.BACKWARD: "backward", Op.UPDATE: "update",
                        Op.VOCAB_FORWARD: "vocab_forward", Op.VOCAB_BACKWARD: "vocab_backward",
                        Op.EMBED_FORWARD: "embed_forward", Op.EMBED_BACKWARD: "embed_backward"}[op], stage)

    def latency(self, consumer: Op, producer: Op, sender: int) -> float:
        """How long what `producer` (on stage `sender`) makes takes to reach `consumer`."""
        if producer is Op.EMBED_FORWARD:
            return self.embed_reduce
        if consumer is Op.EMBED_BACKWARD:
            return self.embed_broadcast
        if consumer is Op.VOCAB_FORWARD:
            return self.vocab_broadcast
        if consumer is Op.VOCAB_BACKWARD:
            return self.vocab_allreduce
        if producer is Op.VOCAB_BACKWARD:
            return self.vocab_reduce
        return self.at("comm", sender)


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
        ready = max((done[(r, j)] + costs.latency(a.op, schedules[r][j].op, r) for r, j in deps.get((s, i), ())),
                    default=0.0)
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


@dataclass(frozen=True)
class VocabPlacement:
    """How a vocabulary-parallel head's S and T go into a pipeline: `warmup` extra forwards of warm-up in the
    skeleton (build_pipeline's vocab_warmup), and `slack`: how many of its own S passes a stage runs between S(i)
    and T(i) (place_vocab_passes)."""

    warmup: int
    slack: int = 0


VOCAB_PLACEMENTS = (VocabPlacement(1, 1), VocabPlacement(1, 0), VocabPlacement(2, 1), VocabPlacement(2, 0))
"""The placements predict() tries, in order of preference: the first as fast as the fastest wins. Less warm-up first
(each extra forward holds one more microbatch's activations on every stage); then a slack of one S pass over none.
One warm-up forward leaves a slot between the last stage's F and B of a microbatch for the head's chain; two when
the chain's collectives or a small head leave it too short.

Why the slack: T(i) waits for the all-gather of every stage's S(i) statistics. Placed right after the stage's own
S(i), as a cost model without jitter places it, every T waits for the slowest stage's S of the same microbatch, and
the stages' head passes march in lock step: measured on CPU (bench/peers.py, tiny_dense P=2 M=8, gloo), 31 ms per
step of such waits on stage 0, 7% of its step. With one S of slack the all-gather has a whole pass to complete
before anyone waits for it. It costs one more S->T pass held per stage (fp32 [N, rows] logits, counted by the memory
plan from the action list), and in the cost model it needs the second warm-up forward to add no bubble (with one,
a 20-30% bubble at P = 2-16 for the paper's models), so it is taken only where it is free in the model: at the
warm-up the schedule needs anyway."""


INF = float("inf")


class _EveryStage:
    """When every one of P stages has ended an action (op, step, microbatch): a running count and the latest end per
    key, so the list schedulers' "after every stage's X" costs O(1) rather than a scan of the stages."""

    def __init__(self, num_stages: int):
        self.num_stages = num_stages
        self._seen: dict[tuple[Op, int, int], list] = {}  # (op, step, microbatch) -> [stages done, latest end]

    def add(self, a: Action, end: float) -> None:
        tally = self._seen.setdefault((a.op, a.step, a.microbatch), [0, 0.0])
        tally[0], tally[1] = tally[0] + 1, max(tally[1], end)

    def end(self, op: Op, step: int, j: int) -> float:
        """When every stage's `op` of (step, j) has ended (inf until all have run)."""
        count, latest = self._seen.get((op, step, j), (0, 0.0))
        return latest if count == self.num_stages else INF


def place_vocab_passes(skeleton: Sequence[Sequence[Action]], costs: OpCosts, slack: int = 0) -> list[list[Action]]:
    """A vocabulary-parallel head's S and T actions placed into F/B lists (built with vocab_warmup > 0) by the cost
    model: an event-driven list scheduler in which every stage, whenever it is free, starts the earliest-ready of
    its next T, its next S and its next F/B/update action (in that priority on ties), S and T in microbatch order,
    T(i) not before the stage's S(i + slack) unless that would deadlock (VOCAB_PLACEMENTS says why).
    Work-conserving, so the head's passes fill the time a stage would wait; deterministic, so every rank derives
    the same lists from the same costs. Each stage keeps its skeleton's order of F, B and updates, and S(i) and T(i)
    go in ascending i on every stage (one order per communicator). The result is checked like any schedule
    (invariants.check_schedules) by the callers that build it."""
    return _VocabPlacer(skeleton, costs).place(slack)


class _VocabPlacer:
    """place_vocab_passes' list scheduler: per stage, the next skeleton action (`nxt`), the next S (`heads`) and the
    next T (`tails`) to place, when the stage is free, and when each placed action ends."""

    def __init__(self, skeleton: Sequence[Sequence[Action]], costs: OpCosts):
        self.skeleton, self.costs, self.P = skeleton, costs, len(skeleton)
        P = self.P
        self.items = [(a.step, a.microbatch, a.version) for a in skeleton[-1] if a.op is Op.FORWARD]
        self.nxt, self.heads, self.tails = [0] * P, [0] * P, [0] * P
        self.free = [0.0] * P
        self.done: dict[tuple[Op, int, int, int], float] = {}  # (op, stage, step, microbatch) -> end
        self.everyone = _EveryStage(P)
        self.out: list[list[Action]] = [[] for _ in range(P)]
        self.max_comm = max(costs.at("comm", r) for r in range(P))

    def end(self, op: Op, stage: int, step: int, j: int) -> float:
        return self.done.get((op, stage, step, j), INF)

    def ready_skeleton(self, s: int) -> float:
        if self.nxt[s] >= len(self.skeleton[s]):
            return INF
        a, costs, last = self.skeleton[s][self.nxt[s]], self.costs, self.P - 1
        if a.op is Op.FORWARD and s > 0:
            return self.end(Op.FORWARD, s - 1, a.step, a.microbatch) + costs.at("comm", s - 1)
        if a.op is Op.BACKWARD and s == last:
            return self.everyone.end(Op.VOCAB_BACKWARD, a.step, a.microbatch) + costs.vocab_reduce
        if a.op is Op.BACKWARD:
            return self.end(Op.BACKWARD, s + 1, a.step, a.microbatch) + costs.at("comm", s + 1)
        if a.op is Op.UPDATE:  # the strictest engine: every stage's UPDATE_START(t) first
            return self.everyone.end(Op.UPDATE_START, a.step, -1) + self.max_comm
        return 0.0

    def ready_head(self, s: int) -> float:
        if self.heads[s] >= len(self.items):
            return INF
        t, j, _ = self.items[self.heads[s]]
        own = self.end(Op.FORWARD, s, t, j)  # after the stage's own F of the item, in list order too
        return max(own, self.end(Op.FORWARD, self.P - 1, t, j) + (self.costs.vocab_broadcast if s < self.P - 1 else 0.0))

    def ready_tail(self, s: int, slack: int) -> float:
        heads, tails = self.heads, self.tails
        if tails[s] >= heads[s] or (tails[s] + slack >= heads[s] and heads[s] < len(self.items)):
            return INF  # T(i) after the stage's own S(i + slack), while there is one
        t, j, _ = self.items[tails[s]]
        return self.everyone.end(Op.VOCAB_FORWARD, t, j) + self.costs.vocab_allreduce

    def earliest(self, slack: int) -> tuple[float, int, int] | None:
        best = None
        for s in range(self.P):
            for rank, ready in enumerate((self.ready_tail(s, slack), self.ready_head(s), self.ready_skeleton(s))):
                if ready < INF:
                    best = min(best or (INF,), (max(self.free[s], ready), rank, s))
        return best

    def take(self, rank: int, s: int) -> Action:
        """The action of kind `rank` (0: T, 1: S, 2: the skeleton's next) that stage s starts next."""
        if rank == 2:
            a = self.skeleton[s][self.nxt[s]]
            self.nxt[s] += 1
            return a
        counter = self.tails if rank == 0 else self.heads
        t, j, v = self.items[counter[s]]
        counter[s] += 1
        return Action(Op.VOCAB_BACKWARD if rank == 0 else Op.VOCAB_FORWARD, t, j, v)

    def place(self, slack: int) -> list[list[Action]]:
        remaining = sum(len(x) for x in self.skeleton) + 2 * len(self.items) * self.P
        while remaining:
            # Without the slack where it would deadlock: where S(i + 1) needs T(i) first (a flush between steps,
            # 1F1B's last microbatch of a step), T(i) goes when nothing else can.
            best = self.earliest(slack) or self.earliest(0)
            if best is None:
                raise DeadlockError("vocabulary-parallel placement is stuck: " + ", ".join(
                    f"stage {s} at #{self.nxt[s]}" for s in range(self.P)))
            start, rank, s = best
            a = self.take(rank, s)
            self.free[s] = self.done[(a.op, s, a.step, a.microbatch)] = start + self.costs.duration(a.op, s)
            self.everyone.add(a, self.free[s])
            self.out[s].append(a)
            remaining -= 1
        return self.out


def placed_vocab_pipeline(kind: str, num_microbatches: int, step_delays: Sequence[Sequence[int]], costs: OpCosts,
                          placement: VocabPlacement, sharded_embedding: bool = False) -> list[list[Action]]:
    """Every stage's actions with a vocabulary-parallel head's S and T placed at `placement` (and a sharded
    embedding's E and G), checked like any schedule: ScheduleError where the placement is invalid (with more warm-up
    than m leaves room for, a forward would run on a version not made yet). What predict() tries for each of
    VOCAB_PLACEMENTS, and the preflight's check of an explicit one (parallel.vocab_placement)."""
    P = len(step_delays)
    skeleton = build_pipeline(kind, P, num_microbatches, step_delays, vocab_warmup=placement.warmup)
    schedules = place_vocab_passes(skeleton, costs, placement.slack)
    if sharded_embedding:
        schedules = place_embedding_passes(schedules, costs)
    check_schedules(schedules, num_microbatches, [max_versions_for(kind, s, P) for s in range(P)],
                    num_steps=len(step_delays[0]))
    return schedules


EMBED_LOOKAHEAD = 2
"""How far a stage's E may run ahead of the first stage's forwards (microbatches): E(k) is placed once the first
stage has run F(k - EMBED_LOOKAHEAD). Enough to hide the reduce behind the first stage's F/B pairs; small, because
the first stage holds every reduced embedding until its F (one [mb, seq, h] buffer each)."""



def place_embedding_passes(schedules: Sequence[Sequence[Action]], costs: OpCosts,
                           lookahead: int = EMBED_LOOKAHEAD) -> list[list[Action]]:
    """A sharded embedding's E and G actions placed into complete schedules (F/B/updates, and a vocabulary-parallel
    head's S and T) by the same kind of list scheduler as place_vocab_passes: every stage, whenever it is free,
    starts the earliest-ready of its next G, its next E and its next listed action (that priority on ties); E and G
    in the first stage's microbatch order on every stage. Every listed action keeps its order, except that an
    UPDATE(v-1) moves up to just before the first E that reads x_v when that E is ready earlier than the UPDATE's
    place: under 2BW a later stage's UPDATE(t-2) sits just before its F(t, 0), which comes after the first stage's
    F(t, 0), which needs that stage's E(t, 0) on x_{t-1}. (The UPDATE may run as soon as its reductions are
    complete; it still follows the stage's UPDATE_START(v-1) and every G of step v-1, so the version bound holds.)
    Deterministic: every rank derives the same lists from the same costs."""
    return _EmbeddingPlacer(schedules, costs, lookahead).run()


class _EmbeddingPlacer:
    """place_embedding_passes' list scheduler: the state of the placement so far and the readiness of each stage's
    three candidates (its next G, its next E, its next listed action)."""

    def __init__(self, schedules: Sequence[Sequence[Action]], costs: OpCosts, lookahead: int):
        P = self.P = len(schedules)
        self.costs, self.lookahead = costs, lookahead
        self.base = [list(x) for x in schedules]
        self.fwd = [(a.step, a.microbatch, a.version) for a in self.base[0] if a.op is Op.FORWARD]
        self.bwd = [(a.step, a.microbatch, a.version) for a in self.base[0] if a.op is Op.BACKWARD]
        self.per_step: dict[int, int] = {}
        for t, _, _ in self.fwd:
            self.per_step[t] = self.per_step.get(t, 0) + 1
        self.vocab = any(a.op is Op.VOCAB_BACKWARD for a in self.base[-1])
        self.nxt, self.e_next, self.g_next = [0] * P, [0] * P, [0] * P
        self.g_done: list[dict[int, int]] = [{} for _ in range(P)]  # stage -> step -> G emitted
        self.g_end: list[dict[int, float]] = [{} for _ in range(P)]  # stage -> step -> when its latest G ends
        self.pulled: list[set[int]] = [set() for _ in range(P)]  # the UPDATEs moved up (skipped at their place)
        self.updated: list[set[int]] = [set() for _ in range(P)]  # the UPDATEs emitted
        self.free = [0.0] * P
        self.done: dict[tuple[Op, int, int, int], float] = {}
        self.everyone = _EveryStage(P)
        self.update_at: dict[tuple[int, int], float] = {}  # (stage, step) -> when its UPDATE may run, once known
        self.out: list[list[Action]] = [[] for _ in range(P)]
        self.comm = [costs.at("comm", r) for r in range(P)]

    def end(self, op: Op, stage: int, step: int, j: int = -1) -> float:
        return self.done.get((op, stage, step, j), INF)

    def update_ready(self, s: int, t: int) -> float:
        """UPDATE(t) on stage s: its own G of step t all run, every other stage's UPDATE_START(t) and last G."""
        if (s, t) in self.update_at:
            return self.update_at[(s, t)]
        if self.g_done[s].get(t, 0) < self.per_step.get(t, 0) or self.end(Op.UPDATE_START, s, t) == INF:
            return INF
        ready = 0.0
        for r in range(self.P):
            if r != s:
                last_g = self.g_end[r].get(t, INF) if self.g_done[r].get(t, 0) == self.per_step[t] else INF
                ready = max(ready, self.end(Op.UPDATE_START, r, t) + self.comm[r], last_g + self.comm[r])
        if ready < INF:  # every input has run: it no longer changes
            self.update_at[(s, t)] = ready
        return ready

    def skip_pulled(self, s: int) -> None:
        base, nxt = self.base[s], self.nxt
        while nxt[s] < len(base) and base[nxt[s]].op is Op.UPDATE and base[nxt[s]].step in self.pulled[s]:
            nxt[s] += 1

    def ready_listed(self, s: int) -> float:
        self.skip_pulled(s)
        if self.nxt[s] >= len(self.base[s]):
            return INF
        a = self.base[s][self.nxt[s]]
        t, j, last, costs = a.step, a.microbatch, self.P - 1, self.costs
        if a.op is Op.FORWARD and s == 0:
            return self.everyone.end(Op.EMBED_FORWARD, t, j) + costs.embed_reduce
        if a.op is Op.FORWARD:
            return self.end(Op.FORWARD, s - 1, t, j) + self.comm[s - 1]
        if a.op is Op.BACKWARD and s == last:
            return self.everyone.end(Op.VOCAB_BACKWARD, t, j) + costs.vocab_reduce if self.vocab else 0.0
        if a.op is Op.BACKWARD:
            return self.end(Op.BACKWARD, s + 1, t, j) + self.comm[s + 1]
        if a.op is Op.VOCAB_FORWARD and s < last:
            return self.end(Op.FORWARD, last, t, j) + costs.vocab_broadcast
        if a.op is Op.VOCAB_BACKWARD:
            return self.everyone.end(Op.VOCAB_FORWARD, t, j) + costs.vocab_allreduce
        if a.op is Op.UPDATE:
            return self.update_ready(s, t)
        return 0.0

    def version_ready(self, s: int, v: int) -> tuple[float, bool]:
        """When x_v is there on stage s, and whether its UPDATE(v-1) must be pulled up to get it."""
        if v == 0:
            return 0.0, False
        if (v - 1) in self.updated[s]:
            return self.end(Op.UPDATE, s, v - 1), False
        return self.update_ready(s, v - 1), True

    def ready_e(self, s: int) -> tuple[float, bool]:
        k = self.e_next[s]
        if k >= len(self.fwd):
            return INF, False
        v = self.fwd[k][2]
        gate = self.end(Op.FORWARD, 0, *self.fwd[k - self.lookahead][:2]) if k >= self.lookahead else 0.0
        when, pull = self.version_ready(s, v)
        return max(gate, when), pull

    def ready_g(self, s: int) -> float:
        if self.g_next[s] >= len(self.bwd):
            return INF
        t, j, _ = self.bwd[self.g_next[s]]
        return self.end(Op.BACKWARD, 0, t, j) + (self.costs.embed_broadcast if s > 0 else 0.0)

    def emit(self, s: int, a: Action, start: float) -> None:
        self.free[s] = self.done[(a.op, s, a.step, a.microbatch)] = start + self.costs.duration(a.op, s)
        self.out[s].append(a)
        self.everyone.add(a, self.free[s])
        if a.op is Op.UPDATE:
            self.updated[s].add(a.step)

    def best(self) -> tuple[float, int, int]:
        """(start, which: 0 G / 1 E / 2 listed, stage) of the earliest start over the stages, ties by priority."""
        best = None
        for s in sorted(range(self.P), key=self.free.__getitem__):
            if best is not None and self.free[s] > best[0]:  # it cannot start earlier than the best (nor tie it)
                break
            e_ready, _ = self.ready_e(s)
            for rank, ready in enumerate((self.ready_g(s), e_ready, self.ready_listed(s))):
                if ready < INF:
                    best = min(best or (INF,), (max(self.free[s], ready), rank, s))
        if best is None:
            raise DeadlockError("embedding placement is stuck: " + ", ".join(
                f"stage {s} at #{self.nxt[s]} E#{self.e_next[s]} G#{self.g_next[s]}" for s in range(self.P)))
        return best

    def run(self) -> list[list[Action]]:
        remaining = sum(len(x) for x in self.base) + 2 * len(self.fwd) * self.P
        while remaining:
            start, rank, s = self.best()
            if rank == 0:
                remaining -= self._emit_g(s, start)
            elif rank == 1:
                remaining -= self._emit_e(s, start)
            else:
                self.emit(s, self.base[s][self.nxt[s]], start)
                self.nxt[s] += 1
                remaining -= 1
        return self.out

    def _emit_g(self, s: int, start: float) -> int:
        t, j, v = self.bwd[self.g_next[s]]
        self.g_next[s] += 1
        self.g_done[s][t] = self.g_done[s].get(t, 0) + 1
        self.emit(s, Action(Op.EMBED_BACKWARD, t, j, v), start)
        self.g_end[s][t] = self.free[s]
        return 1

    def _emit_e(self, s: int, start: float) -> int:
        """E, after x_v's UPDATE when it has to move up out of its listed place; the actions emitted."""
        t, j, v = self.fwd[self.e_next[s]]
        emitted = 1
        if self.ready_e(s)[1]:
            update = next(a for a in self.base[s] if a.op is Op.UPDATE and a.step == v - 1)
            self.pulled[s].add(v - 1)
            self.emit(s, update, start)
            start = self.free[s]
            emitted += 1
        self.e_next[s] += 1
        self.emit(s, Action(Op.EMBED_FORWARD, t, j, v), start)
        return emitted


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
    vocab_parallel: bool = False,
    sharded_embedding: bool = False,
) -> dict:
    """Build the schedules of a steady run and report its predicted step time, bubble and memory. With
    vocab_parallel, the head's S and T placed by place_vocab_passes at each of VOCAB_PLACEMENTS; the fastest (the
    first of them on ties) is reported as "vocab_placement" (its warm-up also as "vocab_warmup"); with sharded_embedding (and
    vocab_parallel), the embedding's E and G placed into those by place_embedding_passes."""
    delays = steady_delays(kind, num_stages, num_steps)
    if not vocab_parallel:
        schedules = build_pipeline(kind, num_stages, num_microbatches, delays)
        tl, placement = simulate(schedules, costs, collective_updates=collective_updates), VocabPlacement(0)
    else:
        options, refused = [], []
        for placement in VOCAB_PLACEMENTS:
            try:
                schedules = placed_vocab_pipeline(kind, num_microbatches, delays, costs, placement, sharded_embedding)
            except ScheduleError as e:
                refused.append(f"{placement}: {e}")
                continue
            tl = simulate(schedules, costs, collective_updates=collective_updates)
            options.append((tl.step_time(), placement, tl))
        if not options:
            raise ScheduleError("no placement of the vocabulary-parallel head is valid: " + "; ".join(refused))
        # The first in VOCAB_PLACEMENTS' order unless a later one is really faster (not by rounding).
        best = min(o[0] for o in options)
        _, placement, tl = next(o for o in options if o[0] <= best * (1 + 1e-9))
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
        "vocab_warmup": placement.warmup,
        "vocab_placement": placement,
    }
