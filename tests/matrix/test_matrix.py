"""Issue 30: the covering matrix. Every pair of feature values (tests/matrix/space.py) appears in a case of a
seeded pairwise covering array; the config validator decides each case: accepted cases run as real gloo
pipelines and must equal the single-process simulator at the equivalence tolerances (loss and gradient norm
relative 1e-5, weights 1e-4: tests/dist/test_pipeline_equivalence.py), refused ones must be refused before any
process group exists with a ConfigError naming the field. `make test-matrix` runs the full array (slow); the
default suite runs the generator's checks, every case's oracle, and a fixed slice of FAST cases."""

from __future__ import annotations

import re

import pytest

from asyncpp.config import ConfigError, RunConfig, check_pipeline_options
from asyncpp.job import resolve
from asyncpp.parallel.mesh import ParallelDims
from tests.dist.test_pipeline_equivalence import assert_parallel_equivalent
from tests.matrix.covering import accepted_cover, all_pairs, covering_array, pairs_of
from tests.matrix.space import DIMENSIONS, container, feasible, label, world

SEED = 30
FIELD = re.compile(r"\b(model|train|optimizer|schedule|staleness|parallel|checkpoint|data)\.[a-z_]+")


def oracle(case: dict) -> ConfigError | None:
    """None if a torchrun job of the case passes every check before its process group exists (asyncpp/job.py's
    resolve and run_distributed: the config, the pipeline's own options, the layout at its world size)."""
    try:
        cfg, model_cfg = resolve(container(case), world(case))
        check_pipeline_options(cfg, model_cfg)
        p = cfg.parallel
        ParallelDims.for_world(world(case), pp=p.pp, tp=p.tp, ep=p.ep, dp=p.dp)
    except ConfigError as e:
        return e
    return None


COVER = accepted_cover(DIMENSIONS, SEED, feasible, lambda case: oracle(case) is None, pool=800, tries_per_pair=10)
CASES = COVER.cases
FAST = tuple(i for i, c in enumerate(CASES) if world(c) == 2)[:2]
"""The default suite's slice: the first two 2-rank cases."""


def test_every_pair_is_in_an_accepted_case_or_refused():
    covered = set().union(*(pairs_of(c, DIMENSIONS) for c in CASES))
    assert covered == COVER.covered
    assert covered | set(COVER.refused) | set(COVER.excluded) == set(all_pairs(DIMENSIONS))
    assert all(feasible(c) and oracle(c) is None for c in CASES)
    # Only the machine's rank limit excludes pairs: pp=4 with tp=2 or dp=2 needs 8 ranks.
    assert COVER.excluded == [("pp", 4, "tp", 2), ("pp", 4, "dp", 2)]


def test_the_covering_array_is_a_function_of_its_seed():
    assert covering_array(DIMENSIONS, SEED, feasible) == covering_array(DIMENSIONS, SEED, feasible)
    assert covering_array(DIMENSIONS, SEED, feasible) != covering_array(DIMENSIONS, SEED + 1, feasible)


@pytest.mark.slow  # a second build of the cover: 12 s
def test_the_accepted_cover_is_a_function_of_its_seed():
    again = accepted_cover(DIMENSIONS, SEED, feasible, lambda case: oracle(case) is None, pool=800, tries_per_pair=10)
    assert again.cases == CASES and again.refused == COVER.refused


@pytest.mark.parametrize("pair", COVER.refused,
                         ids=[f"{a}={va},{b}={vb}" for a, va, b, vb in COVER.refused])
def test_a_pair_no_accepted_case_holds_is_refused_naming_a_field(pair):
    refusal = oracle(COVER.refused[pair])
    assert refusal is not None and FIELD.search(str(refusal)), f"{pair}: {refusal}"


@pytest.mark.parametrize("index", [pytest.param(i, marks=() if i in FAST else pytest.mark.slow)
                                   for i in range(len(CASES))], ids=[label(c) for c in CASES])
def test_an_accepted_case_equals_the_simulator(index):
    assert_parallel_equivalent(RunConfig.from_dict(container(CASES[index])))
