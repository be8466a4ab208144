"""Two implementations of one MoE model (a fused backend, compiled blocks) compared on the same weights.

In bf16 their roundings differ by ~1e-2 of the hidden state, so a token whose k-th and (k+1)-th experts are
that close goes to another expert in one of them, and the two experts' gradients (and the router's) then differ
by that token's whole share: on tiny_hybrid 1-3 of 256 rows per MoE call flip, and 15-20 of 88 gradients differ
by 5-17% (measured on CPU, fused SwiGLU and compiled blocks alike). That is the routing's discontinuity, not the
implementation's error; so `other` makes the reference's choice, call by call, and weighs it with its own
probabilities, and the comparison then bounds what the implementation computes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from model_zoo.moe import MoE


@contextlib.contextmanager
def same_routing(reference: nn.Module, other: nn.Module) -> Iterator[list[int]]:
    """Within the block, each MoE layer of `other` takes the experts its namesake in `reference` chose in
    the matching call (call `reference` first, then `other`, on the same input). Yields a list that
    receives, per pinned call, how many tokens `other` would have sent elsewhere: the proof that pinning
    mattered (or not)."""
    ref_layers = {n: m for n, m in reference.named_modules() if isinstance(m, MoE)}
    other_layers = {n: m for n, m in other.named_modules() if isinstance(m, MoE)}
    assert ref_layers and set(ref_layers) == set(other_layers), "both models need the same MoE layers"
    queues: dict[str, list[torch.Tensor]] = {n: [] for n in ref_layers}
    flipped: list[int] = []

    def recording(name: str, layer: MoE):
        def choose(probs: torch.Tensor) -> torch.Tensor:
            idx = MoE.choose(layer, probs)
            queues[name].append(idx.detach())
            return idx
        return choose

    def pinned(name: str, layer: MoE):
        def choose(probs: torch.Tensor) -> torch.Tensor:
            idx = queues[name].pop(0)
            own = MoE.choose(layer, probs)
            flipped.append(int((own.sort(-1).values != idx.sort(-1).values).any(-1).sum()))
            return idx
        return choose

    for name, layer in ref_layers.items():
        layer.choose = recording(name, layer)
        other_layers[name].choose = pinned(name, other_layers[name])
    try:
        yield flipped
    finally:
        for layer in (*ref_layers.values(), *other_layers.values()):
            del layer.choose
    assert not any(queues.values()), "a reference call was not matched by a call of the other model"
