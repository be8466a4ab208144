"""A pipeline stage's share of a checkpoint (asyncpp/train/checkpoint/: DCP, layout-free keys): its weight
versions, the update's per-parameter buffers (u_{t-1}, g_{t-1}), the optimizer and the versioned router bias,
keyed by full-model names; saved at a drain point and loaded in place on resume. Collective."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from asyncpp.config import RunConfig
from asyncpp.core.batches import BatchPlan
from asyncpp.core.partition import vocab_shards_of
from asyncpp.core.records import DataSource
from asyncpp.parallel.mesh import Mesh
from asyncpp.parallel.sharding import global_view, rows_view
from asyncpp.parallel.vocab_parallel import split_for_tp, vocab_shards
from asyncpp.pipeline.engine import StageEngine
from asyncpp.pipeline.stage import StageSpec, tied_parameters, vocab_rows
from asyncpp.train import checkpoint as ckpt


class StageCheckpoint:
    def __init__(self, cfg: RunConfig, mesh: Mesh, spec: StageSpec, model: nn.Module, engine: StageEngine,
                 data: DataSource, batches: BatchPlan, naming: Callable[[str], object]):
        self.cfg, self.mesh, self.spec, self.model, self.engine = cfg, mesh, spec, model, engine
        self.data, self.batches, self._naming = data, batches, naming
        self.saver = ckpt.Saver(cfg.checkpoint.async_save, timeout_s=cfg.train.timeout_s)

    def stage_state(self, extra: dict[str, Tensor] | None = None) -> ckpt.StageState:
        """This stage's share of a checkpoint, keyed by full-model names (a tied head as embed.weight)."""
        # A tied head is saved as embed.weight; a head split's untied replica under its own name (lm_head.weight).
        tied = {id(p) for p in tied_parameters(self.model, self.spec)} if self.model.config.tie_embeddings else set()
        names = ["embed.weight" if id(p) in tied else n for n, p in self.model.named_parameters() if p.requires_grad]
        v = self.engine.versions
        versions = {v.newest - version: v.tensors(version) for version in v.held()}
        copies = {v.newest - version: v.copies(version) for version in v.held()}  # saved by their masters' owners
        d = self.mesh.dims
        shards = [global_view(layout, self.mesh.device_mesh, d.tp, d.ep) for layout in self.engine.update.layouts]
        mirrors = None
        if self.spec.vocab is not None:  # the head's rows: pieces of the whole head (or of the tied embedding)
            rows, _ = vocab_rows(self.model, self.spec)
            params = [p for p in self.model.parameters() if p.requires_grad]
            i = next(k for k, p in enumerate(params) if p is rows)
            index = self.spec.stage * d.tp + self.mesh.tp_rank  # the statistics group's order: stage, TP rank
            view = rows_view(self.vocab_layout, index, self.model.config.vocab_size, self.mesh.vocab_groups.stats)
            if not (self.spec.is_first and id(rows) in tied):  # the first stage holds a tied embedding whole
                shards[i] = view
            if self.spec.embed is not None:  # a sharded embedding: the same rows of embed.weight (tp = 1)
                shards[next(k for k, p in enumerate(params) if p is self.model.embed.weight)] = view
            # A tied embedding's rows on a later stage equal the first stage's (one update of one gradient):
            # the first stage saves them whole, the others only load theirs.
            mirrors = [k == i and id(rows) in tied and not self.spec.is_first for k in range(len(params))]
        balancing = self.engine.update.balancing
        if extra is None:
            extra = balancing.tensors() if balancing is not None else {}
        update = self.engine.update
        buffers = {k: update.per_parameter(v) for k, v in update.rule.checkpoint_buffers().items()}
        return ckpt.StageState(names, versions, buffers, self.engine.update.optimizer, v.masters, shards,
                               extra=extra, copies=copies, mirrors=mirrors)

    @property
    def vocab_layout(self) -> list[tuple[int, int]]:
        """(start, rows) of every stage's TP ranks' head rows, in stage, then TP rank order."""
        rows = vocab_shards_of(self.cfg, self.model.config)
        return [(piece.start, piece.rows) for stage in vocab_shards(rows, self.model.config.vocab_size)
                for piece in split_for_tp(stage, self.mesh.dims.tp)]

    def save(self, step_done: int) -> None:
        """Collective; called at a drain point, where every stage holds x_{step_done} as its newest."""
        c = self.cfg
        d = self.mesh.dims
        layout = {"pp": d.pp, "dp": d.dp, "tp": d.tp, "ep": d.ep, "stage_layers": c.parallel.stage_layers}
        with self._naming(f"every rank's part of the checkpoint of step {step_done} (its collectives)"):
            self.saver.save(ckpt.checkpoint_root(c), step_done, self.stage_state(), config=c.to_dict(),
                            layout=layout, keep_last=c.checkpoint.keep_last,
                            data=ckpt.data_position(self.data, step_done, self.batches))

    def resume(self, warn: Callable[[str], None] | None = None) -> int | None:
        """Collective. Load checkpoint.resume's checkpoint, if any; returns its step (None: nothing to resume)."""
        point = ckpt.resume_point(self.cfg, self.data, **({"warn": warn} if warn is not None else {}))
        if point is None:
            return None
        path, step = point
        self.saver.resumed_from = path  # never pruned by this run
        v = self.engine.versions
        v.set_newest(step)  # buffers now stand for x_step, x_step-1, ...: DCP fills them in place
        ages = [step - version for version in v.held()]
        balancing = self.engine.update.balancing
        extra = balancing.reset(step, ages) if balancing is not None else {}
        with self._naming(f"every rank's part of loading {path} (its collectives)"):
            ckpt.load(path, self.stage_state(extra), ages=ages)
        v.set_newest(step)
        if balancing is not None:
            balancing.use(step)
        return step
