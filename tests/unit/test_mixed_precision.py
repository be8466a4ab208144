"""train.precision=bf16: bf16 compute and weight versions, fp32 masters, optimizer state and gradient sums.

The mechanism is asyncpp.pipeline.weights (WeightVersions, GradSums, make_masters); the single-process simulator
uses the same pieces, so what is checked here on the simulator holds for the pipeline's stages too.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncpp.config import ConfigError, RunConfig
from asyncpp.core.masters import GradSums, compute_dtype_of
from asyncpp.core.memory import optimizer_state_tensors
from asyncpp.optim import build_from_config
from asyncpp.pipeline.weights import WeightVersions
from asyncpp.reference.executor import build_simulator
from model_zoo import build_model, get_model_config

pytestmark = pytest.mark.usefixtures("one_thread")  # floats compared bit for bit depend on the matmul blocking

BF16 = torch.bfloat16


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def make_versions(k: int = 2):
    lin = nn.Linear(4, 3, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.linspace(-1, 1, 12).reshape(3, 4) / 3)  # not representable in bf16
    full = lin.weight.detach().clone()
    versions = WeightVersions([lin.weight], k, compute_dtype=BF16)
    return lin, versions, full


def test_versions_are_bf16_and_masters_separate_fp32_copies():
    lin, versions, full = make_versions()
    assert lin.weight.dtype == BF16 and all(b[0].dtype == BF16 for b in versions.buffers)
    master = versions.masters[0]
    assert master.dtype == torch.float32 and torch.equal(master, full)  # nothing lost at initialisation
    assert storage(master) not in {storage(b[0]) for b in versions.buffers}
    assert torch.equal(lin.weight, full.to(BF16))


def test_update_steps_fp32_masters_and_fills_the_new_version_on_use():
    lin, versions, full = make_versions()
    opt = torch.optim.SGD(versions.masters, lr=1.0)
    versions.retarget(opt)
    x_t = versions.begin_update(0)
    assert x_t[0].dtype == torch.float32 and torch.equal(x_t[0], full)
    versions.masters[0].grad = torch.full_like(versions.masters[0], 1e-3)  # below bf16 resolution near 0.3
    opt.step()
    assert torch.equal(versions.masters[0], full - 1e-3)  # the fp32 master keeps the small step
    assert torch.equal(lin.weight, full.to(BF16))  # still x_0 until a version is used
    versions.use(1)
    assert torch.equal(lin.weight, (full - 1e-3).to(BF16))
    versions.use(0)  # x_0's buffer was not touched by the update
    assert torch.equal(lin.weight, full.to(BF16))
    assert versions.tensors(1)[0] is not None and versions.tensors(1)[0].dtype == torch.float32  # checkpoint: fp32 x_t
    assert versions.tensors(0)[0].dtype == BF16


def test_set_newest_after_a_load_refills_the_version_from_the_masters():
    lin, versions, _ = make_versions()
    loaded = torch.randn(3, 4)
    versions.set_newest(5)
    versions.tensors(5)[0].copy_(loaded)  # what DCP does in place on load
    versions.set_newest(5)
    assert torch.equal(versions.masters[0], loaded)
    assert torch.equal(lin.weight, loaded.to(BF16))


def test_keep_masters_drops_the_other_owners_fp32_masters_and_their_x_next_comes_in_bf16():
    """The distributed optimizer under bf16 (StageShards.shard_masters): parameter 1 is another rank's. This rank
    keeps no fp32 master for it, steps and casts only its own, and the buffer of x_{t+1} takes parameter 1 from
    its owner's broadcast (here written by hand, as the fill does); a checkpoint loads its bf16 copy in place."""
    own, other = nn.Parameter(torch.linspace(-1, 1, 12).reshape(3, 4) / 3), nn.Parameter(torch.ones(5) / 3)
    versions = WeightVersions([own, other], 2, compute_dtype=BF16)
    full = versions.masters[0].detach().clone()
    opt = torch.optim.SGD([versions.masters[0]], lr=1.0)
    versions.retarget(opt)
    versions.keep_masters([True, False])
    assert versions.masters[1] is None and versions.masters[0].dtype == torch.float32
    x_t = versions.begin_update(0)
    assert x_t[1] is None and torch.equal(x_t[0], full)
    versions.masters[0].grad = torch.full_like(full, 1e-3)
    opt.step()
    sent = versions.newest_buffer()  # what the owner broadcasts: its master cast once, in bf16
    assert sent[0].dtype == BF16 and torch.equal(sent[0], (full - 1e-3).to(BF16))
    received = torch.full((5,), 0.25, dtype=BF16)
    versions.fill_newest_later(lambda: sent[1].copy_(received))
    versions.use(1)  # runs the fill; the cast does not overwrite the received entry (no master for it)
    assert torch.equal(own, (full - 1e-3).to(BF16)) and torch.equal(other, received)
    newest = versions.tensors(1)
    assert newest[0].dtype == torch.float32 and newest[1].dtype == BF16
    assert versions.copies(1) == [False, True] and versions.copies(0) == [False, False]
    newest[1].copy_(torch.full((5,), 0.5))  # a load: DCP casts the owner's saved fp32 master in place
    versions.set_newest(1)
    assert torch.equal(other, torch.full((5,), 0.5, dtype=BF16))
    assert torch.equal(versions.take_grads()[1], torch.zeros(5))  # no gradient arrived: fp32 zeros


def test_keep_masters_is_a_no_op_in_fp32():
    versions = WeightVersions([nn.Parameter(torch.ones(3))], 2)
    versions.keep_masters([False])
    assert versions.masters[0] is not None and versions.copies(0) == [False]


def test_grad_sums_add_bf16_microbatch_gradients_in_fp32():
    w = nn.Parameter(torch.ones(64, dtype=BF16))
    sums = GradSums([w])
    scales = torch.linspace(0.5, 1.5, 32)
    per_mb = []
    for s in scales:
        x = torch.full((64,), float(s), dtype=BF16) / 3
        (w * x).sum().backward()
        per_mb.append(x)
        assert w.grad is None  # moved into the fp32 sum as soon as autograd produced it
    (total,) = sums.pop()
    assert total.dtype == torch.float32
    exact = torch.stack([x.float() for x in per_mb]).sum(0)  # each microbatch's bf16 gradient, summed exactly
    assert torch.allclose(total, exact, rtol=1e-6)
    naive = per_mb[0].clone()
    for x in per_mb[1:]:
        naive += x  # what autograd's own accumulation into a bf16 .grad would do
    assert (naive.float() - exact).abs().max() > 100 * (total - exact).abs().max()
    assert sums.pop() == [None]  # handed over: the next step starts from nothing


def test_fp32_take_grads_is_the_old_behaviour():
    lin = nn.Linear(2, 2, bias=False)
    versions = WeightVersions([lin.weight], 2)
    assert not versions.mixed and versions.grad_sums is None
    lin(torch.ones(1, 2)).sum().backward()
    grad = lin.weight.grad
    assert versions.take_grads()[0] is grad and lin.weight.grad is None
    assert torch.equal(versions.take_grads()[0], torch.zeros(2, 2))


def config(precision: str, steps: int, model: str = "tiny_hybrid", optimizer: str = "muon",
           ef_lambda: float = 0.0) -> RunConfig:
    return RunConfig.from_dict({
        "staleness": {"ef_lambda": ef_lambda},
        "model": {"name": model}, "parallel": {"pp": 2}, "schedule": {"name": "2bw"},
        "train": {"steps": steps, "precision": precision, "micro_batch_size": 4, "num_microbatches": 2,
                  "seq_len": 32, "eval_every": 0},
        "optimizer": {"name": optimizer, "lr": 0.01, "schedule": {"kind": "constant", "warmup_steps": 0}},
        "logging": {"wandb_mode": "disabled", "progress": False}, "checkpoint": {"enabled": False},
    })


def batch(index: int, vocab: int = 64) -> torch.Tensor:
    """Tokens of a 64-symbol language with a learnable rule (every other token is its predecessor + 1),
    so the loss falls from ln(8192) ~ 9 to ~3 within a few dozen steps."""
    g = torch.Generator().manual_seed(1000 + index)
    x = torch.randint(0, vocab, (4, 33), generator=g)
    x[:, 1::2] = (x[:, 0:-1:2] + 1) % vocab
    return x


def train(precision: str, steps: int, model_name: str = "tiny_hybrid", optimizer: str = "muon",
          ef_lambda: float = 0.0):
    cfg = config(precision, steps, model_name, optimizer, ef_lambda)
    model_cfg = get_model_config(model_name)
    cfg = cfg.validate(model_cfg)
    torch.manual_seed(cfg.seed)
    model = build_model(model_cfg)
    sim = build_simulator(cfg, model, build_from_config(model, cfg.optimizer))
    m = cfg.train.num_microbatches
    losses = [sim.step(t, [batch(t * m + j) for j in range(m)]).loss for t in range(steps)]
    return sim, losses


def test_bf16_simulator_keeps_bf16_weights_and_fp32_masters_state_and_ef():
    sim, _ = train("bf16", 2, optimizer="adamw", ef_lambda=1.0)  # at λ = 0 there is no EF buffer
    assert {p.dtype for p in sim.params} == {BF16}
    assert {q.dtype for q in sim.masters} == {torch.float32}
    assert {t.dtype for t in optimizer_state_tensors(sim.optimizer) if t.dim()} == {torch.float32}
    assert {u.dtype for u in sim.error_feedback.prev_update} == {torch.float32}
    assert {x.dtype for version in sim.history for x in version} == {BF16}  # the past version: compute dtype
    assert all(q.grad is None and p.grad is None for p, q in zip(sim.params, sim.masters))
    for p, q in zip(sim.params, sim.masters):
        assert torch.equal(p, q.detach().to(BF16))  # the module runs on the rounded masters
    opt_params = {id(p) for g in sim.optimizer.param_groups for p in g["params"]}
    assert opt_params == {id(q) for q in sim.masters}  # the optimizer steps the masters, not the module


@pytest.mark.equivalence
def test_fp32_precision_is_bit_identical_to_no_precision_option():
    _, with_option = train("fp32", 3, model_name="tiny_dense")
    cfg = config("fp32", 3, "tiny_dense")
    model_cfg = get_model_config("tiny_dense")
    torch.manual_seed(cfg.seed)
    model = build_model(model_cfg)
    from asyncpp.reference.executor import parameter_delays, tied_head_use
    from asyncpp.reference.simulator import DelayedUpdateSimulator

    sim = DelayedUpdateSimulator(model, build_from_config(model, cfg.optimizer), parameter_delays(model, "2bw", 2),
                                 grad_clip=cfg.train.grad_clip, tied_use=tied_head_use(model, "2bw", 2))
    plain = [sim.step(t, [batch(t * 2 + j) for j in range(2)]).loss for t in range(3)]
    assert with_option == plain


@pytest.mark.slow  # re-tiered (session 8, the default suite's budget): 14 s; the bf16 pipeline equals the bf16 simulator by default
def test_bf16_training_tracks_fp32():
    """25 steps of 2BW (two simulated stages, delayed updates) on tiny_hybrid (GDN + attention + MoE),
    Muon: every step's bf16 loss is within 2% of the fp32 loss (measured: < 0.8%), and both learn."""
    _, fp32 = train("fp32", 25)
    _, bf16 = train("bf16", 25)
    for t, (a, b) in enumerate(zip(fp32, bf16)):
        assert abs(a - b) / a < 0.02, (t, a, b)
    assert bf16[-1] < 0.45 * bf16[0] and fp32[-1] < 0.45 * fp32[0]


def test_precision_is_validated_by_name():
    with pytest.raises(ConfigError, match="precision"):
        config("fp16", 2)
    assert compute_dtype_of("bf16") == BF16 and compute_dtype_of("fp32") == torch.float32
    with pytest.raises(ValueError, match="train.precision='fp8'"):
        compute_dtype_of("fp8")


@pytest.mark.equivalence
def test_bf16_run_resumes_bitwise_from_its_checkpoint(tmp_path):
    """The checkpoint holds the fp32 masters as x_t (and bf16 past versions): a resumed bf16 run continues
    exactly as the uninterrupted one."""
    from tests.unit.test_resume import run

    extra = ["train.precision=bf16", "schedule=2bw", "staleness.ef_lambda=1.0"]
    full, full_weights = run(tmp_path / "full", *extra)
    run(tmp_path / "part", *extra, stop_at=3)
    resumed, resumed_weights = run(tmp_path / "part", *extra)
    for t in range(6):
        assert resumed[t]["loss"] == full[t]["loss"], t
    for name, p in full_weights.items():
        assert p.dtype == BF16 and torch.equal(resumed_weights[name], p), name


@pytest.mark.equivalence
@pytest.mark.dist
def test_bf16_two_stage_pipeline_equals_the_bf16_simulator():
    """The engine's mixed-precision path (WeightVersions with fp32 masters, GradSums, bf16 activations
    between stages) against the simulator: 2 gloo ranks, 2BW, Error Feedback, tiny_hybrid. On CPU with
    one thread per process the floats are the same ones (as in tests/dist for fp32)."""
    from tests.dist.test_pipeline_equivalence import relative_error, run_pipeline
    from tests.dist.workers import make_config, reference_run

    cfg = make_config(model={"name": "tiny_hybrid"}, parallel={"pp": 2}, schedule={"name": "2bw"},
                      train={"precision": "bf16", "steps": 5}, staleness={"ef_lambda": 1.0})
    records, params, _ = run_pipeline(cfg)
    ref = reference_run(cfg)
    assert [r["loss"] for r in records] == [s.loss for s in ref["stats"]]
    for r, s in zip(records, ref["stats"]):
        assert r["grad_norm"] == pytest.approx(s.grad_norm, rel=1e-9)
        assert r["update_norm"] == pytest.approx(s.update_norm, rel=1e-9)
    for name, p in params.items():
        ref_p = ref["params"]["embed.weight" if name == "lm_head.weight" and name not in ref["params"] else name]
        assert p.dtype == BF16 and relative_error(p, ref_p) == 0.0, name


@pytest.mark.equivalence
@pytest.mark.dist
def test_bf16_pipeline_resumes_bitwise(tmp_path):
    """A 2-stage bf16 pipeline checkpoints x_t as the fp32 masters (WeightVersions.tensors) and refills its
    bf16 version from them on load (set_newest): the resumed run continues bit for bit."""
    from asyncpp.config import CheckpointConfig
    from tests.dist.test_checkpoint_resume import config, pipeline

    base = config(tmp_path, 2, train={"precision": "bf16", "steps": 6})
    full, full_params = pipeline(base)
    resumed, resumed_params = pipeline(base.replace(checkpoint=CheckpointConfig(
        enabled=False, resume=str(tmp_path / "ckpt" / "step_00000003"))))
    assert sorted(resumed) == [3, 4, 5]
    for t in (3, 4, 5):
        assert resumed[t]["loss"] == full[t]["loss"] and resumed[t]["grad_norm"] == full[t]["grad_norm"], t
    for name, p in full_params.items():
        assert p.dtype == BF16 and torch.equal(resumed_params[name], p), name
