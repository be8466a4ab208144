"""semantics.md "What must hold" 5, single process: a run stopped at a step boundary and resumed from
its checkpoint continues exactly as the uninterrupted run (weights, past versions, u_{t-1}, optimizer
state, data position)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from asyncpp import job
from asyncpp.reference.executor import ReferenceExecutor
from asyncpp.train import checkpoint as ckpt
from asyncpp.train.trainer import Trainer
from model_zoo import build_model

BASE = ["logging=disabled", "logging.progress=false", "model=tiny_dense", "train.steps=6", "train.eval_every=0",
        "train.micro_batch_size=2", "train.num_microbatches=2", "train.seq_len=32", "checkpoint.every=3",
        "optimizer.schedule.warmup_steps=2"]


class Stop(Exception):
    pass


def run(out_dir, *overrides, stop_at: int | None = None):
    cfg, model_cfg = job.resolve(job.compose([f"out_dir={out_dir}", *BASE, *overrides]))
    torch.manual_seed(cfg.seed)
    model = build_model(model_cfg)
    executor = ReferenceExecutor(cfg, model, job.build_from_config(model, cfg.optimizer),
                                 job.build_data(cfg, model_cfg))
    trainer = Trainer(cfg, executor, job.make_metrics(cfg, model_cfg))
    trainer.resume()
    if stop_at is not None:
        step = executor.sim.step

        def stopping(t, batches):
            if t == stop_at:
                raise Stop  # like a preemption right after the step-3 checkpoint
            return step(t, batches)

        executor.sim.step = stopping
    try:
        trainer.run()
    except Stop:
        executor.saver.wait()  # the stop comes after a background save of step 3 finished
    finally:
        trainer.metrics.close({})
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records}, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.equivalence
@pytest.mark.parametrize("schedule, extra", [
    ("2bw", ["staleness.ef_lambda=1.0"]),
    ("pipedream", ["parallel.pp=2"]),
    ("sync", ["optimizer=adamw"]),
    ("2bw", ["staleness.grad_ef_lambda=0.5", "staleness.weight_prediction=true", "optimizer=lion"]),
    ("2bw", ["checkpoint.async_save=true"]),
    # A batch rampup (micro batch 2, global 4): m = 1, 1, 1, 1, 2, 2, so the step-3 checkpoint is in the middle
    # of the ramp's first piece, before its change at step 4; with [2, 2, 2], m = 1, 2, 2, ... (a change at step 1).
    ("2bw", ["train.batch_rampup=[2,2,7]"]),
    ("sync", ["train.batch_rampup=[2,2,2]"]),
])
def test_resumed_run_equals_uninterrupted_bitwise(tmp_path, schedule, extra):
    full, full_weights = run(tmp_path / "full", f"schedule={schedule}", *extra)
    part, _ = run(tmp_path / "part", f"schedule={schedule}", *extra, stop_at=3)
    assert sorted(part) == [0, 1, 2]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "part" / "checkpoints")] == ["step_00000003"]
    resumed, resumed_weights = run(tmp_path / "part", f"schedule={schedule}", *extra)  # resume=auto
    assert sorted(resumed) == list(range(6))
    for t in range(6):
        assert resumed[t]["loss"] == full[t]["loss"], t
        assert resumed[t]["grad_norm"] == full[t]["grad_norm"], t
    for name, p in full_weights.items():
        assert torch.equal(resumed_weights[name], p), name


@pytest.mark.equivalence
def test_resume_after_the_checkpoint_rewrites_the_lost_steps_once(tmp_path):
    """Killed at step 5, two steps after the step-3 checkpoint: the resumed run recomputes steps 3-4, and
    metrics.jsonl ends with each step once (the killed run's records of 3-4 dropped, a torn line too)."""
    full, _ = run(tmp_path / "full", "schedule=2bw")
    part, _ = run(tmp_path / "part", "schedule=2bw", stop_at=5)
    assert sorted(part) == [0, 1, 2, 3, 4]
    with open(tmp_path / "part" / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 1.2')  # a writer killed mid-line
    run(tmp_path / "part", "schedule=2bw")
    lines = (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == list(range(6))
    assert [r["loss"] for r in records] == [full[t]["loss"] for t in range(6)]


def test_checkpoint_contents_and_atomicity(tmp_path):
    run(tmp_path, "schedule=2bw", "staleness.ef_lambda=1.0")
    found = ckpt.list_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in found] == ["step_00000003", "step_00000006"]
    manifest = ckpt.read_manifest(found[-1])
    assert manifest["step"] == 6 and manifest["config"]["schedule"]["name"] == "2bw"
    assert manifest["code_version"] and len(manifest["rng"]) == 1
    keys = set(torch.distributed.checkpoint.FileSystemReader(str(found[-1])).read_metadata().state_dict_metadata)
    assert "weights/0/embed.weight" in keys and "weights/1/embed.weight" in keys  # both 2BW versions
    assert "ef/layers.0.mlp.up_proj.weight" in keys
    assert "optim/layers.0.mlp.up_proj.weight/momentum_buffer" in keys
    assert "optim/embed.weight/exp_avg_sq" in keys
    # a save that died half-way leaves a temporary directory that is never taken for a checkpoint
    (tmp_path / "checkpoints" / ".tmp-step_00000009-dead").mkdir()
    (tmp_path / "checkpoints" / "step_00000012").mkdir()  # no manifest: incomplete
    assert ckpt.latest(tmp_path / "checkpoints").name == "step_00000006"
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        ckpt.read_manifest(tmp_path / "checkpoints" / "step_00000012")


def test_keep_last_prunes_old_checkpoints(tmp_path):
    run(tmp_path, "schedule=2bw", "checkpoint.every=1", "checkpoint.keep_last=2")
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")] == ["step_00000005", "step_00000006"]


def test_a_training_checkpoint_exports_to_hugging_face_with_identical_logits(tmp_path):
    from tools import hf

    _, weights = run(tmp_path / "run", "schedule=2bw")
    step_dir = ckpt.latest(tmp_path / "run" / "checkpoints")
    assert hf.main(["export", "--checkpoint", str(step_dir), "--out", str(tmp_path / "hf"), "--verify"]) == 0
    state, cfg = hf.load_checkpoint_weights(step_dir)
    assert cfg.name == "tiny_dense"
    for name, p in weights.items():
        assert torch.equal(state[name], p), name


class _Stream:
    def __init__(self, **identity):
        self._identity = identity

    def identity(self) -> dict:
        return self._identity


def test_resume_point_finds_the_latest_checkpoint_and_warns_when_the_data_stream_changed(tmp_path):
    def cfg(resume):
        return job.resolve(job.compose([f"out_dir={tmp_path}", *BASE, f"checkpoint.resume={resume}"]))[0]

    root = tmp_path / "checkpoints"
    for step in (3, 6):
        (root / f"step_{step:08d}").mkdir(parents=True)
        ckpt.quiet_single_process_dcp()  # whole shards: auto picks the newest intact checkpoint
        dcp.save({"x": torch.zeros(4)}, checkpoint_id=str(root / f"step_{step:08d}"), no_dist=True)
        data = {"identity": {"dataset": "corpus-a", "seq_len": 32}}
        (root / f"step_{step:08d}" / ckpt.MANIFEST).write_text(json.dumps({"step": step, "data": data}))
    warnings: list[str] = []
    assert ckpt.resume_point(cfg("none"), _Stream(dataset="corpus-a", seq_len=32), warnings.append) is None
    same = ckpt.resume_point(cfg("auto"), _Stream(dataset="corpus-a", seq_len=32), warnings.append)
    assert same == (root / "step_00000006", 6) and warnings == []
    chosen = ckpt.resume_point(cfg(root / "step_00000003"), _Stream(dataset="corpus-b", seq_len=32), warnings.append)
    assert chosen == (root / "step_00000003", 3)
    assert len(warnings) == 1 and "(dataset)" in warnings[0] and "different samples" in warnings[0]
    (root / "step_00000009").mkdir()  # no manifest: a save that never finished
    with pytest.raises(FileNotFoundError, match="not a complete asyncpp checkpoint"):
        ckpt.resume_point(cfg(root / "step_00000009"), _Stream(dataset="corpus-a", seq_len=32), warnings.append)
