"""Token batches from host memory to the training device, without synchronising the host with the GPU.

A data source returns token blocks in ordinary (pageable) CPU memory. `tensor.to("cuda")` from pageable
memory waits for the device's stream to drain before it returns, so calling it before every microbatch's
forward stalls the host once per microbatch, and the GPU then waits for the host to queue work again.
From pinned (page-locked) memory a copy with non_blocking=True is only queued on the current stream,
ordered before the forward that reads it, and the host goes on.
"""

from __future__ import annotations

import torch
from torch import Tensor


def to_device(tokens: Tensor, device: torch.device | str) -> Tensor:
    """`tokens` on `device`. CPU -> CUDA goes through pinned memory with non_blocking=True (no host sync);
    every other move is a plain .to(). The pinned staging block belongs to torch's caching host allocator,
    which records the copy's stream and does not hand the block out again before the copy has run, so the
    caller may drop `tokens` at once. Values are unchanged (an integer copy is exact)."""
    device = torch.device(device)
    if device.type != "cuda" or tokens.device.type != "cpu":
        return tokens.to(device)
    staged = tokens if tokens.is_pinned() else tokens.pin_memory()
    return staged.to(device, non_blocking=True)
