"""The one home of a rank's model build, for the real run and the dry run alike:

    meta build -> prune to the stage -> TP/EP plan (shapes only) -> materialize the local shards on the
    target device -> initialize them (model_zoo/init.py: a function of the seed, the parameter's
    full-model name, its global shape and the slice this rank holds)

so a rank never allocates a layer or a shard it does not own, and every layout (pp, tp, ep) starts from
the same full-model weights as the single-process run. device="meta" stops before materializing (the dry
run sizes memory from the shard shapes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from asyncpp.config import RunConfig
from asyncpp.core.layout import Layout
from asyncpp.core.loss import LogitsLoss, cross_entropy, logits_loss_for
from asyncpp.core.partition import stage_split
from asyncpp.core.recompute import apply_recompute, modes_per_layer
from asyncpp.parallel.mesh import Mesh
from asyncpp.parallel.sharding import ParamSharding, ShardingPlan, layout_of
from asyncpp.parallel.vocab_parallel import VocabShard, vocab_shards
from asyncpp.pipeline.stage import StageSpec, prune_to_stage
from model_zoo import ModelConfig, build_model
from model_zoo.init import ParamSlice, read_weights_file
from model_zoo.parallelize import apply_tensor_parallel
from model_zoo.transformer import materialize


@dataclass
class BuiltStage:
    """What a rank trains: its pruned (and sharded) part of the model, named by full-model names."""

    model: nn.Module
    spec: StageSpec
    sharding: ShardingPlan
    """The TP/EP layout of every sharded parameter ({} without TP/EP)."""
    loss_fn: LogitsLoss
    """The loss for the last stage's logits (vocabulary-parallel cross entropy when the head is sharded)."""


@dataclass(frozen=True)
class ShardCoords:
    """This rank's position in the groups that split parameters (1 = not split)."""

    tp_rank: int = 0
    tp: int = 1
    ep_rank: int = 0
    ep: int = 1

    @staticmethod
    def of(mesh) -> ShardCoords:
        d = mesh.dims
        return ShardCoords(mesh.tp_rank if d.tp > 1 else 0, d.tp, mesh.ep_rank if d.ep > 1 else 0, d.ep)


def param_slice(name: str, local_shape: torch.Size, layout: ParamSharding, at: ShardCoords,
                vocab: tuple[VocabShard, int] | None = None) -> ParamSlice:
    """Where the local piece of parameter `name` sits in the full tensor, from its layout. The plans
    split with torch.chunk into equal parts (they refuse sizes that do not divide), so the global size is
    the local size times the group size and the offset the rank times the local size. `vocab` (this stage's
    rows of the head under parallel.head=vocab, the vocabulary size): lm_head.weight is those rows, and so is
    embed.weight when it is [rows, h] (parallel.embedding=vocab: TP is refused there, so never chunked)."""
    shape, offsets = list(local_shape), [0] * len(local_shape)
    if vocab is not None and name == "embed.weight" and shape[0] == vocab[0].rows and shape[0] != vocab[1]:
        return ParamSlice(name, (vocab[1], *shape[1:]), (vocab[0].start, *offsets[1:]))
    if vocab is not None and name == "lm_head.weight":  # the stage's rows, chunked over TP like any TP weight
        shard, vocab_size = vocab
        start = shard.start + (at.tp_rank * shape[0] if layout.is_tp_sharded and at.tp > 1 else 0)
        return ParamSlice(name, (vocab_size, *shape[1:]), (start, *offsets[1:]))
    if layout.expert and at.ep > 1:  # experts along dim 0
        offsets[0], shape[0] = at.ep_rank * shape[0], shape[0] * at.ep
    if layout.is_tp_sharded and at.tp > 1:
        d = layout.tp_dim
        offsets[d], shape[d] = at.tp_rank * shape[d], shape[d] * at.tp
    return ParamSlice(name, tuple(shape), tuple(offsets))


Parallelize = Callable[[nn.Module], tuple[ShardingPlan, LogitsLoss]]


def build_stage(model_cfg: ModelConfig, spec: StageSpec, device: torch.device | str, seed: int,
                parallelize: Parallelize | None = None, coords: ShardCoords = ShardCoords(),
                recompute: Sequence[str] | None = None, weights: Mapping[str, Tensor] | None = None) -> BuiltStage:
    """This rank's stage: built on meta, pruned to `spec`, sharded by `parallelize` (the TP/EP plan, applied
    on meta: shapes only), then, unless `device` is meta, allocated on `device` and initialized (from `weights`,
    full-model tensors by name, where given: checkpoint.init_from).
    `recompute`: the activation-recomputation mode of every layer of the model (core/recompute.py)."""
    model = prune_to_stage(build_model(model_cfg, device="meta"), spec)
    sharding, loss_fn = parallelize(model) if parallelize is not None else ({}, cross_entropy)
    if torch.device(device).type != "meta":
        rows = (spec.vocab, model_cfg.vocab_size) if spec.vocab is not None else None
        materialize(model, device, seed,
                    lambda name, p: param_slice(name, p.shape, layout_of(sharding, name), coords, rows), weights)
    if recompute is not None:
        apply_recompute(model, recompute)
    return BuiltStage(model, spec, sharding, loss_fn)


def tp_ep_plan(mesh, sequence_parallel: bool = False) -> Parallelize | None:
    """The TP/EP plan of a stage on `mesh`: stage -> (its ShardingPlan, the loss for its logits), or None
    when the layout has neither (the stage then stays the plain pruned model)."""
    dims = mesh.dims
    if dims.tp == 1 and dims.ep == 1:
        return None

    def apply(stage: nn.Module) -> tuple[ShardingPlan, LogitsLoss]:
        plan = apply_tensor_parallel(stage, mesh.tp_group if dims.tp > 1 else None,
                                     ep_group=mesh.ep_group if dims.ep > 1 else None,
                                     sequence_parallel=sequence_parallel and dims.tp > 1)
        return plan, logits_loss_for(stage)

    return apply


def stage_spec_of(cfg: RunConfig, model_cfg: ModelConfig, stage: int) -> StageSpec:
    """Stage `stage`'s place in the model under run config `cfg`: its layers, and its rows of a
    vocabulary-parallel head."""
    layout = Layout.of(cfg, model_cfg)
    vocab = vocab_shards(layout.shards, model_cfg.vocab_size)[stage] if layout.shards is not None else None
    return StageSpec(stage, cfg.parallel.pp, model_cfg.num_layers, list(layout.sizes), vocab=vocab,
                     embedding=layout.embedding)


def mesh_for(cfg: RunConfig, model_cfg: ModelConfig, dims, device: torch.device | str, timeout_s: float | None = None) -> Mesh:
    """The mesh of a run: its groups, with the head's (a vocabulary-parallel head's three, and a sharded
    embedding's two)."""
    layout = Layout.of(cfg, model_cfg)
    return Mesh(dims, torch.device(device), vocab_head=layout.head == "vocab", vocab_embedding=layout.embedding,
                timeout_s=timeout_s)


def build_rank_stage(cfg: RunConfig, model_cfg: ModelConfig, mesh, device: torch.device | str) -> BuiltStage:
    """The stage this rank of `mesh` owns under run config `cfg` (seed, stage split, sequence parallelism)."""
    spec = stage_spec_of(cfg, model_cfg, mesh.pp_rank)
    return build_stage(model_cfg, spec, device, cfg.seed, tp_ep_plan(mesh, cfg.parallel.sequence_parallel),
                       ShardCoords.of(mesh), recompute=recompute_modes(cfg, model_cfg, mesh.num_stages),
                       weights=initial_weights(cfg))


def build_whole_model(cfg: RunConfig, model_cfg: ModelConfig, device: torch.device | str) -> BuiltStage:
    """The single-process run's model (the simulator): the whole model, built as the one stage of a one-stage
    layout by the same build as every rank's stage; each layer recomputes as its simulated stage would
    (train.recompute per stage of parallel.pp)."""
    spec = StageSpec(0, 1, model_cfg.num_layers)
    return build_stage(model_cfg, spec, device, cfg.seed, recompute=recompute_modes(cfg, model_cfg, cfg.parallel.pp),
                       weights=initial_weights(cfg))


def initial_weights(cfg: RunConfig) -> Mapping[str, Tensor] | None:
    """checkpoint.init_from's full-model tensors (memory-mapped), or None: the weights are drawn from the seed. A
    resumed run builds with them too and then reads its checkpoint over them."""
    return read_weights_file(cfg.checkpoint.init_from)[0] if cfg.checkpoint.init_from else None


def recompute_modes(cfg: RunConfig, model_cfg: ModelConfig, num_stages: int) -> list[str]:
    """train.recompute as the mode of every layer of the model, with the stages split as the run splits them."""
    split = stage_split(cfg, model_cfg) if num_stages > 1 else None
    return modes_per_layer(cfg.train.recompute, model_cfg.num_layers, num_stages, split)
