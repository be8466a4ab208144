"""Checkpoints written before issue 34's restructure still resume.

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
