"""Rank functions of tests/dist/test_megatron_checkpoint.py: examples/megatron_2bw.py's train() in a fresh process of
run_ranks (each run its own processes, as a restart is), on the process group the harness made; and an unsplit
GPTModel (pipeline size 1) loading a checkpoint's newest weights."""

from __future__ import annotations

import itertools

import torch
from megatron.core import parallel_state

from asyncpp.parallel import megatron_cpu
from asyncpp.pipeline.megatron_checkpoint import megatron_state_dict
from examples.megatron_2bw import forward_step, model_provider, parse_args, synthetic_tokens, train


def example_rank(rank: int, argv: list[str]) -> dict:
    log = train(parse_args(argv))
    parallel_state.destroy_model_parallel()
    return log


def unsplit_rank(rank: int, argv: list[str], path: str) -> dict:
    """One process: megatron's unsplit GPTModel (pipeline size 1, megatron's own output layer and loss) built from
    `argv`, the checkpoint's newest weights loaded into it strictly (every key, every shape), and its loss on the
    example's validation microbatches (evaluate(): the synthetic stream 1), as the example reports it."""
    args = parse_args(argv)
    device = torch.device("cpu")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    megatron_cpu.enable(device, seed=args.seed)
    model = model_provider(args, pre_process=True, post_process=True)
    missing, unexpected = model.load_state_dict(megatron_state_dict(path), strict=True)
    total, tokens = 0.0, 0
    with torch.no_grad():
        valid = synthetic_tokens(args, 1)
        for sample in itertools.islice(valid, args.num_microbatches):
            losses, _ = forward_step(iter([sample]), model, device)  # [b, s] per-token losses (labels given)
            total, tokens = total + float(losses.double().sum()), tokens + losses.numel()
    parallel_state.destroy_model_parallel()
    return {"loss": total / tokens, "keys": sorted(k for k in model.state_dict() if not k.endswith("_extra_state")),
            "expert_bias": {k: v.clone() for k, v in model.state_dict().items() if k.endswith(".expert_bias")},
            "missing": list(missing), "unexpected": list(unexpected)}
