"""pretrain_gpt.py, shortened, with asyncpp's never-flushing 2BW pipeline in place of Megatron's 1F1B.

    torchrun --standalone --nproc_per_node=2 examples/megatron_2bw.py                   # PP=2, Muon, CPU (gloo)
    torchrun --standalone --nproc_per_node=4 examples/megatron_2bw.py --tp 2 --optimizer adamw --ef-lambda 1
    torchrun --standalone --nproc_per_node=2 examples/megatron_2bw.py --weight-prediction --dc-lambda 0.1
    torchrun --standalone --nproc_per_node=4 examples/megatron_2bw.py --tp 2 --sequence-parallel \
        --data-path /data/tokens/shard_text_document               # an indexed dataset (python -m data.preprocess)
    torchrun --standalone --nproc_per_node=4 examples/megatron_2bw.py --num-experts 4 \
        --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall                 # PP=2 x DP=2 x EP=2 MoE
    torchrun --standalone --nproc_per_node=4 examples/megatron_2bw.py --num-experts 4 \
        --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --vocab-parallel-head  # + the head spread
    torchrun --standalone --nproc_per_node=2 examples/megatron_2bw.py --save ckpt --save-interval 10 --exit-interval 10
    torchrun --standalone --nproc_per_node=2 examples/megatron_2bw.py --load ckpt --save ckpt     # resumes at 10
    torchrun --standalone --nproc_per_node=2 examples/megatron_2bw.py --vocab-parallel-head --save ckpt  # spread head
    torchrun --standalone --nproc_per_node=2 examples/megatron_2bw.py --vocab-parallel-head --schedule 1f1b  # baseline
    torchrun --standalone --nproc_per_node=4 examples/megatron_2bw.py --tp 2 --sequence-parallel \
        --vocab-parallel-head --untie-embeddings-and-output-weights          # spread over stages, then over TP

A Megatron-LM user keeps megatron-core's parallel_state, GPTModel, forward_step_func and loop. What changes:
- get_forward_backward_func("2bw", engine_factory=...) from asyncpp.pipeline.megatron;
- the optimizer is asyncpp's (Muon or AdamW) and its update runs inside the schedule, one step late
  (x_{t+1} = x_t - U(g(x_{t-1}))); `optimizer_step()` only reports it;
- asyncpp's mesh is megatron's groups (Mesh.from_megatron); drain() before evaluation, a checkpoint and exit;
- checkpoints: --save/--save-interval/--load as Megatron's, through asyncpp's own checkpoint (DCP step_* directories
  with a manifest: asyncpp/pipeline/megatron_checkpoint.py); --load resumes at the saved iteration, the data skipped
  to it, and continues the same trajectory bit for bit (tests/dist/test_megatron_checkpoint.py);
- a log line is printed once its iteration's update was applied (two calls later under 2BW, or at a drain), so its
  grad norm is its own iteration's, beside its loss.
On a CPU, megatron-core runs in asyncpp's CPU mode (asyncpp/parallel/megatron_cpu.py, for tests and examples;
with --sequence-parallel its norms are megatron_cpu.SequenceParallelLayerNorm, the CPU stand-in of apex's).
The data: --data-path prefixes of megatron indexed datasets (.bin/.idx, data.preprocess's output) read through
megatron-core's BlendedMegatronDatasetBuilder and GPTDataset (data.source.IndexedDataSource); without it, a synthetic
token stream with a learnable pattern. Each data-parallel replica reads its own microbatches.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without an install
from asyncpp.config.data import is_number
from asyncpp.optim import build_optimizer
from asyncpp.parallel import megatron_cpu
from asyncpp.parallel.mesh import Mesh, init_distributed
from asyncpp.pipeline.megatron import Pipeline2BW, get_forward_backward_func, optimizer_sharding
from asyncpp.pipeline.megatron_checkpoint import MegatronCheckpoint, checkpoint_dir
from asyncpp.pipeline.megatron_vocab import VocabSpreadStage, check_spread_tp, vocab_split_of
from asyncpp.pipeline.megatron_vocab_pipeline import VocabPipeline2BW
from data.source import IndexedDataSource


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (--pipeline-model-parallel-size)")
    p.add_argument("--tp", type=int, default=1, help="--tensor-model-parallel-size")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--num-microbatches", type=int, default=4, help="global batch / (micro batch x dp)")
    p.add_argument("--train-iters", type=int, default=30)
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--save", type=Path, default=None, help="checkpoint directory (written at --save-interval and at "
                   "the end)")
    p.add_argument("--save-interval", type=int, default=None, help="drain and save every N iterations")
    p.add_argument("--load", type=Path, default=None, help="resume from this --save directory's newest checkpoint "
                   "(or a step_* directory in it)")
    p.add_argument("--exit-interval", type=int, default=None, help="stop after an iteration divisible by N (saved "
                   "first with --save)")
    p.add_argument("--schedule", choices=("2bw", "1f1b"), default="2bw",
                   help="asyncpp: 2bw, or the flushed 1f1b baseline (each iteration applies its own update)")
    p.add_argument("--optimizer", choices=("muon", "adamw"), default="muon")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--ef-lambda", type=float, default=0.0, help="asyncpp: update-level Error Feedback")
    p.add_argument("--sync-start-steps", type=int, default=0, help="asyncpp: the first steps synchronous")
    p.add_argument("--grad-ef-lambda", type=float, default=0.0, help="asyncpp: gradient-level Error Feedback")
    p.add_argument("--dc-lambda", type=float, default=0.0, help="asyncpp: DC-ASGD delay compensation")
    p.add_argument("--weight-prediction", action="store_true", help="asyncpp: SAPipe-style weight prediction")
    p.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--num-experts", type=int, default=None, help="MoE: experts per layer (every layer's MLP)")
    p.add_argument("--moe-router-topk", type=int, default=2)
    p.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall"), default="allgather")
    p.add_argument("--expert-model-parallel-size", type=int, default=1)
    p.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"), default="softmax")
    p.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing (needs --moe-router-score-function sigmoid): the bias is versioned "
                   "and moved at the 2BW update (asyncpp/pipeline/megatron_balancing.py)")
    p.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    p.add_argument("--vocab-parallel-head", action="store_true",
                   help="asyncpp: spread the output layer over the stages by the cost model's shards (with "
                   "--tp > 1: untied, split again over each stage's TP ranks)")
    p.add_argument("--vocab-parallel-embedding", action="store_true",
                   help="asyncpp: with --vocab-parallel-head, shard the input embedding by the same rows")
    p.add_argument("--data-path", nargs="+", default=None,
                   help="indexed dataset prefixes, optionally weighted: [weight] prefix [weight prefix ...]")
    p.add_argument("--tokenizer", default=None, help="the tokenizer the data was made with (default: <prefix>.json's)")
    p.add_argument("--split", default="98,2,0")
    p.add_argument("--data-cache-path", type=Path, default=Path(".cache/asyncpp-data"))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=Path, default=None, help="write the losses as JSON here (the last stage)")
    args = p.parse_args(argv)
    if args.vocab_parallel_embedding and not args.vocab_parallel_head:
        p.error("--vocab-parallel-embedding shards the input embedding by the head's rows: add --vocab-parallel-head")
    if args.vocab_parallel_head and args.pp < 2:
        p.error(f"--vocab-parallel-head needs --pp >= 2 (got --pp {args.pp}): the rows are spread over the stages")
    try:  # under TP: untied, the embedding whole (as asyncpp's own pipeline)
        if args.vocab_parallel_head:
            check_spread_tp(args.tp, tied=not args.untie_embeddings_and_output_weights,
                            embedding=args.vocab_parallel_embedding)
    except NotImplementedError as e:
        p.error(f"--vocab-parallel-head needs --untie-embeddings-and-output-weights and no --vocab-parallel-embedding "
                f"with --tp {args.tp}: {e}")
    if args.sequence_parallel and args.tp == 1:
        p.error("--sequence-parallel needs --tp > 1 (it splits the sequence over the tensor-parallel group)")
    for flag in ("save_interval", "exit_interval"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be >= 1")
    if args.save_interval is not None and args.save is None:
        p.error(f"--save-interval={args.save_interval} needs --save DIR (where to write the checkpoints)")
    if args.save is not None and args.save.exists() and not args.save.is_dir():
        p.error(f"--save={args.save} is a file; give a directory for the checkpoints")
    if args.load is not None:
        try:
            checkpoint_dir(args.load)
        except FileNotFoundError as e:
            p.error(str(e))
    if args.expert_model_parallel_size > 1 and args.num_experts is None:
        p.error(f"--expert-model-parallel-size={args.expert_model_parallel_size} needs --num-experts")
    if args.moe_router_enable_expert_bias and (args.num_experts is None or args.moe_router_score_function != "sigmoid"
                                               or args.sequence_parallel):
        p.error("--moe-router-enable-expert-bias needs --num-experts and --moe-router-score-function sigmoid (megatron "
                "requires it), and no --sequence-parallel (the token counts would have to be summed over TP: not "
                f"done yet); got --num-experts {args.num_experts}, --moe-router-score-function "
                f"{args.moe_router_score_function}, --sequence-parallel {args.sequence_parallel}")
    problem = argument_problem(args)
    if problem is not None:
        p.error(problem)  # exit 2 and the usage line, before any process group or model exists
    return args


POSITIVE = ("pp", "tp", "num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
            "micro_batch_size", "num_microbatches", "train_iters", "eval_interval")
NON_NEGATIVE = ("ef_lambda", "sync_start_steps", "grad_ef_lambda", "dc_lambda")


def argument_problem(args: argparse.Namespace, world_size: int | None = None) -> str | None:
    """What megatron-core or the pipeline would fail on later (a shape that does not split, a schedule without
    enough microbatches), as one line naming the option, its value and the fix; None if the arguments are sound.
    `world_size`: also check the layout against it."""
    flag = {name: "--" + name.replace("_", "-") for name in (*POSITIVE, *NON_NEGATIVE, "lr", "clip_grad")}
    for name in POSITIVE:
        if getattr(args, name) < 1:
            return f"{flag[name]}={getattr(args, name)} must be >= 1"
    for name in NON_NEGATIVE:
        if not getattr(args, name) >= 0:
            return f"{flag[name]}={getattr(args, name)} must be >= 0 (0 turns it off)"
    if not 0 < args.lr < float("inf"):
        return f"--lr={args.lr} must be a positive finite number, e.g. --lr 0.01"
    if not args.clip_grad > 0:
        return f"--clip-grad={args.clip_grad} must be > 0"
    if args.hidden_size % args.num_attention_heads:
        return (f"--hidden-size={args.hidden_size} is not divisible by --num-attention-heads="
                f"{args.num_attention_heads} (each head gets hidden_size / heads channels)")
    if args.num_attention_heads % args.tp:
        return f"--num-attention-heads={args.num_attention_heads} is not divisible by --tp={args.tp}"
    if args.num_layers % args.pp:
        return f"--num-layers={args.num_layers} is not divisible by --pp={args.pp} (megatron splits layers evenly)"
    delayed_only = [flag[n] for n in ("ef_lambda", "sync_start_steps", "grad_ef_lambda", "dc_lambda")
                    if getattr(args, n)] + ["--weight-prediction"] * args.weight_prediction
    if args.schedule == "1f1b" and delayed_only:
        return (f"{', '.join(delayed_only)} act on delayed updates; --schedule 1f1b has none: drop them or use "
                "--schedule 2bw")
    if args.num_microbatches < args.pp and args.schedule == "2bw":
        return (f"--num-microbatches={args.num_microbatches} is below --pp={args.pp}: the 2BW schedule needs at least "
                "one microbatch per stage in flight")
    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device=cuda but no CUDA device is visible; use --device cpu"
    if args.out is not None and args.out.is_dir():
        return f"--out={args.out} is a directory; give the JSON file to write"
    if world_size is not None and world_size % (args.pp * args.tp):
        return (f"--pp={args.pp} x --tp={args.tp} does not divide the {world_size} ranks torchrun started; start "
                f"a multiple of {args.pp * args.tp} (--nproc_per_node)")
    return None


# ---- pretrain_gpt's pieces ------------------------------------------------------------------------------
def model_provider(args, pre_process: bool, post_process: bool) -> GPTModel:
    moe = {} if args.num_experts is None else {
        "num_moe_experts": args.num_experts, "moe_router_topk": args.moe_router_topk,
        "moe_token_dispatcher_type": args.moe_token_dispatcher_type, "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": 0.01, "moe_router_score_function": args.moe_router_score_function,
        "moe_router_enable_expert_bias": args.moe_router_enable_expert_bias,
        "moe_router_bias_update_rate": args.moe_router_bias_update_rate}
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, add_bias_linear=False,
        expert_model_parallel_size=args.expert_model_parallel_size, sequence_parallel=args.sequence_parallel,
        hidden_dropout=0.0, attention_dropout=0.0, pipeline_dtype=torch.float32,
        use_cpu_initialization=args.device == "cpu", **moe)
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False)
    if args.sequence_parallel and args.device == "cpu":  # the local spec's torch norm refuses SP (apex's does not)
        spec = megatron_cpu.local_block_spec(config, spec)
    return GPTModel(config, spec, vocab_size=args.vocab_size,
                    max_sequence_length=args.seq_length, pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)


def get_batch(data_iterator, device: torch.device):
    sample = next(data_iterator).to(device)
    tokens, labels = sample[:, :-1], sample[:, 1:]
    position_ids = torch.arange(tokens.size(1), device=device).expand_as(tokens)
    attention_mask = torch.triu(torch.ones(tokens.size(1), tokens.size(1), dtype=torch.bool, device=device),
                                diagonal=1)[None, None]
    return tokens, labels, torch.ones_like(labels, dtype=torch.float), attention_mask, position_ids


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])}


def forward_step(data_iterator, model: GPTModel, device: torch.device):
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, device)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, functools.partial(loss_func, loss_mask)


def synthetic_tokens(args, stream: int, dp: int = 1, dp_rank: int = 0, start: int = 0):
    """This replica's microbatches of a stream (global microbatch i * dp + dp_rank, from i = start): random tokens
    where every odd position is its predecessor + 1."""
    for i in itertools.count(start):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + (i * dp + dp_rank) * 7 + stream)
        x = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=g)
        x[:, 1::2] = (x[:, 0:-1:2] + 1) % args.vocab_size
        yield x


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's --make-vocab-size-divisible-by padding: the embedding's rows split evenly over TP."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def indexed_source(args, dp: int) -> IndexedDataSource:
    """--data-path through megatron-core's BlendedMegatronDatasetBuilder and GPTDataset (built once per process,
    cached under --data-cache-path): enough train samples for every iteration, one batch of validation samples."""
    paths = args.data_path
    weighted = len(paths) % 2 == 0 and all(is_number(w) for w in paths[::2])
    prefixes, weights = (paths[1::2], [float(w) for w in paths[::2]]) if weighted else (paths, None)
    batch = args.num_microbatches * args.micro_batch_size
    return IndexedDataSource(prefixes, weights, tokenizer=args.tokenizer, split=args.split, seq_len=args.seq_length,
                             micro_batch_size=args.micro_batch_size, seed=args.seed,
                             train_samples=args.train_iters * batch * dp, eval_samples=batch,
                             cache_dir=args.data_cache_path)


def indexed_microbatches(source: IndexedDataSource, m: int, dp: int, dp_rank: int, start: int = 0):
    """This replica's microbatches: step t's global microbatches (t * dp + dp_rank) * m + j, j < m, from t = start."""
    for t in itertools.count(start):
        for j in range(m):
            yield source.train_microbatch((t * dp + dp_rank) * m + j)


def reduced_loss(store: list[dict], mesh: Mesh) -> float:
    """The step's per-token loss over the data-parallel replicas (Megatron's training_log reduction)."""
    total = torch.stack([d["lm loss"] for d in store]).double().sum(0)
    if mesh.dims.dp > 1:
        dist.all_reduce(total, group=mesh.dp_group)
    return float(total[0] / total[1])


def megatron_log_line(args, iteration: int, elapsed_s: float, lr: float, loss: float, loss_scale: float,
                      grad_norm: float | None, skipped: int, nans: int, dp: int) -> str:
    """One line of Megatron-LM's training_log (megatron/training/training.py): iteration's loss and its own
    update's learning rate and grad norm (LogLines prints it once that update was applied)."""
    batch = args.num_microbatches * args.micro_batch_size * dp
    line = (f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {iteration:8d}/{args.train_iters:8d} |"
            f" consumed samples: {iteration * batch:12d} | elapsed time per iteration (ms): {elapsed_s * 1e3:.1f} |"
            f" learning rate: {lr:.6E} | global batch size: {batch:5d} | lm loss: {loss:.6E} |"
            f" loss scale: {loss_scale:.1f} |")
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    return line + f" number of skipped iterations: {skipped:3d} | number of nan iterations: {nans:3d} |"


class LogLines:
    """Megatron's training log under 2BW: iteration k's update (its grad norm, its learning rate) is applied two
    calls later (or at a drain), so each line waits until then and prints the loss and the grad norm of one
    iteration together, in order (Megatron's 1F1B has both after its call)."""

    def __init__(self, args, pipeline: Pipeline2BW, dp: int, printing: bool):
        self.args, self.pipeline, self.dp, self.printing = args, pipeline, dp, printing
        self.pending: list[tuple[int, float, float]] = []  # (iteration, elapsed s, loss) waiting for the update
        self.skipped = self.nans = 0
        self.grad_norms: dict[int, float] = {}
        """iteration -> its own update's grad norm, as printed."""

    def add(self, iteration: int, elapsed_s: float, loss: float) -> None:
        self.pending.append((iteration, elapsed_s, loss))

    def flush(self) -> None:
        """Print every pending line whose update was applied (iteration k is step k-1)."""
        applied = self.pipeline.applied_step
        while self.pending and applied is not None and self.pending[0][0] - 1 <= applied:
            iteration, elapsed_s, loss = self.pending.pop(0)
            record = self.pipeline.records[iteration - 1]
            self.skipped += record.skipped
            self.nans += not math.isfinite(record.grad_norm)
            self.grad_norms[iteration] = record.grad_norm
            if self.printing:
                print(megatron_log_line(self.args, iteration, elapsed_s, record.lr, loss, 1.0, record.grad_norm,
                                        self.skipped, self.nans, self.dp), flush=True)
        records = self.pipeline.records  # every stage: keep the newest applied one (a checkpoint saves it)
        for step in [t for t in records if applied is not None and t < applied]:
            del records[step]


# ---- the loop ---------------------------------------------------------------------------------------------
def evaluate(args, forward_backward_func, step_func, source, mesh: Mesh, model, iteration: int, log: dict) -> None:
    """Megatron's evaluate_and_print_results on the drained pipeline's newest weights."""
    dp = mesh.dims.dp
    valid = iter(source.val_batches()) if source is not None else synthetic_tokens(args, 1, dp, mesh.dp_rank)
    store = forward_backward_func(forward_step_func=step_func, data_iterator=valid, model=[model],
                                  num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                                  micro_batch_size=args.micro_batch_size, forward_only=True)
    if store:
        value = log["valid"][iteration] = reduced_loss(store, mesh)
        if mesh.tp_rank == 0 and mesh.dp_rank == 0:
            print(f" validation loss at iteration {iteration} | lm loss value: {value:.6E} | "
                  f"lm loss PPL: {math.exp(min(20.0, value)):.6E} |", flush=True)


def vars_of(args: argparse.Namespace) -> dict:
    """The arguments as the checkpoint's manifest records them (JSON: paths as strings)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def train(args) -> dict:
    device = init_distributed(args.device)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp,
                                             pipeline_model_parallel_size=args.pp,
                                             expert_model_parallel_size=args.expert_model_parallel_size)
    if device.type == "cpu":
        megatron_cpu.enable(device, seed=args.seed)
    else:
        model_parallel_cuda_manual_seed(args.seed)
    mesh = Mesh.from_megatron(device, vocab_head=args.vocab_parallel_head, vocab_embedding=args.vocab_parallel_embedding)
    dp = mesh.dims.dp
    source = indexed_source(args, dp) if args.data_path else None
    if source is not None:
        args.vocab_size = padded_vocab_size(source.vocab_size, args.tp)
    torch.manual_seed(args.seed)
    model = model_provider(args, parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage())
    model.to(device)
    gpt, engine = model, Pipeline2BW
    if args.vocab_parallel_head:  # the rows by the cost model's shards; megatron's whole output layer frozen
        embedding = args.vocab_parallel_embedding
        split = vocab_split_of(gpt, seq_len=args.seq_length, micro_batch_size=args.micro_batch_size,
                               embedding=embedding, device_type=device.type)
        model = VocabSpreadStage(gpt, mesh, split, embedding=embedding)
        # a sample is [micro batch, seq + 1] token ids (synthetic_tokens, the indexed source): get_batch's tokens
        engine = functools.partial(VocabPipeline2BW, split=split, input_ids=lambda sample: sample[:, :-1].to(device))
    # Muon orthogonalises whole matrices: megatron's TP shards are gathered over the TP group (exact).
    optimizer = build_optimizer(model, name=args.optimizer, lr=args.lr, sharding=optimizer_sharding(model),
                                tp_group=mesh.tp_group)
    # (a spread head's tied rows are the VocabSpreadStage's own: VocabPipeline2BW takes them from it)
    tied = ([gpt.shared_embedding_or_output_weight()] if gpt.share_embeddings_and_output_weights
            and not args.vocab_parallel_head else [])
    forward_backward_func = get_forward_backward_func(args.schedule, engine_factory=lambda schedule: engine(
        model, optimizer, mesh, schedule=schedule, hidden_size=args.hidden_size, grad_clip=args.clip_grad,
        ef_lambda=args.ef_lambda, grad_ef_lambda=args.grad_ef_lambda, dc_lambda=args.dc_lambda,
        weight_prediction=args.weight_prediction, sync_start_steps=args.sync_start_steps, tied=tied,
        sequence_first=True))
    pipeline = forward_backward_func.pipeline
    checkpoint = MegatronCheckpoint(pipeline) if args.save or args.load else None
    start = saved_at = 0
    if args.load is not None:  # Megatron's load_checkpoint: the iteration, the weights, the optimizer, ...
        manifest = checkpoint.load(args.load)
        start = saved_at = manifest["step"]
        if dist.get_rank() == 0:
            print(f" successfully loaded checkpoint from {args.load} at iteration {start}", flush=True)
    step_func = functools.partial(forward_step, device=device)
    if source is not None:  # skipped to the first iteration this run trains (Megatron's consumed samples)
        train_data = indexed_microbatches(source, args.num_microbatches, dp, mesh.dp_rank, start=start)
    else:
        train_data = synthetic_tokens(args, stream=0, dp=dp, dp_rank=mesh.dp_rank, start=start * args.num_microbatches)
    log = {"train": [], "valid": {}, "vocab_size": args.vocab_size, "data": "indexed" if source else "synthetic",
           "start_iteration": start, "saved": []}
    lines = LogLines(args, pipeline, dp, printing=mesh.is_last_stage and mesh.tp_rank == 0 and mesh.dp_rank == 0)
    started = time.perf_counter()
    for iteration in range(start + 1, args.train_iters + 1):  # 1-based, as Megatron's log
        call_started = time.perf_counter()
        losses = forward_backward_func(forward_step_func=step_func, data_iterator=train_data, model=[model],
                                       num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                                       micro_batch_size=args.micro_batch_size)
        pipeline.optimizer_step()  # reports the newest applied update (LogLines prints it beside its own loss)
        if losses:  # the last pipeline stage
            log["train"].append(reduced_loss(losses, mesh))
            lines.add(iteration, time.perf_counter() - call_started, log["train"][-1])
        lines.flush()
        if iteration % args.eval_interval == 0:
            pipeline.drain()  # every in-flight microbatch and update done: the module holds x_iteration
            lines.flush()
            evaluate(args, forward_backward_func, step_func, source, mesh, model, iteration, log)
        stop = args.exit_interval is not None and iteration % args.exit_interval == 0
        if args.save is not None and (stop or args.save_interval and iteration % args.save_interval == 0):
            pipeline.drain()
            lines.flush()
            log["saved"].append(str(checkpoint.save(args.save, config=vars_of(args))))
            saved_at = iteration
        if stop:
            break
    pipeline.drain()
    lines.flush()
    if args.save is not None and saved_at != pipeline.next_step:  # Megatron saves at the end too
        log["saved"].append(str(checkpoint.save(args.save, config=vars_of(args))))
    log["wall_s"] = time.perf_counter() - started
    log["applied_step"] = pipeline.applied_step
    log["grad_norm"] = lines.grad_norms
    log["model_class"] = f"{type(gpt).__module__}.{type(gpt).__name__}"
    log["vocab_rows"] = tuple(model.head_weight().shape) if args.vocab_parallel_head else None
    log["vocab_start"] = model.start if args.vocab_parallel_head else None
    log["sequence_parallel"] = model.config.sequence_parallel
    log["dispatchers"] = sorted({type(m.token_dispatcher).__name__ for m in model.modules()
                                 if hasattr(m, "token_dispatcher")})
    return log


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    problem = argument_problem(args, int(os.environ.get("WORLD_SIZE", "1")))
    if problem is not None:  # exit 2 as argparse's usage errors (1 would read as a crash to a launcher)
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    log = train(args)
    if (args.out is not None and log["train"] and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0):
        args.out.write_text(json.dumps(log, indent=1))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
