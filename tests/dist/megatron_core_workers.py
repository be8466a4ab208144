"""megatron-core's GPTModel as asyncpp's 2BW pipeline stages, and the single-process reference they must equal.

Each rank initializes megatron-core's parallel_state (gloo, CPU mode: asyncpp/parallel/megatron_cpu.py), builds
its GPTModel stage (pre_process/post_process, the local layer spec), takes asyncpp's mesh from megatron's groups
(Mesh.from_megatron) and trains with get_forward_backward_func("2bw") from a pretrain_gpt-style loop. The
reference is the same GPTModel unsplit in one process, under DelayedUpdateSimulator (x_{t+1} = x_t - U(g(x_{t-1})),
synchronous start and EF as configured). Both start from the reference's initial weights (each rank loads its
layers and TP shards), so the comparison is of the training, not of the initialization.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.optimizer import FP32Optimizer
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import Tensor, nn

from asyncpp.optim import build_optimizer, muon_sharded
from asyncpp.parallel import megatron_cpu
from asyncpp.parallel.mesh import Mesh
from asyncpp.pipeline.megatron import Pipeline2BW, get_forward_backward_func, optimizer_sharding
from asyncpp.pipeline.megatron_balancing import megatron_balanced_routers
from asyncpp.pipeline.megatron_checkpoint import global_name
from asyncpp.pipeline.megatron_vocab import (
    VocabSpreadStage,
    assemble_state_dict,
    checkpoint_of,
    vocab_split_of,
)
from asyncpp.pipeline.megatron_vocab_pipeline import VocabPipeline2BW
from asyncpp.reference.simulator import DelayedUpdateSimulator
from tests.dist.workers import SyntheticData

VOCAB, SEQ, MICRO_BATCH, HIDDEN, LAYERS, HEADS = 64, 16, 2, 32, 4, 4


@dataclass(frozen=True)
class Case:
    name: str
    schedule: str = "2bw"
    """get_forward_backward_func's: "2bw", or "1f1b" (every call flushed; the reference's every step synchronous)."""
    pp: int = 2
    """Pipeline stages: megatron splits the LAYERS layers evenly (get_num_layers_to_build)."""
    tp: int = 1
    dp: int = 1
    """Data-parallel replicas (world = pp stages x tp x dp); each reads its own m microbatches of a step."""
    ep: int = 1
    tied: bool = False
    optimizer: str = "muon"
    ef_lambda: float = 0.0
    grad_ef_lambda: float = 0.0
    dc_lambda: float = 0.0
    weight_prediction: bool = False
    sync_start_steps: int = 0
    drain_after: int | None = None
    """Drain the pipeline after this many calls, then resume (the mathematics does not change)."""
    moe: bool = False
    """Every layer's MLP a megatron-core MoELayer: 4 experts, top-2, aux loss, `dispatcher`."""
    dispatcher: str = "allgather"
    """moe_token_dispatcher_type: "allgather" or "alltoall" (MoEAlltoAllTokenDispatcher)."""
    router_bias: bool = False
    """With `moe`: megatron's aux-loss-free balancing (ROUTER_BIAS: the router's expert_bias moved every step)."""
    vocab: bool = False
    """The output layer spread over the stages by the cost model's shards (VocabSpreadStage, VocabPipeline2BW)."""
    vocab_embedding: bool = False
    """With `vocab`: the input embedding sharded by the same rows (VocabSpreadStage(embedding=True))."""
    sp: bool = False
    """Sequence parallelism (needs tp > 1): megatron_cpu's SequenceParallelLayerNorm in every norm."""
    loss_mask: bool = False
    """pretrain_gpt's loss_mask not all ones (masked_loss_mask: 4 positions of every sample masked, where depends on
    the sample); with `vocab`, given to VocabPipeline2BW as its loss_mask hook."""
    loss_scale: float | None = None
    """fp16-style loss scaling: config.grad_scale_func multiplies the loss by this (None: no grad_scale_func)."""
    overflow_step: int | None = None
    """The step whose scaled gradient overflows: the pipeline's loss scale is inf there, the reference's gradient is
    multiplied by inf (GradTimes); both skip the step. Must be a synchronous step (a scale change needs a drain)."""
    steps: int = 6
    num_microbatches: int = 4
    grad_clip: float = 1.0
    seed: int = 7
    reversed_sums: bool = False
    """The reference only: each step's microbatches in reverse order (its gradient summed in another float order,
    the same mathematics): its distance from the forward-order reference is the case's rounding floor."""

    @property
    def corrections(self) -> dict[str, float]:
        """The staleness corrections this case turns on (a synchronous start is not one: it removes delay)."""
        return {k: getattr(self, k) for k in CORRECTIONS if getattr(self, k)}


CORRECTIONS = ("ef_lambda", "grad_ef_lambda", "dc_lambda", "weight_prediction")


# ---- the model and the pretrain_gpt-style step ---------------------------------------------------------
MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_token_dispatcher_type": "allgather",
       "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.01}
# DeepSeek-V3's balancing as megatron has it (sigmoid scores, which megatron requires with the bias); the rate is
# 10x megatron's default so that the bias changes the top-2 choice within the run's 6 steps.
ROUTER_BIAS = {"moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid",
               "moe_router_bias_update_rate": 1e-2}


def transformer_config(pp: int, tp: int, moe: bool, ep: int = 1, dispatcher: str = "allgather",
                       sp: bool = False, router_bias: bool = False) -> TransformerConfig:
    """No linear biases: the key part of the qkv bias has an identically zero gradient (softmax is shift
    invariant), so AdamW would turn the rounding noise there into lr-sized steps that differ between any two
    float orders; every other parameter's comparison is well conditioned."""
    return TransformerConfig(add_bias_linear=False, num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                             use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                             pipeline_dtype=torch.float32, params_dtype=torch.float32,
                             pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
                             expert_model_parallel_size=ep, sequence_parallel=sp,
                             **({**MOE, "moe_token_dispatcher_type": dispatcher, **(ROUTER_BIAS if router_bias else {})}
                                if moe else {}))


def build_gpt(case: Case, pp: int, pre_process: bool, post_process: bool) -> GPTModel:
    spec = get_gpt_layer_local_spec(num_experts=MOE["num_moe_experts"] if case.moe else None, moe_grouped_gemm=False)
    split = pp > 1  # the reference: one process, every expert, the whole sequence
    config = transformer_config(pp, case.tp, case.moe, case.ep if split else 1, case.dispatcher, case.sp and split,
                                case.router_bias)
    if case.sp:  # the reference too: the same LayerNorm kernel
        spec = megatron_cpu.local_block_spec(config, spec)
    return GPTModel(config, spec, vocab_size=VOCAB,
                    max_sequence_length=SEQ, pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=case.tied)


def get_batch(data_iterator, masked: bool = False):
    """pretrain_gpt's get_batch (every stage reads the microbatch; each uses what it needs)."""
    sample = next(data_iterator)
    tokens, labels = sample[:, :-1], sample[:, 1:]
    position_ids = torch.arange(tokens.size(1)).expand_as(tokens)
    mask = masked_loss_mask(sample) if masked else torch.ones_like(labels, dtype=torch.float)
    return tokens, labels, mask, megatron_cpu.causal_mask(tokens.size(1)), position_ids


def masked_loss_mask(sample: Tensor) -> Tensor:
    """[mb, seq]: 0 at 4 consecutive positions of each sample, starting where its first token says (as a prompt's
    tokens are masked out), 1 elsewhere: the same count per microbatch, so the reported per-token mean over the step
    equals the mean of the microbatches' masked means (the reference's)."""
    mb, seq = sample.shape[0], sample.shape[1] - 1
    start = sample[:, :1] % (seq - 4)
    pos = torch.arange(seq).expand(mb, seq)
    return ((pos < start) | (pos >= start + 4)).float()


def loss_func(loss_mask: Tensor, output_tensor: Tensor):
    """pretrain_gpt's loss_func: (summed loss, num_tokens, {"lm loss": [sum, num_tokens]})."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])}


def forward_step(data_iterator, model: GPTModel, masked: bool = False):
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, masked)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, functools.partial(loss_func, loss_mask)


def data_for(case: Case) -> SyntheticData:
    return SyntheticData(VOCAB, SEQ, MICRO_BATCH, case.seed)


def eval_microbatches(case: Case) -> list[Tensor]:
    """m held-out microbatches (indices no training step reads) for an evaluation after the run."""
    data = data_for(case)
    return [data.train_microbatch(10_000 + j) for j in range(case.num_microbatches)]


# ---- names and shards: a stage's parameters as pieces of the unsplit model -----------------------------
def shard_of(full: Tensor, param: nn.Parameter, tp: int, tp_rank: int) -> Tensor:
    """This TP rank's piece of `full`, by megatron's own parameter attributes."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    return full.chunk(tp, dim=param.partition_dim)[tp_rank]


# ---- the single-process reference ----------------------------------------------------------------------
def setup_megatron(tp: int, pp: int, ep: int = 1, vocab: bool = False, vocab_embedding: bool = False) -> Mesh:
    if parallel_state.model_parallel_is_initialized():  # the previous case's layout
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep)
    megatron_cpu.enable(torch.device("cpu"))
    return Mesh.from_megatron(torch.device("cpu"), vocab_head=vocab, vocab_embedding=vocab_embedding)


def reference_rank(rank: int, cases: list[dict]) -> dict:
    setup_megatron(1, 1)
    return {c["name"]: reference_run(Case(**c)) for c in cases}


def reference_run(case: Case) -> dict:
    torch.manual_seed(case.seed)
    model = build_gpt(case, pp=1, pre_process=True, post_process=True)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, name=case.optimizer, lr=0.01)

    at = {"step": 0}

    def lm_loss(model: GPTModel, sample: Tensor) -> Tensor:
        tokens, labels, loss_mask, attention_mask, position_ids = get_batch(iter([sample]), case.loss_mask)
        loss = (model(tokens, position_ids, attention_mask, labels=labels) * loss_mask).sum() / loss_mask.sum()
        return GradTimes.apply(loss, math.inf) if at["step"] == case.overflow_step else loss

    params = [p for p in model.parameters() if p.requires_grad]
    sim = DelayedUpdateSimulator(model, opt, [1] * len(params), loss_fn=lm_loss, grad_clip=case.grad_clip,
                                 ef_lambda=case.ef_lambda, grad_ef_lambda=case.grad_ef_lambda,
                                 dc_lambda=case.dc_lambda, weight_prediction=case.weight_prediction,
                                 sync_step=lambda t: case.schedule == "1f1b" or t < case.sync_start_steps,
                                 routers=megatron_balanced_routers(model))
    data, n = data_for(case), case.num_microbatches * case.dp  # replica by replica, as the pipeline reads them
    stats, biases = [], {0: router_biases(sim.balancing, 0, lambda name: name)} if sim.balancing else {}
    for t in range(case.steps):
        at["step"] = t
        microbatches = [data.train_microbatch(t * n + j) for j in range(n)]
        stats.append(sim.step(t, microbatches[::-1] if case.reversed_sums else microbatches))
        if sim.balancing:
            biases[t + 1] = router_biases(sim.balancing, t + 1, lambda name: name)
    out = {"init": init, "router_bias": biases, "losses": [s.loss for s in stats], "grad_norms": [s.grad_norm for s in stats],
           "skipped": [s.skipped for s in stats],
           "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    with torch.no_grad():  # the final model's loss on held-out microbatches (what an evaluation drain reports)
        out["eval"] = sum(float(lm_loss(model, x)) for x in eval_microbatches(case)) / case.num_microbatches
    if case.corrections:  # the same run without them: the test shows they changed the trajectory
        out["uncorrected"] = reference_run(replace(case, **dict.fromkeys(CORRECTIONS, 0)))["params"]
    return out


def router_biases(balancing, version: int, name_of: Callable[[str], str]) -> dict[str, Tensor]:
    """The expert bias of weight version `version` per router, by its MoE layer's name in the unsplit model."""
    return {name_of(n): b.clone() for n, b in zip(balancing.names, balancing.versions[version])}


class GradTimes(torch.autograd.Function):
    """The identity whose backward multiplies the gradient by `factor`: an overflow of the reference's gradient
    (what a loss scale of `factor` does to the pipeline's) that leaves the reported loss as it is."""

    @staticmethod
    def forward(ctx, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.factor, None


# ---- one pipeline rank -----------------------------------------------------------------------------------
class Calls:
    """Counts the forwards of megatron-core's own layer classes on this rank."""

    KINDS = (TransformerLayer, ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, MoELayer)

    def __init__(self, model: nn.Module):
        self.count: dict[str, int] = {}
        for module in model.modules():
            if isinstance(module, self.KINDS):
                module.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        name = type(module).__name__
        self.count[name] = self.count.get(name, 0) + 1


def pipeline_rank(rank: int, cases: list[dict], references: dict) -> list[dict]:
    out = []
    for c in (Case(**c) for c in cases):
        mesh = setup_megatron(c.tp, c.pp, c.ep, c.vocab, c.vocab_embedding)
        assert mesh.dims.dp == c.dp, (mesh.dims, c)
        out.append(pipeline_run(c, mesh, references[c.name]["init"]))
    return out


def replica_microbatches(case: Case, dp_rank: int):
    """This replica's microbatches: step t's global microbatches t*m*dp + dp_rank*m + j, j < m."""
    data, m = data_for(case), case.num_microbatches
    for t in itertools.count():
        for j in range(m):
            yield data.train_microbatch((t * case.dp + dp_rank) * m + j)


def pipeline_run(case: Case, mesh: Mesh, init: dict[str, Tensor]) -> dict:
    pre, post = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    model = build_gpt(case, mesh.num_stages, pre, post)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(shard_of(init[global_name(model, name)], p, case.tp, mesh.tp_rank))
    calls = Calls(model)
    tied = [model.shared_embedding_or_output_weight()] if case.tied and not case.vocab else []  # (vocab: the stage's)
    # The spread head: the stages train `stage` (the GPTModel and its rows), megatron's whole output_layer frozen.
    split = vocab_split_of(model, seq_len=SEQ, micro_batch_size=MICRO_BATCH,
                           embedding=case.vocab_embedding) if case.vocab else None
    stage = VocabSpreadStage(model, mesh, split, embedding=case.vocab_embedding) if case.vocab else model
    engine = (functools.partial(VocabPipeline2BW, split=split, input_ids=lambda sample: sample[:, :-1],
                                loss_mask=masked_loss_mask if case.loss_mask else None)
              if case.vocab else Pipeline2BW)
    step = functools.partial(forward_step, masked=case.loss_mask)
    # Megatron's TP layout for Muon (param_layouts): a sharded matrix is gathered and orthogonalised whole.
    optimizer = build_optimizer(stage, name=case.optimizer, lr=0.01, sharding=optimizer_sharding(stage),
                                tp_group=mesh.tp_group)
    muon = MuonWatch(optimizer, model, mesh)
    layout_refusal = unaware_muon_refusal(model, mesh) if case.optimizer == "muon" and case.tp > 1 else None
    fp16_refusal = half_model_refusal(case, mesh, pre, post) if case.loss_scale is not None else None
    fwd_bwd = get_forward_backward_func(case.schedule, engine_factory=lambda schedule: engine(
        stage, optimizer, mesh, schedule=schedule, hidden_size=HIDDEN, grad_clip=case.grad_clip,
        ef_lambda=case.ef_lambda, grad_ef_lambda=case.grad_ef_lambda, dc_lambda=case.dc_lambda,
        weight_prediction=case.weight_prediction, tied=tied, sequence_first=True,
        sync_start_steps=case.sync_start_steps))
    pipeline = fwd_bwd.pipeline
    scale = {"now": case.loss_scale}
    if case.loss_scale is not None:  # what megatron's training loop sets from its optimizer, here a constant
        model.config.grad_scale_func = lambda loss: loss * scale["now"]
    predicted = PredictedReads(pipeline)
    partial_tp = PartialTpWatch(pipeline, model)
    train_iter = replica_microbatches(case, mesh.dp_rank)
    losses, applied, scales, scale_refusal, biases = [], [], [], None, {}
    tokens = []  # the last stage: each microbatch's reported token count (pretrain_gpt's sum(loss_mask))
    balancing = pipeline.engine.update.balancing

    def keep_biases() -> None:  # every version the stage holds now (a version, once made, never changes)
        biases.update({v: router_biases(balancing, v, lambda n: n) for v in balancing.versions} if balancing else {})
    for k in range(case.steps):
        if case.loss_scale is not None:
            scale["now"] = math.inf if k == case.overflow_step else case.loss_scale
            if k == case.steps - 1:  # a stream is open: a new scale is refused before anything runs
                scale_refusal = changed_scale_refusal(fwd_bwd, stage, train_iter, case, scale)
        store = fwd_bwd(forward_step_func=step, data_iterator=train_iter, model=[stage],
                        num_microbatches=case.num_microbatches, seq_length=SEQ, micro_batch_size=MICRO_BATCH)
        if store:  # the last stage: per-token mean of the step, as Megatron's training_log reduces it
            total = torch.stack([d["lm loss"] for d in store]).double().sum(0)
            losses.append(float(total[0] / total[1]))
            tokens += [float(d["lm loss"][1]) for d in store]
        applied.append(pipeline.applied_step)
        keep_biases()
        scales.append(pipeline.engine.update.reduction.grad_scale)
        if case.drain_after is not None and k + 1 == case.drain_after:
            pipeline.drain()
            applied.append(pipeline.applied_step)
    pipeline.drain()
    keep_biases()
    valid = None
    if case.vocab:  # an evaluation through the drained pipeline (the spread head's forward_only path)
        store = fwd_bwd(forward_step_func=step, data_iterator=iter(eval_microbatches(case)), model=[stage],
                        num_microbatches=case.num_microbatches, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
                        forward_only=True)
        if store:  # the last stage
            total = torch.stack([d["lm loss"] for d in store]).double().sum(0)
            valid = float(total[0] / total[1])
    # (checkpoint_of assembles one TP and one EP rank per stage: MegatronCheckpoint holds every piece,
    # test_megatron_checkpoint)
    checkpoint = (unsplit_from_checkpoints(case, model, stage, split, mesh)
                  if case.vocab and case.tp == 1 and case.ep == 1 else None)
    muon.close()
    grad_norms = {t: r.grad_norm for t, r in pipeline.records.items()}
    return {
        "case": asdict(case), "stage": mesh.pp_rank, "tp_rank": mesh.tp_rank, "dp_rank": mesh.dp_rank,
        "mask_tokens": tokens or None,
        "ep_rank": mesh.ep_rank, "losses": losses, "router_bias": biases, "applied": applied, "eval": valid, "checkpoint": checkpoint,
        "grad_norms": grad_norms, "skipped": {t: r.skipped for t, r in pipeline.records.items()},
        "grad_scales": scales, "scale_refusal": scale_refusal, "fp16_refusal": fp16_refusal,
        "params": {**{global_name(model, n): (p.detach().clone(), getattr(p, "tensor_model_parallel", False),
                                              getattr(p, "partition_dim", None)) for n, p in model.named_parameters()
                      if not (case.vocab and n in stage.frozen)},
                   **(spread_head_of(stage, mesh, init) if case.vocab else {})},
        "layout_refusal": layout_refusal,
        "evidence": {**evidence(model, mesh, calls), "muon": muon.report(),
                     "vocab": vocab_evidence(stage, pipeline, init) if case.vocab else None,
                     "corrections": corrections_evidence(pipeline, predicted.count),
                     "partial_tp": partial_tp.report()},
    }


def spread_head_of(stage: VocabSpreadStage, mesh: Mesh, init: dict[str, Tensor]) -> dict:
    """The trained head assembled from every stage's rows (in stage order: the rows are consecutive), reported by
    the last stage as megatron's output_layer.weight (its own whole one was frozen)."""
    tied = stage.module.share_embeddings_and_output_weights  # the head rows are rows of the table
    out = {}
    for name, rows in stage.rows().items() if stage.embedding_sharded else []:  # the sharded table's rows too
        gathered = [None] * mesh.num_stages
        dist.all_gather_object(gathered, rows.clone(), group=mesh.pp_group)
        out[name] = (torch.cat(gathered), False, None)
    if not stage.embedding_sharded or not tied:  # every (stage, TP rank)'s rows, in that order (the stats group's)
        gathered = [None] * dist.get_world_size(mesh.vocab_groups.stats)
        dist.all_gather_object(gathered, stage.head_weight().detach().clone(), group=mesh.vocab_groups.stats)
        out["embedding.word_embeddings.weight" if tied else "output_layer.weight"] = (torch.cat(gathered), False, None)
    return out if mesh.is_last_stage else {}


def unsplit_from_checkpoints(case: Case, model: GPTModel, stage: VocabSpreadStage, split, mesh: Mesh) -> dict | None:
    """Every stage's checkpoint of the trained spread model (megatron_vocab.checkpoint_of: its layers and rows),
    gathered and assembled on the last stage, loaded strictly into an unsplit GPTModel built there (pipeline size 1
    inside the pipelined job): that model's parameters, by name (None on the other stages)."""
    saved = [None] * mesh.num_stages
    dist.all_gather_object(saved, checkpoint_of(model, stage.rows(), split, mesh, embedding=case.vocab_embedding),
                           group=mesh.pp_group)
    if not mesh.is_last_stage:
        return None
    unsplit = build_gpt(case, pp=1, pre_process=True, post_process=True)
    unsplit.load_state_dict(assemble_state_dict(saved, VOCAB, tied=case.tied), strict=True)
    return {n: p.detach().clone() for n, p in unsplit.named_parameters()}


def vocab_evidence(stage: VocabSpreadStage, pipeline, init: dict[str, Tensor]) -> dict:
    """What shows the spread head ran: this stage's rows' shape and start, the S passes and their logits' widths
    (VocabHead), that megatron's whole output_layer stayed out of training (frozen and equal to its init) and that
    the rows moved."""
    head = pipeline.head
    gpt = stage.module
    frozen = gpt.output_layer.weight if hasattr(gpt, "output_layer") else None  # the last stage's
    whole = init["embedding.word_embeddings.weight" if gpt.share_embeddings_and_output_weights else "output_layer.weight"]
    start, rows = stage.start, stage.shard_rows
    mesh = pipeline.mesh  # (under TP the frozen output_layer is this TP rank's piece of the whole)
    return {"rows": tuple(stage.head_weight().shape), "start": start, "passes": head.passes,
            "widths": sorted(head.logits_widths), "rows_of_table": stage.rows_of_table,
            "output_layer_untouched": None if frozen is None else (not frozen.requires_grad and torch.equal(
                frozen.detach(), shard_of(whole, frozen, mesh.dims.tp, mesh.tp_rank))),
            "rows_moved": not torch.equal(stage.head_weight().detach(), whole[start:start + rows])}


def changed_scale_refusal(fwd_bwd, model: nn.Module, data, case: Case, scale: dict) -> str | None:
    """What forward_backward_func says when config.grad_scale_func's scale changes inside an open 2BW stream."""
    before, scale["now"] = scale["now"], 2 * scale["now"]
    try:
        fwd_bwd(forward_step_func=forward_step, data_iterator=data, model=[model],
                num_microbatches=case.num_microbatches, seq_length=SEQ, micro_batch_size=MICRO_BATCH)
    except ValueError as e:
        return str(e)
    finally:
        scale["now"] = before
    return None


class MuonWatch:
    """What Muon did with megatron's TP layout on this rank: each matrix's tp_dim in its param group, the shape
    Newton-Schulz saw for it (Muon._job) and the all-gathers Muon issued on megatron's TP group."""

    def __init__(self, optimizer, model: GPTModel, mesh: Mesh):
        self.muon = optimizer.optimizers.get("muon")
        self.tp_group, self.gathers, self.jobs = mesh.tp_group, 0, set()
        if self.muon is None:
            return
        names = {id(p): global_name(model, n) for n, p in model.named_parameters()}
        self.tp_dims = {names[id(p)]: d for g in self.muon.param_groups for p, d in zip(g["params"], g["tp_dims"])}
        job, gather = self.muon._job, muon_sharded._all_gather

        def watched_job(x, tp_dim, expert):
            out = job(x, tp_dim, expert)
            self.jobs.add((tuple(out.shape), out.gather_dim))
            return out

        def watched_gather(output, input, *, group, async_op):
            self.gathers += group is self.tp_group
            return gather(output, input, group=group, async_op=async_op)

        self.muon._job, muon_sharded._all_gather, self._restore = watched_job, watched_gather, gather

    def close(self) -> None:
        if self.muon is not None:
            muon_sharded._all_gather = self._restore

    def report(self) -> dict:
        if self.muon is None:
            return {}
        return {"tp_dims": self.tp_dims, "jobs": sorted(self.jobs, key=str), "tp_gathers": self.gathers}


def unaware_muon_refusal(model: GPTModel, mesh: Mesh) -> str | None:
    """What Pipeline2BW says to a Muon built without megatron's TP layout (it would orthogonalise each shard)."""
    try:
        Pipeline2BW(model, build_optimizer(model, name="muon", lr=0.01), mesh, hidden_size=HIDDEN)
    except ValueError as e:
        return str(e)
    return None


class PartialTpWatch:
    """The TP all-reduce of the partial gradients (megatron's sequence-parallel norms, marked by param_layouts) in
    the engine's reduction: how often it ran, on which tensors, and whether the sum differed from this rank's part
    (it does when the other TP rank's part is nonzero: the reduction really summed)."""

    def __init__(self, pipeline: Pipeline2BW, model: GPTModel):
        reduction = pipeline.engine.update.reduction
        name_of = {id(p): global_name(model, n) for n, p in model.named_parameters()}  # (a spread head's rows: none)
        self.names = [name_of.get(id(p), "?") for p, lay in zip(pipeline.engine.versions.params, reduction.layouts)
                      if lay.tp_grad_reduce]
        self.calls, self.tensors, self.changed = 0, 0, 0
        inner, layouts = reduction._reduce_partial_tp, reduction.layouts

        def watched(grads: list[Tensor]) -> None:
            partial = [g for g, lay in zip(grads, layouts) if lay.tp_grad_reduce]
            before = [g.clone() for g in partial]
            inner(grads)
            self.calls += 1
            self.tensors += len(partial)
            self.changed += sum(not torch.equal(b, g) for b, g in zip(before, partial))

        reduction._reduce_partial_tp = watched

    def report(self) -> dict:
        return {"names": self.names, "calls": self.calls, "tensors": self.tensors, "changed": self.changed}


def half_model_refusal(case: Case, mesh: Mesh, pre: bool, post: bool) -> str | None:
    """What Pipeline2BW says to a GPTModel whose parameters are fp16 (megatron's Float16Module does .half())."""
    model = build_gpt(case, mesh.num_stages, pre, post).half()
    try:
        Pipeline2BW(model, build_optimizer(model, name="adamw", lr=0.01), mesh, hidden_size=HIDDEN)
    except NotImplementedError as e:
        return str(e)
    return None


class PredictedReads:
    """Counts the forwards/backwards the engine ran on a weight prediction x^ (WeightVersions.use, predicted)."""

    def __init__(self, pipeline: Pipeline2BW):
        self.count, versions = 0, pipeline.engine.versions
        use = versions.use

        def counted(version: int, predicted: bool = False) -> None:
            self.count += bool(predicted and versions.predict_delay)
            use(version, predicted)

        versions.use = counted


def corrections_evidence(pipeline: Pipeline2BW, predicted_reads: int) -> dict:
    """The pipeline's own state of the corrections: gradient EF's g_{t-1} buffer, the weight versions kept, the
    reads of a predicted version."""
    update = pipeline.engine.update
    prev = [g for g in update.rule.grad_error_feedback.prev_grad if g is not None]
    return {"grad_ef_buffer_norm": float(torch.stack([g.norm() for g in prev]).norm()) if prev else 0.0,
            "num_buffers": pipeline.engine.versions.num_buffers, "predicted_reads": predicted_reads}


def evidence(model: GPTModel, mesh: Mesh, calls: Calls) -> dict:
    """What shows that megatron-core's modules and groups did the work (not a fallback to asyncpp's)."""
    ps = parallel_state
    ranks = dist.get_process_group_ranks
    linear = next(m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear)))
    return {
        "model_class": type(model).__module__ + "." + type(model).__name__,
        "module_classes": sorted({type(m).__module__ + "." + type(m).__name__ for m in model.modules()}),
        "forward_calls": calls.count,
        "dispatchers": sorted({type(m.token_dispatcher).__name__ for m in model.modules() if isinstance(m, MoELayer)}),
        "sequence_parallel": model.config.sequence_parallel,
        "cpu_mode": megatron_cpu.is_enabled(),
        "linear_tp_group_is_megatrons": linear.tp_group is ps.get_tensor_model_parallel_group(),
        "mesh_groups_are_megatrons": {
            "tp": mesh.tp_group is ps.get_tensor_model_parallel_group(),
            "pp": mesh.pp_group is ps.get_pipeline_model_parallel_group(),
            "dp": mesh.dp_group is ps.get_data_parallel_group(),
            "ep": mesh.ep_group is ps.get_expert_model_parallel_group(),
            "edp": mesh.edp_group is ps.get_expert_data_parallel_group(),
            # megatron's on the first and last stage; with the head spread, asyncpp's over every stage
            "embedding": (mesh.embedding_group is (ps.get_embedding_group() if mesh.pp_rank in (0, mesh.num_stages - 1)
                                                   else None)) if mesh.vocab_groups is None
            else ranks(mesh.embedding_group) == ranks(mesh.pp_group),
            "norm": mesh.norm_group is (ps.get_model_parallel_group() if mesh.dims.ep == 1
                                        else ps.get_expert_tensor_model_pipeline_parallel_group()),
        },
        "tp_group_ranks": ranks(ps.get_tensor_model_parallel_group()),
        # megatron's embedding group exists on the first and last stage only (a middle stage raises for it)
        "embedding_group_ranks": ranks(mesh.embedding_group) if mesh.embedding_group is not None else [],
    }


# ---- megatron-core's DistributedDataParallel / finalize_model_grads / optimizers (asyncpp refuses them) -------
def megatron_grad_machinery_rank(rank: int) -> dict:
    """On one CPU process: megatron's DistributedDataParallel and finalize_model_grads run megatron's own flushed
    step (forward_backward_no_pipelining) in the CPU mode and give the plain gradient, in param.main_grad, with
    param.grad taken away (what keeps them out of a 2BW stage); megatron's optimizers cannot be built on a CPU;
    Pipeline2BW refuses each with its reason. Returns what happened, as data."""
    mesh, case = setup_megatron(1, 1), Case("megatron_ddp")
    data = data_for(case)
    microbatches = [data.train_microbatch(j) for j in range(case.num_microbatches)]
    torch.manual_seed(case.seed)
    plain = build_gpt(case, pp=1, pre_process=True, post_process=True)
    wrapped = build_gpt(case, pp=1, pre_process=True, post_process=True)
    wrapped.load_state_dict(plain.state_dict())
    for sample in microbatches:  # Megatron's convention: per-token mean of each microbatch, / m
        tokens, labels, loss_mask, attention_mask, position_ids = get_batch(iter([sample]))
        loss = (plain(tokens, position_ids, attention_mask, labels=labels) * loss_mask).sum() / loss_mask.sum()
        (loss / case.num_microbatches).backward()
    ddp = DistributedDataParallel(wrapped.config, DistributedDataParallelConfig(), wrapped)
    wrapped.config.finalize_model_grads_func = finalize_model_grads
    # megatron's forward_backward_no_pipelining, by hand: it allocates on device="cuda" itself
    # (pipeline_parallel/schedules.py:596). Every microbatch but the last under no_sync, then finalize.
    for j, sample in enumerate(microbatches):
        with ddp.no_sync() if j + 1 < len(microbatches) else contextlib.nullcontext():
            output, loss_func = forward_step(iter([sample]), ddp)
            loss, num_tokens, _ = loss_func(output)
            (loss / num_tokens / len(microbatches)).backward()
    wrapped.config.finalize_model_grads_func([ddp])
    pairs = list(zip(plain.parameters(), wrapped.parameters()))
    out = {"main_grad_error": max(float((q.main_grad - p.grad).norm() / p.grad.norm()) for p, q in pairs),
           "grads_taken": all(q.grad is None for _, q in pairs)}
    refusals = {}

    def refused(name: str, build: Callable) -> None:
        try:
            build()
        except ValueError as e:
            refusals[name] = str(e)

    def pipeline(model, optimizer=None):
        return Pipeline2BW(model, optimizer or build_optimizer(model, name="adamw", lr=0.01), mesh,
                           hidden_size=HIDDEN, sequence_first=True)

    refused("ddp", lambda: pipeline(ddp))
    refused("ddp_inner", lambda: pipeline(wrapped))
    try:  # megatron's optimizers on a CPU: where they stop
        get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.01), [ddp])
    except AssertionError as e:  # torch: "Torch not compiled with CUDA enabled"
        frame = next(f for f in reversed(traceback.extract_tb(e.__traceback__)) if "megatron/core" in f.filename)
        out["megatron_optimizer_stops_at"] = f"{frame.filename.split('megatron/core/')[-1]}:{frame.lineno}"
    fresh = build_gpt(case, pp=1, pre_process=True, post_process=True)
    # A real megatron optimizer class, its CUDA constructor not run (it cannot run here, see above).
    refused("megatron_optimizer", lambda: pipeline(fresh, FP32Optimizer.__new__(FP32Optimizer)))
    fresh.config.finalize_model_grads_func = finalize_model_grads
    fwd_bwd = pipeline(fresh).forward_backward_func  # built: only the call refuses (the loop sets it later)
    refused("finalize_model_grads_func", lambda: fwd_bwd(
        forward_step_func=forward_step, data_iterator=iter(microbatches), model=[fresh],
        num_microbatches=case.num_microbatches, seq_length=SEQ, micro_batch_size=MICRO_BATCH))
    out["refusals"] = refusals
    return out
