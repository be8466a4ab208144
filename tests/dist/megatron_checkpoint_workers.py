"""Rank function of tests/dist/test_megatron_checkpoint.py: examples/megatron_2bw.py's train() in a fresh process of
run_ranks (each run its own processes, as a restart is), on the process group the harness made."""

from __future__ import annotations

from megatron.core import parallel_state

from examples.megatron_2bw import parse_args, train


def example_rank(rank: int, argv: list[str]) -> dict:
    log = train(parse_args(argv))
    parallel_state.destroy_model_parallel()
    return log
