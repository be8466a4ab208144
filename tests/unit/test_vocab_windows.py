"""The Megatron front-end's per-call windows of a stream with a vocabulary-parallel head (and a sharded embedding):
asyncpp/pipeline/vocab_windows.py, checked on the schedules alone (no processes).

Calls 0..K-1 of one 2BW stream, then the drain, as the front-end would run them: every action of the stream runs
exactly once, b_k's forwards all in call k on every stage, every wait's counterpart in the same or an earlier call
(so calls separated by a barrier cannot deadlock), the concatenation is the placed stream asyncpp's own pipeline
runs up to the drain, and it passes check_schedules (complete, one version per microbatch, deadlock-free, FIFO)."""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque

import pytest

from asyncpp.core.vocab_split import VocabSplit, vocab_placement
from asyncpp.pipeline.vocab_windows import (
    DONE_CALLS,
    assign_calls,
    drain_2bw_vocab,
    vocab_stream,
    window_2bw_vocab,
)
from asyncpp.schedules.actions import Op
from asyncpp.schedules.invariants import check_schedules, dependencies


def split_of(P: int, embed: bool) -> VocabSplit:
    """A head and embedding cost like a small model's: stages of unequal bodies (the last one heaviest)."""
    return VocabSplit(sizes=(2,) * P, shards=(32,) * P, compute=tuple(10.0 + 2 * s for s in range(P)),
                      head=(3.0,) * P, comm=0.0, overlap="none", embed=(1.0,) * P if embed else (),
                      embed_lookup=0.3 if embed else 0.0)


def run_calls(P: int, m: int, embed: bool, calls: int, start: int = 0) -> tuple[list[list[list]], object]:
    """Per stage, the actions of each call start..start+calls-1 and of the drain (the last entry)."""
    split = split_of(P, embed)
    placement = vocab_placement("2bw", m, split)
    per_stage = []
    for s in range(P):
        windows, recent = [], deque(maxlen=DONE_CALLS)
        for k in range(start, start + calls):
            window = window_2bw_vocab("2bw", s, m, split, placement, k, start, set().union(*recent))
            windows.append(window)
            recent.append(set(window))
        windows.append(drain_2bw_vocab("2bw", s, m, split, placement, start + calls - 1, start, set().union(*recent)))
        per_stage.append(windows)
    return per_stage, (split, placement)


CASES = [(2, 2, False), (2, 4, False), (2, 4, True), (4, 4, False), (4, 4, True), (4, 6, True),
         pytest.param(8, 8, True, marks=pytest.mark.slow)]  # P=8: a placement per horizon and stage, ~30 s


@pytest.mark.parametrize("P,m,embed", CASES)
def test_calls_run_the_placed_stream_once_and_cannot_deadlock_across_calls(P, m, embed):
    calls = 6
    per_stage, (split, placement) = run_calls(P, m, embed, calls)
    stream = [list(itertools.chain.from_iterable(windows)) for windows in per_stage]
    full = vocab_stream("2bw", m, split, placement, 0, calls - 1)
    assert any(a.op is Op.VOCAB_FORWARD for a in stream[0]) and (
        any(a.op is Op.EMBED_FORWARD for a in stream[-1]) == embed)  # the head's (and embedding's) passes ran
    for s in range(P):
        assert len(stream[s]) == len(set(stream[s])), f"stage {s} runs an action twice"
        assert set(stream[s]) == set(full[s]), f"stage {s}: {set(full[s]) ^ set(stream[s])}"
        for k in range(calls):
            forwards = {(a.step, a.microbatch) for a in per_stage[s][k] if a.op is Op.FORWARD}
            assert {(k, j) for j in range(m)} <= forwards and {t for t, _ in forwards} == {k}, (s, k)
        # the last stage reports b_k's losses (its T's) in call k
        losses = [{a.microbatch for a in per_stage[-1][k] if a.op is Op.VOCAB_BACKWARD and a.step == k}
                  for k in range(calls)]
        assert losses == [set(range(m))] * calls
        # each call's window, from its short horizon, is that call's part of the whole stream's assignment
        longer = vocab_stream("2bw", m, split, placement, 0, calls + 2)
        whole = assign_calls(longer)[s]
        for k in range(calls):
            assert per_stage[s][k] == [a for a, c in zip(longer[s], whole) if c == k], (s, k)
    call_of = [[k for k, w in enumerate(windows) for _ in w] for windows in per_stage]
    # a broadcast's receivers share a call (vocab_windows._joins): the hidden states' S on every stage but the last,
    # the embedding gradient's G on every stage but the first
    for op, receivers in ((Op.VOCAB_FORWARD, range(P - 1)), (Op.EMBED_BACKWARD, range(1, P))):
        joined: dict[tuple[int, int], set[int]] = {}
        for s in receivers:
            for a, k in zip(stream[s], call_of[s]):
                if a.op is op:
                    joined.setdefault((a.step, a.microbatch), set()).add(k)
        assert all(len(ks) == 1 for ks in joined.values()), (op, joined)
    for (s, i), producers in dependencies(stream, collective_updates=True).items():
        for r, j in producers:
            assert j >= 0 and call_of[r][j] <= call_of[s][i], (
                f"stage {s} {stream[s][i]} in call {call_of[s][i]} waits for stage {r} {stream[r][j]} in call "
                f"{call_of[r][j]}")
    check_schedules(stream, m, max_versions=2)  # 2BW's two weight versions suffice after the reassignment


def test_a_stream_started_later_has_the_same_windows_shifted():
    """After a drain the stream restarts at its step: the windows are those of a stream started at 0, shifted."""
    P, m = 4, 4
    at_zero, _ = run_calls(P, m, True, 4)
    at_five, _ = run_calls(P, m, True, 4, start=5)
    for s in range(P):
        for a, b in zip(at_zero[s], at_five[s]):
            assert [(x.op, x.step + 5, x.microbatch) for x in a] == [(x.op, x.step, x.microbatch) for x in b]


def test_a_stream_whose_forward_waits_for_a_later_call_is_refused():
    """assign_calls refuses a stream in which a forward cannot run in its call: here the last stage's F(1, 0) reads
    x_3, made by UPDATE(2), which waits for b_2's actions (call 2 at the earliest)."""
    P, m = 2, 2
    split = split_of(P, False)
    first, last = vocab_stream("2bw", m, split, vocab_placement("2bw", m, split), 0, 3)
    assign_calls([first, last])  # the placed stream itself is assigned
    bad = [dataclasses.replace(a, version=3) if (a.op, a.step, a.microbatch) == (Op.FORWARD, 1, 0) else a
           for a in last]
    with pytest.raises(RuntimeError, match=r"F1.0@v3 in call 1 waits for stage 1.s U2 in call 2"):
        assign_calls([first, bad])


def test_the_placed_streams_own_sections_would_wait_across_calls():
    """Why the calls are assigned per action: cut plainly before each F(k+1, 0), the placed stream at P=4 has a stage
    whose call k waits for the first stage's S of b_k, which the placement puts after the first stage's F(k+1, 0),
    in its call k+1; the assignment runs that S in call k (and so reorders the first stage's list)."""
    P, m = 4, 4
    split = split_of(P, False)
    stages = vocab_stream("2bw", m, split, vocab_placement("2bw", m, split), 0, 4)
    sections = []
    for actions in stages:
        k, mine = -1, []
        for a in actions:
            k += a.op is Op.FORWARD and a.microbatch == 0
            mine.append(k)
        sections.append(mine)
    crossing = [(stages[s][i], stages[r][j]) for (s, i), producers in dependencies(stages).items()
                for r, j in producers if j >= 0 and sections[r][j] > sections[s][i]]
    assert any(w.op is Op.VOCAB_BACKWARD and p.op is Op.VOCAB_FORWARD for w, p in crossing), crossing
    calls = assign_calls(stages)
    reordered = [a for a, c, k in zip(stages[0], calls[0], sections[0]) if c < k]
    assert reordered and all(a.op is Op.VOCAB_FORWARD or a.op is Op.VOCAB_BACKWARD for a in reordered), reordered


@pytest.mark.parametrize("P,m,embed", [(2, 4, False), (4, 4, True)])
def test_the_cached_window_is_the_placed_horizon_of_its_call(P, m, embed):
    """window_2bw_vocab places one horizon per shape and shifts it; here every call's window against its own
    horizon placed afresh (vocab_stream + assign_calls), streams started at 0 and later."""
    split = split_of(P, embed)
    placement = vocab_placement("2bw", m, split)
    for start in (0, 3):
        for step in range(start, start + 6):
            stages = vocab_stream("2bw", m, split, placement, max(step - 2, start), step + 2)
            calls = assign_calls(stages)
            for s in range(P):
                fresh = [a for a, k in zip(stages[s], calls[s]) if k <= step]
                cached = window_2bw_vocab("2bw", s, m, split, placement, step, start, set())
                assert cached == fresh, (start, step, s)
                assert any(a.op is Op.FORWARD and a.step == step for a in cached)  # the call's own forwards
