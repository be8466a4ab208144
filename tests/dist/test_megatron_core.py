"""A megatron-core GPTModel trained by asyncpp's 2BW from a Megatron-style loop equals the one-step-delayed rule.

Megatron's own model (GPTModel, local layer spec, CPU mode), Megatron's own process groups (parallel_state, taken
by Mesh.from_megatron) and a pretrain_gpt-style forward_step/loss_func, driven through
get_forward_backward_func("2bw"), against DelayedUpdateSimulator on the same model unsplit in one process
(tests/dist/megatron_core_workers.py). Each case also checks that megatron-core's modules ran on megatron's groups.

Tolerance: the pipeline and the reference run the same kernels on the same shapes except where the split
changes the float order: the loss is divided per microbatch by its token count and by m (Megatron's
convention) where the reference averages then sums (exact: m = 4 and 32 tokens are powers of two), the tied
embedding's two gradient parts are summed by an all-reduce, and under TP=2 every row-parallel matmul sums two
halves (under SP the same sums as reduce-scatters, and each norm's gradient as the sum of the two TP ranks' token
halves; with the alltoall dispatcher an expert sees its tokens in another order, so its gradient sums them in
another order; with the output layer spread over the stages, the logits are computed per shard and the softmax
and its gradient formed from the gathered per-shard statistics (vocab_head.py) where megatron's cross entropy takes
the whole row, and the layers' input gradient is the sum of the stages' partial ones). Those are rounding
differences of ~1e-7 relative per step; 6 steps of Muon/AdamW (whose normalisations
amplify them where a gradient entry is near zero) stay below 1e-5, the bound of the other equivalence tests.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from data import preprocess
from data.default import DEFAULT_TOKENIZER
from data.tokenizer import load_tokenizer
from examples.megatron_2bw import parse_args as parse_example_args
from tests.dist.harness import run_ranks
from tests.dist.megatron_core_workers import (
    LAYERS,
    VOCAB,
    Case,
    megatron_grad_machinery_rank,
    pipeline_rank,
    reference_rank,
)
from tests.dist.test_pipeline_equivalence import relative_error

pytestmark = [pytest.mark.dist, pytest.mark.equivalence]

CASES = {
    "pp2": [Case("dense", drain_after=3),
            Case("tied_ef_sync_start", tied=True, ef_lambda=1.0, sync_start_steps=2),
            Case("moe", moe=True),
            Case("weight_prediction_tied", tied=True, weight_prediction=True, sync_start_steps=1, drain_after=3),
            Case("loss_scale_overflow", loss_scale=1024.0, overflow_step=1, sync_start_steps=2),
            # the output layer spread over the stages (VocabSpreadStage / VocabPipeline2BW), with a drain mid-run,
            # and with EF + weight prediction on top
            Case("vocab_head", vocab=True, drain_after=3),
            Case("vocab_head_ef_weight_prediction", vocab=True, ef_lambda=1.0, weight_prediction=True),
            Case("vocab_head_tied", vocab=True, tied=True, drain_after=3),
            Case("vocab_head_and_embedding", vocab=True, vocab_embedding=True, drain_after=3),
            Case("vocab_head_and_embedding_tied", vocab=True, vocab_embedding=True, tied=True)],
    # DC-ASGD's term lam * g * g * (x_t - x_read) is ~1e-5 of the update at lam 0.1 in 6 steps here (below the
    # test's own tolerance): lam = 100 makes it ~1e-2, so the case shows the correction was applied.
    "pp2_slow": [Case("dc_asgd", dc_lambda=100.0),
                 Case("grad_ef_tied", tied=True, grad_ef_lambda=0.5, drain_after=3),
                 Case("dc_asgd_adamw_sync_start", optimizer="adamw", dc_lambda=100.0, sync_start_steps=2)],
    # megatron's middle stages: no embedding group, no pre/post process, one layer each (LAYERS = 4 over 4 stages)
    "pp4": [Case("pp4", pp=4, drain_after=3),
            Case("pp4_tied_weight_prediction", pp=4, tied=True, weight_prediction=True, sync_start_steps=1),
            Case("pp4_vocab_head", pp=4, vocab=True, drain_after=2),
            Case("pp4_vocab_head_tied_weight_prediction", pp=4, vocab=True, tied=True, weight_prediction=True),
            Case("pp4_vocab_head_and_embedding", pp=4, vocab=True, vocab_embedding=True, drain_after=2),
            Case("pp4_vocab_head_and_embedding_tied", pp=4, vocab=True, vocab_embedding=True, tied=True)],
    "four": [Case("tp2_tied", tp=2, tied=True, optimizer="adamw", ef_lambda=0.5, drain_after=2),
             Case("tp2_muon", tp=2, drain_after=3),
             Case("dp2_tied", dp=2, tied=True),
             Case("dp2_ep2_moe", dp=2, ep=2, moe=True),
             Case("tp2_sp", tp=2, sp=True, drain_after=3),
             Case("dp2_ep2_moe_alltoall", dp=2, ep=2, moe=True, dispatcher="alltoall")],
}
RTOL = 1e-5
ACTED = 100 * RTOL
"""A correction acted: the reference without it ends at least this far (relative) from the one with it, in some
weight, so the pipeline's match at RTOL could not have come from a run without it."""
ROOT = Path(__file__).resolve().parents[2]


def world_of(group: str) -> int:
    (world,) = {c.pp * c.tp * c.dp for c in CASES[group]}
    return world


@pytest.fixture(scope="module")
def references():
    """references(group): the single-process reference of each of the group's cases (computed once)."""
    cache: dict[str, dict] = {}

    def of(group: str) -> dict:
        if group not in cache:
            cache[group] = run_ranks(reference_rank, 1, [dataclasses.asdict(c) for c in CASES[group]])[0]
        return cache[group]
    return of


def run_cases(cases: list[Case], refs: dict | None = None, timeout_per_case: float = 120.0
              ) -> tuple[dict, dict[str, list[dict]]]:
    """The cases' single-process references (`refs` if given) and the pipeline's run of them, one job at their common
    world size: (references by case name, {case name: every rank's report})."""
    dicts = [dataclasses.asdict(c) for c in cases]
    if refs is None:
        refs = run_ranks(reference_rank, 1, dicts)[0]
    (world,) = {c.pp * c.tp * c.dp for c in cases}
    per_rank = run_ranks(pipeline_rank, world, dicts, refs, timeout=timeout_per_case * len(cases))
    return refs, {c.name: [r[i] for r in per_rank] for i, c in enumerate(cases)}


def run_pipeline(group: str, references) -> dict[str, list[dict]]:
    # ~20 s per case of four processes on an idle 2-core box (below); the bound leaves room for a loaded box
    return run_cases(CASES[group], references(group))[1]


@pytest.fixture(scope="module")
def pp2(references):
    return run_pipeline("pp2", references)


@pytest.fixture(scope="module")
def pp2_slow(references):
    return run_pipeline("pp2_slow", references)


@pytest.fixture(scope="module")
def four_ranks(references):
    return run_pipeline("four", references)


def check_equals_reference(ranks: list[dict], ref: dict, weights_rtol: float = RTOL) -> None:
    """Losses and grad norms at RTOL, every weight at `weights_rtol` (RTOL unless a case derives its own)."""
    case = Case(**ranks[0]["case"])
    # The step's loss: the mean over the replicas' (equal token counts) of the last stage's per-token mean.
    last = [r["losses"] for r in ranks if r["stage"] == case.pp - 1 and r["tp_rank"] == 0]
    assert len(last) == case.dp
    assert [sum(x) / case.dp for x in zip(*last)] == pytest.approx(ref["losses"], rel=RTOL)
    finite = [t for t in range(case.steps) if t != case.overflow_step]  # check_loss_scaling: the skipped one
    for r in ranks:
        assert sorted(r["grad_norms"]) == list(range(case.steps))
        assert [r["grad_norms"][t] for t in finite] == pytest.approx([ref["grad_norms"][t] for t in finite], rel=RTOL)
    covered, worst = set(), (0.0, "")
    for r in ranks:
        for name, (value, sharded, dim) in r["params"].items():
            full = ref["params"][name]
            expected = full.chunk(case.tp, dim=dim)[r["tp_rank"]] if sharded else full
            error = relative_error(value, expected)
            assert error < weights_rtol, (case.name, r["stage"], name, error)
            covered.add(name)
            worst = max(worst, (error, name))
    assert covered == set(ref["params"])
    print(f"{case.name}: worst weight relative error {worst[0]:.2e} ({worst[1]})")  # pytest -s shows the margins
    # The tied weight: both stages hold it and end equal (one version, updated with the delayed rule). (With the
    # embedding sharded each stage holds its rows once, for both roles: compared above, assembled.)
    if case.tied and not case.vocab_embedding:
        copies = [r["params"]["embedding.word_embeddings.weight"][0] for r in ranks
                  if r["tp_rank"] == 0 and r["stage"] in (0, case.pp - 1)]
        assert len(copies) == 2 * case.dp and all(relative_error(c, copies[0]) == 0 for c in copies)


def check_megatron_ran(ranks: list[dict], tp: int) -> None:
    case = Case(**ranks[0]["case"])
    moe, per_stage = case.moe, LAYERS // case.pp
    for r in ranks:
        # megatron's even split: stage s built and trained the global layers [s * L/P, (s + 1) * L/P)
        layers = {int(n.split(".")[2]) for n in r["params"] if n.startswith("decoder.layers.")}
        assert layers == set(range(r["stage"] * per_stage, (r["stage"] + 1) * per_stage)), (r["stage"], layers)
        ends = r["stage"] in (0, case.pp - 1)
        e = r["evidence"]
        assert e["model_class"] == "megatron.core.models.gpt.gpt_model.GPTModel"
        assert "megatron.core.transformer.transformer_block.TransformerBlock" in e["module_classes"]
        assert e["cpu_mode"] and e["linear_tp_group_is_megatrons"]
        assert all(e["mesh_groups_are_megatrons"].values()), e["mesh_groups_are_megatrons"]
        assert len(e["tp_group_ranks"]) == tp
        assert len(e["embedding_group_ranks"]) == (case.pp if case.vocab else 2 * ends)
        calls = e["forward_calls"]
        # 2 layers per stage, each a ColumnParallel qkv/fc1 and a RowParallel proj/fc2, every microbatch forward;
        # with MoE, megatron's MoELayer in every layer (its experts' fc1/fc2 run on the tokens routed to them).
        # (at P=4 a stage has one layer, and a middle stage neither the embedding nor the output layer).
        assert calls["TransformerLayer"] > 0 and calls["ColumnParallelLinear"] >= 2 * calls["TransformerLayer"]
        assert calls.get("MoELayer", 0) == (calls["TransformerLayer"] if moe else 0)
        assert calls["RowParallelLinear"] >= 2 * calls["TransformerLayer"]
        assert ("VocabParallelEmbedding" in calls) == (r["stage"] == 0)
        dispatcher = {"allgather": "MoEAllGatherTokenDispatcher", "alltoall": "MoEAlltoAllTokenDispatcher"}
        assert e["dispatchers"] == ([dispatcher[Case(**r["case"]).dispatcher]] if moe else [])


def check_vocab_head_ran(ranks: list[dict]) -> None:
    """The output layer was spread: every stage trained its own consecutive rows (the cost model's shards, covering
    the vocabulary once), ran S on every microbatch with logits of its rows' width, and moved them; megatron's whole
    output_layer stayed frozen at its initial value on the last stage."""
    case = Case(**ranks[0]["case"])
    vocab = [r["evidence"]["vocab"] for r in sorted(ranks, key=lambda r: r["stage"])]
    assert [v["start"] for v in vocab] == [sum(v["rows"][0] for v in vocab[:s]) for s in range(case.pp)]
    assert sum(v["rows"][0] for v in vocab) == VOCAB and all(v["rows"][0] > 0 for v in vocab), vocab
    for v in vocab:
        assert v["passes"] == case.steps * case.num_microbatches and v["widths"] == [v["rows"][0]], v
        assert v["rows_moved"]
    assert [v["output_layer_untouched"] for v in vocab] == [None] * (case.pp - 1) + [True]


def check_vocab_checkpoint_loads_unsplit(ranks: list[dict], ref: dict, weights_rtol: float = RTOL) -> None:
    """The trained stages' checkpoints (layers and rows by offset) load strictly into an unsplit GPTModel whose every
    parameter is the reference's final one (at the run's bound)."""
    (loaded,) = [r["checkpoint"] for r in ranks if r["checkpoint"] is not None]
    assert set(loaded) == set(ref["params"])
    for name, value in loaded.items():
        assert relative_error(value, ref["params"][name]) < weights_rtol, name


def check_vocab_head_evaluates(ranks: list[dict], ref: dict) -> None:
    """An evaluation through the drained pipeline (forward_only: the spread head's pass on every stage) gives the
    final unsplit model's loss on the same held-out microbatches (reported by the last stage only)."""
    case = Case(**ranks[0]["case"])
    assert [r["eval"] is not None for r in sorted(ranks, key=lambda r: r["stage"])] == [False] * (case.pp - 1) + [True]
    (value,) = [r["eval"] for r in ranks if r["eval"] is not None]
    assert value == pytest.approx(ref["eval"], rel=RTOL)


def check_spread_head(ranks: list[dict], ref: dict, weights_rtol: float = RTOL) -> None:
    """The spread head's three checks of a case whose whole pipeline is one DP replica: it ran spread, it evaluates
    to the reference's loss, its checkpoint loads unsplit into the reference's final weights."""
    check_vocab_head_ran(ranks)
    check_vocab_head_evaluates(ranks, ref)
    check_vocab_checkpoint_loads_unsplit(ranks, ref, weights_rtol)


def check_sequence_parallel_reduced(ranks: list[dict]) -> None:
    """Megatron's SP norms (every layer's two LayerNorms and the final one: weight and bias) were marked partial and
    all-reduced over TP once per step, in the step's reduction, and the sum differed from each rank's own part."""
    case = Case(**ranks[0]["case"])
    for r in ranks:
        assert r["evidence"]["sequence_parallel"]
        sp = r["evidence"]["partial_tp"]
        norms = {n for n in r["params"] if "layernorm" in n}
        assert set(sp["names"]) == norms and len(norms) == 2 * 2 * 2 + 2 * (r["stage"] == 1), (sp, norms)
        assert sp["calls"] == case.steps and sp["tensors"] == sp["changed"] == case.steps * len(norms), sp


def check_loss_scaling(ranks: list[dict], ref: dict) -> None:
    """config.grad_scale_func's scale was divided out of each step's gradient (the grad norms above equal the
    unscaled reference's), an overflowing step was skipped on every rank as in the reference, and a new scale
    inside an open 2BW stream is refused, as is a model with fp16 parameters (no fp32 masters here)."""
    case = Case(**ranks[0]["case"])
    bad = case.overflow_step
    assert ref["skipped"] == [t == bad for t in range(case.steps)] and not math.isfinite(ref["grad_norms"][bad])
    for r in ranks:
        assert r["grad_scales"] == [0.0 if t == bad else 1 / case.loss_scale for t in range(case.steps)]
        assert r["skipped"] == {t: t == bad for t in range(case.steps)}
        assert not math.isfinite(r["grad_norms"][bad])
        assert "loss scale changed from 1024.0 to 2048.0" in r["scale_refusal"] and "drain()" in r["scale_refusal"]
        assert "torch.float16" in r["fp16_refusal"] and "no fp32 master weights" in r["fp16_refusal"]


def check_corrections_acted(ranks: list[dict], ref: dict) -> None:
    """Each correction the case turns on changed the trajectory (the reference without it is ACTED away), and
    the pipeline's own state shows it: gradient EF's g_{t-1} buffer is nonzero, weight prediction kept a third
    weight version and ran forwards/backwards on the predicted weights."""
    case = Case(**ranks[0]["case"])
    if not case.corrections:
        assert "uncorrected" not in ref
        return
    moved = max(relative_error(ref["params"][n], ref["uncorrected"][n]) for n in ref["params"])
    assert moved > ACTED, (case.name, moved)
    print(f"{case.name}: {case.corrections} moved the reference's weights by up to {moved:.2e} (relative)")
    for r in ranks:
        e = r["evidence"]["corrections"]
        assert (e["grad_ef_buffer_norm"] > 0) == bool(case.grad_ef_lambda), (case.name, e)
        assert e["num_buffers"] == (3 if case.weight_prediction else 2), (case.name, e)
        # delayed steps: every microbatch's forward and backward after the synchronous start reads x^
        assert (e["predicted_reads"] >= 2 * case.num_microbatches * (case.steps - case.sync_start_steps)) == \
            case.weight_prediction, (case.name, e)


def check_muon_used_megatron_layouts(ranks: list[dict], ref: dict) -> None:
    """Muon orthogonalised each TP-sharded matrix whole: its param group has megatron's partition_dim as the
    matrix's tp_dim, Newton-Schulz saw the unsplit shape (gathered along that dim), and Muon's all-gathers ran
    on megatron's TP group."""
    case = Case(**ranks[0]["case"])
    assert case.tp > 1
    for r in ranks:
        muon = r["evidence"]["muon"]
        assert muon, "the case's optimizer has no Muon"
        sharded = {n for n, (_, is_sharded, _) in r["params"].items() if is_sharded and n in muon["tp_dims"]}
        assert sharded, "no TP-sharded matrix went to Muon"
        for name in sharded:
            assert muon["tp_dims"][name] == r["params"][name][2], name
        gathered = {(shape, dim) for shape, dim in muon["jobs"] if dim is not None}
        expected = {(tuple(ref["params"][n].shape), muon["tp_dims"][n] - 2) for n in sharded}
        assert gathered == expected, (gathered, expected)
        assert muon["tp_gathers"] >= case.steps
        # and a Muon that does not know megatron's layout is refused before it could orthogonalise shards
        assert r["layout_refusal"].startswith("Muon") and "sharding=optimizer_sharding(model)" in r["layout_refusal"]


@pytest.mark.parametrize("name", [c.name for c in CASES["pp2"]])
def test_gpt_model_pp2_equals_delayed_reference(pp2, references, name):
    ref = references("pp2")[name]
    check_equals_reference(pp2[name], ref)
    check_megatron_ran(pp2[name], tp=1)
    check_corrections_acted(pp2[name], ref)
    if Case(**pp2[name][0]["case"]).loss_scale is not None:
        check_loss_scaling(pp2[name], ref)
    if Case(**pp2[name][0]["case"]).vocab:
        check_spread_head(pp2[name], ref)


@pytest.mark.slow  # two processes importing megatron-core, three cases: about 40 s
@pytest.mark.parametrize("name", [c.name for c in CASES["pp2_slow"]])
def test_gpt_model_pp2_corrections_equal_delayed_reference(pp2_slow, references, name):
    """DC-ASGD and gradient-level EF through the Megatron front-end (weight prediction and EF: default tier)."""
    ref = references("pp2_slow")[name]
    check_equals_reference(pp2_slow[name], ref)
    check_megatron_ran(pp2_slow[name], tp=1)
    check_corrections_acted(pp2_slow[name], ref)


@pytest.fixture(scope="module")
def pp4(references):
    return run_pipeline("pp4", references)


@pytest.mark.parametrize("name", [c.name for c in CASES["pp4"]])
def test_gpt_model_pp4_equals_delayed_reference(pp4, references, name):
    """Four megatron pipeline stages (the head whole on the last; in pp4_vocab_head spread over the four): two middle
    stages that have neither megatron's embedding group nor its pre/post-processing, the tied weight on stages 0
    and 3 only."""
    ref = references("pp4")[name]
    check_equals_reference(pp4[name], ref)
    check_megatron_ran(pp4[name], tp=1)
    check_corrections_acted(pp4[name], ref)
    vocab = Case(**pp4[name][0]["case"]).vocab
    if vocab:
        check_spread_head(pp4[name], ref)
    for r in pp4[name]:
        if not vocab:  # (check_megatron_ran: with the head spread, the tied group is asyncpp's, over every stage)
            assert (r["evidence"]["embedding_group_ranks"] == [0, 3]) == (r["stage"] in (0, 3)), r["evidence"]
        # (the spread head's rows are reported once, assembled, by the last stage; a sharded table's too, the first
        # stage's whole one being frozen)
        owners = (3,) if Case(**r["case"]).vocab_embedding else (0, 3)
        assert ("output_layer.weight" in r["params"] or "embedding.word_embeddings.weight" in r["params"]) == \
            (r["stage"] in owners)


def test_drain_in_the_middle_resumes_the_same_trajectory(pp2):
    # dense drains after call 3: updates 0 and 1 ran in calls 2 and 3 (applied_step 0, 1 reported), the
    # drain applies 2, the restarted stream applies 3 in call 5, the final drain the rest.
    for r in pp2["dense"]:
        assert r["applied"] == [None, None, 0, 2, 2, 2, 3]


@pytest.mark.slow  # four processes importing megatron-core on two cores: about 80 s before SP and alltoall joined
@pytest.mark.parametrize("name", [c.name for c in CASES["four"]])
def test_gpt_model_on_four_ranks_equals_delayed_reference(four_ranks, references, name):
    """PP=2 x TP=2 (megatron's TP linears and vocab-parallel embedding / cross entropy; with Muon, megatron's
    layouts gathered for Newton-Schulz; with SP, its norms' partial gradients all-reduced over TP), PP=2 x DP=2
    (asyncpp's DP all-reduce on megatron's data-parallel group) and PP=2 x DP=2 x EP=2 MoE (allgather and alltoall
    dispatchers)."""
    case = next(c for c in CASES["four"] if c.name == name)
    ref = references("four")[name]
    check_equals_reference(four_ranks[name], ref)
    check_megatron_ran(four_ranks[name], tp=case.tp)
    check_corrections_acted(four_ranks[name], ref)
    if case.optimizer == "muon" and case.tp > 1:
        check_muon_used_megatron_layouts(four_ranks[name], ref)
    if case.sp:
        check_sequence_parallel_reduced(four_ranks[name])


@pytest.mark.slow  # one process importing megatron-core and building three GPTModels: 20-80 s on this box
def test_megatron_ddp_runs_on_cpu_and_is_refused_under_2bw():
    """Issue 32, item 5. megatron-core's DistributedDataParallel and finalize_model_grads do run on the CPU (one
    shim: megatron_cpu gives param_and_grad_buffer the CPU as its current device): a flushed step gives the plain
    gradient in param.main_grad, bit for bit, and takes param.grad away, which is what keeps them out of a 2BW
    stage (the message names megatron's lines). megatron's optimizers stop in their constructor on the CPU. The
    front-end refuses all four, each with its reason."""
    out = run_ranks(megatron_grad_machinery_rank, 1)[0]
    assert out["main_grad_error"] == 0.0 and out["grads_taken"]
    assert out["megatron_optimizer_stops_at"] == "optimizer/optimizer.py:907"  # FP32Optimizer: device='cuda'
    refusals = out["refusals"]
    assert set(refusals) == {"ddp", "ddp_inner", "megatron_optimizer", "finalize_model_grads_func"}
    for name in ("ddp", "ddp_inner"):
        assert "param_and_grad_buffer.py:837" in refusals[name] and "distributed_data_parallel.py:440" in refusals[name]
    assert "FP32Optimizer" in refusals["megatron_optimizer"] and "build_optimizer" in refusals["megatron_optimizer"]
    assert "finalize_model_grads_func = None" in refusals["finalize_model_grads_func"]


@pytest.fixture(scope="module")
def indexed_prefix(tmp_path_factory) -> Path:
    """A small indexed dataset as data.preprocess writes it (.bin/.idx/.json), with the default tokenizer."""
    texts = [" ".join(random.Random(i).choices(WORDS, k=random.Random(-i).randint(20, 60))) for i in range(200)]
    out = tmp_path_factory.mktemp("indexed") / "docs_text_document"
    preprocess.write_indexed(lambda skip: iter(texts[skip:]), load_tokenizer(DEFAULT_TOKENIZER), out,
                             source={"test": str(out)}, workers=0, progress=False)
    return out


WORDS = ["pipeline", "stage", "Muon", "gradient", "the", "a", "of", "2BW", "delay", "update", "def f(x):", "\n"]
MEGATRON_LOG = re.compile(r" \[[0-9-]+ [0-9:]+\] iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \| elapsed time "
                          r"per iteration \(ms\): [0-9.]+ \| learning rate: [0-9.E+-]+ \| global batch size: +(\d+) \| "
                          r"lm loss: [0-9.E+-]+ \| loss scale: 1\.0 \|( grad norm: [0-9.]+ \|)? number of skipped "
                          r"iterations: +0 \| number of nan iterations: +0 \|")


def run_example(tmp_path: Path, nproc: int, *args: str) -> tuple[dict, str]:
    out = tmp_path / "log.json"
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc_per_node={nproc}",
           "examples/megatron_2bw.py", *args, "--out", str(out)]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def check_megatron_log(stdout: str, iters: int, batch: int) -> None:
    lines = [MEGATRON_LOG.match(line) for line in stdout.splitlines() if "] iteration " in line]
    assert len(lines) == iters and all(lines), stdout[-2000:]
    assert [(int(m[1]), int(m[2]), int(m[3]), int(m[4])) for m in lines] == \
        [(k, iters, k * batch, batch) for k in range(1, iters + 1)]


def test_example_trains_under_torchrun(tmp_path, indexed_prefix):
    """examples/megatron_2bw.py as a user runs it: two CPU processes on an indexed dataset (data.preprocess's output,
    read through megatron-core's GPTDataset), 6 iterations, an evaluation drain after 3, Megatron's log line."""
    log, stdout = run_example(tmp_path, 2, "--train-iters", "6", "--eval-interval", "3",
                              "--data-path", str(indexed_prefix))
    assert log["model_class"] == "megatron.core.models.gpt.gpt_model.GPTModel"
    assert log["data"] == "indexed" and log["vocab_size"] == 8192  # the tokenizer's 8192, padded to 128 * tp
    assert len(log["train"]) == 6 and log["applied_step"] == 5  # the final drain applied every update
    assert list(log["valid"]) == ["3", "6"] and log["valid"]["6"] < log["valid"]["3"]
    check_megatron_log(stdout, 6, 4 * 4)
    assert stdout.count(" validation loss at iteration ") == 2


@pytest.mark.slow  # four processes importing megatron-core, each run: about 60-120 s on this box
@pytest.mark.parametrize("flags", [("--tp", "2", "--sequence-parallel"),
                                   ("--num-experts", "4", "--expert-model-parallel-size", "2",
                                    "--moe-token-dispatcher-type", "alltoall")], ids=["tp2_sp", "dp2_ep2_alltoall"])
def test_example_sp_and_alltoall_under_torchrun(tmp_path, indexed_prefix, flags):
    log, stdout = run_example(tmp_path, 4, "--train-iters", "4", "--eval-interval", "2", "--num-layers", "2",
                              "--data-path", str(indexed_prefix), *flags)
    assert log["sequence_parallel"] == ("--sequence-parallel" in flags)
    assert log["dispatchers"] == (["MoEAlltoAllTokenDispatcher"] if "alltoall" in flags else [])
    assert len(log["train"]) == 4 and log["applied_step"] == 3 and all(map(math.isfinite, log["train"]))
    dp = 2 if "alltoall" in flags else 1
    check_megatron_log(stdout, 4, 4 * 4 * dp)


def test_example_refuses_a_vocab_parallel_head_with_tp(capsys):
    """--vocab-parallel-head with --tp 2 and a tied embedding (as asyncpp's own pipeline: tied + TP is refused) is
    refused by name, before any process group exists."""
    with pytest.raises(SystemExit):
        parse_example_args(["--vocab-parallel-head", "--tp", "2"])
    assert "--vocab-parallel-head needs" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the embedding is sharded by the head's rows
        parse_example_args(["--vocab-parallel-embedding"])
    assert "add --vocab-parallel-head" in capsys.readouterr().err


@pytest.mark.slow  # four processes importing megatron-core: about 40-60 s on this box, each
@pytest.mark.parametrize("embedding", [(), ("--vocab-parallel-embedding",)], ids=["head", "head_and_embedding"])
def test_example_vocab_parallel_head_pp4_under_torchrun(tmp_path, indexed_prefix, embedding):
    """examples/megatron_2bw.py --vocab-parallel-head --pp 4 as a user runs it (tied, megatron's default): the output
    layer spread over the four stages (the last stage's rows reported), training and evaluation through the spread
    head, Megatron's log."""
    log, stdout = run_example(tmp_path, 4, "--train-iters", "4", "--eval-interval", "2", "--pp", "4",
                              "--num-layers", "4", "--vocab-parallel-head", *embedding,
                              "--data-path", str(indexed_prefix))
    assert log["vocab_rows"][0] < log["vocab_size"] and log["vocab_rows"][1] == 64  # the last stage's rows only
    assert len(log["train"]) == 4 and log["applied_step"] == 3 and all(map(math.isfinite, log["train"]))
    assert list(log["valid"]) == ["2", "4"] and all(map(math.isfinite, log["valid"].values()))
    check_megatron_log(stdout, 4, 4 * 4)
