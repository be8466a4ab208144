"""Invariants of a set of per-stage schedules, checked on the data alone (no processes, no torch).

`check_schedules` runs, in order: completeness, one version per microbatch, version readiness,
the weight-version bound, a no-deadlock simulation of all stages together, and the FIFO order of
every p2p channel. Each failure raises ScheduleError (an AssertionError) naming the stage and the
actions involved.

Weight versions *held* by a stage after an action are the versions that are already produced and
still needed by a microbatch whose BACKWARD has not run yet (started or not), plus the newest
version (the base of the next update). This is the memory the stage really needs; it is never less
than the count of "versions of in-flight microbatches plus the newest".
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

from asyncpp.schedules.actions import Action, Op
from asyncpp.schedules.registry import kind_of, version_of

Node = tuple[int, int]
"""(stage, index of the action in that stage's list)."""
_MAX_LISTED = 6


class ScheduleError(AssertionError):
    """A schedule violates an invariant; the message names the stage and the actions."""


class DeadlockError(ScheduleError):
    """The stages cannot all run their lists to the end; the message lists the stuck actions."""


def check_schedules(
    schedules: Sequence[Sequence[Action]],
    num_microbatches: int,
    max_versions: int | Sequence[int] | None,
    *,
    step_delays: Sequence[Sequence[int]] | None = None,
    collective_updates: bool = True,
    num_steps: int | None = None,
) -> None:
    """Raise ScheduleError unless the schedules are complete, consistent and deadlock-free.

    max_versions: bound on weight versions held (one int, or one per stage; None skips the check).
    step_delays[s][t]: when given, b_t on stage s must run on max(t - d, 0) (needed for pipedream,
    whose stages use different versions); when None, every stage must use the same version for b_t.
    collective_updates: UPDATE(t) also waits for UPDATE_START(t) on every stage (global grad-norm
    clipping, tied embeddings), so the deadlock check covers the strictest engine.
    num_steps: expected number of steps (default: inferred from the largest step present).
    """
    if num_steps is None:
        num_steps = _num_steps(schedules)
    for s, actions in enumerate(schedules):
        _check_complete(s, actions, num_steps, num_microbatches)
        _check_ready(s, actions, num_microbatches)
    _check_vocab(schedules, num_steps, num_microbatches)
    _check_embed(schedules, num_steps, num_microbatches)
    _check_versions(schedules, step_delays)
    if max_versions is not None:
        _check_version_bound(schedules, max_versions)
    execution_order(schedules, collective_updates=collective_updates)
    check_fifo(schedules)


def max_versions_for(kind: str, stage: int, num_stages: int) -> int:
    """The weight-version bound of the semantics: the registry's buffer count (1 sync, 2 for 2bw, P-s for
    pipedream)."""
    return kind_of(kind).num_buffers(stage, num_stages)


def _num_steps(schedules: Sequence[Sequence[Action]]) -> int:
    return 1 + max((a.step for actions in schedules for a in actions), default=-1)


def _fail(stage: int, what: str, items: Sequence[object]) -> None:
    shown = ", ".join(str(x) for x in items[:_MAX_LISTED])
    more = f" (+{len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    raise ScheduleError(f"stage {stage}: {what}: {shown}{more}")


def _check_complete(stage: int, actions: Sequence[Action], num_steps: int, m: int) -> None:
    """Exactly one F and one B per (t, j), F first; one UPDATE_START and one UPDATE per step, in order."""
    counts = Counter((a.op, a.step, a.microbatch) for a in actions if a.op in (Op.FORWARD, Op.BACKWARD))
    expected = {(op, t, j) for op in (Op.FORWARD, Op.BACKWARD) for t in range(num_steps) for j in range(m)}
    missing = sorted(f"{op.value}{t}.{j}" for op, t, j in expected - counts.keys())
    if missing:
        _fail(stage, "missing actions", missing)
    extra = sorted(
        f"{op.value}{t}.{j}" for (op, t, j), n in counts.items() if n > 1 or (op, t, j) not in expected
    )
    if extra:
        _fail(stage, "duplicated or out-of-range actions", extra)
    where = {(a.op, a.step, a.microbatch): i for i, a in enumerate(actions)}
    early = [
        f"B{t}.{j}"
        for (op, t, j) in expected
        if op is Op.BACKWARD and where[(op, t, j)] < where[(Op.FORWARD, t, j)]
    ]
    if early:
        _fail(stage, "BACKWARD before its FORWARD", sorted(early))
    for op in (Op.UPDATE_START, Op.UPDATE):
        steps = [a.step for a in actions if a.op is op]
        if steps != list(range(num_steps)):
            _fail(stage, f"{op.name} must occur once per step in step order, got steps", [steps])
    bad = [str(a) for a in actions if a.op is Op.UPDATE and a.version != a.step + 1]
    if bad:
        _fail(stage, "UPDATE(t) must produce version t+1", bad)


VOCAB_OPS = (Op.VOCAB_FORWARD, Op.VOCAB_BACKWARD)


def has_vocab_parallel(schedules: Sequence[Sequence[Action]]) -> bool:
    """Whether the head is vocabulary-parallel (the last stage's list holds VOCAB_FORWARD actions)."""
    return bool(schedules) and any(a.op is Op.VOCAB_FORWARD for a in schedules[-1])


def _check_vocab(schedules: Sequence[Sequence[Action]], num_steps: int, m: int) -> None:
    """A vocabulary-parallel head: every stage runs exactly one S and one T per (t, j), in the order F, S, T, B of
    that microbatch and before UPDATE_START(t) (its shard's weight gradient belongs to b_t), on F's version (one
    version per microbatch across all shards, semantics.md); the collectives they join are issued in the same
    order on every stage (check_collective_order). Without one, no stage runs S or T."""
    if not has_vocab_parallel(schedules):
        for s, actions in enumerate(schedules):
            if any(a.op in VOCAB_OPS for a in actions):
                _fail(s, "vocabulary-parallel actions while the last stage runs none", [a for a in actions
                                                                                        if a.op in VOCAB_OPS])
        return
    expected = {(t, j) for t in range(num_steps) for j in range(m)}
    for s, actions in enumerate(schedules):
        where = {(a.op, a.step, a.microbatch): (i, a) for i, a in enumerate(actions)}
        _check_once_per_microbatch(s, actions, VOCAB_OPS, expected)
        for t, j in sorted(expected):
            f, fa = where[(Op.FORWARD, t, j)]
            i, sa = where[(Op.VOCAB_FORWARD, t, j)]
            k, ta = where[(Op.VOCAB_BACKWARD, t, j)]
            b, _ = where[(Op.BACKWARD, t, j)]
            u, _ = where[(Op.UPDATE_START, t, -1)]
            if not f < i < k < b < u or not sa.version == ta.version == fa.version:
                _fail(s, f"S{t}.{j} and T{t}.{j} must run after F{t}.{j}, in that order, before B{t}.{j} and "
                      f"U0{t}, on F's version", [sa, ta])
    check_collective_order(schedules)


def _check_once_per_microbatch(s: int, actions: Sequence[Action], ops, expected: set[tuple[int, int]]) -> None:
    """Each of `ops` (the head's S/T, the embedding's E/G) runs exactly once per expected (t, j) on stage s."""
    for op in ops:
        counts = Counter((a.step, a.microbatch) for a in actions if a.op is op)
        wrong = sorted(f"{op.value}{t}.{j} x{counts[(t, j)]}" for t, j in expected | counts.keys()
                       if counts[(t, j)] != 1 or (t, j) not in expected)
        if wrong:
            _fail(s, f"{op.name} must run once per microbatch", wrong)


EMBED_OPS = (Op.EMBED_FORWARD, Op.EMBED_BACKWARD)


def has_sharded_embedding(schedules: Sequence[Sequence[Action]]) -> bool:
    """Whether the input embedding is sharded over the stages (the first stage's list holds EMBED_FORWARD)."""
    return bool(schedules) and any(a.op is Op.EMBED_FORWARD for a in schedules[0])


def _check_embed(schedules: Sequence[Sequence[Action]], num_steps: int, m: int) -> None:
    """A sharded embedding: every stage runs exactly one E and one G per (t, j), E on F(t, j)'s version (one version
    per microbatch across all shards, semantics.md) and before the stage's own F(t, j) (the first stage's F needs
    every E; a later stage's F follows the first's), G after the first stage's B(t, j) (on the first stage: after
    its own) and before the stage's UPDATE(t) (its rows' gradient belongs to b_t); E and G each in one microbatch
    order on every stage (check_collective_order). Without one, no stage runs E or G."""
    if not has_sharded_embedding(schedules):
        for s, actions in enumerate(schedules):
            if any(a.op in EMBED_OPS for a in actions):
                _fail(s, "embedding actions while the first stage runs none", [a for a in actions if a.op in EMBED_OPS])
        return
    expected = {(t, j) for t in range(num_steps) for j in range(m)}
    for s, actions in enumerate(schedules):
        where = {(a.op, a.step, a.microbatch): (i, a) for i, a in enumerate(actions)}
        _check_once_per_microbatch(s, actions, EMBED_OPS, expected)
        for t, j in sorted(expected):
            f, fa = where[(Op.FORWARD, t, j)]
            e, ea = where[(Op.EMBED_FORWARD, t, j)]
            g, ga = where[(Op.EMBED_BACKWARD, t, j)]
            b, _ = where[(Op.BACKWARD, t, j)]
            u, _ = where[(Op.UPDATE, t, -1)]
            if not e < f or not g < u or (s == 0 and not b < g) or not ea.version == ga.version == fa.version:
                _fail(s, f"E{t}.{j} must run before F{t}.{j} and G{t}.{j} before U{t} (on the first stage after "
                      f"B{t}.{j}), on F's version", [ea, ga])
    check_collective_order(schedules, EMBED_OPS)


def check_collective_order(schedules: Sequence[Sequence[Action]], ops: Sequence[Op] = VOCAB_OPS) -> None:
    """The head's collectives (the broadcast and statistics' all-reduce of S, the reduce of T), and a sharded
    embedding's (the reduce of E, the broadcast G joins) each have a communicator of their own, and a
    communicator's collectives must be issued in one order on every rank (NCCL): every stage runs its S actions in
    the same microbatch order, and its T, E and G actions too."""
    for op in ops:
        first = [(a.step, a.microbatch) for a in schedules[0] if a.op is op]
        for s, actions in enumerate(schedules[1:], start=1):
            order = [(a.step, a.microbatch) for a in actions if a.op is op]
            if order != first:
                k = next((n for n, (x, y) in enumerate(zip(first, order)) if x != y), min(len(first), len(order)))
                raise ScheduleError(f"{op.name} collectives out of order: stage {s} issues #{k} as "
                                    f"{order[k:k + 1]} but stage 0 as {first[k:k + 1]}")


def _check_ready(stage: int, actions: Sequence[Action], m: int) -> None:
    """F/B/H on v >= 1 after UPDATE(v-1); UPDATE_START(t) after all B of b_t; UPDATE(t) after it."""
    newest, backwards, started = 0, Counter[int](), set[int]()
    for i, a in enumerate(actions):
        if a.op in (Op.FORWARD, Op.BACKWARD, *VOCAB_OPS, *EMBED_OPS) and a.version > newest:
            _fail(stage, f"action #{i} runs on a version not produced yet (newest is v{newest})", [a])
        if a.op is Op.BACKWARD:
            backwards[a.step] += 1
        elif a.op is Op.UPDATE_START:
            if backwards[a.step] != m:
                _fail(
                    stage, f"action #{i} before all {m} backwards of its step ({backwards[a.step]} ran)", [a]
                )
            started.add(a.step)
        elif a.op is Op.UPDATE:
            if a.step not in started:
                _fail(stage, f"action #{i} before its UPDATE_START", [a])
            newest = a.version


def _check_versions(
    schedules: Sequence[Sequence[Action]], step_delays: Sequence[Sequence[int]] | None
) -> None:
    """F and B of b_t use one version per stage: the delay's, or the same on every stage."""
    per_step: dict[int, dict[int, int]] = defaultdict(dict)
    for s, actions in enumerate(schedules):
        for a in actions:
            if a.op not in (Op.FORWARD, Op.BACKWARD):
                continue
            first = per_step[a.step].setdefault(s, a.version)
            if step_delays is not None:
                d = step_delays[s][a.step]
                if a.version != version_of(a.step, d):
                    _fail(s, f"b{a.step} must run on v{version_of(a.step, d)} (delay {d})", [a])
            elif a.version != first:
                _fail(s, f"b{a.step} runs on more than one version (first v{first})", [a])
    if step_delays is None:
        mixed = [f"b{t}: {dict(v)}" for t, v in sorted(per_step.items()) if len(set(v.values())) > 1]
        if mixed:
            raise ScheduleError(
                f"stages disagree on the version of a minibatch (stage: version): {mixed[:_MAX_LISTED]}"
            )


def versions_held(actions: Sequence[Action]) -> list[int]:
    """After each action: how many weight versions the stage must keep (see the module docstring)."""
    last_use: dict[int, int] = {}
    for i, a in enumerate(actions):
        if a.op is Op.BACKWARD:
            last_use[a.version] = i
    newest, out = 0, []
    for i, a in enumerate(actions):
        if a.op is Op.UPDATE:
            newest = a.version
        out.append(1 + sum(1 for v, last in last_use.items() if v < newest and last > i))
    return out


def peak_versions(actions: Sequence[Action]) -> int:
    return max(versions_held(actions), default=1)


def in_flight_after(actions: Sequence[Action]) -> list[int]:
    """After each action: the microbatches whose FORWARD ran and BACKWARD has not (stashed activations). The one
    count of them: the peak below, and the memory plan's walk over a stage's actions (core/memory.py)."""
    live, after = 0, []
    for a in actions:
        live += (a.op is Op.FORWARD) - (a.op is Op.BACKWARD)
        after.append(live)
    return after


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Most microbatches in flight at once (in_flight_after's peak)."""
    return max(in_flight_after(actions), default=0)


def _check_version_bound(schedules: Sequence[Sequence[Action]], max_versions: int | Sequence[int]) -> None:
    for s, actions in enumerate(schedules):
        bound = max_versions if isinstance(max_versions, int) else max_versions[s]
        held = versions_held(actions)
        over = [f"#{i} {actions[i]} holds {n}" for i, n in enumerate(held) if n > bound]
        if over:
            _fail(s, f"more than {bound} weight versions held", over)


def _positions(schedules: Sequence[Sequence[Action]]) -> list[dict[tuple[Op, int, int], int]]:
    return [{(a.op, a.step, a.microbatch): i for i, a in enumerate(actions)} for actions in schedules]


def dependencies(
    schedules: Sequence[Sequence[Action]], *, collective_updates: bool = True
) -> dict[Node, list[Node]]:
    """Cross-stage producers of each action (a stage's own list order is implied, not listed).

    F(t,j) at s > 0 needs F(t,j) at s-1 (activation); B(t,j) at s < P-1 needs B(t,j) at s+1
    (gradient); with collective_updates, UPDATE(t) needs UPDATE_START(t) on every other stage.
    A vocabulary-parallel head: S(t,j) on a stage s < P-1 needs F(t,j) at P-1 (the broadcast hidden states);
    T(t,j) needs S(t,j) on every stage (the statistics' all-reduce); B(t,j) at P-1 needs T(t,j) on every stage
    (the reduce of the input gradient). The collectives' own stage is listed too: the wait is for all.
    A sharded embedding: F(t,j) at 0 needs E(t,j) on every stage (the reduce of the partial embeddings); G(t,j) at
    s > 0 needs B(t,j) at 0 (the broadcast of the embedding gradient); a stage's reductions of step t start at its
    UPDATE_START(t) or its last G of step t, whichever is later, so with collective_updates UPDATE(t) also needs
    every other stage's G of step t.
    A producer that does not exist maps to (stage, -1): it never runs.
    """
    pos, last = _positions(schedules), len(schedules) - 1
    vocab = has_vocab_parallel(schedules)
    embed = has_sharded_embedding(schedules)
    everyone = range(len(schedules))
    last_g: list[dict[int, int]] = [{} for _ in schedules]  # stage -> step -> position of its last G of the step
    for s, actions in enumerate(schedules):
        for i, a in enumerate(actions):
            if a.op is Op.EMBED_BACKWARD:
                last_g[s][a.step] = max(i, last_g[s].get(a.step, -1))
    deps: dict[Node, list[Node]] = {}
    for s, actions in enumerate(schedules):
        for i, a in enumerate(actions):
            key = (a.op, a.step, a.microbatch)
            if a.op is Op.FORWARD and s == 0 and embed:
                deps[(s, i)] = [(r, pos[r].get((Op.EMBED_FORWARD, a.step, a.microbatch), -1)) for r in everyone]
            elif a.op is Op.EMBED_BACKWARD and s > 0:
                deps[(s, i)] = [(0, pos[0].get((Op.BACKWARD, a.step, a.microbatch), -1))]
            elif a.op is Op.UPDATE and collective_updates and embed:
                start = (Op.UPDATE_START, a.step, -1)
                deps[(s, i)] = [(r, pos[r].get(start, -1)) for r in everyone if r != s] + [
                    (r, last_g[r].get(a.step, -1)) for r in everyone if r != s]
            elif a.op is Op.VOCAB_FORWARD and s < last:
                deps[(s, i)] = [(last, pos[last].get((Op.FORWARD, a.step, a.microbatch), -1))]
            elif a.op is Op.VOCAB_BACKWARD:
                deps[(s, i)] = [(r, pos[r].get((Op.VOCAB_FORWARD, a.step, a.microbatch), -1)) for r in everyone]
            elif a.op is Op.BACKWARD and s == last and vocab:
                deps[(s, i)] = [(r, pos[r].get((Op.VOCAB_BACKWARD, a.step, a.microbatch), -1)) for r in everyone]
            elif a.op is Op.FORWARD and s > 0:
                deps[(s, i)] = [(s - 1, pos[s - 1].get(key, -1))]
            elif a.op is Op.BACKWARD and s < last:
                deps[(s, i)] = [(s + 1, pos[s + 1].get(key, -1))]
            elif a.op is Op.UPDATE and collective_updates:
                start = (Op.UPDATE_START, a.step, -1)
                deps[(s, i)] = [(r, pos[r].get(start, -1)) for r in range(len(schedules)) if r != s]
    return deps


def execution_order(schedules: Sequence[Sequence[Action]], *, collective_updates: bool = True) -> list[Node]:
    """Run every stage's list in order over unbounded buffered channels; raise DeadlockError if stuck."""
    deps = dependencies(schedules, collective_updates=collective_updates)
    done = [0] * len(schedules)  # done[s]: actions of stage s executed so far

    def ready(node: Node) -> bool:
        return all(i >= 0 and done[r] > i for r, i in deps.get(node, ()))

    order: list[Node] = []
    progress = True
    while progress:
        progress = False
        for s, actions in enumerate(schedules):
            while done[s] < len(actions) and ready((s, done[s])):
                order.append((s, done[s]))
                done[s] += 1
                progress = True
    stuck = [
        _describe_stuck(schedules, deps, s, done)
        for s in range(len(schedules))
        if done[s] < len(schedules[s])
    ]
    if stuck:
        raise DeadlockError("deadlock: " + "; ".join(stuck))
    return order


def _describe_stuck(
    schedules: Sequence[Sequence[Action]], deps: dict[Node, list[Node]], s: int, done: list[int]
) -> str:
    i = done[s]
    waits = [
        f"stage {r} {schedules[r][j]} (#{j})" if j >= 0 else f"stage {r} (action missing)"
        for r, j in deps.get((s, i), ())
        if j < 0 or done[r] <= j
    ]
    return f"stage {s} stuck at #{i} {schedules[s][i]} waiting for {', '.join(waits)}"


def _channels(schedules: Sequence[Sequence[Action]]) -> list[tuple[int, Op, int, Op, str]]:
    """Every p2p channel as (sender, the op that sends, receiver, the op that receives, what it carries)."""
    out = []
    for s in range(len(schedules) - 1):
        out += [(s, Op.FORWARD, s + 1, Op.FORWARD, "activation"), (s + 1, Op.BACKWARD, s, Op.BACKWARD, "gradient")]
    return out


def check_fifo(schedules: Sequence[Sequence[Action]]) -> None:
    """Each p2p channel delivers in send order, so the receiver must consume in that order too."""
    for src, op, dst, use, what in _channels(schedules):
        sent = [(a.step, a.microbatch) for a in schedules[src] if a.op is op]
        used = [(a.step, a.microbatch) for a in schedules[dst] if a.op is use]
        for k, (x, y) in enumerate(zip(sent, used)):
            if x != y:
                raise ScheduleError(
                    f"{what} channel stage {src} -> {dst} is FIFO: message #{k} sent is b{x[0]}.{x[1]} "
                    f"but stage {dst} consumes b{y[0]}.{y[1]} there"
                )
