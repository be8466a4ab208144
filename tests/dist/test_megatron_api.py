"""asyncpp.pipeline.megatron: a Megatron-LM style training loop on the 2BW / 1F1B pipeline equals the simulator.

One spawn of 2 gloo ranks runs both schedules (spawning costs more than the tiny model): a loop written
as Megatron's train() writes it (forward_step_func / loss_func / set_input_tensor, one call per step,
then optimizer_step()), with a drain and a forward_only evaluation in the middle and at the end. The
window rule itself is checked on schedules alone (no processes).
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from torch import Tensor, nn

from asyncpp.config import RunConfig
from asyncpp.pipeline.megatron import Pipeline2BW, drain_2bw, get_forward_backward_func, window_2bw
from asyncpp.parallel.mesh import Mesh, ParallelDims
from asyncpp.optim.lr_schedule import lr_multiplier
from asyncpp.schedules.actions import Op
from asyncpp.schedules.build import build_schedule
from asyncpp.schedules.invariants import check_schedules, execution_order
from asyncpp.core.loss import cross_entropy
from asyncpp.pipeline.stage import StageSpec, prune_to_stage, stage_forward, tied_parameters
from model_zoo import build_model, get_model_config
from tests.dist.harness import run_ranks
from tests.dist.test_pipeline_equivalence import relative_error
from tests.dist.workers import data_for, make_config, optimizer_factory, reference_run

pytestmark = pytest.mark.dist

STEPS, EVAL_AT = 6, 3  # drain + evaluate after 3 steps and at the end, as eval_every=3 does


# ---- the window rule, on schedules alone ---------------------------------------------------------------
def calls_of(stage: int, P: int, m: int, segments: list[int]) -> list[list]:
    """Per-call action lists of one stage: segments of calls, each closed by a drain."""
    calls, k = [], 0
    for n in segments:
        start, windows = k, []
        for _ in range(n):
            windows.append(window_2bw(stage, P, m, k, start, set().union(*windows[-2:])))
            k += 1
        calls.extend(windows)
        calls.append(drain_2bw(stage, P, m, k - 1, start, set().union(*windows[-2:])))
    return calls


@pytest.mark.parametrize("P, m", [(1, 1), (2, 2), (2, 5), (3, 3), (4, 4), (4, 7)])
def test_windows_cut_the_continuous_schedule_without_cross_call_waits(P, m):
    K = 5
    calls = [calls_of(s, P, m, [K]) for s in range(P)]
    for s in range(P):
        # Calls 0..K-1 are a prefix of the unbounded 2BW stream: the one PipelineExecutor runs.
        full = build_schedule("2bw", s, P, m, [1] * (K + 1))
        # (up to its last F/B before F(K, 0): updates trailing a call run at the start of the next)
        first_of_k = next(i for i, a in enumerate(full) if a.op is Op.FORWARD and a.step == K)
        cut = 1 + max(i for i in range(first_of_k) if full[i].op in (Op.FORWARD, Op.BACKWARD))
        assert [a for c in calls[s][:K] for a in c] == full[:cut]
        # Call k runs exactly b_k's forwards; the last stage also all its backwards.
        for k in range(K):
            assert {(a.step, a.microbatch) for a in calls[s][k] if a.op is Op.FORWARD} == {(k, j) for j in range(m)}
        if s == P - 1:
            assert all(sum(a.op is Op.BACKWARD and a.step == k for a in calls[s][k]) == m for k in range(K))
    # Every prefix of calls terminates on its own: no wait on something a later call does.
    for j in range(1, K + 2):
        execution_order([[a for c in calls[s][:j] for a in c] for s in range(P)])
    # The blocking reductions of UPDATE_START(t) (tied embedding, DP) meet in the same call everywhere.
    calls_of_start = [{a.step: i for i, c in enumerate(calls[s]) for a in c if a.op is Op.UPDATE_START}
                      for s in range(P)]
    assert all(c == {t: t + 1 for t in range(K)} for c in calls_of_start)
    check_schedules([[a for c in calls[s] for a in c] for s in range(P)], m, 2, num_steps=K)


def test_training_resumes_after_a_drain_with_the_same_versions():
    P, m = 3, 4
    whole = [[a for c in calls_of(s, P, m, [2, 1, 3]) for a in c] for s in range(P)]
    check_schedules(whole, m, 2, num_steps=6, step_delays=[[1] * 6] * P)


# ---- a Megatron-style model, forward_step_func and loss_func -----------------------------------------
class MegatronStyleStage(nn.Module):
    """A model_zoo stage with GPTModel's pipeline interface: set_input_tensor(list) + forward(tokens)."""

    def __init__(self, model: nn.Module, spec: StageSpec):
        super().__init__()
        self.model, self.spec = model, spec
        self.input_tensor: Tensor | None = None

    def set_input_tensor(self, input_tensor: list[Tensor | None] | Tensor | None) -> None:
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def forward(self, tokens: Tensor | None) -> Tensor:
        return stage_forward(self.model, self.spec, tokens if self.spec.is_first else self.input_tensor)


def get_batch(data_iterator, spec: StageSpec) -> tuple[Tensor | None, Tensor | None]:
    """As pretrain_gpt.get_batch: only the first and the last stage read data."""
    if not (spec.is_first or spec.is_last):
        return None, None
    tokens = next(data_iterator)
    return tokens[:, :-1], tokens[:, 1:]


def loss_func(labels: Tensor, output_tensor: Tensor):
    loss = cross_entropy(output_tensor, labels)
    return loss, {"lm loss": loss.detach()}


def loss_func_per_token(labels: Tensor, output_tensor: Tensor):
    """pretrain_gpt's 3-value form: (summed loss, num_tokens, {name: [sum, num_tokens]})."""
    logits = output_tensor.float().reshape(-1, output_tensor.size(-1))
    total = nn.functional.cross_entropy(logits, labels.reshape(-1), reduction="sum")
    num_tokens = torch.tensor(labels.numel(), dtype=torch.int)
    return total, num_tokens, {"lm loss": torch.stack([total.detach(), num_tokens.float()])}


def forward_step(data_iterator, model: MegatronStyleStage, loss=loss_func):
    inputs, labels = get_batch(data_iterator, model.spec)
    return model(inputs), functools.partial(loss, labels)


def mean_loss(store: list[dict]) -> float:
    values = [d["lm loss"] for d in store]
    if values[0].numel() == 2:  # per-token reports: sum of losses / sum of tokens
        total = torch.stack(values).double().sum(0)
        return float(total[0] / total[1])
    return float(torch.stack(values).double().mean())


# ---- one rank --------------------------------------------------------------------------------------
def build(cfg: RunConfig, mesh: Mesh):
    model_cfg = get_model_config(cfg.model.name, **(cfg.model.overrides or {}))
    torch.manual_seed(cfg.seed)
    model = build_model(model_cfg)
    spec = StageSpec(mesh.pp_rank, mesh.num_stages, len(model.layers))
    model = prune_to_stage(model, spec)
    stage = MegatronStyleStage(model, spec)
    sched = cfg.optimizer.schedule
    lr_mult = functools.partial(lr_multiplier, total_steps=cfg.train.steps, warmup_steps=sched.warmup_steps,
                                kind=sched.kind, min_lr_ratio=sched.min_lr_ratio, decay_fraction=sched.decay_fraction)
    fwd_bwd = get_forward_backward_func(cfg.schedule.name, engine_factory=lambda schedule: Pipeline2BW(
        stage, optimizer_factory(cfg)(model), mesh, schedule=schedule, hidden_size=model_cfg.hidden_size,
        grad_clip=cfg.train.grad_clip, ef_lambda=cfg.staleness.ef_lambda, lr_multiplier=lr_mult,
        tied=tied_parameters(model, spec)))
    return fwd_bwd, stage, data_for(cfg, model_cfg.vocab_size)


def error_messages(fwd_bwd, stage, cfg: RunConfig) -> dict[str, str]:
    """The refusals, raised before anything is consumed or communicated (so on every rank alike)."""
    kwargs = {"forward_step_func": forward_step, "data_iterator": iter(()), "model": stage,
              "seq_length": cfg.train.seq_len, "micro_batch_size": cfg.train.micro_batch_size}
    out = {}
    for key, extra in {"adjust": {"adjust_tensor_shapes_fn": lambda *a: a}, "p2p": {"p2p_communicator": object()},
                       "few_microbatches": {"num_microbatches": 1}, "forward_only": {"forward_only": True}}.items():
        try:
            fwd_bwd(**{"num_microbatches": cfg.train.num_microbatches, **kwargs, **extra})
        except (NotImplementedError, ValueError, RuntimeError) as e:
            out[key] = f"{type(e).__name__}: {e}"
    return out


def train_and_evaluate(cfg: RunConfig, mesh: Mesh, loss) -> dict:
    fwd_bwd, stage, data = build(cfg, mesh)
    pipeline = fwd_bwd.pipeline
    m = cfg.train.num_microbatches
    train_iter = (data.train_microbatch(i) for i in itertools.count())  # global microbatch t * m + j
    step = functools.partial(forward_step, loss=loss)
    out = {"losses": [], "store_sizes": [], "reports": [], "val": [], "errors": {}}

    def evaluate() -> float:
        pipeline.drain()
        val = data.val_batches()
        store = fwd_bwd(forward_step_func=forward_step, data_iterator=iter(val), model=[stage],
                        num_microbatches=len(val), seq_length=cfg.train.seq_len,
                        micro_batch_size=cfg.train.micro_batch_size, forward_only=True)
        return mean_loss(store) if store else float("nan")

    for k in range(cfg.train.steps):
        store = fwd_bwd(forward_step_func=step, data_iterator=train_iter, model=stage, num_microbatches=m,
                        seq_length=cfg.train.seq_len, micro_batch_size=cfg.train.micro_batch_size)
        out["store_sizes"].append(len(store))
        out["losses"].append(mean_loss(store) if store else float("nan"))
        out["reports"].append((pipeline.applied_step, pipeline.optimizer_step()))
        if k == 0 and cfg.schedule.name == "2bw":
            out["errors"] = error_messages(fwd_bwd, stage, cfg)  # b_0 is in flight here
        if k + 1 == EVAL_AT:
            out["val"].append(evaluate())
            out["reports"].append((pipeline.applied_step, pipeline.optimizer_step()))
    out["val"].append(evaluate())
    out["params"] = {n: p.detach().clone() for n, p in stage.model.named_parameters()}
    out["stage"] = mesh.pp_rank
    return out


def megatron_rank(rank: int, runs: list[tuple[dict, str]]) -> list[dict]:
    mesh = Mesh(ParallelDims(pp=2).validate(torch.distributed.get_world_size()), torch.device("cpu"))
    losses = {"loss": loss_func, "per_token": loss_func_per_token}
    return [train_and_evaluate(RunConfig.from_dict(cfg), mesh, losses[loss]) for cfg, loss in runs]


# ---- the multi-process comparison ------------------------------------------------------------------
CONFIGS = {
    "2bw": make_config(parallel={"pp": 2}, schedule={"name": "2bw"}, staleness={"ef_lambda": 1.0},
                       train={"steps": STEPS, "eval_every": EVAL_AT}),
    "1f1b": make_config(parallel={"pp": 2}, schedule={"name": "1f1b"}, train={"steps": STEPS, "eval_every": EVAL_AT}),
}
LOSS_FORMS = {"2bw": "loss", "1f1b": "per_token"}


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[list[dict], dict]]:
    names = list(CONFIGS)
    per_rank = run_ranks(megatron_rank, 2, [(CONFIGS[n].to_dict(), LOSS_FORMS[n]) for n in names])
    return {n: ([r[i] for r in per_rank], reference_run(CONFIGS[n])) for i, n in enumerate(names)}


@pytest.mark.equivalence
@pytest.mark.parametrize("schedule", list(CONFIGS))
def test_megatron_loop_equals_simulator(runs, schedule):
    ranks, ref = runs[schedule]
    last = next(r for r in ranks if r["stage"] == 1)
    assert last["losses"] == pytest.approx([s.loss for s in ref["stats"]], rel=1e-5)
    params = {}
    for r in ranks:
        params.update(r["params"])
    for name, p in params.items():
        ref_name = "embed.weight" if name == "lm_head.weight" else name
        assert relative_error(p, ref["params"][ref_name]) < 1e-5, name
    assert set(ref["params"]) <= set(params)


@pytest.mark.parametrize("schedule", list(CONFIGS))
def test_forward_data_store_and_optimizer_report(runs, schedule):
    ranks, ref = runs[schedule]
    first, last = (next(r for r in ranks if r["stage"] == s) for s in (0, 1))
    assert first["store_sizes"] == [0] * STEPS
    assert last["store_sizes"] == [CONFIGS[schedule].train.num_microbatches] * STEPS
    # After calls 0, 1, 2, the mid-run drain, calls 3, 4, 5: 1f1b applied step k in call k; 2bw applies
    # step k-2 in call k, the drain the two pending ones, and the stream restarted at 3 applies 3 in 5.
    expected = [0, 1, 2, 2, 3, 4, 5] if schedule == "1f1b" else [None, None, 0, 2, 2, 2, 3]
    for r in ranks:
        assert [applied for applied, _ in r["reports"]] == expected
        for applied, (ok, grad_norm, zeros) in r["reports"]:
            assert ok and zeros is None
            if applied is None:
                assert grad_norm is None
            else:
                assert grad_norm == pytest.approx(ref["stats"][applied].grad_norm, rel=1e-5)


@pytest.mark.equivalence
@pytest.mark.parametrize("schedule", list(CONFIGS))
def test_forward_only_after_drain_equals_simulator_evaluate(runs, schedule):
    ranks, ref = runs[schedule]
    last = next(r for r in ranks if r["stage"] == 1)
    assert last["val"][-1] == pytest.approx(ref["val_loss"], rel=1e-5)


def test_refusals_name_the_option_and_the_numbers(runs):
    for r in runs["2bw"][0]:
        errors = r["errors"]
        assert errors["adjust"].startswith("NotImplementedError") and "adjust_tensor_shapes_fn" in errors["adjust"]
        assert errors["p2p"].startswith("NotImplementedError") and "p2p_communicator" in errors["p2p"]
        assert errors["few_microbatches"].startswith("ValueError")
        assert "num_microbatches=1" in errors["few_microbatches"] and "2 stages" in errors["few_microbatches"]
        assert errors["forward_only"].startswith("RuntimeError") and "drain()" in errors["forward_only"]
