"""megatron's aux-loss-free router balancing (`moe_router_enable_expert_bias=True`) under Pipeline2BW equals the
delayed simulator on the unsplit GPTModel.

megatron moves each router's `expert_bias` in finalize_model_grads, which a 2BW stage never calls; the front-end
drives it with asyncpp's RouterBiasVersions (pipeline/megatron_balancing.py): b_t's forwards read the bias of the
weight version they run on, and the update of step t moves it with b_t's token counts summed over the step's
microbatches and over DP. The simulator does the same on one process (every microbatch of the step, all replicas'),
so the bias of every version must be equal, and the losses, grad norms and weights at the front-end's RTOL (its
derivation: test_megatron_core.py's module docstring).

The bias moves by exactly +-rate or 0 per step from integer counts: equal counts give equal biases bit for bit, so
they are compared exactly; a count that differed (a routing choice flipped by rounding) would show as a difference
of a whole rate.
"""

from __future__ import annotations

import types

import pytest
import torch

from asyncpp.pipeline.megatron_balancing import check_router_bias
from examples.megatron_2bw import parse_args
from tests.dist.harness import run_ranks
from tests.dist.megatron_checkpoint_workers import example_rank, unsplit_rank
from tests.dist.megatron_core_workers import LAYERS, ROUTER_BIAS, Case
from tests.dist.test_megatron_checkpoint import ARGS, tensors
from tests.dist.test_megatron_core import check_corrections_acted, check_equals_reference, check_megatron_ran, run_cases

pytestmark = [pytest.mark.dist, pytest.mark.equivalence]

CASES = {
    "pp2": [Case("pp2_moe_router_bias", moe=True, router_bias=True, drain_after=3)],
    "four": [Case("dp2_ep2_moe_router_bias", dp=2, ep=2, moe=True, router_bias=True),
             Case("dp2_moe_router_bias_ef_alltoall", dp=2, moe=True, router_bias=True, dispatcher="alltoall",
                  ef_lambda=1.0, drain_after=3)],
}


def run(group: str) -> tuple[dict, dict[str, list[dict]]]:
    return run_cases(CASES[group])


def check_router_bias_equals_reference(ranks: list[dict], ref: dict) -> None:
    """Every bias version every rank held equals the simulator's; together they cover every router and every
    version x_0..x_T; and the bias moved (so a pipeline that never updated it could not pass)."""
    case = Case(**ranks[0]["case"])
    expected = ref["router_bias"]
    routers = {f"decoder.layers.{i}.mlp" for i in range(LAYERS)}
    assert sorted(expected) == list(range(case.steps + 1)) and set(expected[0]) == routers
    seen: dict[str, set[int]] = {}
    for r in ranks:
        for v, biases in r["router_bias"].items():
            for name, bias in biases.items():
                assert torch.equal(bias, expected[v][name]), (case.name, r["stage"], v, name, bias, expected[v][name])
                seen.setdefault(name, set()).add(v)
    assert seen == {name: set(range(case.steps + 1)) for name in routers}, seen
    rate = ROUTER_BIAS["moe_router_bias_update_rate"]
    final = torch.stack([expected[case.steps][n] for n in sorted(routers)])
    assert torch.all(expected[0][next(iter(routers))] == 0)
    assert (final != 0).any(), "the bias never moved"
    assert (final > 0).any() and (final < 0).any(), final  # under- and over-loaded experts both
    # each step moves each entry by -rate, 0 or +rate
    for v in range(case.steps):
        for n in routers:
            step = (expected[v + 1][n] - expected[v][n]) / rate
            assert torch.allclose(step, step.round(), atol=1e-4) and step.abs().max() <= 1 + 1e-4, (v, n, step)


@pytest.fixture(scope="module")
def pp2():
    return run("pp2")


@pytest.mark.slow  # a reference and a two-process run: ~24 s at load 16 on the 2-core box (the default suite is full)
def test_router_bias_pp2_equals_delayed_reference(pp2):
    refs, runs = pp2
    for c in CASES["pp2"]:
        check_equals_reference(runs[c.name], refs[c.name])
        check_megatron_ran(runs[c.name], tp=1)
        check_router_bias_equals_reference(runs[c.name], refs[c.name])


@pytest.mark.slow  # four processes, two cases: ~40 s
def test_router_bias_dp2_ep2_and_alltoall_ef_equal_delayed_reference():
    refs, runs = run("four")
    for c in CASES["four"]:
        check_equals_reference(runs[c.name], refs[c.name])
        check_megatron_ran(runs[c.name], tp=1)
        check_corrections_acted(runs[c.name], refs[c.name])
        check_router_bias_equals_reference(runs[c.name], refs[c.name])


def config(**kw) -> types.SimpleNamespace:
    base = {"moe_router_enable_expert_bias": True, "sequence_parallel": False, "tensor_model_parallel_size": 1,
            "context_parallel_size": 1}
    return types.SimpleNamespace(**{**base, **kw})


def test_router_bias_refuses_sequence_and_context_parallelism_by_name():
    """Where megatron sums the counts over ranks that the 2BW reduction does not (TP under SP, CP), and where its
    router counts in the backward (activation recompute): refused."""
    check_router_bias(config())
    check_router_bias(config(tensor_model_parallel_size=2))  # every TP rank routes the same tokens: the sign holds
    check_router_bias(config(moe_router_enable_expert_bias=False, sequence_parallel=True, tensor_model_parallel_size=2))
    with pytest.raises(NotImplementedError, match="moe_router_enable_expert_bias=True with sequence_parallel=True"):
        check_router_bias(config(sequence_parallel=True, tensor_model_parallel_size=2))
    with pytest.raises(NotImplementedError, match="context_parallel_size=2"):
        check_router_bias(config(context_parallel_size=2))
    with pytest.raises(NotImplementedError, match="recompute_granularity='full'"):
        check_router_bias(config(recompute_granularity="full"))


BIAS_ARGS = ["--num-experts", "4", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
             "--moe-router-bias-update-rate", "0.01"]


@pytest.mark.slow  # three two-process runs of the example: ~60 s on a loaded 2-core box
def test_router_bias_checkpoint_resumes_bit_for_bit(tmp_path):
    """The example with megatron's expert bias, stopped at 3 and resumed, equals the uninterrupted run bit for bit:
    losses, grad norms and every tensor of the final checkpoint, the bias versions (`balancing/<age>/<router>`,
    each router under its unsplit layer name, so the two stages' do not collide) among them; the bias moved after
    the resume."""
    def run(*argv) -> dict:  # the last stage's log
        return run_ranks(example_rank, 2, [*ARGS, *BIAS_ARGS, *map(str, argv)], timeout=600.0)[1]

    whole = run("--save", tmp_path / "whole")
    first = run("--save", tmp_path / "a", "--exit-interval", "3")
    resumed = run("--load", tmp_path / "a", "--save", tmp_path / "b")
    assert len(first["train"]) == 3 and resumed["start_iteration"] == 3
    assert resumed["train"] == whole["train"][3:] and resumed["grad_norm"] == {k: whole["grad_norm"][k] for k in (4, 5, 6)}
    end, end_resumed, at_stop = (tensors(p) for p in (tmp_path / "whole" / "step_00000006",
                                                        tmp_path / "b" / "step_00000006", tmp_path / "a" / "step_00000003"))
    assert set(end) == set(end_resumed)
    biases = {k for k in end if k.startswith("balancing/")}
    assert biases == {f"balancing/{age}/decoder.layers.{i}.mlp" for age in (0, 1) for i in (0, 1)}, biases
    different = [k for k in end if not torch.equal(end[k], end_resumed[k])]
    assert not different, different[:5]
    assert all(not torch.equal(end[k], at_stop[k]) for k in biases if k.startswith("balancing/0/"))
    assert all(end[k].abs().sum() > 0 for k in biases)
    # the checkpoint as an unsplit GPTModel's state dict (megatron_state_dict): every key, strictly, the routers'
    # expert_bias (a persistent buffer of megatron's) the newest version's, and the model's loss the run's
    unsplit = run_ranks(unsplit_rank, 1, [*ARGS, *BIAS_ARGS, "--pp", "1"], str(tmp_path / "b" / "step_00000006"),
                        timeout=300.0)[0]
    assert unsplit["missing"] == unsplit["unexpected"] == []
    assert unsplit["expert_bias"].keys() == {f"decoder.layers.{i}.mlp.router.expert_bias" for i in (0, 1)}
    for i in (0, 1):
        assert torch.equal(unsplit["expert_bias"][f"decoder.layers.{i}.mlp.router.expert_bias"],
                           end[f"balancing/0/decoder.layers.{i}.mlp"])
    assert unsplit["loss"] == pytest.approx(resumed["valid"][6], rel=1e-5, abs=0)  # test_megatron_checkpoint's bound


def test_example_refuses_the_expert_bias_without_sigmoid_or_with_sp(capsys):
    for extra in (["--num-experts", "4", "--moe-router-enable-expert-bias"],
                  [*BIAS_ARGS, "--tp", "2", "--sequence-parallel"]):
        with pytest.raises(SystemExit):
            parse_args(extra)
        assert "--moe-router-enable-expert-bias needs --num-experts and --moe-router-score-function sigmoid" in \
            capsys.readouterr().err
