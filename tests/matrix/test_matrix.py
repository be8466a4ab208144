"""Issue 30: the covering matrix. Every pair of feature values (tests/matrix/space.py) appears in a case of a
seeded pairwise covering array; the config validator decides each case: accepted cases run as real gloo
pipelines, equal the single-process simulator at the tolerances of tests/matrix/run.py and pass the NCCL
replay (tests/nccl), refused ones must be refused before any process group exists with a ConfigError naming
the field. Seeded random full configurations run on top. `make test-matrix` runs everything (slow); the
default suite runs the generator's checks, every refusal, and a fixed slice of FAST cases. The cases are
recorded in cover.json (tests/matrix/cover.py)."""

from __future__ import annotations

import re

import pytest

from asyncpp.config import RunConfig
from asyncpp.core.partition import vocab_shards_of
from model_zoo import get_model_config
from tests.matrix.cover import COVER_FILE, SEED, accepts, build, load, oracle
from tests.matrix.covering import all_pairs, covering_array
from tests.matrix.run import head_blocks, run_case
from tests.matrix.space import DIMENSIONS, container, feasible, label, layerless_cases, world

pytestmark = [pytest.mark.dist, pytest.mark.equivalence]

FIELD = re.compile(r"\b(model|train|optimizer|schedule|staleness|parallel|checkpoint|data)\.[a-z_]+")


COVER, RANDOM = load()
CASES = COVER.cases
FAST = tuple(i for i, c in enumerate(CASES) if world(c) == 2 and not c["resume"] and c["precision"] == "fp32")[:1]
"""The default suite's slice: the first 2-rank fp32 case without a stop (one run, no bf16 noise runs: ~15-30 s
on the shared machine); every other case is slow."""


def test_every_pair_is_in_an_accepted_case_or_refused():
    covered = COVER.covered
    assert not covered & set(COVER.refused) and not covered & set(COVER.excluded)
    assert covered | set(COVER.refused) | set(COVER.excluded) == set(all_pairs(DIMENSIONS))
    assert all(feasible(c) and accepts(c) for c in CASES + RANDOM)
    # Only the machine's rank limit excludes pairs: pp=3 or 4 with tp=2 or dp=2 needs 6 or 8 ranks.
    assert COVER.excluded == [("pp", 3, "tp", 2), ("pp", 4, "tp", 2), ("pp", 3, "dp", 2), ("pp", 4, "dp", 2)]


@pytest.mark.slow  # three builds of the validator-agnostic array (3.5 s at load 25); the matrix uses accepted_greedy
def test_the_covering_array_is_a_function_of_its_seed():
    assert covering_array(DIMENSIONS, SEED, feasible) == covering_array(DIMENSIONS, SEED, feasible)
    assert covering_array(DIMENSIONS, SEED, feasible) != covering_array(DIMENSIONS, SEED + 1, feasible)


@pytest.mark.slow  # a build of the cover (~10 s of CPU)
def test_the_recorded_cover_is_what_the_generator_builds_for_its_seed():
    again, random_cases = build()
    message = f"{COVER_FILE.name} is stale: rewrite it with `.venv/bin/python -m tests.matrix.cover`"
    assert again.cases == CASES and again.refused == COVER.refused, message
    assert again.covered == COVER.covered and again.excluded == COVER.excluded, message
    assert random_cases == RANDOM, message


@pytest.mark.parametrize("pair", COVER.refused,
                         ids=[f"{a}={va},{b}={vb}" for a, va, b, vb in COVER.refused])
def test_a_pair_no_accepted_case_holds_is_refused_naming_a_field(pair):
    refusal = oracle(COVER.refused[pair])
    assert refusal is not None and FIELD.search(str(refusal)), f"{pair}: {refusal}"


@pytest.mark.parametrize("index", [pytest.param(i, marks=() if i in FAST else pytest.mark.slow)
                                   for i in range(len(CASES))], ids=[label(c) for c in CASES])
def test_an_accepted_case_equals_the_simulator(index, tmp_path):
    measured = run_case(CASES[index], tmp_path)
    print(f"{label(CASES[index])}: {measured}")


BF16_BEYOND_4N: dict[str, str] = {
    "model=tiny_moe,sync_start_steps=1,grad_ef_lambda=0.5,tp=2,sequence_parallel=True,dp=2,ep=2,precision=bf16,"
    "head=auto,rampup=True":
        "bf16 reordering through TP+SP x DP x EP and gradient EF: layers.3.mlp.shared_gate.weight 1.36e-2 against the "
        "bf16 bound 9.1e-3 (2026-11-26); its fp32 twin passes (worst weight 4.3e-6, layers.0.mlp.w_down)",
    "schedule=pipedream,optimizer=muon,ef_lambda=1.0,pp=2,tp=2,distributed_optimizer=True,precision=bf16,head=auto,"
    "rampup=True,m=P+1,resume=True":
        "TP=2's bf16 roundings of its partial sums, amplified by Muon with Error Feedback at lambda=1 under pipedream: "
        "step 3's gradient norm 6.870 against 7.078 (8.7 N, the bound 4 N = 0.096) (2026-11-29); at TP=1 the case is "
        "the simulator bit for bit, with AdamW, ef_lambda=0 or 2bw it lands within 1.5 N, and the simulator alone with "
        "every nn.Linear evaluated in TP=2's halves (bf16 partial sums) moves 0.145-0.160 (6.1-6.7 N) from itself "
        "there; its fp32 twin passes (gradient norm 2.3 N of the head-order noise, worst weight 1.28e-4 against "
        "1.75e-4, layers.3.mlp.down_proj)",
}
"""Cases whose bf16 run lands past the bf16 bound while their fp32 twin passes at the fp32 tolerance (issue 30's
note): expected failures, strict, so a change in either shows. (The one entry of 2026-11-25, the random case
tiny_moe,ef,grad_ef,dc,wp,pp=2,tp=2,bf16,selective,rampup,m=2P,resume at 1.46e-2 against 1.35e-2, left the
random sample when parallel.head gained vocab and auto: the seeded draw changed; the entry of 2026-11-26 came in
when the token split left parallel.head and the draw changed again.)"""


def test_every_expected_bf16_failure_names_a_random_case():
    assert set(BF16_BEYOND_4N) <= {label(c) for c in RANDOM}


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=BF16_BEYOND_4N[label(c)])
                                               if label(c) in BF16_BEYOND_4N else ()) for c in RANDOM],
                         ids=[label(c) for c in RANDOM])
def test_a_random_accepted_configuration_equals_the_simulator(case, tmp_path):
    measured = run_case(case, tmp_path)
    print(f"{label(case)}: {measured}")


LAYERLESS = layerless_cases()


def test_every_layerless_case_is_accepted_and_has_a_stage_without_layers():
    """Issue 44's layouts on top of the cover (tests/matrix/space.py LAYERLESS): each accepted by the validator at
    its world size, inside the machine's rank limit, with a stage of no layer (the dry run steps such stages:
    tests/unit/test_dryrun.py)."""
    for name, case in LAYERLESS.items():
        assert feasible(case) and oracle(case) is None, (name, oracle(case))
        assert 0 in case["stage_layers"] and len(case["stage_layers"]) == case["pp"], name


@pytest.mark.slow  # 2-4 gloo ranks and the simulator each (a minute or more on the shared 2 cores)
@pytest.mark.parametrize("name", list(LAYERLESS))
def test_a_layerless_case_equals_the_simulator(name, tmp_path):
    case = LAYERLESS[name]
    measured = run_case(case, tmp_path)
    print(f"{name} ({label(case)}): {measured}")
    assert measured["layers_of_stage"] == case["stage_layers"], measured["layers_of_stage"]  # the layout really ran


def test_the_fp32_head_order_noise_evaluates_the_head_in_the_pipelines_vocabulary_blocks():
    """tests/matrix/run.head_blocks, the blocks of the fp32 noise scale (run.py's derivation of the bound): every TP
    layout splits the head's vocabulary over its TP ranks (Megatron's vocab-parallel cross entropy), on the last
    stage or on each stage of a spread head; with one block (tp=1, the head on the last stage) there is no noise
    scale and the plain fp32 bound holds."""
    base = {d: values[0] for d, values in DIMENSIONS.items()}

    def config(**over) -> RunConfig:
        d = container({**base, **over})
        if over.get("head") == "vocab":  # a spread head with TP needs an untied model (the validator's refusal)
            d["model"]["overrides"] = {"tie_embeddings": False}
        return RunConfig.from_dict(d)

    model_cfg = get_model_config(base["model"])
    vocab = model_cfg.vocab_size
    assert head_blocks(config(pp=2)) is None
    assert [(b.start, b.rows) for b in head_blocks(config(pp=2, tp=2))] == [(0, vocab // 2), (vocab // 2, vocab // 2)]
    spread = config(pp=2, tp=2, head="vocab")
    untied = get_model_config(base["model"], tie_embeddings=False)
    stage_rows = vocab_shards_of(spread.validate(untied), untied)
    got = head_blocks(spread)
    assert [b.rows for b in got] == [r // 2 + (r % 2 > i) for r in stage_rows for i in range(2)], (stage_rows, got)
    assert [b.start for b in got] == [sum(b.rows for b in got[:i]) for i in range(len(got))]  # consecutive, from 0
    assert sum(b.rows for b in got) == vocab
