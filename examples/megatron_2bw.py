"""pretrain_gpt.py, shortened, with asyncpp's never-flushing 2BW pipeline in place of Megatron's 1F1B.

    torchrun --standalone --nproc_per_node=2 examples/megatron_2bw.py                   # PP=2, Muon, CPU (gloo)
    torchrun --standalone --nproc_per_node=4 examples/megatron_2bw.py --tp 2 --optimizer adamw --ef-lambda 1
    torchrun --standalone --nproc_per_node=2 examples/megatron_2bw.py --weight-prediction --dc-lambda 0.1

A Megatron-LM user keeps megatron-core's parallel_state, GPTModel, forward_step_func and loop. What changes:
- get_forward_backward_func("2bw", engine_factory=...) from asyncpp.pipeline.megatron;
- the optimizer is asyncpp's (Muon or AdamW) and its update runs inside the schedule, one step late
  (x_{t+1} = x_t - U(g(x_{t-1}))); `optimizer_step()` only reports it;
- asyncpp's mesh is megatron's groups (Mesh.from_megatron); drain() before evaluation and exit.
On a CPU, megatron-core runs in asyncpp's CPU mode (asyncpp/reference/megatron_cpu.py, for tests and examples).
The data is a synthetic token stream with a learnable pattern, the same on every rank.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
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
from asyncpp.optim import build_optimizer
from asyncpp.parallel.mesh import Mesh, init_distributed
from asyncpp.pipeline.megatron import Pipeline2BW, get_forward_backward_func, optimizer_sharding
from asyncpp.reference import megatron_cpu


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
    p.add_argument("--optimizer", choices=("muon", "adamw"), default="muon")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--ef-lambda", type=float, default=0.0, help="asyncpp: update-level Error Feedback")
    p.add_argument("--sync-start-steps", type=int, default=0, help="asyncpp: the first steps synchronous")
    p.add_argument("--grad-ef-lambda", type=float, default=0.0, help="asyncpp: gradient-level Error Feedback")
    p.add_argument("--dc-lambda", type=float, default=0.0, help="asyncpp: DC-ASGD delay compensation")
    p.add_argument("--weight-prediction", action="store_true", help="asyncpp: SAPipe-style weight prediction")
    p.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=Path, default=None, help="write the losses as JSON here (the last stage)")
    args = p.parse_args(argv)
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
    if args.num_microbatches < args.pp:
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
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, pipeline_dtype=torch.float32,
        use_cpu_initialization=args.device == "cpu")
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=args.vocab_size,
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


def synthetic_tokens(args, stream: int, start: int = 0):
    """Microbatch i of a stream: random tokens where every odd position is its predecessor + 1."""
    for i in itertools.count(start):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + i * 7 + stream)
        x = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=g)
        x[:, 1::2] = (x[:, 0:-1:2] + 1) % args.vocab_size
        yield x


def reduced_loss(store: list[dict]) -> float:
    total = torch.stack([d["lm loss"] for d in store]).double().sum(0)
    return float(total[0] / total[1])


# ---- the loop ---------------------------------------------------------------------------------------------
def train(args) -> dict:
    device = init_distributed(args.device)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp,
                                             pipeline_model_parallel_size=args.pp)
    if device.type == "cpu":
        megatron_cpu.enable(device, seed=args.seed)
    else:
        model_parallel_cuda_manual_seed(args.seed)
    mesh = Mesh.from_megatron(device)
    torch.manual_seed(args.seed)
    model = model_provider(args, parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage())
    model.to(device)
    # Muon orthogonalises whole matrices: megatron's TP shards are gathered over the TP group (exact).
    optimizer = build_optimizer(model, name=args.optimizer, lr=args.lr, sharding=optimizer_sharding(model),
                                tp_group=mesh.tp_group)
    tied = [model.shared_embedding_or_output_weight()] if model.share_embeddings_and_output_weights else []
    forward_backward_func = get_forward_backward_func("2bw", engine_factory=lambda schedule: Pipeline2BW(
        model, optimizer, mesh, schedule=schedule, hidden_size=args.hidden_size, grad_clip=args.clip_grad,
        ef_lambda=args.ef_lambda, grad_ef_lambda=args.grad_ef_lambda, dc_lambda=args.dc_lambda,
        weight_prediction=args.weight_prediction, sync_start_steps=args.sync_start_steps, tied=tied,
        sequence_first=True))
    pipeline = forward_backward_func.pipeline
    step_func = functools.partial(forward_step, device=device)
    train_data = synthetic_tokens(args, stream=0)
    log = {"train": [], "valid": {}}
    started = time.perf_counter()
    for iteration in range(args.train_iters):
        losses = forward_backward_func(forward_step_func=step_func, data_iterator=train_data, model=[model],
                                       num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                                       micro_batch_size=args.micro_batch_size)
        update_successful, grad_norm, _ = pipeline.optimizer_step()  # the update of step iteration-2
        if losses:  # the last pipeline stage
            log["train"].append(reduced_loss(losses))
            if mesh.tp_rank == 0:
                norm = f"{grad_norm:.3f} (step {pipeline.applied_step})" if grad_norm is not None else "-"
                print(f" iteration {iteration + 1:4d}/{args.train_iters} | lm loss {log['train'][-1]:.4f} | "
                      f"grad norm {norm} | ok {update_successful}", flush=True)
        if (iteration + 1) % args.eval_interval == 0:
            pipeline.drain()  # every in-flight microbatch and update done: the module holds x_{iteration+1}
            store = forward_backward_func(forward_step_func=step_func, data_iterator=synthetic_tokens(args, 1),
                                          model=[model], num_microbatches=args.num_microbatches,
                                          seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                                          forward_only=True)
            if store:
                log["valid"][iteration + 1] = reduced_loss(store)
                if mesh.tp_rank == 0:
                    print(f" validation at iteration {iteration + 1} | lm loss {log['valid'][iteration + 1]:.4f}",
                          flush=True)
    pipeline.drain()
    log["wall_s"] = time.perf_counter() - started
    log["applied_step"] = pipeline.applied_step
    log["model_class"] = f"{type(model).__module__}.{type(model).__name__}"
    return log


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    problem = argument_problem(args, int(os.environ.get("WORLD_SIZE", "1")))
    if problem is not None:  # exit 2 as argparse's usage errors (1 would read as a crash to a launcher)
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    log = train(args)
    if args.out is not None and log["train"] and parallel_state.get_tensor_model_parallel_rank() == 0:
        args.out.write_text(json.dumps(log, indent=1))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
