"""Every rank's RNG state in the manifest: gathered at save, restored at load when the layout is the same."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from asyncpp.train.checkpoint.runtime import is_distributed, my_rank


def rng_state() -> dict:
    """This rank's generators: the CPU's, and the CUDA generator of the current device only (the rank's
    own GPU; the others belong to other ranks, and a run resumed on fewer visible GPUs must still load)."""
    state = {"torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device()).tolist()
    return state


def _restore_cuda_rng(saved: list) -> None:
    """Set the current device's CUDA generator from a manifest entry. Checkpoints written before this
    format hold one state per visible GPU (a list of lists): the current device's entry is taken."""
    device = torch.cuda.current_device()
    if saved and isinstance(saved[0], list):
        if device >= len(saved):
            warnings.warn(f"the checkpoint holds CUDA RNG states of {len(saved)} GPUs (older format) and this rank "
                          f"runs on cuda:{device}; its CUDA generator is not restored", stacklevel=3)
            return
        saved = saved[device]
    torch.cuda.set_rng_state(torch.tensor(saved, dtype=torch.uint8), device)


def gather_rng() -> list[dict]:
    mine = rng_state()
    if not is_distributed():
        return [mine]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def restore_rng(manifest: dict) -> None:
    rng = manifest.get("rng") or []
    rank = my_rank()
    same_layout = is_distributed() and len(rng) == dist.get_world_size() or not is_distributed() and len(rng) == 1
    if same_layout and rank < len(rng):
        torch.set_rng_state(torch.tensor(rng[rank]["torch"], dtype=torch.uint8))
        if "cuda" in rng[rank] and torch.cuda.is_available():
            _restore_cuda_rng(rng[rank]["cuda"])
