"""A megatron-core GPTModel trained by asyncpp's 2BW from a Megatron-style loop equals the one-step-delayed rule.

Megatron's own model (GPTModel, local layer spec, CPU mode), Megatron's own process groups (parallel_state, taken
by Mesh.from_megatron) and a pretrain_gpt-style forward_step/loss_func, driven through
get_forward_backward_func("2bw"), against DelayedUpdateSimulator on the same model unsplit in one process
(tests/dist/megatron_core_workers.py). Each case also checks that megatron-core's modules ran on megatron's groups.

Tolerance: the pipeline and the reference run the same kernels on the same shapes except where the split
changes the float order: the loss is divided per microbatch by its token count and by m (Megatron's
convention) where the reference averages then sums (exact: m = 4 and 32 tokens are powers of two), the tied
embedding's two gradient parts are summed by an all-reduce, and under TP=2 every row-parallel matmul sums two
halves. Those are rounding differences of ~1e-7 relative per step; 6 steps of Muon/AdamW (whose normalisations
amplify them where a gradient entry is near zero) stay below 1e-5, the bound of the other equivalence tests.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.harness import run_ranks
from tests.dist.megatron_core_workers import Case, pipeline_rank, reference_rank
from tests.dist.test_pipeline_equivalence import relative_error

pytestmark = [pytest.mark.dist, pytest.mark.equivalence]

CASES = {
    2: [Case("dense", drain_after=3),
        Case("tied_ef_sync_start", tied=True, ef_lambda=1.0, sync_start_steps=2),
        Case("moe", moe=True)],
    4: [Case("tp2_tied", tp=2, tied=True, optimizer="adamw", ef_lambda=0.5, drain_after=2),
        Case("dp2_tied", dp=2, tied=True),
        Case("dp2_ep2_moe", dp=2, ep=2, moe=True)],
}
RTOL = 1e-5
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def references() -> dict:
    cases = [dataclasses.asdict(c) for group in CASES.values() for c in group]
    return run_ranks(reference_rank, 1, cases)[0]


def run_pipeline(world: int, references: dict) -> dict[str, list[dict]]:
    cases = CASES[world]
    per_rank = run_ranks(pipeline_rank, world, [dataclasses.asdict(c) for c in cases], references)
    return {c.name: [r[i] for r in per_rank] for i, c in enumerate(cases)}


@pytest.fixture(scope="module")
def pp2(references):
    return run_pipeline(2, references)


@pytest.fixture(scope="module")
def four_ranks(references):
    return run_pipeline(4, references)


def check_equals_reference(ranks: list[dict], ref: dict) -> None:
    case = Case(**ranks[0]["case"])
    # The step's loss: the mean over the replicas' (equal token counts) of the last stage's per-token mean.
    last = [r["losses"] for r in ranks if r["stage"] == 1 and r["tp_rank"] == 0]
    assert len(last) == case.dp
    assert [sum(x) / case.dp for x in zip(*last)] == pytest.approx(ref["losses"], rel=RTOL)
    for r in ranks:
        assert sorted(r["grad_norms"]) == list(range(case.steps))
        assert [r["grad_norms"][t] for t in range(case.steps)] == pytest.approx(ref["grad_norms"], rel=RTOL)
    covered = set()
    for r in ranks:
        for name, (value, sharded, dim) in r["params"].items():
            full = ref["params"][name]
            expected = full.chunk(case.tp, dim=dim)[r["tp_rank"]] if sharded else full
            assert relative_error(value, expected) < RTOL, (case.name, r["stage"], name)
            covered.add(name)
    assert covered == set(ref["params"])
    # The tied weight: both stages hold it and end equal (one version, updated with the delayed rule).
    if case.tied:
        copies = [r["params"]["embedding.word_embeddings.weight"][0] for r in ranks if r["tp_rank"] == 0]
        assert len(copies) == 2 * case.dp and all(relative_error(c, copies[0]) == 0 for c in copies)


def check_megatron_ran(ranks: list[dict], tp: int) -> None:
    moe = Case(**ranks[0]["case"]).moe
    for r in ranks:
        e = r["evidence"]
        assert e["model_class"] == "megatron.core.models.gpt.gpt_model.GPTModel"
        assert "megatron.core.transformer.transformer_block.TransformerBlock" in e["module_classes"]
        assert e["cpu_mode"] and e["linear_tp_group_is_megatrons"]
        assert all(e["mesh_groups_are_megatrons"].values()), e["mesh_groups_are_megatrons"]
        assert len(e["tp_group_ranks"]) == tp and len(e["embedding_group_ranks"]) == 2
        calls = e["forward_calls"]
        # 2 layers per stage, each a ColumnParallel qkv/fc1 and a RowParallel proj/fc2, every microbatch forward;
        # with MoE, megatron's MoELayer in every layer (its experts' fc1/fc2 run on the tokens routed to them).
        assert calls["TransformerLayer"] > 0 and calls["ColumnParallelLinear"] >= 2 * calls["TransformerLayer"]
        assert calls.get("MoELayer", 0) == (calls["TransformerLayer"] if moe else 0)
        assert calls["RowParallelLinear"] >= 2 * calls["TransformerLayer"]
        assert ("VocabParallelEmbedding" in calls) == (r["stage"] == 0)


@pytest.mark.parametrize("name", [c.name for c in CASES[2]])
def test_gpt_model_pp2_equals_delayed_reference(pp2, references, name):
    check_equals_reference(pp2[name], references[name])
    check_megatron_ran(pp2[name], tp=1)


def test_drain_in_the_middle_resumes_the_same_trajectory(pp2):
    # dense drains after call 3: updates 0 and 1 ran in calls 2 and 3 (applied_step 0, 1 reported), the
    # drain applies 2, the restarted stream applies 3 in call 5, the final drain the rest.
    for r in pp2["dense"]:
        assert r["applied"] == [None, None, 0, 2, 2, 2, 3]


@pytest.mark.slow  # four processes importing megatron-core on two cores: about 80 s
@pytest.mark.parametrize("name", [c.name for c in CASES[4]])
def test_gpt_model_on_four_ranks_equals_delayed_reference(four_ranks, references, name):
    """PP=2 x TP=2 (megatron's TP linears and vocab-parallel embedding / cross entropy) and PP=2 x DP=2
    (asyncpp's DP all-reduce on megatron's data-parallel group)."""
    case = next(c for c in CASES[4] if c.name == name)
    check_equals_reference(four_ranks[name], references[name])
    check_megatron_ran(four_ranks[name], tp=case.tp)


def test_example_trains_under_torchrun(tmp_path):
    """examples/megatron_2bw.py as a user runs it: two CPU processes, 6 iterations, an evaluation drain after 3."""
    out = tmp_path / "log.json"
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node=2",
           "examples/megatron_2bw.py", "--train-iters", "6", "--eval-interval", "3", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = json.loads(out.read_text())
    assert log["model_class"] == "megatron.core.models.gpt.gpt_model.GPTModel"
    assert len(log["train"]) == 6 and log["applied_step"] == 5  # the final drain applied every update
    assert list(log["valid"]) == ["3", "6"] and log["valid"]["6"] < log["valid"]["3"]
    assert "iteration    6/6 | lm loss" in proc.stdout
