"""A seeded pairwise covering array: every pair of values of two dimensions appears in at least one case.

Two builders. covering_array() covers every pair regardless of what a validator says. accepted_greedy() covers
every pair that a case the validator accepts can hold (one refusal would hide every other pair of its case):
each case is grown like covering_array's, repaired toward the defaults until accepted, and hill-climbed toward
more uncovered pairs; a pair no accepted case was found for is reported with a refused case holding it.
(The first version drew a pool of 800 random cases and took a set cover of the accepted ones: 61 cases for
this space, against 28.)

Greedy, in the manner of AETG (Cohen et al., 1997): each new case starts from an uncovered pair and fills the
other dimensions one at a time with the value that covers the most pairs still uncovered (ties broken by a
seeded generator); of a few such candidates the one that covers the most is kept. Deterministic for a seed.
`feasible(partial case)` prunes cases the machine cannot run (the test suite's: at most 4 ranks); a pair no
feasible case can hold is reported as excluded, not covered.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

Case = dict[str, object]
Pair = tuple[str, object, str, object]


def all_pairs(dims: Mapping[str, Sequence]) -> list[Pair]:
    names = list(dims)
    return [(a, va, b, vb) for a, b in itertools.combinations(names, 2) for va in dims[a] for vb in dims[b]]


def pairs_of(case: Case, dims: Mapping[str, Sequence]) -> set[Pair]:
    names = list(dims)
    return {(a, case[a], b, case[b]) for a, b in itertools.combinations(names, 2)}


def _completes(partial: Case, dims: Mapping[str, Sequence], feasible: Callable[[Case], bool]) -> bool:
    """Whether some feasible case extends `partial` (depth-first over the unset dimensions, feasible() pruning
    partial cases: it must accept a partial case that some completion makes feasible)."""
    if not feasible(partial):
        return False
    rest = [d for d in dims if d not in partial]
    if not rest:
        return True
    return any(_completes({**partial, rest[0]: v}, dims, feasible) for v in dims[rest[0]])


def coverable(dims: Mapping[str, Sequence], feasible: Callable[[Case], bool]) -> tuple[list[Pair], list[Pair]]:
    """(the pairs some feasible case holds, the pairs none can)."""
    ok, excluded = [], []
    for a, va, b, vb in all_pairs(dims):
        (ok if _completes({a: va, b: vb}, dims, feasible) else excluded).append((a, va, b, vb))
    return ok, excluded


def covering_array(dims: Mapping[str, Sequence], seed: int, feasible: Callable[[Case], bool] = lambda c: True,
                   candidates: int = 8) -> list[Case]:
    rng = random.Random(seed)
    todo = set(coverable(dims, feasible)[0])
    cases: list[Case] = []
    while todo:
        best, best_gain = None, -1
        start = sorted(todo, key=repr)  # a set's order is not seeded: start from a sorted, then shuffled, list
        rng.shuffle(start)
        for a, va, b, vb in start[:candidates]:
            case = _grow({a: va, b: vb}, dims, todo, feasible, rng)
            gain = len(pairs_of(case, dims) & todo)
            if gain > best_gain:
                best, best_gain = case, gain
        cases.append(best)
        todo -= pairs_of(best, dims)
    return cases


def _pair(dims: Mapping[str, Sequence], a: str, va: object, b: str, vb: object) -> Pair:
    """The pair in all_pairs' orientation (its dimensions in `dims` order)."""
    names = list(dims)
    return (a, va, b, vb) if names.index(a) < names.index(b) else (b, vb, a, va)


def _grow(case: Case, dims: Mapping[str, Sequence], todo: set[Pair], feasible, rng: random.Random) -> Case:
    order = [d for d in dims if d not in case]
    rng.shuffle(order)
    for d in order:
        scored = []
        for v in dims[d]:
            trial = {**case, d: v}
            if not _completes(trial, dims, feasible):
                continue
            gain = sum(_pair(dims, d, v, o, trial[o]) in todo for o in trial if o != d)
            scored.append((gain, rng.random(), v))
        case[d] = max(scored)[2]
    return {d: case[d] for d in dims}


@dataclass
class Cover:
    cases: list[Case]
    """Accepted cases; together they hold every pair of `covered`."""
    covered: set[Pair]
    refused: dict[Pair, Case]
    """Pairs no accepted case was found for (refused with every other dimension at its default, on every
    accepted case of the cover, and on every such case with one more dimension changed), each with that default
    completion (refused)."""
    excluded: list[Pair]
    """Pairs no feasible case can hold (the machine's limit)."""


def _first_completion(partial: Case, dims: Mapping[str, Sequence], feasible) -> Case:
    """The feasible case holding `partial` with each other dimension at its earliest value: the smallest change
    from the defaults, so a refusal of it is most likely the pair's own."""
    case = dict(partial)
    for d in dims:
        if d not in case:
            case[d] = next(v for v in dims[d] if _completes({**case, d: v}, dims, feasible))
    return {d: case[d] for d in dims}


def _repair(case: Case, keep: Sequence[str], dims: Mapping[str, Sequence], feasible, accepts,
            rng: random.Random) -> Case | None:
    """An accepted case near `case`, with the dimensions in `keep` unchanged: the others return to their first
    value (the defaults) one at a time in a seeded order until the validator accepts; None if even all of them
    at their defaults is refused."""
    if feasible(case) and accepts(case):
        return case
    order = [d for d in dims if d not in keep and case[d] != dims[d][0]]
    rng.shuffle(order)
    for d in order:
        trial = {**case, d: dims[d][0]}
        if not feasible(trial):
            continue
        case = trial
        if accepts(case):
            return case
    return None


def _one_change(case: Case, keep: Sequence[str], dims: Mapping[str, Sequence], feasible, accepts) -> Case | None:
    """An accepted case at most one dimension (not in `keep`) away from `case`, set to any of its values; None if
    there is none. _repair only walks toward the defaults, which can walk away from what a pair needs (ep=2 needs
    dp=2 and an MoE model, head=vocab needs pp >= 2; none of them is a default)."""
    if feasible(case) and accepts(case):
        return case
    trials = ({**case, d: v} for d in dims if d not in keep for v in dims[d] if v != case[d])
    return next((t for t in trials if feasible(t) and accepts(t)), None)


def _improve(case: Case, todo: set[Pair], dims: Mapping[str, Sequence], feasible, accepts,
             rng: random.Random) -> Case:
    """Hill-climb an accepted case: each dimension in a seeded order takes the value that covers the most pairs
    still to cover, among the values that keep it feasible and accepted."""
    order = list(dims)
    rng.shuffle(order)
    for d in order:
        best, best_gain = case, len(pairs_of(case, dims) & todo)
        for v in dims[d]:
            if v == case[d]:
                continue
            trial = {**case, d: v}
            gain = len(pairs_of(trial, dims) & todo)
            if gain > best_gain and feasible(trial) and accepts(trial):
                best, best_gain = trial, gain
        case = best
    return case


def accepted_greedy(dims: Mapping[str, Sequence], seed: int, feasible: Callable[[Case], bool],
                    accepts: Callable[[Case], bool], candidates: int = 4) -> Cover:
    """A pairwise cover of accepted cases built directly: each new case grows from a pair still to cover (AETG,
    as covering_array), is repaired toward the defaults until the validator accepts it, then hill-climbed
    toward more uncovered pairs; of `candidates` such cases the one covering the most is kept. A pair whose
    start cannot be repaired (refused even with every other dimension at its default) is checked on every
    accepted case so far, then recorded as refused with that default completion. Deterministic for a seed."""
    rng = random.Random(seed)
    ok, excluded = coverable(dims, feasible)
    todo, cases, refused = set(ok), [], {}
    while todo:
        start = sorted(todo, key=repr)
        rng.shuffle(start)
        best, best_gain = None, 0
        for a, va, b, vb in start[:candidates]:
            grown = _repair(_grow({a: va, b: vb}, dims, todo, feasible, rng), (a, b), dims, feasible, accepts, rng)
            if grown is None:
                on_background = next((c for c in ({**c, a: va, b: vb} for c in cases)
                                      if feasible(c) and accepts(c)), None)
                if on_background is None:
                    refused[(a, va, b, vb)] = _first_completion({a: va, b: vb}, dims, feasible)
                    todo.discard((a, va, b, vb))
                    continue
                grown = on_background
            grown = _improve(grown, todo, dims, feasible, accepts, rng)
            gain = len(pairs_of(grown, dims) & todo)
            if gain > best_gain:
                best, best_gain = grown, gain
        if best is not None:
            cases.append(best)
            todo -= pairs_of(best, dims)
    # A pair given up early (no accepted background yet held the other values it needs, e.g. an MoE model for
    # ep=2) gets a second try: on every case of the finished cover, repaired toward the defaults, then, failing
    # that, with one more dimension changed to any value (the pairs still refused after it cost the most: ~0.5 s
    # of validator calls each).
    covered = set().union(*(pairs_of(c, dims) for c in cases)) & set(ok)
    for a, va, b, vb in [p for p in ok if p in refused and p not in covered]:
        backgrounds = [{**c, a: va, b: vb} for c in cases]
        late = next((r for r in (_repair(c, (a, b), dims, feasible, accepts, rng) for c in backgrounds)
                     if r is not None), None)
        if late is None:
            late = next((r for r in (_one_change(c, (a, b), dims, feasible, accepts) for c in backgrounds)
                         if r is not None), None)
        if late is not None:
            cases.append(late)
            covered |= pairs_of(late, dims) & set(ok)
    refused = {p: refused[p] for p in ok if p in refused and p not in covered}
    return Cover(cases, covered, refused, excluded)
