"""Which actions one forward_backward_func call runs when the stages also run a vocabulary-parallel head's S and T
(and a sharded embedding's E and G): the Megatron front-end's per-call windows (megatron.py's window_2bw) for the
placed stream asyncpp's own pipeline runs (core/vocab_split.vocab_pipeline).

The stream. One continuous 2BW stream, every stage's list built by vocab_pipeline: the skeleton with one more
warm-up forward and the head's (and embedding's) passes placed by the cost model, the same placement on every rank
(deterministic), so the collectives of each vocabulary group are issued in the same order on every member. A call
builds only a short horizon of it, the steps [max(k-2, stream start), k+2] as a drained stream: in the steady state
the placement is periodic (the section of call k of such a horizon equals the unbounded stream's; tested), and
what the horizon holds before call k's section ran in earlier calls (`done`).

The calls. Call k must run every stage's F(k, *) (the forwards read b_k from this call's data_iterator) and nothing
of a later step (the loop may drain after it: nothing of b_{k+1} may then be in flight). `assign_calls` starts from
the stream cut plainly before each F(k+1, 0) (`_sections`: the 2BW overlap of b_k's backwards with b_{k+1}'s
forwards kept across the calls, as megatron.window_2bw keeps it) and, while an action waits for one that runs in a
later call, runs that producer in the waiter's call instead (and, in turn, what it waits for). The waits:
- on other stages, the producers of schedules/invariants.dependencies (the activation and gradient links, the
  hidden states' broadcast, the statistics' all-gather, the input gradient's reduce, the partial embeddings' reduce,
  the embedding gradient's broadcast, the updates' reductions);
- the other receivers of the same broadcast (the hidden states' S on every stage but the last, the embedding
  gradient's G on every stage but the first: `_joins`): a broadcast may complete on a member only once the members
  relaying to it joined (a tree). Without it a P=4 run with the embedding sharded hung: stage 3's G(0, 0), in call
  0, waited for stages 1 and 2, whose G(0, 0) were in call 1 behind F(1, 0), which waited for stage 3's E(1, 0);
- on its own stage: the previous action of the same kind (so each communicator and each link sees a stage's ops in
  the stream's order, the same on every member), the forward of its microbatch (for B, S, T, G), the update that
  made its weight version, every microbatch action of its step (for UPDATE_START(t)), and for UPDATE(t) its
  UPDATE_START(t) and every action that reads the version it overwrites (x_{t-1}: two versions).
The last stage's T of b_k runs in call k too (it reports the microbatch's loss: call k returns b_k's m losses).
This is needed: at P=4 the placement runs the first stage's S of b_k after its F(k+1, 0), and another stage's T
of b_k, before its own last forward of b_k, waits for them; they run in call k. Then an action of b_{k+1} placed
before the cut (a sharded embedding's E(k+1, j), looked up ahead) moves to call k+1. A stage's list of call k is
its stream's actions of call k, in stream order. `assign_calls` refuses (RuntimeError) a stream where a forward
would have to leave its call or a wait would still cross into a later call.

Deadlock freedom. Every wait of call k then has its counterpart in call k or earlier on every stage, so the calls
can be separated by anything a training loop does between them (a barrier, a loss all-reduce) and each call
completes; the concatenated lists (the placed stream up to those moves) pass schedules/invariants.check_schedules:
complete, one version per microbatch, deadlock-free, FIFO links (tests/unit/test_vocab_windows.py; the NCCL
replay once the runtime runs them).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from asyncpp.core.vocab_split import VocabSplit, vocab_pipeline
from asyncpp.pipeline.executor import absolute_steps
from asyncpp.schedules.actions import MICROBATCH_OPS, Action, Op
from asyncpp.schedules.costmodel import VocabPlacement
from asyncpp.schedules.invariants import dependencies

DONE_CALLS = 3
"""How many of the latest calls' actions a window (calls k-2, k-1) and the drain after call K (calls K-2..K) must be
given as `done`: their horizons start at step k-2 (K-2), and an action of step t runs in call t or later."""


def vocab_stream(kind: str, m: int, split: VocabSplit, placement: VocabPlacement, first: int, last: int
                 ) -> list[list[Action]]:
    """Every stage's actions of steps [first, last] as a 2BW stream drained at both ends (each step on x_{t-1}),
    in absolute step and version numbers."""
    delays = [1] * (last + 1)
    return [absolute_steps(actions, delays, first)
            for actions in vocab_pipeline(kind, m, delays[first:], split, placement)]


def _same_stage_needs(actions: Sequence[Action]) -> list[list[int]]:
    """Per action, the indices of the actions of its own stage it waits for (the module docstring's list)."""
    where = {(a.op, a.step, a.microbatch): i for i, a in enumerate(actions)}
    previous: dict[Op, int] = {}
    needs: list[list[int]] = []
    for i, a in enumerate(actions):
        mine = [previous[a.op]] if a.op in previous else []
        previous[a.op] = i
        if a.op in MICROBATCH_OPS:
            if a.op is not Op.FORWARD:
                mine.append(where.get((Op.FORWARD, a.step, a.microbatch), -1))
            if a.version > 0:
                mine.append(where.get((Op.UPDATE, a.version - 1, -1), -1))
        elif a.op is Op.UPDATE_START:
            mine += [j for j, b in enumerate(actions) if b.op in MICROBATCH_OPS and b.step == a.step]
        elif a.op is Op.UPDATE:
            mine.append(where.get((Op.UPDATE_START, a.step, -1), -1))
            mine += [j for j, b in enumerate(actions) if b.op in MICROBATCH_OPS and b.version <= a.step - 1]
        needs.append([j for j in mine if j >= 0])
    return needs


def _sections(actions: Sequence[Action]) -> list[int]:
    """The stream cut plainly into calls: call k from just after the last microbatch action before F(k, 0) (the
    updates in between open call k, as in megatron.window_2bw) to the same place before F(k+1, 0)."""
    out, k = [0] * len(actions), actions[0].step
    pending: list[int] = []
    for i, a in enumerate(actions):
        if a.op not in MICROBATCH_OPS:
            pending.append(i)
            continue
        if a.op is Op.FORWARD and a.microbatch == 0:
            k = a.step
        for j in pending + [i]:
            out[j] = k
        pending = []
    for j in pending:
        out[j] = k
    return out


def _joins(stages: Sequence[Sequence[Action]]) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """The receivers of one broadcast, each listed as waiting for the others: the hidden states' (S(t, j) on every
    stage but the last) and the embedding gradient's (G(t, j) on every stage but the first). A broadcast may complete
    on a member only once the members relaying to it joined (a tree), so they must share a call."""
    last = len(stages) - 1
    where = [{(a.op, a.step, a.microbatch): i for i, a in enumerate(actions)} for actions in stages]
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for op, receivers in ((Op.VOCAB_FORWARD, range(last)), (Op.EMBED_BACKWARD, range(1, last + 1))):
        keys = {(a.step, a.microbatch) for s in receivers for a in stages[s] if a.op is op}
        for step, mb in keys:
            nodes = [(s, where[s][(op, step, mb)]) for s in receivers if (op, step, mb) in where[s]]
            for node in nodes:
                out[node] = [n for n in nodes if n != node]
    return out


def assign_calls(stages: Sequence[Sequence[Action]]) -> list[list[int]]:
    """Per stage, the call each of its actions runs in (the module docstring's rule). A producer outside `stages`
    (before a horizon's start) counts as done. Waits within one call are the stream's own order, whose deadlock
    freedom is check_schedules' to prove."""
    cross = dependencies(stages, collective_updates=True)
    own = [_same_stage_needs(actions) for actions in stages]
    needs = {(s, i): [(s, j) for j in own[s][i]] + [(r, j) for r, j in cross.get((s, i), ()) if j >= 0]
             for s, actions in enumerate(stages) for i in range(len(actions))}
    for node, members in _joins(stages).items():  # a broadcast's receivers: one call for all (see _joins)
        needs[node] += members
    calls = [_sections(actions) for actions in stages]
    # The last stage's T(k, j) reports (k, j)'s loss: in call k, so that call returns b_k's m losses as Megatron's
    # forward_data_store (a pull like any other: what it waits for follows it into call k).
    calls[-1] = [min(k, a.step) if a.op is Op.VOCAB_BACKWARD else k for a, k in zip(stages[-1], calls[-1])]
    changed = True
    while changed:  # pull every producer into its waiter's call (calls only decrease: it ends)
        changed = False
        for (s, i), producers in needs.items():
            for r, j in producers:
                if calls[r][j] > calls[s][i]:
                    calls[r][j], changed = calls[s][i], True
    for s, actions in enumerate(stages):  # nothing runs before its step's call (a sharded embedding's E of b_{k+1})
        calls[s] = [max(k, a.step) for a, k in zip(actions, calls[s])]
    for (s, i), producers in needs.items():
        a = stages[s][i]
        if a.op is Op.FORWARD and calls[s][i] != a.step:
            raise RuntimeError(f"stage {s}: {a} cannot run in call {a.step}: an action of an earlier call waits for "
                               "it (the placement's waits cross the calls' forwards)")
        late = [(r, j) for r, j in producers if calls[r][j] > calls[s][i]]
        if late:
            r, j = late[0]
            raise RuntimeError(f"stage {s}: {a} in call {calls[s][i]} waits for stage {r}'s {stages[r][j]} in call "
                               f"{calls[r][j]}: the placement's waits cross the calls")
    return calls


@functools.lru_cache(maxsize=16)
def _horizon_calls(kind: str, m: int, split: VocabSplit, placement: VocabPlacement, first: int, step: int
                   ) -> tuple[tuple[Action, ...], ...]:
    """Per stage, the actions of the horizon [first, step + 2] that run in call `step` or earlier, in stream order."""
    stages = vocab_stream(kind, m, split, placement, first, step + 2)
    return tuple(tuple(a for a, k in zip(actions, calls) if k <= step)
                 for actions, calls in zip(stages, assign_calls(stages)))


def _shifted(a: Action, by: int) -> Action:
    version = a.version + by if a.op in MICROBATCH_OPS or a.op is Op.UPDATE else a.version
    return dataclasses.replace(a, step=a.step + by, version=version)


def window_2bw_vocab(kind: str, stage: int, m: int, split: VocabSplit, placement: VocabPlacement, step: int,
                     stream_start: int, done: set[Action]) -> list[Action]:
    """The actions of call `step` on `stage` in a stream started (drained) at `stream_start`; `done` holds at least
    the actions of the latest DONE_CALLS calls.

    Cached: a horizon starting at step first >= 1 is the one starting at step 1 shifted by first - 1 (every step and
    weight version; versions are clipped at 0 only in a horizon holding step 0), so the steady state places one
    horizon per (kind, m, split, placement) instead of one per call (at P=16, 1.5 s per call)."""
    first = max(step - 2, stream_start)
    base = min(first, 1)
    placed = _horizon_calls(kind, m, split, placement, base, base + step - first)[stage]
    return [a for a in (_shifted(a, first - base) for a in placed) if a not in done]
def drain_2bw_vocab(kind: str, stage: int, m: int, split: VocabSplit, placement: VocabPlacement, last_step: int,
                    stream_start: int, done: set[Action]) -> list[Action]:
    """The cool-down after call `last_step`: the rest of the stream truncated there (placed as a drained stream)."""
    stages = vocab_stream(kind, m, split, placement, max(last_step - 2, stream_start), last_step)
    return [a for a in stages[stage] if a not in done]
