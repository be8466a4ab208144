"""Checkpoints written before issue 34's restructures still resume.

tests/fixtures/checkpoints_aee4099/ holds step 2 of a 4-step 2BW pipeline run (PP=2, Error Feedback, weight
prediction: three weight versions, u_{t-1}, Muon + AdamW state, the data position) saved by the code of commit
aee4099 (tests/fixtures/make_old_checkpoints.py says how). Today's code must restore every saved tensor exactly
and continue from it as the contract says.

The fixture's numbers were computed by one machine's kernels, so nothing here compares them with a run of today's
code from scratch (another CPU rounds the first two steps differently). What is compared is kernel-independent:
the restored tensors against the saved ones, bit for bit; and today's pipeline against today's simulator, both
continuing from the same restored state, at the bounds of tests/dist/test_checkpoint_resume.py's one-process
resume (the contract's fp32 1e-5, semantics.md)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from asyncpp.reference.executor import ReferenceExecutor
from asyncpp.train import checkpoint as ckpt
from asyncpp.train.trainer import Trainer
from model_zoo import build_model, get_model_config
from tests.dist.harness import run_ranks
from tests.dist.workers import data_for, optimizer_factory, pipeline_rank
from tests.fixtures.make_checkpoints_3f29e35 import config as new_config
from tests.fixtures.make_old_checkpoints import config
from tests.threads import single_thread

pytestmark = [pytest.mark.equivalence, pytest.mark.dist]

OLD = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoints_aee4099" / "2bw_ef_prediction" / "step_00000002"


def saved_tensors(path: Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under `prefixes`, read with DCP as plain tensors."""
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
           if k.startswith(prefixes) and hasattr(m, "size")}
    ckpt.quiet_single_process_dcp()
    dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return out


def test_a_checkpoint_of_the_old_layout_restores_every_tensor_and_resumes(tmp_path):
    old = tmp_path / "old" / OLD.name
    shutil.copytree(OLD, old)  # a resume must not need to write next to the fixture
    base = config(tmp_path / "unused", weight_prediction=True)
    cfg = base.replace(checkpoint=base.checkpoint.__class__(enabled=False, resume=str(old)),
                       out_dir=str(tmp_path / "resumed"))

    # Today's simulator restores x_2, x_1, x_0 and u_1 exactly as aee4099 saved them.
    model_cfg = get_model_config(cfg.model.name, **(cfg.model.overrides or {}))
    torch.manual_seed(1)  # another init on purpose: everything must come from the checkpoint
    model = build_model(model_cfg)
    saved = saved_tensors(old, ("weights/", "ef/"))
    with single_thread():
        data = data_for(cfg, model_cfg.vocab_size)
        executor = ReferenceExecutor(cfg, model, optimizer_factory(cfg)(model), data)
        assert Trainer(cfg, executor).resume() == 2
        sim = executor.sim
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        assert len(sim.history) == 2  # x_1 and x_0: weight prediction's extra version
        versions = [[q.detach() for q in sim.masters], *sim.history]
        for age, tensors in enumerate(versions):
            for name, x in zip(names, tensors):
                assert torch.equal(x, saved[f"weights/{age}/{name}"]), (age, name)
        for name, u in zip(names, sim.error_feedback.prev_update):
            assert torch.equal(u, saved[f"ef/{name}"]), name
        assert any(u.abs().sum() > 0 for u in sim.error_feedback.prev_update)  # u_1 is a real update
        m = cfg.train.num_microbatches
        reference = {t: sim.step(t, [data.train_microbatch(t * m + j) for j in range(m)]) for t in (2, 3)}

    # Today's pipeline resumes the same checkpoint and continues as the simulator does.
    results = run_ranks(pipeline_rank, 2, cfg.to_dict())
    records = {r["step"]: r for res in results for r in res["records"]}
    assert sorted(records) == [2, 3] and [res["num_buffers"] for res in results] == [3, 3]
    for t in (2, 3):
        assert records[t]["loss"] == pytest.approx(reference[t].loss, rel=1e-6), t
    params = {n: p for res in results for n, p in res["params"].items()}
    for name, p in model.named_parameters():
        ref = params.get(name, params.get("lm_head.weight"))
        assert float((p.detach() - ref).norm() / ref.norm()) < 1e-5, name


# ---- checkpoints of 3f29e35: before both executors assembled their checkpoint state through one path ----------
NEW = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoints_3f29e35"


def resume_simulator(old: Path, cfg) -> tuple[ReferenceExecutor, object]:
    """Today's simulator of `cfg`, built from another seed, resumed from `old` (a copy of the fixture)."""
    model_cfg = get_model_config(cfg.model.name, **(cfg.model.overrides or {}))
    torch.manual_seed(1)  # another init on purpose: everything must come from the checkpoint
    model = build_model(model_cfg, seed=1)
    data = data_for(cfg, model_cfg.vocab_size)
    executor = ReferenceExecutor(cfg, model, optimizer_factory(cfg)(model), data)
    assert Trainer(cfg, executor).resume() == 2
    return executor, data


def assert_restored(executor: ReferenceExecutor, old: Path) -> None:
    """Every tensor of the simulator's checkpoint state equals the saved one bit for bit: the weight versions, u_{t-1},
    g_{t-1}, the router-bias versions (and they moved: real state, not zeros or the init)."""
    sim = executor.sim
    saved = saved_tensors(old, ("weights/", "ef/", "gef/", "balancing/"))
    names = [n for n, p in executor.model.named_parameters() if p.requires_grad]
    versions = [[q.detach() for q in sim.masters], *sim.history]
    assert len(versions) == 2  # x_2, x_1 (2BW)
    for age, tensors in enumerate(versions):
        for name, x in zip(names, tensors):
            assert torch.equal(x, saved[f"weights/{age}/{name}"]), (age, name)
    buffers = {"ef": sim.error_feedback.prev_update, "gef": sim.grad_error_feedback.prev_grad}
    for kind, tensors in buffers.items():
        assert any(t.abs().sum() > 0 for t in tensors), kind
        for name, t in zip(names, tensors):
            assert torch.equal(t, saved[f"{kind}/{name}"]), (kind, name)
    biases = {k: v for k, v in saved.items() if k.startswith("balancing/")}
    assert sorted(biases) == sorted(sim.balancing.state_dict()) and len(biases) == 4  # 2 routers x 2 ages
    for key, bias in sim.balancing.state_dict().items():
        assert torch.equal(bias, biases[key]), key
    assert any(b.abs().sum() > 0 for b in biases.values())  # the bias moved before step 2
    for name, router in sim.balancing.routers.items():  # the routers hold x_2's bias
        assert torch.equal(router.expert_bias, biases[f"balancing/0/{name}"]), name


def test_a_pipeline_checkpoint_with_router_biases_and_gradient_ef_resumes_in_both_executors(tmp_path):
    """3f29e35's 2-stage pipeline checkpoint (tiny_moe, aux-loss-free balancing, update- and gradient-level EF)
    restores exactly into today's simulator and today's pipeline, which then continue alike."""
    old = tmp_path / "old" / "step_00000002"
    shutil.copytree(NEW / "pipeline_moe_gef" / old.name, old)
    base = new_config(tmp_path / "unused")
    cfg = base.replace(checkpoint=base.checkpoint.__class__(enabled=False, resume=str(old)),
                       out_dir=str(tmp_path / "resumed"))
    with single_thread():
        executor, data = resume_simulator(old, cfg)
        assert_restored(executor, old)
        m = cfg.train.num_microbatches
        reference = {t: executor.sim.step(t, [data.train_microbatch(t * m + j) for j in range(m)]) for t in (2, 3)}

    results = run_ranks(pipeline_rank, 2, cfg.to_dict())
    records = {r["step"]: r for res in results for r in res["records"]}
    assert sorted(records) == [2, 3]
    for t in (2, 3):  # the contract's fp32 bound for a pipeline against the simulator (semantics.md)
        assert records[t]["loss"] == pytest.approx(reference[t].loss, rel=1e-6), t
    params = {n: p for res in results for n, p in res["params"].items()}
    for name, p in executor.model.named_parameters():
        ref = params.get(name, params.get("lm_head.weight"))
        assert float((p.detach() - ref).norm() / ref.norm()) < 1e-5, name


def test_a_bf16_simulator_checkpoint_with_router_biases_and_gradient_ef_resumes(tmp_path):
    """3f29e35's single-process checkpoint under bf16 (x_t saved as the fp32 masters, x_1 in bf16) restores exactly:
    the masters, the past version, u_1, g_1, the router biases; the bf16 parameters are the masters' cast."""
    old = tmp_path / "old" / "step_00000002"
    shutil.copytree(NEW / "simulator_moe_gef_bf16" / old.name, old)
    base = new_config(tmp_path / "unused", precision="bf16")
    cfg = base.replace(checkpoint=base.checkpoint.__class__(enabled=False, resume=str(old)),
                       out_dir=str(tmp_path / "resumed"))
    with single_thread():
        executor, _ = resume_simulator(old, cfg)
    assert_restored(executor, old)
    sim = executor.sim
    assert {q.dtype for q in sim.masters} == {torch.float32} and {x.dtype for x in sim.history[0]} == {torch.bfloat16}
    for p, q in zip(sim.params, sim.masters):
        assert torch.equal(p.detach(), q.detach().to(torch.bfloat16))
