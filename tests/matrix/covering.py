"""A seeded pairwise covering array: every pair of values of two dimensions appears in at least one case.

Two builders. covering_array() covers every pair regardless of what a validator says. accepted_cover() covers
every pair that some case the validator accepts can hold (one refusal would hide every other pair of its
case): a seeded pool of random cases, the accepted ones, a targeted search for each pair the pool missed,
then a greedy set cover; a pair no accepted case was found for is reported with a refused case holding it.

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
    """Pairs no accepted case was found for (on every accepted background of the pool, and in random
    completions), each with the case nearest the defaults that holds it (refused)."""
    excluded: list[Pair]
    """Pairs no feasible case can hold (the machine's limit)."""
    pool: int
    accepted_in_pool: int


def _random_case(dims: Mapping[str, Sequence], rng: random.Random, fixed: Case, feasible) -> Case | None:
    for _ in range(50):
        case = {d: fixed[d] if d in fixed else rng.choice(list(dims[d])) for d in dims}
        if feasible(case):
            return case
    return None


def _first_completion(partial: Case, dims: Mapping[str, Sequence], feasible) -> Case:
    """The feasible case holding `partial` with each other dimension at its earliest value: the smallest change
    from the defaults, so a refusal of it is most likely the pair's own."""
    case = dict(partial)
    for d in dims:
        if d not in case:
            case[d] = next(v for v in dims[d] if _completes({**case, d: v}, dims, feasible))
    return {d: case[d] for d in dims}


def accepted_cover(dims: Mapping[str, Sequence], seed: int, feasible: Callable[[Case], bool],
                   accepts: Callable[[Case], bool], pool: int = 2000, tries_per_pair: int = 100) -> Cover:
    rng = random.Random(seed)
    ok, excluded = coverable(dims, feasible)
    accepted, refused_example = [], {}
    for _ in range(pool):
        case = _random_case(dims, rng, {}, feasible)
        if case is not None and accepts(case):
            accepted.append(case)
    in_pool = len(accepted)
    reachable = set().union(*(pairs_of(c, dims) for c in accepted)) if accepted else set()
    backgrounds = list(accepted)
    for a, va, b, vb in ok:  # in all_pairs order: deterministic
        if (a, va, b, vb) in reachable:
            continue
        # The pair on each accepted background first (the other values already agree with the validator),
        # then random completions.
        tries = [{**c, a: va, b: vb} for c in backgrounds]
        tries += [_random_case(dims, rng, {a: va, b: vb}, feasible) for _ in range(tries_per_pair)]
        for case in tries:
            if case is not None and feasible(case) and accepts(case):
                accepted.append(case)
                reachable |= pairs_of(case, dims)
                break
        else:
            refused_example[(a, va, b, vb)] = _first_completion({a: va, b: vb}, dims, feasible)
    todo, cases = set(reachable), []
    while todo:
        best = max(accepted, key=lambda c: len(pairs_of(c, dims) & todo))  # first of the best: deterministic
        cases.append(best)
        todo -= pairs_of(best, dims)
    refused = {p: refused_example[p] for p in ok if p not in reachable}  # found later via another pair: not refused
    return Cover(cases, reachable, refused, excluded, pool, in_pool)
