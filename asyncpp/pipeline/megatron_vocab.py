"""A megatron-core GPTModel's vocabulary over the pipeline stages: the cost model's shards for it, and its
checkpoint's rows assembled into the unsplit model's state dict.

The shards. asyncpp's own pipeline sizes every stage's rows of the LM head (and of a sharded input embedding) with
the cost model (core/vocab_split.plan_vocab_split, water filling over the stages' layer costs). A Megatron user
builds the stages themselves, so the layers per stage are megatron's (its get_num_layers_to_build, per pipeline
rank), and the costs come from the model's TransformerConfig read as a model_zoo ModelConfig (`model_config_of`):
the same layer costs (core/layer_costs) and so the same rows as asyncpp's own pipeline for the same model and
split (`vocab_split_of`). Every rank derives the same split from its own stage: the config is the whole model's.

The checkpoint. A stage of a vocabulary-spread model saves `StageCheckpoint`: its megatron state dict (its layers
numbered from 0, as megatron numbers a stage's modules) and its rows of `output_layer.weight` and
`embedding.word_embeddings.weight` at their offset in the vocabulary. `assemble_state_dict` builds the unsplit
GPTModel's state dict from every stage's: the layers at their global index, the rows concatenated by offset (each
row once, every row present), a tied model's head rows being its embedding rows (megatron's
share_embeddings_and_output_weights: no output_layer.weight of its own). Tensor and expert parallelism are not
assembled here (one TP and EP rank per stage): MegatronCheckpoint (megatron_checkpoint.py) saves any layout,
the rows of every (stage, TP rank) at their offsets.

Under TP (untied, the embedding whole, as asyncpp's own pipeline requires) each stage's rows are split again over
its TP ranks (rows_of_rank), megatron's whole output layer being gathered over TP once to take them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from torch import Tensor, nn

from asyncpp.core.layer_costs import layer_costs
from asyncpp.core.vocab_split import VocabSplit, plan_vocab_split, shard_granule
from asyncpp.parallel.mesh import Mesh
from asyncpp.parallel.vocab_parallel import VocabShard, split_for_tp, vocab_shards
from model_zoo.config import ModelConfig, MoEConfig

HEAD = "output_layer.weight"
EMBEDDING = "embedding.word_embeddings.weight"
LAYERS = "decoder.layers."


def _gpt(model: nn.Module) -> nn.Module:
    """The GPTModel inside any `.module` wrapper chain (DDP, Float16Module)."""
    while not hasattr(model, "share_embeddings_and_output_weights") and hasattr(model, "module"):
        model = model.module
    if not hasattr(model, "share_embeddings_and_output_weights"):
        raise TypeError(f"{type(model).__name__} is not a megatron-core GPTModel (nor a wrapper of one)")
    return model


def _swiglu_width(config, width: int) -> int:
    """The cost model counts a SwiGLU MLP (three [h, f] matrices). Megatron's gated MLP is one; its plain MLP (two
    matrices, GELU) has the FLOPs of a SwiGLU of 2/3 its width, which is what it is counted as (rounded to a whole
    column: a cost estimate off by less than one column's FLOPs)."""
    return width if config.gated_linear_unit else round(2 * width / 3)


def _moe_of(config) -> MoEConfig | None:
    if config.num_moe_experts is None:
        return None
    if config.moe_layer_freq != 1:
        raise NotImplementedError(f"moe_layer_freq={config.moe_layer_freq!r}: the cost model reads a megatron MoE "
                                  "model whose every layer is MoE (moe_layer_freq=1)")
    shared = config.moe_shared_expert_intermediate_size or 0
    return MoEConfig(num_experts=config.num_moe_experts, top_k=config.moe_router_topk,
                     expert_ffn_hidden_size=_swiglu_width(config, config.moe_ffn_hidden_size),
                     shared_expert_ffn_hidden_size=_swiglu_width(config, shared))


def model_config_of(model: nn.Module) -> ModelConfig:
    """`model` (a megatron-core GPTModel stage, or a wrapper) as the model_zoo ModelConfig the cost model reads: the
    whole model's sizes (its TransformerConfig, vocab_size, max_sequence_length, share_embeddings_and_output_weights).
    Only what the costs read is mapped; the rest (norm eps, rope base, init) keeps ModelConfig's defaults."""
    gpt = _gpt(model)
    c = gpt.config
    moe = _moe_of(c)
    return ModelConfig(name=f"megatron-gpt-{c.num_layers}x{c.hidden_size}", vocab_size=gpt.vocab_size,
                       hidden_size=c.hidden_size, num_layers=c.num_layers, num_heads=c.num_attention_heads,
                       num_kv_heads=c.num_query_groups or c.num_attention_heads, head_dim=c.kv_channels,
                       ffn_hidden_size=0 if moe is not None else _swiglu_width(c, c.ffn_hidden_size),
                       max_seq_len=gpt.max_sequence_length, tie_embeddings=gpt.share_embeddings_and_output_weights,
                       qk_norm=bool(c.qk_layernorm), moe=moe)


def stage_layers_of(config) -> tuple[int, ...]:
    """The layers megatron builds on each pipeline rank (get_num_layers_to_build at every pp_rank: even, or with
    num_layers_in_first/last_pipeline_stage)."""
    for name in ("pipeline_model_parallel_layout", "virtual_pipeline_model_parallel_size"):
        if getattr(config, name, None) is not None:
            raise NotImplementedError(f"{name}={getattr(config, name)!r}: the vocabulary-parallel head spreads the "
                                      "rows over one model chunk per pipeline rank; build the model without it")
    sizes = tuple(get_num_layers_to_build(config, pp_rank=s) for s in range(config.pipeline_model_parallel_size))
    if sum(sizes) != config.num_layers:
        raise ValueError(f"megatron builds {list(sizes)} layers on the pipeline ranks, {sum(sizes)} in all, but "
                         f"num_layers={config.num_layers} (account_for_embedding/loss_in_pipeline_split leave a "
                         "stage without layers, which the vocabulary-parallel head replaces): build it without them")
    return sizes


def vocab_split_of(model: nn.Module, *, seq_len: int, micro_batch_size: int, embedding: bool = False,
                   device_type: str = "cpu") -> VocabSplit:
    """The cost model's layers and rows per stage for a megatron-core GPTModel (any stage of it): megatron's layer
    split, and the rows water-filled over it at this work shape, in granules a multiple of the model's TP size
    (core/vocab_split.shard_granule). `embedding`: the input embedding sharded by the same rows."""
    gpt = _gpt(model)
    config = gpt.config
    model_cfg = model_config_of(gpt)
    pp, tp = config.pipeline_model_parallel_size, config.tensor_model_parallel_size
    if pp < 2:
        raise ValueError(f"pipeline_model_parallel_size={pp}: the vocabulary is spread over the pipeline stages, "
                         "so it needs at least 2")
    costs = layer_costs(model_cfg, seq_len, micro_batch_size, device_type)
    return plan_vocab_split(costs, pp, model_cfg.vocab_size, sizes=stage_layers_of(config), embedding=embedding,
                            granule=shard_granule(model_cfg.vocab_size, pp, tp))


# ---- the rows ------------------------------------------------------------------------------------------------
def _whole(gpt: nn.Module, mesh: Mesh, name: str, owner: int) -> Tensor:
    """The whole [vocab, hidden] weight `name` of the stage `owner` (under TP, megatron's vocabulary-split pieces of
    it all-gathered over the TP group there first), broadcast over megatron's pipeline group."""
    if mesh.pp_rank == owner:
        weight = gpt.get_parameter(name).detach().contiguous()
        pieces = [torch.empty_like(weight) for _ in range(mesh.dims.tp)]
        if mesh.dims.tp > 1:  # megatron's output_layer and word embeddings: rows split evenly over TP, in rank order
            dist.all_gather(pieces, weight, group=mesh.tp_group)
        buffer = torch.cat(pieces) if mesh.dims.tp > 1 else weight.clone()
    else:
        buffer = torch.empty((gpt.vocab_size, gpt.config.hidden_size), dtype=gpt.config.params_dtype,
                             device=mesh.device)
    dist.broadcast(buffer, src=mesh.global_rank(owner), group=mesh.pp_group)
    return buffer


def rows_of_rank(split: VocabSplit, mesh: Mesh) -> VocabShard:
    """This rank's rows of the vocabulary: its stage's shard, split again over its TP ranks as asyncpp's own
    pipeline splits it (vocab_parallel.split_for_tp: equal pieces, the shards being multiples of TP)."""
    start = sum(split.shards[:mesh.pp_rank])
    return split_for_tp(VocabShard(start, split.shards[mesh.pp_rank]), mesh.dims.tp)[mesh.tp_rank]


def rows_layout(split: VocabSplit, tp: int) -> list[tuple[int, int]]:
    """(start, rows) of every rank's rows in (stage, TP rank) order: the head's statistics group's order."""
    stages = vocab_shards(split.shards, sum(split.shards))
    return [(piece.start, piece.rows) for stage in stages for piece in split_for_tp(stage, tp)]


def check_spread_tp(tp: int, *, tied: bool, embedding: bool) -> None:
    """Under TP the spread head is untied and the embedding whole, as asyncpp's own pipeline requires
    (config/parallel.py _check_vocab_head), for the same reasons."""
    if tp > 1 and tied:
        raise NotImplementedError(
            f"tensor_model_parallel_size={tp} with share_embeddings_and_output_weights=True: a later stage's TP piece "
            "of the spread head is not the same rows as the first stage's TP piece of the embedding, so their "
            "gradients would be summed across TP ranks (as in asyncpp's own pipeline, parallel.head=vocab refuses "
            "tp > 1 with a tied embedding); build the GPTModel with share_embeddings_and_output_weights=False")
    if tp > 1 and embedding:
        raise NotImplementedError(
            f"tensor_model_parallel_size={tp} with the embedding sharded (embedding=True): each stage's embedding "
            "rows would be split again over TP, which asyncpp's own pipeline does not do either "
            "(parallel.embedding=vocab with tp > 1); keep the embedding whole (embedding=False)")


def spread_rows(model: nn.Module, split: VocabSplit, mesh: Mesh, *, embedding: bool) -> dict[str, nn.Parameter]:
    """This stage's rows of megatron's head (`HEAD`, the last stage's output_layer; a tied model's head rows are the
    first stage's word embeddings) and, with the embedding sharded, of its input embedding (`EMBEDDING`, the first
    stage's word embeddings), [split.shards[stage], hidden] each (under TP its TP rank's piece: rows_of_rank), taken
    from the stage that holds the whole weight by a broadcast over megatron's pipeline group (every stage calls it,
    once, after building its GPTModel). A tied model's head rows are rows of its embedding: returned as EMBEDDING
    only (one tensor; without `embedding` they are a copy of those rows of the first stage's whole table, and the
    first stage's checkpoint saves the table)."""
    gpt = _gpt(model)
    tied = gpt.share_embeddings_and_output_weights
    check_spread_tp(mesh.dims.tp, tied=tied, embedding=embedding)
    if len(split.shards) != mesh.num_stages:
        raise ValueError(f"the split has {len(split.shards)} stages' rows, the pipeline {mesh.num_stages} stages")
    last, piece = mesh.num_stages - 1, rows_of_rank(split, mesh)
    start, n = piece.start, piece.rows
    out = {}
    if tied or embedding:
        table = _whole(gpt, mesh, EMBEDDING, 0)
        out[EMBEDDING] = nn.Parameter(table[start:start + n].clone())
    if not tied:
        head = _whole(gpt, mesh, HEAD, last)
        out[HEAD] = nn.Parameter(head[start:start + n].clone())
    return out


class VocabSpreadStage(nn.Module):
    """A GPTModel stage whose vocabulary is spread over the pipeline: build it on every stage after the GPTModel and
    before the optimizer (which takes its parameters), and hand it to Pipeline2BW in the GPTModel's place.

    It holds the GPTModel as `module` (megatron's `.module` chain: Pipeline2BW, optimizer_sharding and `_gpt` see
    through it) and this stage's rows (spread_rows) as trained parameters: `output_layer_rows` [shards[s], hidden], and
    with the embedding sharded `embedding_rows` (a tied model's are the same Parameter: the head rows are rows of the
    embedding); a tied model whose first stage keeps its whole table uses that table's rows there (head_param). Megatron's whole weights leave training (requires_grad False, so neither the optimizer built
    afterwards nor the engine's weight versions hold them): the last stage's output_layer.weight, and with the
    embedding sharded the first stage's word embeddings.

    The last stage ends at the final norm: GPTModel decides at each forward, by `self.post_process`, whether
    `_postprocess` applies the output layer and the loss; the final norm is the decoder's own (TransformerBlock
    built `final_layernorm` from the constructor's post_process), so with post_process turned off after the
    construction the stage returns the normed hidden states [s, b, h] that a vocabulary-parallel head's S passes
    read (`shared_embedding_or_output_weight` then names no weight on the last stage: the rows replace it)."""

    def __init__(self, model: nn.Module, mesh: Mesh, split: VocabSplit, *, embedding: bool):
        super().__init__()
        gpt = _gpt(model)
        rows = spread_rows(gpt, split, mesh, embedding=embedding)  # collective: every stage, also the first
        tied = gpt.share_embeddings_and_output_weights
        piece = rows_of_rank(split, mesh)  # under TP this TP rank's piece of the stage's rows
        self.module, self.start, self.embedding_sharded = model, piece.start, embedding
        self.vocab_size, self.shard_rows = sum(split.shards), piece.rows
        # A tied model whose first stage keeps the whole table: that stage's head rows are rows of the table itself
        # (no copy); every other stage's are a copy, kept equal to the table's by the tied reduction (tied_rows).
        self.rows_of_table = tied and not embedding and mesh.is_first_stage
        if not self.rows_of_table:  # the name keeps Muon off it (optim.build)
            self.output_layer_rows = rows.get(HEAD, rows.get(EMBEDDING))
        self.embedding_rows = rows.get(EMBEDDING) if embedding else None
        if mesh.dims.tp > 1:  # each TP rank's rows are its own: megatron's attributes make the norm count them all
            set_tensor_model_parallel_attributes(self.output_layer_rows, True, 0, 1)
        self.frozen = [name for name in (HEAD, EMBEDDING) if name in dict(gpt.named_parameters())
                       and (name == HEAD or embedding)]
        for name in self.frozen:
            gpt.get_parameter(name).requires_grad_(False)
        gpt.post_process = False

    def head_param(self) -> tuple[nn.Parameter, int]:
        """The parameter holding this stage's head rows and the row they start at in it."""
        if self.rows_of_table:
            return _gpt(self.module).embedding.word_embeddings.weight, self.start
        return self.output_layer_rows, 0

    def head_weight(self) -> Tensor:
        """This stage's head rows [shard, hidden]."""
        param, row0 = self.head_param()
        return param.narrow(0, row0, self.shard_rows)

    @property
    def tied(self) -> list[nn.Parameter]:
        """Pipeline2BW's `tied`: a tied model with its table whole on the first stage sums the table's gradient with
        every stage's head rows' (the first stage's whole table, the others' rows); none otherwise (a sharded
        embedding's head rows are the stage's own embedding rows, one tensor)."""
        if not _gpt(self.module).share_embeddings_and_output_weights or self.embedding_sharded:
            return []
        return [self.head_param()[0]]

    @property
    def tied_rows(self) -> tuple[int, int] | None:
        """(row0, vocab) of this stage's tied tensor in the tied weight (reduction.RowsOfTied); None on the first."""
        return (self.start, self.vocab_size) if self.tied and not self.rows_of_table else None

    @property
    def config(self):
        return _gpt(self.module).config

    def set_input_tensor(self, input_tensor) -> None:
        _gpt(self.module).set_input_tensor(input_tensor)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def rows(self) -> dict[str, Tensor]:
        """This stage's rows by megatron's name, for checkpoint_of (a tied model's: EMBEDDING only)."""
        tied = _gpt(self.module).share_embeddings_and_output_weights
        out = {} if tied else {HEAD: self.head_weight().detach()}
        if self.embedding_rows is not None:
            out[EMBEDDING] = self.embedding_rows.detach()
        return out


# ---- checkpoints --------------------------------------------------------------------------------------------
@dataclass
class StageCheckpoint:
    """One stage's share of a vocabulary-spread GPTModel: its megatron state dict (layers numbered from 0, no whole
    head or embedding), the global index of its first layer, and its rows: name (`HEAD`, `EMBEDDING`) ->
    (the vocabulary row they start at, [rows, hidden])."""

    state: dict[str, Tensor]
    layer_offset: int
    rows: dict[str, tuple[int, Tensor]]


def _global_layer(name: str, offset: int) -> str:
    if not name.startswith(LAYERS):
        return name
    index, rest = name[len(LAYERS):].split(".", 1)
    return f"{LAYERS}{int(index) + offset}.{rest}"


def _assembled_rows(stages: Sequence[StageCheckpoint], name: str, vocab: int) -> Tensor:
    """The stages' rows of `name` in vocabulary order, checked to cover [0, vocab) once."""
    pieces = sorted((s.rows[name] for s in stages if name in s.rows), key=lambda p: p[0])
    at = 0
    for start, rows in pieces:
        if start != at:
            raise ValueError(f"{name}: the stages' rows leave a gap or overlap at row {at} (a stage's start at "
                             f"{start}): every stage's checkpoint of the same run is needed, once each")
        at += rows.shape[0]
    if at != vocab:
        raise ValueError(f"{name}: the stages' rows cover [0, {at}) of a vocabulary of {vocab}")
    return torch.cat([rows for _, rows in pieces])


def assemble_state_dict(stages: Sequence[StageCheckpoint], vocab_size: int, *, tied: bool) -> dict[str, Tensor]:
    """The unsplit GPTModel's state dict (megatron's names; load it with load_state_dict(strict=True)) from every
    stage's checkpoint: layers at their global index, the head's and the embedding's rows by offset. `tied`
    (share_embeddings_and_output_weights): the head rows are the embedding's, saved under EMBEDDING only."""
    out: dict[str, Tensor] = {}
    for stage in stages:
        for name, value in stage.state.items():
            if name in (HEAD, EMBEDDING):
                raise ValueError(f"the stage at layer offset {stage.layer_offset} saved a whole {name} in its "
                                 "state: a vocabulary-spread stage saves its rows in StageCheckpoint.rows")
            key = _global_layer(name, stage.layer_offset)
            if key in out:
                raise ValueError(f"{key} is saved by two stages")
            out[key] = value
    out[EMBEDDING] = _assembled_rows(stages, EMBEDDING, vocab_size)
    if tied and any(HEAD in s.rows for s in stages):
        raise ValueError(f"tied=True, but a stage saved {HEAD} rows: a tied model's head rows are its {EMBEDDING} "
                         "rows (save those)")
    if not tied:
        out[HEAD] = _assembled_rows(stages, HEAD, vocab_size)
    return out


def stage_checkpoint(state: Mapping[str, Tensor], rows: Mapping[str, Tensor], split: VocabSplit, stage: int,
                     *, embedding: bool) -> StageCheckpoint:
    """Stage `stage`'s checkpoint from its module's state dict and its `rows` (HEAD and/or EMBEDDING). The rows
    are its shard's, [split.shards[stage], hidden], placed at the shard's start; with the embedding not sharded
    (`embedding` False) EMBEDDING is the first stage's whole table, at row 0. A whole head or embedding the stage
    module still holds itself (a GPTModel built with post_process keeps its output_layer) is what the rows
    replace: it is not saved."""
    start, hold = sum(split.shards[:stage]), split.shards[stage]
    placed = {}
    for name, value in rows.items():
        if name not in (HEAD, EMBEDDING):
            raise ValueError(f"rows[{name!r}]: a stage's rows are {HEAD} and/or {EMBEDDING}")
        whole = name == EMBEDDING and not embedding
        if whole and stage != 0:
            raise ValueError(f"stage {stage} saved {EMBEDDING} rows, but the embedding is not sharded "
                             "(embedding=False): the first stage holds it whole")
        want = sum(split.shards) if whole else hold
        if value.shape[0] != want:
            raise ValueError(f"rows[{name!r}] of stage {stage} has {value.shape[0]} rows; its shard has {want}")
        placed[name] = (0 if whole else start, value)
    kept = {k: v for k, v in state.items() if k not in (HEAD, EMBEDDING)}
    return StageCheckpoint(kept, sum(split.sizes[:stage]), placed)


def checkpoint_of(model: nn.Module, rows: Mapping[str, Tensor], split: VocabSplit, mesh: Mesh, *,
                  embedding: bool) -> StageCheckpoint:
    """This stage's checkpoint: its GPTModel's state dict (without TE's _extra_state) and its rows (spread_rows's).
    With the embedding not sharded, the first stage saves its whole table, and a tied model's other stages save no
    rows (theirs are copies of the table's)."""
    if mesh.dims.tp > 1:
        raise NotImplementedError(f"checkpoint_of at tensor_model_parallel_size={mesh.dims.tp}: it assembles one TP "
                                  "rank per stage; save with megatron_checkpoint.MegatronCheckpoint, whose checkpoint "
                                  "holds every TP piece and row at its offset (train.checkpoint.newest_weights reads "
                                  "it as the unsplit model's state dict)")
    gpt = _gpt(model)
    state = {k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    saved = dict(rows)
    if not embedding:
        saved.pop(EMBEDDING, None)
        if mesh.is_first_stage:
            saved[EMBEDDING] = gpt.embedding.word_embeddings.weight.detach()
    return stage_checkpoint(state, saved, split, mesh.pp_rank, embedding=embedding)
