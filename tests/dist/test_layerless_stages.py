"""Stages that hold no transformer layer, only their rows of the vocabulary-parallel head (issue 44): pp=6 with
parallel.stage_layers=[1,1,1,1,0,0] on tiny_dense. Such a stage has gradients only for its head rows, or none at
all for some reductions; every collective is still called by every member of its group (NCCL's rule), with empty
tensors where a stage has nothing to add, and the run equals the single-process simulator (the vocabulary tests'
tolerances: tests/dist/test_vocab_parallel_pipeline.py)."""

from __future__ import annotations

import pytest

from tests.dist.test_vocab_parallel_pipeline import assert_vocab_equivalent
from tests.dist.tp_workers import ADAMW_EPS
from tests.dist.workers import make_config

pytestmark = [pytest.mark.equivalence, pytest.mark.dist]

LAYERLESS = {"pp": 6, "head": "vocab", "stage_layers": [1, 1, 1, 1, 0, 0]}


@pytest.mark.slow  # 6 gloo ranks: minutes on the shared 2 cores; the 4-stage case below is the same mechanism
def test_the_issue_layout_pp6_equals_the_simulator() -> None:
    """The layout of issue 44: stages 4 (passes its input on) and 5 (the final norm) hold no layer."""
    check_layerless(LAYERLESS, 6)


@pytest.mark.slow  # 4 gloo ranks (~1-3 min here); tests/unit/test_dryrun.py runs these stages' step on meta by default
def test_layerless_middle_and_last_stage_equal_the_simulator() -> None:
    check_layerless({"pp": 4, "head": "vocab", "stage_layers": [2, 2, 0, 0]}, 4)


def check_layerless(parallel: dict, world: int) -> None:
    cfg = make_config(parallel=parallel, train={"steps": 4, "num_microbatches": world, "micro_batch_size": 1},
                      optimizer={"eps": ADAMW_EPS})
    results, _, _ = assert_vocab_equivalent(cfg, world)
    empty = [s for s, n in enumerate(parallel["stage_layers"]) if n == 0]
    for r in results:
        if r["stage"] in empty:  # the layer-less stages really held nothing but their head rows (+ the final norm)
            extra = {"norm.weight"} if r["stage"] == world - 1 else set()
            assert set(r["params"]) == {"lm_head.weight"} | extra, (r["stage"], sorted(r["params"]))
