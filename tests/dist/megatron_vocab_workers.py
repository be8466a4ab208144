"""Workers of tests/dist/test_megatron_vocab.py: megatron-core GPTModels built in one gloo process (world 1), the
pipeline stages by setting megatron's pipeline rank before each is built (parallel_state's own setters)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from asyncpp.parallel import megatron_cpu
from asyncpp.parallel.mesh import Mesh, ParallelDims
from asyncpp.pipeline.megatron_vocab import (
    EMBEDDING,
    HEAD,
    VocabSpreadStage,
    assemble_state_dict,
    checkpoint_of,
    model_config_of,
    spread_rows,
    stage_checkpoint,
    stage_layers_of,
    vocab_split_of,
)
from model_zoo.registry import MOE_2B
from tests.dist.megatron_core_workers import global_name, setup_megatron


def _megatron_on_cpu() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)
    megatron_cpu.enable(torch.device("cpu"))


def moe_2b_config(pp: int) -> TransformerConfig:
    """model_zoo's moe_2b (model_zoo/registry.py) in megatron's words: 16 layers of d 1024, 16 query and 4 KV heads
    of 64, SwiGLU experts (64 of width 512, top 8), RMSNorm, no biases."""
    m = MOE_2B
    return TransformerConfig(num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_heads,
                             num_query_groups=m.num_kv_heads, kv_channels=m.head_dim, gated_linear_unit=True,
                             activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
                             num_moe_experts=m.moe.num_experts, moe_router_topk=m.moe.top_k,
                             moe_ffn_hidden_size=m.moe.expert_ffn_hidden_size, use_cpu_initialization=True,
                             perform_initialization=False, pipeline_model_parallel_size=pp,
                             pipeline_dtype=torch.float32)


def moe_2b_split(pp: int, seq_len: int, micro_batch_size: int, device_type: str) -> dict:
    """moe_2b built as megatron-core GPTModel stages at `pp` on the meta device (every stage, each with its
    megatron pipeline rank): the model config the cost model reads and each stage's vocabulary split at this work
    shape on `device_type`."""
    config = moe_2b_config(pp)
    spec = get_gpt_layer_local_spec(num_experts=MOE_2B.moe.num_experts, moe_grouped_gemm=False,
                                    normalization="RMSNorm")
    splits, layers = [], []
    parallel_state.set_pipeline_model_parallel_world_size(pp)
    for s in range(pp):
        parallel_state.set_pipeline_model_parallel_rank(s)
        with torch.device("meta"):
            gpt = GPTModel(config, spec, vocab_size=MOE_2B.vocab_size, max_sequence_length=MOE_2B.max_seq_len,
                           pre_process=s == 0, post_process=s == pp - 1, share_embeddings_and_output_weights=False,
                           position_embedding_type="rope")
        layers.append(len(gpt.decoder.layers))
        splits.append({e: vocab_split_of(gpt, seq_len=seq_len, micro_batch_size=micro_batch_size, embedding=e,
                                        device_type=device_type)
                       for e in (False, True)})
    return {"model": model_config_of(gpt), "splits": splits, "built_layers": layers,
            "megatron_layers": stage_layers_of(config)}


# ---- the checkpoint ------------------------------------------------------------------------------------------
VOCAB, HIDDEN, LAYERS, HEADS, SEQ = 96, 32, 4, 4, 16


def tiny_gpt(pp: int, pre: bool, post: bool, tied: bool) -> GPTModel:
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               add_bias_linear=False, use_cpu_initialization=True, pipeline_model_parallel_size=pp,
                               pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                    pre_process=pre, post_process=post, share_embeddings_and_output_weights=tied)


def vocab_rank(rank: int, cases: list[tuple[int, bool, bool]], moe_2b: tuple[int, int, int, str]) -> dict:
    """Everything the test reads, in one process: checkpoint_case of every (pp, tied, embedding) case, the
    refusals and moe_2b_split at (pp, seq_len, micro_batch_size, device_type)."""
    _megatron_on_cpu()
    return {"checkpoints": [checkpoint_case(*case) for case in cases], "refusals": refusals(),
            "moe_2b": moe_2b_split(*moe_2b)}


def checkpoint_case(pp: int, tied: bool, embedding: bool) -> dict:
    """Build the `pp` stages of a tiny GPTModel (each its own random init), spread the first stage's embedding
    and the last stage's head over the stages by the cost model's shards (rows taken by offset), save every
    stage's StageCheckpoint, assemble them and load the result into an unsplit GPTModel (strict). Returns the
    stages' own tensors by their unsplit name, the loaded model's state, the split and the saved rows' shapes.

    Tied stages are built untied: megatron's tied construction all-reduces the weight over its embedding group,
    which one process does not have; the checkpoint of a tied model saves no head rows (its head rows are the
    embedding's), which the strict load into a tied unsplit GPTModel (no output_layer.weight) checks."""
    parallel_state.set_pipeline_model_parallel_world_size(pp)
    torch.manual_seed(pp + 7)
    stages = []
    for s in range(pp):
        parallel_state.set_pipeline_model_parallel_rank(s)
        stages.append(tiny_gpt(pp, s == 0, s == pp - 1, False))  # tied: see the docstring
    split = vocab_split_of(stages[0], seq_len=SEQ, micro_batch_size=2, embedding=embedding)
    table = stages[0].embedding.word_embeddings.weight.detach()
    head = table if tied else stages[-1].output_layer.weight.detach()
    truth = {EMBEDDING: table.clone(), **({} if tied else {HEAD: head.clone()})}
    saved, shapes = [], []
    for s, gpt in enumerate(stages):
        start, n = sum(split.shards[:s]), split.shards[s]
        rows = {} if tied else {HEAD: head[start:start + n].clone()}
        if embedding:
            rows[EMBEDDING] = table[start:start + n].clone()
        elif s == 0:
            rows[EMBEDDING] = table.clone()
        state = {k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
        ckpt = stage_checkpoint(state, rows, split, s, embedding=embedding)
        saved.append(ckpt)
        shapes.append({k: (start, tuple(v.shape)) for k, (start, v) in ckpt.rows.items()})
        offset = sum(split.sizes[:s])
        for name, value in state.items():
            if name.startswith("decoder.layers."):
                index, rest = name[len("decoder.layers."):].split(".", 1)
                truth[f"decoder.layers.{int(index) + offset}.{rest}"] = value.clone()
            elif name not in (HEAD, EMBEDDING):
                truth[name] = value.clone()
    assembled = assemble_state_dict(saved, VOCAB, tied=tied)
    parallel_state.set_pipeline_model_parallel_world_size(1)
    parallel_state.set_pipeline_model_parallel_rank(0)
    unsplit = tiny_gpt(1, True, True, tied)
    missing, unexpected = unsplit.load_state_dict(assembled, strict=True)
    loaded = {k: v.clone() for k, v in unsplit.state_dict().items() if not k.endswith("_extra_state")}
    return {"truth": truth, "loaded": loaded, "shards": split.shards, "sizes": split.sizes, "shapes": shapes,
            "missing": list(missing), "unexpected": list(unexpected)}


def refusals() -> dict:
    """What assemble_state_dict says to a checkpoint missing a stage, and what stage_checkpoint says to rows of
    the wrong shape."""
    parallel_state.set_pipeline_model_parallel_world_size(2)
    parallel_state.set_pipeline_model_parallel_rank(0)
    gpt = tiny_gpt(2, True, False, False)
    split = vocab_split_of(gpt, seq_len=SEQ, micro_batch_size=2, embedding=True)
    out = {}
    rows = torch.zeros(split.shards[0], HIDDEN)
    first = stage_checkpoint({}, {HEAD: rows, EMBEDDING: rows}, split, 0, embedding=True)
    for name, call in {"missing_stage": lambda: assemble_state_dict([first], VOCAB, tied=False),
                       "wrong_rows": lambda: stage_checkpoint({}, {HEAD: torch.zeros(1, HIDDEN)}, split, 1,
                                                              embedding=True)}.items():
        try:
            call()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


# ---- the rows spread over real pipeline ranks -----------------------------------------------------------------
def spread_rank(rank: int, cases: list[tuple[bool, bool]]) -> list[dict]:
    """On `world` pipeline ranks (megatron's groups, one stage each): every (tied, embedding) case builds its stage
    of the tiny GPTModel, spreads the rows (spread_rows) and saves its StageCheckpoint (checkpoint_of); rank 0
    gathers them, assembles the unsplit state dict and loads it into an unsplit GPTModel (strict). Returns, per
    case: this stage's own tensors by unsplit name (its layers, and the whole table/head it built), the rows' shapes
    and starts, and on rank 0 the loaded model's state."""
    pp = dist.get_world_size()
    out = []
    # A layout before the pipeline's (pp=1: every rank its own embedding group): megatron's destroy_model_parallel
    # keeps its embedding ranks, so a mesh that asked is_rank_in_embedding_group() would then take a middle stage
    # for a member of a group it does not have (asyncpp/parallel/mesh.py, from_megatron).
    setup_megatron(1, 1)
    for tied, embedding in cases:
        mesh = setup_megatron(1, pp)
        torch.manual_seed(1 + rank)  # each stage its own init: the rows must come from the right stage
        gpt = tiny_gpt(pp, mesh.is_first_stage, mesh.is_last_stage, tied)
        split = vocab_split_of(gpt, seq_len=SEQ, micro_batch_size=2, embedding=embedding)
        rows = spread_rows(gpt, split, mesh, embedding=embedding)
        ckpt = checkpoint_of(gpt, rows, split, mesh, embedding=embedding)
        own = {global_name(gpt, n): p.detach().clone() for n, p in gpt.named_parameters()}
        gathered = [None] * pp
        dist.all_gather_object(gathered, ckpt)
        result = {"own": own, "shards": split.shards, "rank": rank,
                  "rows": {k: (start, tuple(v.shape)) for k, (start, v) in ckpt.rows.items()},
                  "spread": {k: tuple(v.shape) for k, v in rows.items()}}
        # The unsplit model on one stage of the pipelined job: built with pipeline size 1, it posts no tied-embedding
        # all-reduce (megatron_cpu._setup_embeddings_on_cpu, as megatron's own method; the last stage would not join).
        if rank == 0:
            unsplit = tiny_gpt(1, True, True, tied)
            missing, unexpected = unsplit.load_state_dict(assemble_state_dict(gathered, VOCAB, tied=tied))
            result.update(loaded={k: v.clone() for k, v in unsplit.state_dict().items()
                                  if not k.endswith("_extra_state")}, missing=list(missing),
                          unexpected=list(unexpected))
        out.append(result)
    return out


# ---- a vocabulary-parallel head's groups over megatron's pipelines ----------------------------------------------
def vocab_groups_rank(rank: int, layouts: list[tuple[int, int]]) -> list[dict]:
    """For each (pp, tp): Mesh.from_megatron(vocab_head=True, vocab_embedding=True) on megatron's parallel_state, and
    asyncpp's own Mesh of the same layout. Returns, per layout, every vocabulary group's ranks from both, whether
    megatron's own groups were kept, whether the new groups are communicators of their own (not megatron's pipeline
    group), and each group's all-reduce of the rank (the groups carry traffic)."""
    out = []
    for pp, tp in layouts:
        plain = setup_megatron(tp, pp)  # the whole head: megatron's embedding group on the ends
        mesh = Mesh.from_megatron(torch.device("cpu"), vocab_head=True, vocab_embedding=True)
        own = Mesh(ParallelDims.for_world(dist.get_world_size(), pp=pp, tp=tp), torch.device("cpu"), vocab_head=True,
                   vocab_embedding=True)
        groups = {"embedding": mesh.embedding_group, **vars(mesh.vocab_groups)}
        own_groups = {"embedding": own.embedding_group, **vars(own.vocab_groups)}
        sums = {}
        for name, group in groups.items():
            x = torch.tensor([float(rank)])
            dist.all_reduce(x, group=group)
            sums[name] = float(x)
        out.append({
            "ranks": {n: dist.get_process_group_ranks(g) for n, g in groups.items()},
            "own_ranks": {n: dist.get_process_group_ranks(g) for n, g in own_groups.items()},
            "megatron_groups_kept": mesh.pp_group is parallel_state.get_pipeline_model_parallel_group()
            and mesh.tp_group is parallel_state.get_tensor_model_parallel_group(),
            "new_communicators": len({g.group_name for g in groups.values()} | {mesh.pp_group.group_name})
            == len(groups) + 1,
            "plain_embedding_ranks": (dist.get_process_group_ranks(plain.embedding_group)
                                      if plain.embedding_group is not None else []),
            "sums": sums, "stage": mesh.pp_rank, "tp_rank": mesh.tp_rank,
        })
    return out


# ---- a stage with its vocabulary spread (VocabSpreadStage) --------------------------------------------------------
def spread_stage_rank(rank: int, cases: list[tuple[bool, bool]]) -> list[dict]:
    """On 2 megatron pipeline ranks, per (tied, embedding sharded): the last stage's logits from megatron's own
    output layer on a fixed input, then VocabSpreadStage on every stage; its output on the last stage (the normed
    hidden states), broadcast, times each stage's head rows, gathered in stage order. Returns the trainable
    parameters' names and shapes, the frozen names, the output's shape, megatron's logits and the gathered ones."""
    out = []
    for tied, embedding in cases:
        mesh = setup_megatron(1, 2)
        torch.manual_seed(11 + rank)
        gpt = tiny_gpt(2, mesh.is_first_stage, mesh.is_last_stage, tied)
        split = vocab_split_of(gpt, seq_len=SEQ, micro_batch_size=2, embedding=embedding)
        x = torch.randn(SEQ, 2, HIDDEN, generator=torch.Generator().manual_seed(3))  # a [s, b, h] activation
        tokens, mask = torch.zeros(2, SEQ, dtype=torch.long), megatron_cpu.causal_mask(SEQ)
        positions = torch.arange(SEQ).expand(2, SEQ)
        logits = None
        if mesh.is_last_stage:
            gpt.set_input_tensor([x])
            logits = gpt(tokens, positions, mask).detach()  # megatron's head: [b, s, vocab]
        stage = VocabSpreadStage(gpt, mesh, split, embedding=embedding)
        hidden = torch.empty(SEQ, 2, HIDDEN)
        if mesh.is_last_stage:
            stage.set_input_tensor([x])
            hidden = stage(tokens, positions, mask).detach()
        shape = tuple(hidden.shape)
        dist.broadcast(hidden, src=mesh.global_rank(1), group=mesh.pp_group)
        gathered = [None] * 2
        dist.all_gather_object(gathered, hidden.transpose(0, 1) @ stage.head_weight().detach().T)
        out.append({"trainable": {n: tuple(p.shape) for n, p in stage.named_parameters() if p.requires_grad},
                    "frozen": stage.frozen, "shape": shape, "logits": logits, "spread": torch.cat(gathered, -1),
                    "shards": split.shards,
                    "tied_rows_shared": stage.embedding_rows is not None
                    and stage.embedding_rows is getattr(stage, "output_layer_rows", None),
                    "rows": {k: tuple(v.shape) for k, v in stage.rows().items()}})
    return out
