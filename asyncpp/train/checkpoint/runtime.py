"""The process group and DCP as checkpointing uses them (with or without a process group)."""

from __future__ import annotations

import warnings

import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def torch_dcp():
    """torch.distributed.checkpoint, imported at the first save or load rather than with this module: it pulls
    in DTensor and sympy, 46 MB of resident memory and half a second per process, which a process that never
    checkpoints (bench/peers.py's, a run with checkpoint.enabled=false and synthetic data) should not pay.
    (megatron-core's datasets import it anyway, with their whole package.)"""
    import torch.distributed.checkpoint as dcp

    return dcp


def quiet_single_process_dcp() -> None:
    """DCP warns on every save/load without a process group ("assuming the intent is to save in a
    single process"), which is exactly what a single-process run means; keep it out of run logs. A
    process-wide filter for that one message, because async saves write from a background thread
    (a catch_warnings block would be gone by then). Idempotent: warnings keeps one copy of a filter.
    Harmless with a process group: DCP only says this without one."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def my_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()
