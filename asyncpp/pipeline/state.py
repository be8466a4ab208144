"""A pipeline stage's share of a checkpoint (asyncpp/train/checkpoint/: DCP, layout-free keys): its weight
versions, the update's per-parameter buffers (u_{t-1}, g_{t-1}), the optimizer and the versioned router bias,
keyed by full-model names; saved at a drain point and loaded in place on resume. Collective.

What is the pipeline's own here is where its tensors sit in the full model (names, TP/EP shards, a vocabulary-
parallel head's rows); the assembly, the save and the load are the simulator's too (train/checkpoint/parts.py)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

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


class StageCheckpoint(ckpt.Checkpointer):
    """A pipeline stage's share of a checkpoint, by full-model names: its save and its resume (the module
    docstring); the checkpoint machinery itself is the simulator's too (train/checkpoint)."""

    def __init__(self, cfg: RunConfig, mesh: Mesh, spec: StageSpec, model: nn.Module, engine: StageEngine,
                 data: DataSource, batches: BatchPlan, naming: Callable[[str], object]):
        self.mesh, self.spec, self.model, self.engine = mesh, spec, model, engine
        d = mesh.dims
        layout = {"pp": d.pp, "dp": d.dp, "tp": d.tp, "ep": d.ep, "stage_layers": cfg.parallel.stage_layers}
        super().__init__(cfg, self._parts, data, batches, layout, timeout_s=cfg.train.timeout_s, naming=naming)

    def _parts(self) -> ckpt.StageParts:
        """This stage's parts, keyed by full-model names (a tied head as embed.weight)."""
        # A tied head is saved as embed.weight; a head split's untied replica under its own name (lm_head.weight).
        tied = {id(p) for p in tied_parameters(self.model, self.spec)} if self.model.config.tie_embeddings else set()
        names = ["embed.weight" if id(p) in tied else n for n, p in self.model.named_parameters() if p.requires_grad]
        d = self.mesh.dims
        update = self.engine.update
        shards = [global_view(layout, self.mesh.device_mesh, d.tp, d.ep) for layout in update.layouts]
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
        versions = self.engine.versions
        return ckpt.StageParts(names, versions, update.rule, update.optimizer, versions.masters, update.balancing,
                               aligned=update.per_parameter, shards=shards, mirrors=mirrors)

    @property
    def vocab_layout(self) -> list[tuple[int, int]]:
        """(start, rows) of every stage's TP ranks' head rows, in stage, then TP rank order."""
        rows = vocab_shards_of(self.cfg, self.model.config)
        return [(piece.start, piece.rows) for stage in vocab_shards(rows, self.model.config.vocab_size)
                for piece in split_for_tp(stage, self.mesh.dims.tp)]

    def stage_state(self) -> ckpt.StageState:
        """This stage's share of a checkpoint as a save writes it (the traced dry run measures its cost)."""
        return self._parts().state()
