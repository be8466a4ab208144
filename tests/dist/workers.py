"""What each rank runs in the multi-process tests, and the single-process references they must equal."""

from __future__ import annotations

import time

import torch
from torch import Tensor

from asyncpp import job
from asyncpp.config import RunConfig
from asyncpp.core.batches import BatchPlan
from asyncpp.core.loss import LossFn, lm_loss
from asyncpp.core.records import StepMetrics
from asyncpp.optim import build_from_config
from asyncpp.parallel.experts import ExpertDispatcher
from asyncpp.parallel.mesh import Mesh, ParallelDims
from asyncpp.pipeline.build import build_rank_stage, mesh_for
from asyncpp.pipeline.compose import pipeline_executor
from asyncpp.pipeline.reduction import GradientReduction
from asyncpp.pipeline.vocab_embedding import VocabEmbedding
from asyncpp.pipeline.vocab_head import VocabHead
from asyncpp.reference.executor import build_simulator, evaluate
from asyncpp.train.trainer import Trainer
from model_zoo import ModelConfig, build_model, get_model_config
from model_zoo.init import read_weights_file
from tests.threads import single_thread


class SyntheticData:
    """Random tokens, a pure function of (seed, index): the same on every rank and in the reference."""

    def __init__(self, vocab: int, seq_len: int, micro_batch_size: int, seed: int, eval_batches: int = 2):
        self.vocab, self.shape, self.seed, self.eval_batches = vocab, (micro_batch_size, seq_len + 1), seed, eval_batches

    def _batch(self, index: int, stream: int) -> Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index * 7 + stream)
        # a learnable pattern (next token = token + 1 half the time) so losses move
        x = torch.randint(0, self.vocab, self.shape, generator=g)
        x[:, 1::2] = (x[:, 0:-1:2] + 1) % self.vocab
        return x

    def train_microbatch(self, index: int) -> Tensor:
        return self._batch(index, 0)

    def val_batches(self) -> list[Tensor]:
        return [self._batch(i, 1) for i in range(self.eval_batches)]


def make_config(**sections) -> RunConfig:
    base = {
        "model": {"name": "tiny_dense"},
        "train": {"steps": 6, "micro_batch_size": 2, "num_microbatches": 4, "seq_len": 16, "eval_every": 0,
                  "grad_clip": 1.0},
        "optimizer": {"name": "muon", "lr": 0.02, "schedule": {"kind": "constant", "warmup_steps": 0}},
        "schedule": {"name": "2bw"},
        "logging": {"wandb_mode": "disabled", "progress": False},
        "checkpoint": {"enabled": False},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return RunConfig.from_dict(base)


def optimizer_factory(cfg: RunConfig):
    return lambda model, sharding=None: build_from_config(model, cfg.optimizer)


def data_for(cfg: RunConfig, vocab: int) -> SyntheticData:
    return SyntheticData(vocab, cfg.train.seq_len, cfg.train.micro_batch_size, cfg.seed, cfg.train.eval_batches)


class Collect:
    """The metrics sink the trainer logs to on the writer rank: keeps the records, drops messages."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def log(self, record: StepMetrics) -> None:
        self.records.append(record.to_json())  # the metrics.jsonl line

    def message(self, text: str) -> None:
        pass

    def rewind(self, step: int) -> None:
        self.records = [r for r in self.records if r["step"] < step]


def rank_layout(cfg_dict: dict) -> tuple[RunConfig, ModelConfig, Mesh]:
    """A worker's run config, model config (both validated) and CPU mesh at the process group's world size."""
    cfg = RunConfig.from_dict(cfg_dict)
    model_cfg = get_model_config(cfg.model.name, **(cfg.model.overrides or {}))
    cfg = cfg.validate(model_cfg)  # the resolved config (derived microbatch count, warmup), as pretrain runs
    p = cfg.parallel
    dims = ParallelDims.for_world(torch.distributed.get_world_size(), pp=p.pp, tp=p.tp, ep=p.ep, dp=p.dp)
    return cfg, model_cfg, mesh_for(cfg, model_cfg, dims, "cpu", timeout_s=cfg.train.timeout_s)


def pipeline_rank(rank: int, cfg_dict: dict) -> dict:
    """One rank of a pipeline run: losses (last stage) and this stage's final parameters by name."""
    cfg, model_cfg, mesh = rank_layout(cfg_dict)
    torch.manual_seed(cfg.seed)
    stage = build_rank_stage(cfg, model_cfg, mesh, "cpu")
    run = pipeline_executor(cfg, stage, mesh, data_for(cfg, model_cfg.vocab_size), job.optimizer_for(cfg, mesh))
    sink = Collect()
    trainer = Trainer(cfg, run, sink)
    trainer.resume()
    summary = trainer.run()
    params = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    v = run.engine.versions
    # The fp32 masters this rank holds apart from its weight versions (bf16; in fp32 they are the newest version).
    master_bytes = sum(q.numel() * q.element_size() for q in v.masters if q is not None) if v.mixed else 0
    return {"stage": mesh.pp_rank, "dp": mesh.dp_rank, "tp": mesh.tp_rank, "ep": mesh.ep_rank, "records": sink.records,
            "params": params, "summary": summary, "layouts": {n: (l.tp_dim, l.expert) for n, l in run.sharding.items()},
            "master_bytes": master_bytes, "num_buffers": v.num_buffers,
            "version_bytes": sum(x.numel() * x.element_size() for buffer in v.buffers for x in buffer),
            "vocab": vocab_report(run.engine.part(VocabHead)),
            "embedding": embedding_report(run.engine.part(VocabEmbedding))}


def embedding_report(embedding) -> dict | None:
    """What a sharded embedding's stage did: its rows, its parameter's rows, its E and G passes."""
    if embedding is None:
        return None
    return {"start": embedding.shard.start, "rows": embedding.shard.rows, "param_rows": embedding.param.shape[0],
            "lookups": embedding.lookups, "gradients": embedding.gradients}


def vocab_report(head) -> dict | None:
    """What a vocabulary-parallel head's stage did: its rows, the widths of the logits it computed, its passes."""
    if head is None:
        return None
    return {"start": head.shard.start, "rows": head.shard.rows, "widths": sorted(head.logits_widths),
            "passes": head.passes, "param_rows": head.param.shape[0], "held_peak": head.held_peak}


def reference_run(cfg: RunConfig, loss_fn: LossFn = lm_loss) -> dict:
    """The single-process simulator on the same seed, data and config (`loss_fn`: how it evaluates the model's
    loss of a microbatch, asyncpp.core.loss.LossFn).

    Runs on one thread like the ranks do: CPU matmul kernels block differently with more threads,
    and the rounding differences would otherwise be amplified by Newton-Schulz and AdamW over steps.
    """
    with single_thread():
        return _reference_run(cfg, loss_fn)


def _reference_run(cfg: RunConfig, loss_fn: LossFn) -> dict:
    model_cfg = get_model_config(cfg.model.name, **(cfg.model.overrides or {}))
    cfg = cfg.validate(model_cfg)  # resolved like the ranks' (rank_layout)
    torch.manual_seed(cfg.seed)
    model = build_model(model_cfg)
    if cfg.checkpoint.init_from:  # the file's weights, as every rank's stage build copies them
        model.load_state_dict(read_weights_file(cfg.checkpoint.init_from)[0], strict=not model_cfg.tie_embeddings)
    sim = build_simulator(cfg, model, optimizer_factory(cfg)(model), loss_fn)
    data = data_for(cfg, model_cfg.vocab_size)
    plan = BatchPlan.of(cfg)  # m_t * dp microbatches from the step's first global index (a rampup grows m_t)
    stats, val = [], None
    for t in range(cfg.train.steps):
        first, n = plan.first_microbatch(t), plan.microbatches(t) * plan.dp
        stats.append(sim.step(t, [data.train_microbatch(first + j) for j in range(n)]))
        if cfg.train.eval_every and ((t + 1) % cfg.train.eval_every == 0 or t == cfg.train.steps - 1):
            val = evaluate(model, data.val_batches(), torch.device("cpu"))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"stats": stats, "params": params, "val_loss": val}


def pipeline_rank_late_after_update_start(rank: int, cfg_dict: dict, late_rank: int, delay_s: float) -> dict:
    """pipeline_rank, with `late_rank` pausing `delay_s` right after it posts each step's DP all-reduce: at its
    next action boundary that all-reduce has arrived, while the other ranks reach theirs at once and find it
    still in flight, so reduction.progress() posts the norm all-reduce at a different action on different
    ranks (issue 30: that must not share a group with the forward's collectives). Also returns, per step, how
    many expert dispatches this rank had run when it posted the step's norm all-reduce."""
    posted_after: dict[int, int] = {}
    dispatches = [0]
    dispatch, start_norm, start_dp = (ExpertDispatcher.dispatch, GradientReduction._start_norm,
                                      GradientReduction._start_data_parallel)

    def counted_dispatch(self, *args):
        dispatches[0] += 1
        return dispatch(self, *args)

    def recorded_start_norm(self, p):
        posted_after[p.step] = dispatches[0]
        return start_norm(self, p)

    def late_start_dp(self, p):
        buckets = start_dp(self, p)
        if rank == late_rank:
            time.sleep(delay_s)
        return buckets

    # Patched in this spawned process only.
    ExpertDispatcher.dispatch, GradientReduction._start_norm = counted_dispatch, recorded_start_norm
    GradientReduction._start_data_parallel = late_start_dp
    return {**pipeline_rank(rank, cfg_dict), "norm_posted_after_dispatches": posted_after}
