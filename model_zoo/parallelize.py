"""Megatron-style tensor-parallel plans for the model_zoo models, applied after the plain model is
built (and after it is pruned to a pipeline stage). The models know nothing about parallelism.

Each layer kind is a table: parameter -> the dim it is split along over the TP group. Dim 0 of a
Linear weight [out, in] is column parallel (output features, i.e. whole heads or ffn channels),
dim 1 is row parallel (its input features, which are the column-parallel outputs of the same
region); the region's input is copied in (copy_to) and its partial output summed (reduce_from).

    plan = apply_tensor_parallel(model, mesh.tp_group, sequence_parallel=..., ep_group=mesh.ep_group)
    loss = asyncpp.core.loss.logits_loss_for(model)(logits, labels)   # vocab-parallel CE when sharded
    asyncpp.parallel.tp.all_reduce_partial_grads_(model, plan, mesh.tp_group)   # after backward

MoE layers are delegated to asyncpp.parallel.experts.parallelize_moe (experts' ffn over TP, experts
over EP). Under sequence parallelism the residual stream between regions is [B, T/tp, hidden].
"""

from __future__ import annotations

from torch import nn

from asyncpp.config import check_parallel_sizes
from asyncpp.parallel.collectives import Group, group_size
from asyncpp.parallel.experts import parallelize_moe
from asyncpp.parallel.sharding import ParamSharding, ShardingPlan
from asyncpp.parallel.tp import (
    prefixed,
    sequence_parallel_around,
    shard_by_table,
    tp_region,
    vocab_parallel_embedding,
    vocab_parallel_head,
)
from model_zoo.attention import Attention
from model_zoo.config import ModelConfig
from model_zoo.gated_deltanet import GatedDeltaNet
from model_zoo.layers import SwiGLU
from model_zoo.moe import MoE
from model_zoo.transformer import Block, CausalLM

COLUMN, ROW = 0, 1

ATTENTION = {"q_proj.weight": COLUMN, "k_proj.weight": COLUMN, "v_proj.weight": COLUMN, "o_proj.weight": ROW}
# The optional output gate (attn_output_gate) has one channel per q channel: split with q, by head.
ATTENTION_GATE = {"gate_proj.weight": COLUMN}
# The optional q/k norms (qk_norm) hold one weight [head_dim] shared by all heads: replicated, and each
# rank's gradient sums only its own heads, so it is all-reduced over TP (like GDN's o_norm).
ATTENTION_PARTIAL_GRADS = ("q_norm.weight", "k_norm.weight")

# Every per-head tensor is split by head: projection rows are head-major (reshape(b, t, h, d)), the
# depthwise convs have one filter per channel, A_log / dt_bias one entry per head.
GATED_DELTANET = {
    "q_proj.weight": COLUMN, "k_proj.weight": COLUMN, "v_proj.weight": COLUMN, "g_proj.weight": COLUMN,
    "a_proj.weight": COLUMN, "b_proj.weight": COLUMN,
    "conv_q.weight": 0, "conv_k.weight": 0, "conv_v.weight": 0, "A_log": 0, "dt_bias": 0,
    "o_proj.weight": ROW,
}
# o_norm's weight [head_v_dim] is shared by all heads: replicated, but each rank's gradient only sums
# its own heads, so it must be all-reduced over TP.
GDN_PARTIAL_GRADS = ("o_norm.weight",)

SWIGLU = {"gate_proj.weight": COLUMN, "up_proj.weight": COLUMN, "down_proj.weight": ROW}

_APPLIED_ATTR = "_tensor_parallel_applied"


def apply_tensor_parallel(model: CausalLM, tp_group: Group | None, *, sequence_parallel: bool = False,
                          ep_group: Group | None = None) -> ShardingPlan:
    """Shard `model` (full or pruned to a stage, materialised or on meta) in place over `tp_group`
    (and MoE experts over `ep_group`); returns the layout of every TP-sharded, expert-sharded or
    TP-partial-gradient parameter, by full name. Call it once, before building optimizers."""
    tp = group_size(tp_group)
    validate_tensor_parallel(model.config, tp)
    if getattr(model, _APPLIED_ATTR, False):
        raise ValueError("apply_tensor_parallel was already applied to this model; apply it once, to the "
                         "plain model (sharding twice would split the shards).")
    setattr(model, _APPLIED_ATTR, True)
    # Like parallelize_moe: a layout is reported only where a group has more than one rank, so with
    # tp = ep = 1 the plan is {} and the model is untouched (one rank holds every sequence position too).
    sp = sequence_parallel and tp > 1
    plan = _parallelize_ends(model, tp_group, sp) if tp > 1 else {}
    for i, block in enumerate(model.layers):
        if isinstance(block, Block):  # a stage replaces the layers it does not own with nn.Identity
            plan |= prefixed(f"layers.{i}.", _parallelize_block(block, tp_group, sp, ep_group))
    return plan


def validate_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """Every size the plan splits must divide by tp (asyncpp.config's rules, also run at config time).
    Needs no process group. Raises ConfigError, a ValueError."""
    check_parallel_sizes(cfg, tp)


def _parallelize_ends(model: CausalLM, group: Group | None, sp: bool) -> ShardingPlan:
    """Embedding and head over the vocabulary; a tied head keeps sharing the embedding's Parameter."""
    plan: ShardingPlan = {}
    embed, head = getattr(model, "embed", None), getattr(model, "lm_head", None)
    tied = embed is not None and head is not None and head.weight is embed.weight
    if embed is not None:
        model.embed = vocab_parallel_embedding(embed, group, sequence_parallel=sp)
        plan["embed.weight"] = ParamSharding(tp_dim=0)
    if head is not None:
        if tied:
            head.weight = model.embed.weight
        vocab_parallel_head(head, group, sequence_parallel=sp, shard=not tied)
        plan["lm_head.weight"] = ParamSharding(tp_dim=0)  # also when tied: state_dict lists both names
    if sp and getattr(model, "norm", None) is not None:
        plan["norm.weight"] = ParamSharding(tp_grad_reduce=True)
    return plan


def _parallelize_block(block: Block, group: Group | None, sp: bool, ep_group: Group | None) -> ShardingPlan:
    if group_size(group) == 1:  # MoE experts may still be split over EP
        return prefixed("mlp.", parallelize_moe(block.mlp, group, ep_group)) if isinstance(block.mlp, MoE) else {}
    plan = prefixed("mixer.", _parallelize_mixer(block.mixer, group, sp))
    plan |= prefixed("mlp.", _parallelize_mlp(block.mlp, group, sp, ep_group))
    if sp:  # norms see only their sequence shard: each rank's weight gradient is partial
        plan |= {f"{norm}.weight": ParamSharding(tp_grad_reduce=True) for norm in ("mixer_norm", "mlp_norm")}
    return plan


def _parallelize_mixer(mixer: nn.Module, group: Group | None, sp: bool) -> ShardingPlan:
    tp = group_size(group)
    if isinstance(mixer, Attention):
        plan = shard_by_table(mixer, ATTENTION, group)
        if mixer.gate_proj is not None:
            plan |= shard_by_table(mixer, ATTENTION_GATE, group)
        if mixer.q_norm is not None:
            plan |= {name: ParamSharding(tp_grad_reduce=True) for name in ATTENTION_PARTIAL_GRADS}
        mixer.num_heads //= tp
        mixer.num_kv_heads //= tp  # GQA groups stay aligned: tp divides both head counts
    elif isinstance(mixer, GatedDeltaNet):
        plan = shard_by_table(mixer, GATED_DELTANET, group)
        plan |= {name: ParamSharding(tp_grad_reduce=True) for name in GDN_PARTIAL_GRADS}
        mixer.num_heads //= tp
        for conv in (mixer.conv_q, mixer.conv_k, mixer.conv_v):  # depthwise: groups == channels
            conv.in_channels = conv.out_channels = conv.groups = conv.weight.shape[0]
    else:
        raise NotImplementedError(f"no tensor-parallel plan for mixer {type(mixer).__name__}; "
                                  "add its table to model_zoo/parallelize.py.")
    tp_region(mixer, group, sequence_parallel=sp)
    return plan


def _parallelize_mlp(mlp: nn.Module, group: Group | None, sp: bool, ep_group: Group | None) -> ShardingPlan:
    if isinstance(mlp, SwiGLU):
        plan = shard_by_table(mlp, SWIGLU, group)
        tp_region(mlp, group, sequence_parallel=sp)
        return plan
    if isinstance(mlp, MoE):
        plan = parallelize_moe(mlp, group, ep_group)  # replicated in, reduced out over TP (its dispatcher)
        if sp:
            sequence_parallel_around(mlp, group)
        return plan
    raise NotImplementedError(f"no tensor-parallel plan for mlp {type(mlp).__name__}; "
                              "add its table to model_zoo/parallelize.py.")
