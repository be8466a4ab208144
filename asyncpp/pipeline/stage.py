"""Cut a model_zoo-layout model (embed, layers, norm, lm_head) down to one pipeline stage.

The model is pruned in place rather than wrapped, so parameter names stay those of the full model
("layers.5.mlp.w_up", ...): checkpoints, the Muon/AdamW split and the equivalence tests compare
stage parameters with single-process ones by name. Layers the stage does not own become
nn.Identity (no parameters), which keeps the indices of the owned ones.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from asyncpp.core.loss import LogitsLoss
from asyncpp.core.partition import stage_layer_ranges
from asyncpp.parallel.mesh import Mesh
from asyncpp.parallel.tp import enter_region
from asyncpp.parallel.vocab_parallel import VocabShard, split_for_tp
from asyncpp.pipeline.stage_data import StageData


class StageSpec:
    def __init__(self, stage: int, num_stages: int, num_layers: int, sizes: Sequence[int] | None = None,
                 *, vocab: VocabShard | None = None, embedding: bool = False):
        """vocab: parallel.head=vocab, this stage's rows of the LM head (every stage
        holds some: pipeline/vocab_head.py). embedding (with vocab): parallel.embedding=vocab, the stage holds the
        same rows of the input embedding instead of the first stage holding all of it (VocabEmbedding)."""
        self.stage = stage
        self.num_stages = num_stages
        self.layers = stage_layer_ranges(num_layers, num_stages, sizes)[stage]
        self.vocab = vocab if num_stages > 1 else None
        self.embed = self.vocab if embedding and self.vocab is not None else None
        """This stage's rows of a sharded input embedding (parallel.embedding=vocab), else None."""

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


def prune_to_stage(model: nn.Module, spec: StageSpec) -> nn.Module:
    """Drop everything `spec.stage` does not own. A tied head keeps its (shared) Parameter."""
    for i in range(len(model.layers)):
        if i not in spec.layers:
            model.layers[i] = nn.Identity()
    if spec.embed is not None:
        _keep_embedding_rows(model, spec)
    elif not spec.is_first:
        del model.embed
    if not spec.is_last:
        del model.norm
    if spec.vocab is not None:
        _keep_head_rows(model, spec)
    elif not spec.is_last:
        del model.lm_head
    return model


def _keep_head_rows(model: nn.Module, spec: StageSpec) -> None:
    """parallel.head=vocab: the stage's rows of the LM head, still named lm_head.weight (model_zoo/init.py keys
    them by the full head's name and their offset, so they start as those rows of the unsplit head). On the first
    stage of a tied model the rows are the embedding's own (no parameter of their own)."""
    if (spec.is_first or spec.embed is not None) and model.config.tie_embeddings:
        del model.lm_head
        return
    h = model.lm_head.weight.shape[1]
    model.lm_head = nn.Linear(h, spec.vocab.rows, bias=False, device=model.lm_head.weight.device,
                              dtype=model.lm_head.weight.dtype)


def _keep_embedding_rows(model: nn.Module, spec: StageSpec) -> None:
    """parallel.embedding=vocab: the stage's rows of the input embedding, still named embed.weight (keyed by the
    full embedding's name and their offset, like the head's rows). A tied model's head rows are these (no
    lm_head of its own on any stage: _keep_head_rows, vocab_rows)."""
    w = model.embed.weight
    model.embed = nn.Embedding(spec.embed.rows, w.shape[1], device=w.device, dtype=w.dtype)


def stage_forward(model: nn.Module, spec: StageSpec, x: Tensor, head: bool = True) -> Tensor:
    """tokens (first stage) or activation -> activation, or logits on the last stage (head=False: the last
    block's output, before the final norm). With a sharded embedding the first stage is given the summed
    embedding (VocabEmbedding), not the tokens."""
    h = model.embed_tokens(x) if spec.is_first and spec.embed is None else x
    for i in spec.layers:
        h = model.layers[i](h)
    return model.head(h) if spec.is_last and head else h


class StageForward:
    """The stage's layers between its two ends (parts.py), for a trainer run: the engine's ForwardFn (a microbatch
    of the plan, its tokens read where the layers read them) and the same pass on an evaluation batch. It returns
    what the stage's exit takes: the activation, the whole head's loss on the last stage, or, under a
    vocabulary-parallel head, the last stage's normed hidden states."""

    def __init__(self, model: nn.Module, spec: StageSpec, loss_fn: LogitsLoss, mesh: Mesh, sequence_parallel: bool,
                 data: StageData):
        self.model, self.spec, self.loss_fn, self.mesh, self.data = model, spec, loss_fn, mesh, data
        self.sequence_parallel = sequence_parallel

    def __call__(self, step: int, microbatch: int, x: Tensor | None) -> Tensor:
        # The last stage reads the labels here unless a vocabulary-parallel head reads them at S; the first stage its
        # tokens unless a sharded embedding looked them up at E (x is then their embedding).
        spec = self.spec
        own_tokens = spec.is_first and spec.embed is None
        reads = own_tokens or (spec.is_last and spec.vocab is None)
        tokens = self.data.tokens(step, microbatch) if reads else None
        return self.through(tokens[:, :-1] if own_tokens else x, tokens[:, 1:] if tokens is not None else None)

    def through(self, x: Tensor, labels: Tensor | None) -> Tensor:
        """x (the token ids on a first stage with the whole embedding) through the stage's layers."""
        if self.spec.vocab is not None and self.spec.is_last:  # the head is every stage's; P >= 2: never first
            return self.head_input(stage_forward(self.model, self.spec, x, head=False))
        out = stage_forward(self.model, self.spec, x)
        return self.loss_fn(out, labels) if self.spec.is_last else out

    def head_input(self, h: Tensor) -> Tensor:
        """The last stage's final norm, entering the head's TP region as the TP head does (tp.enter_region: under
        sequence parallelism the all-gather of the sequence, whose backward sums the TP ranks' partial input
        gradients; else a copy whose backward all-reduces them)."""
        normed = self.model.norm(h)
        if self.mesh.dims.tp == 1:
            return normed
        return enter_region(normed, self.mesh.tp_group, self.sequence_parallel)


def vocab_rows(model: nn.Module, spec: StageSpec) -> tuple[nn.Parameter, int]:
    """parallel.head=vocab: the parameter holding this stage's head rows and the row they start at in it (the
    embedding and the shard's start on a tied first stage; a tied stage's embedding rows from row 0 when the
    embedding is sharded too; else the stage's lm_head.weight from row 0)."""
    if spec.embed is not None and model.config.tie_embeddings:
        return model.embed.weight, 0
    if spec.is_first and model.config.tie_embeddings:
        return model.embed.weight, spec.vocab.start
    return model.lm_head.weight, 0


def vocab_head_rows(model: nn.Module, spec: StageSpec, tp: int, tp_rank: int) -> tuple[nn.Parameter, int, VocabShard]:
    """parallel.head=vocab on one TP rank: (the parameter holding its head rows, the row they start at in it, its
    piece of the stage's rows: the TP plan chunked them, split_for_tp)."""
    param, row0 = vocab_rows(model, spec)
    return param, row0, split_for_tp(spec.vocab, tp)[tp_rank]


def tied_parameters(model: nn.Module, spec: StageSpec) -> list[nn.Parameter]:
    """The embedding/head weight when it is tied *across* stages (first and last hold a copy): the pair (first,
    last) sums its gradient and applies the same update (semantics.md)."""
    if spec.num_stages == 1 or not getattr(model.config, "tie_embeddings", False) or spec.embed is not None:
        return []  # (a sharded embedding: each stage's head rows are its own embedding rows, one tensor)
    if spec.vocab is not None:  # every stage holds rows of the tied weight (the first stage all of them)
        return [vocab_rows(model, spec)[0]]
    if spec.is_first:
        return [model.embed.weight]
    if spec.is_last:
        return [model.lm_head.weight]
    return []
