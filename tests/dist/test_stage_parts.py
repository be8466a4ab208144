"""A third part plugs into a stage without touching the engine (pipeline/parts.py, issue 42).

The toy part owns an action kind of its own (P, placed after every FORWARD), and its share of the step's gradient
is complete at the step's last P (its `gradient_op`). It is run beside a vocabulary-parallel head and a sharded
embedding on a 2-stage pipeline. It does no arithmetic, so the run with it must equal the run without it bit for
bit (its evaluations too), and it records what the engine and the executor did for it: every P ran once, on its
action's weight version (the module pointed at that version's buffer), its share joined every step's gradient once,
in step order, and every evaluation batch passed its two evaluation hooks, before and after the stage's layers."""

from __future__ import annotations

import dataclasses
import math
from enum import Enum

import pytest
import torch
from torch import Tensor, nn

from asyncpp import job
from asyncpp.pipeline.build import build_rank_stage
from asyncpp.pipeline.compose import pipeline_executor
from asyncpp.pipeline.executor import PipelineExecutor
from asyncpp.pipeline.parts import Part, PartAction
from asyncpp.schedules.actions import Action, Op
from asyncpp.train.trainer import Trainer
from tests.dist.harness import run_ranks
from tests.dist.workers import Collect, data_for, make_config, rank_layout

pytestmark = pytest.mark.usefixtures("one_thread")


class ToyOp(str, Enum):
    PROBE = "P"


class VersionProbe(Part):
    """Owns the P actions; reads which weight version the module points at."""

    gradient_op = ToyOp.PROBE

    def __init__(self) -> None:
        self.versions = None  # the engine's, set once it is built
        self.ran: list[tuple[int, int, int, bool]] = []  # (step, microbatch, version, module on that version)
        self.added: list[int] = []
        self.evaluated: list[str] = []  # "before" / "after", one pair per evaluation batch

    def actions(self) -> dict:
        return {ToyOp.PROBE: PartAction(self._run)}

    def _run(self, a: Action, _) -> None:
        v = self.versions
        buffer = v.buffers[a.version % v.num_buffers]
        on_version = all(p.data_ptr() == b.data_ptr() for p, b in zip(v.params, buffer))
        self.ran.append((a.step, a.microbatch, a.version, on_version))

    def add_into(self, step: int, grads: list[Tensor], params: list[nn.Parameter]) -> None:
        self.added.append(step)

    def evaluate_before(self, inputs: Tensor | None) -> None:
        assert inputs is not None  # a part of every stage reads the batches (reads_batches: the head's labels)
        self.evaluated.append("before")

    def evaluate_after(self, labels: Tensor | None) -> None:
        self.evaluated.append("after")


class ProbedExecutor(PipelineExecutor):
    def actions_of(self, t0: int, t1: int) -> list[Action]:
        out = []
        for a in super().actions_of(t0, t1):
            out.append(a)
            if a.op is Op.FORWARD:
                out.append(dataclasses.replace(a, op=ToyOp.PROBE))
        return out


def run_once(cfg, model_cfg, mesh, probe: VersionProbe | None) -> dict:
    torch.manual_seed(cfg.seed)
    stage = build_rank_stage(cfg, model_cfg, mesh, "cpu")
    data, optimizer = data_for(cfg, model_cfg.vocab_size), job.optimizer_for(cfg, mesh)
    if probe is None:
        run = pipeline_executor(cfg, stage, mesh, data, optimizer)
    else:
        run = pipeline_executor(cfg, stage, mesh, data, optimizer, parts=[probe], executor_cls=ProbedExecutor)
        probe.versions = run.engine.versions
    before = [p.detach().clone() for p in run.model.parameters()]
    sink = Collect()
    Trainer(cfg, run, sink).run()
    params = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    return {"records": sink.records, "params": params, "parts": [type(p).__name__ for p in run.engine.parts],
            "moved": any(not torch.equal(p, q) for p, q in zip(before, params.values()))}


def probed_rank(rank: int, cfg_dict: dict) -> dict:
    cfg, model_cfg, mesh = rank_layout(cfg_dict)
    plain = run_once(cfg, model_cfg, mesh, None)
    probe = VersionProbe()
    probed = run_once(cfg, model_cfg, mesh, probe)
    return {"stage": mesh.pp_rank, "plain": plain, "probed": probed, "ran": probe.ran, "added": probe.added,
            "evaluated": probe.evaluated}


def values(records: list[dict]) -> list[tuple]:
    """What a step computed (not how long it took)."""
    return [(r["step"], r["loss"], r["grad_norm"], r["update_norm"], r["lr"], r["skipped"], r.get("val_loss"))
            for r in records]


def test_a_toy_part_runs_in_a_pipeline_without_changing_it():
    steps, m, eval_batches = 4, 2, 2
    cfg = make_config(parallel={"pp": 2, "head": "vocab", "embedding": "vocab"},
                      model={"name": "tiny_dense", "overrides": {"tie_embeddings": False}},
                      train={"steps": steps, "num_microbatches": m, "eval_every": 2, "eval_batches": eval_batches},
                      optimizer={"name": "adamw"})
    results = run_ranks(probed_rank, 2, cfg.to_dict())
    assert [len(r["plain"]["records"]) for r in results] == [0, steps]  # the writer, the last stage, logs them
    evaluated = [v["val_loss"] for v in results[1]["probed"]["records"] if v.get("val_loss") is not None]
    assert len(evaluated) == steps // 2 and all(math.isfinite(v) for v in evaluated)  # compared with plain below
    for r in results:
        assert r["probed"]["parts"] == ["VocabHead", "VocabEmbedding", "VersionProbe"]
        assert sorted((t, j) for t, j, _, _ in r["ran"]) == [(t, j) for t in range(steps) for j in range(m)]
        assert all(on for *_, on in r["ran"]), r["ran"]  # the engine switched to each P's version first
        assert len({v for _, _, v, _ in r["ran"]}) > 1  # ... and the versions did change over the run
        assert r["added"] == list(range(steps))
        assert r["evaluated"] == ["before", "after"] * (steps // 2) * eval_batches  # evaluations at steps 2 and 4
        assert values(r["probed"]["records"]) == values(r["plain"]["records"])
        for name, p in r["plain"]["params"].items():
            assert torch.equal(r["probed"]["params"][name], p), (r["stage"], name)
        assert r["plain"]["moved"]  # the runs trained: the equality above is not of two untouched models
