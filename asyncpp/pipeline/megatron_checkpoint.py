"""A drained Pipeline2BW's checkpoint (the Megatron front-end, asyncpp/pipeline/megatron.py): saved and loaded
through asyncpp's own checkpoint machinery (asyncpp/train/checkpoint: DCP, atomic step_* directories, a manifest,
keep_last), so the two front-ends cannot write different checkpoints of the same state.

What a drained 2BW stage holds, and so what is saved (StageParts, keyed by the unsplit model's names):
    weights/<age>/<name>   x_k and x_{k-1}: 2BW's next call reads x_{k-1} for b_k (its forwards) while the update
                           of b_k is computed from the newest
    ef/<name>, gef/<name>  Error Feedback's u_{k-1}, gradient-level EF's g_{k-1} (when on)
    optim/<name>/<key>     the optimizer state (Muon's momentum, AdamW's moments and step)
and, in the manifest: the step k (the next call's minibatch b_k, = Megatron's iteration), the loss scale the
stream ran at, the newest applied update's record (optimizer_step() reports it until the resumed stream's first
update), the layout and the caller's config. Weight prediction keeps no state of its own: it extrapolates
from the versions and the optimizer state, both saved.

Names: megatron numbers each stage's layers and each EP rank's experts from 0; here they are the unsplit model's
(global_name), so the keys are the same whatever the layout, and TP shards are DTensor views of the whole tensor
(param_layouts), as asyncpp's own stages save them. A tied output layer on the last stage is saved under the
embedding's name; both copies hold the same values (one update of one summed gradient), so DCP keeps one.
A vocabulary-spread stage's rows (VocabSpreadStage: the head's, a sharded embedding's) are pieces of the whole
output_layer.weight / embedding.word_embeddings.weight at their offsets (spread_rows_of), so whatever the layout
the newest weights (train/checkpoint.newest_weights; megatron_state_dict adds the routers' expert bias) are an
unsplit GPTModel's state dict.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor, nn

from asyncpp.parallel.sharding import global_view, rows_view
from asyncpp.pipeline.megatron import Pipeline2BW, param_layouts
from asyncpp.pipeline.megatron_vocab import EMBEDDING, HEAD, VocabSpreadStage, _gpt, rows_layout
from asyncpp.pipeline.megatron_vocab_pipeline import VocabPipeline2BW
from asyncpp.pipeline.update import StepRecord
from asyncpp.train.checkpoint import (
    MANIFEST,
    StageParts,
    is_complete,
    latest_intact,
    newest_weights,
    read_manifest,
    saved_under,
    step_of,
)
from asyncpp.train.checkpoint.saver import Saver


def global_name(model: nn.Module, name: str) -> str:
    """A stage's parameter name in the unsplit model: megatron numbers a stage's layers from 0, their
    layer_number is global; an EP rank numbers its experts from 0 (local_expert_indices are global); the last
    stage's tied output weight is the embedding."""
    if name.startswith("decoder.layers."):
        index, rest = name[len("decoder.layers."):].split(".", 1)
        layer = model.decoder.layers[int(index)]
        local = "mlp.experts.local_experts."
        if rest.startswith(local):
            expert, tail = rest[len(local):].split(".", 1)
            rest = f"{local}{layer.mlp.local_expert_indices[int(expert)]}.{tail}"
        return f"decoder.layers.{layer.layer_number - 1}.{rest}"
    if name == "output_layer.weight" and getattr(model, "share_embeddings_and_output_weights", False):
        return "embedding.word_embeddings.weight"
    return name


@dataclass(frozen=True)
class RowPiece:
    """A vocabulary-spread stage's trained rows as a piece of the unsplit model's weight `name`."""

    name: str
    shard: Callable[[Tensor], Tensor]
    """rows_view: the rows at their offset in the whole [vocab, hidden] weight (DCP saves and loads by it)."""
    mirror: bool
    """A copy of rows another stage holds whole and saves (a tied model's table on the first stage): loaded only."""


def spread_rows_of(pipe: VocabPipeline2BW) -> dict[int, RowPiece]:
    """The trained rows of a VocabSpreadStage (megatron_vocab.py), by id of their parameter: the rows [start, start +
    n) of the unsplit model's output_layer.weight (of its word embeddings for a tied model's head rows and for a
    sharded embedding's rows), saved and loaded by their global offsets as asyncpp's own pipeline saves its head's
    rows (pipeline/state.py: rows_view over the head's statistics group, whose ranks are in (stage, TP rank) order).
    So the checkpoint holds the whole weights under megatron's names whatever the split, and a resume reads its rows
    by their offsets, also with another TP degree (test_megatron_checkpoint: saved at TP 1, resumed at TP 2). A tied model whose first stage keeps its whole table:
    the other stages' head rows are copies of the table's (one update of one summed gradient), which the first stage
    saves whole; theirs are mirrors, loaded from the table's rows."""
    stage, mesh, split = pipe.model, pipe.mesh, pipe.split
    tied = _gpt(stage).share_embeddings_and_output_weights
    index = mesh.pp_rank * mesh.dims.tp + mesh.tp_rank  # the statistics group's order: stage, then TP rank
    view = rows_view(rows_layout(split, mesh.dims.tp), index, sum(split.shards), mesh.vocab_groups.stats)
    out = {}
    if not stage.rows_of_table:  # (the first stage of a tied model: its head rows are its table's, saved whole)
        out[id(stage.output_layer_rows)] = RowPiece(EMBEDDING if tied else HEAD, view,
                                                    mirror=tied and not stage.embedding_sharded)
    if stage.embedding_rows is not None:
        out[id(stage.embedding_rows)] = RowPiece(EMBEDDING, view, mirror=False)
    return out


def _inner(model: nn.Module) -> nn.Module:
    """The GPTModel under any `.module` wrapper chain (Float16Module, DDP)."""
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model


class MegatronCheckpoint:
    """Save a drained Pipeline2BW's state and load it into a freshly built one (same model, optimizer and
    staleness options). Collective: every rank of the job calls save() and load() at the same iteration."""

    def __init__(self, pipeline: Pipeline2BW, *, keep_last: int = 3, async_save: bool = False):
        self.pipeline, self.keep_last = pipeline, keep_last
        self.saver = Saver(async_save)

    def _parts(self) -> StageParts:
        pipe = self.pipeline
        model = _inner(pipe.model)
        engine, mesh = pipe.engine, pipe.mesh
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        name_of = {id(p): global_name(model, n) for n, p in trained}
        # Experts are whole tensors under their global names (global_name), so no EP dimension shards them.
        shard_of = {id(p): global_view(lay, mesh.device_mesh, mesh.dims.tp, 1)
                    for (_, p), lay in zip(trained, param_layouts(model))}
        rows = spread_rows_of(pipe) if isinstance(pipe.model, VocabSpreadStage) else {}
        params = engine.versions.params
        names = [rows[id(p)].name if id(p) in rows else name_of[id(p)] for p in params]
        shards = [rows[id(p)].shard if id(p) in rows else shard_of[id(p)] for p in params]
        mirrors = [id(p) in rows and rows[id(p)].mirror for p in params] if rows else None
        update = engine.update
        return StageParts(names, engine.versions, update.rule, update.optimizer, engine.versions.masters,
                          update.balancing, aligned=update.per_parameter, shards=shards, mirrors=mirrors)

    def _layout(self) -> dict:
        d, pipe = self.pipeline.mesh.dims, self.pipeline
        return {"pp": d.pp, "tp": d.tp, "dp": d.dp, "ep": d.ep, "schedule": pipe.schedule}

    def save(self, root: str | os.PathLike, *, config: dict | None = None, data: dict | None = None) -> Path:
        """Write `root`/step_<k> (k = the pipeline's next_step, Megatron's iteration): the pipeline must be drained
        (drain() first: a 2BW stream has updates in flight). Returns the directory (committed when this returns,
        unless async_save: then at the next save or wait())."""
        pipe = self.pipeline
        if not pipe.drained:
            raise RuntimeError(f"checkpoint at iteration {pipe.next_step}: b_{pipe.next_step - 1}'s update is in "
                               "flight; call forward_backward_func.pipeline.drain() before saving")
        applied = pipe.records.get(pipe.applied_step) if pipe.applied_step is not None else None
        meta = {"loss_scale": pipe.loss_scale, "applied": None if applied is None else dataclasses.asdict(applied),
                "run": config or {}}
        return self.saver.save(root, pipe.next_step, self._parts().state(), config=meta, layout=self._layout(),
                               keep_last=self.keep_last, data=data)

    def wait(self) -> None:
        """Collective: finish a background save (async_save)."""
        self.saver.wait()

    def load(self, path: str | os.PathLike) -> dict:
        """Fill a fresh, drained pipeline from `path` (a step_* directory, or a --save directory: its newest intact
        checkpoint); afterwards the next call is b_k of the saved iteration k. Returns the manifest."""
        pipe = self.pipeline
        path = checkpoint_dir(path)
        manifest = read_manifest(path)
        layout = manifest.get("layout") or {}
        if layout.get("schedule", pipe.schedule) != pipe.schedule:
            raise ValueError(f"checkpoint {path} was written by schedule={layout['schedule']!r}; this pipeline "
                             f"runs schedule={pipe.schedule!r}: resume with the schedule it was saved with")
        if not pipe.drained or pipe.next_step != 0:
            raise RuntimeError(f"load {path} into a freshly built Pipeline2BW, before its first call (this one is "
                               f"at iteration {pipe.next_step})")
        step = manifest["step"]
        self.saver.resumed_from = path  # never pruned by the resumed run
        self._parts().load(path, step)
        meta = manifest.get("config") or {}
        applied = meta.get("applied")
        pipe.restore_position(step, None if applied is None else StepRecord(**applied),
                              float(meta.get("loss_scale", 1.0)))
        return manifest


def megatron_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    """A checkpoint of the front-end as an unsplit GPTModel's state dict, whatever the layout that wrote it: the newest
    weights, and each router's newest expert bias (megatron's persistent `expert_bias` buffer, which asyncpp keeps
    versioned as balancing/<age>/<router>, age 0 the newest, each router named by its MoE layer:
    megatron_balancing.megatron_balanced_routers)."""
    biases = saved_under(path, "balancing/0/")
    return {**newest_weights(path), **{f"{layer}.router.expert_bias": b for layer, b in biases.items()}}


def checkpoint_dir(path: str | os.PathLike) -> Path:
    """--load's directory: a step_* checkpoint as it is, a --save directory its newest intact checkpoint; a clear
    error (FileNotFoundError) when there is none, before any process group or model exists."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"--load={path} is not a directory; give the --save directory of an earlier run")
    newest = path if step_of(path) is not None else latest_intact(path, warn=print)
    if newest is None or not is_complete(newest):
        raise FileNotFoundError(f"--load={path} holds no complete checkpoint (a step_* directory with a "
                                f"{MANIFEST}); give the --save directory of a run that saved one, or drop --load to "
                                "start afresh")
    return newest
