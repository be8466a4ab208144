"""The matrix's cases: the validator as the oracle of what is allowed, the seeded cover (tests/matrix/covering.py)
of the feature space (tests/matrix/space.py) and the seeded random full configurations on top, recorded in
cover.json (rewrite it: `.venv/bin/python -m tests.matrix.cover`)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from asyncpp.config import ConfigError, check_pipeline_options
from asyncpp.job import resolve
from asyncpp.parallel.mesh import ParallelDims
from tests.matrix.covering import Cover, accepted_greedy, pairs_of
from tests.matrix.space import DIMENSIONS, container, feasible, world

SEED = 30
RANDOM_CASES = 4
"""Seeded random accepted full configurations run on top of the cover (slow)."""


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


def accepts(case: dict) -> bool:
    return oracle(case) is None


def random_accepted(seed: int, count: int, skip: list[dict]) -> list[dict]:
    """`count` accepted full configurations drawn uniformly per dimension (seeded), none already in `skip`."""
    rng, out = random.Random(seed), []
    while len(out) < count:
        case = {d: rng.choice(values) for d, values in DIMENSIONS.items()}
        if feasible(case) and case not in skip and case not in out and accepts(case):
            out.append(case)
    return out


COVER_FILE = Path(__file__).with_name("cover.json")
"""The generator's output for SEED (cases, refused pairs with their refused completions, excluded pairs, the random
cases), recorded: building it takes ~10 s of CPU (30 s on the loaded machine) at every collection of the suite.
The default tier checks the record against the validator as it is now (every case accepted, every pair covered,
refused or excluded, every refused pair refused); the slow tier rebuilds it and requires the same. Rewrite it after
a change of the space or the validator: `.venv/bin/python -m tests.matrix.cover`."""


def build() -> tuple[Cover, list[dict]]:
    cover = accepted_greedy(DIMENSIONS, SEED, feasible, accepts)
    return cover, random_accepted(SEED + 1, RANDOM_CASES, cover.cases)


def load() -> tuple[Cover, list[dict]]:
    data = json.loads(COVER_FILE.read_text())
    assert data["seed"] == SEED, f"{COVER_FILE} was built for seed {data['seed']}"
    cases = data["cases"]
    covered = set().union(*(pairs_of(c, DIMENSIONS) for c in cases)) - {tuple(p) for p in data["excluded"]}
    refused = {tuple(p): case for p, case in data["refused"]}
    return Cover(cases, covered, refused, [tuple(p) for p in data["excluded"]]), data["random"]


def write() -> None:
    cover, random_cases = build()
    COVER_FILE.write_text(json.dumps({"seed": SEED, "cases": cover.cases, "refused": list(cover.refused.items()),
                                      "excluded": cover.excluded, "random": random_cases}, indent=1) + "\n")


if __name__ == "__main__":
    write()
    print(f"wrote {COVER_FILE}", file=sys.stderr)
