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
def same_routing(reference: nn.Module, *others: nn.Module) -> Iterator[list[int]]:
    """Within the block, each MoE layer of every model in `others` takes the experts its namesake in
    `reference` chose in the matching call (call `reference` first, then the others, on the same input).
    Yields a list that receives, per pinned call of the first other model, how many tokens it would have
    sent elsewhere: the proof that pinning mattered (or not)."""
    ref_layers = {n: m for n, m in reference.named_modules() if isinstance(m, MoE)}
    assert ref_layers, "the reference has no MoE layer"
    queues: list[dict[str, list[torch.Tensor]]] = [{n: [] for n in ref_layers} for _ in others]
    flipped: list[int] = []
    patched: list[MoE] = list(ref_layers.values())

    def recording(name: str, layer: MoE):
        def choose(probs: torch.Tensor) -> torch.Tensor:
            idx = MoE.choose(layer, probs)
            for queue in queues:
                queue[name].append(idx.detach())
            return idx
        return choose

    def pinned(name: str, layer: MoE, queue: dict[str, list[torch.Tensor]], count: bool):
        def choose(probs: torch.Tensor) -> torch.Tensor:
            idx = queue[name].pop(0)
            if count:
                own = MoE.choose(layer, probs)
                flipped.append(int((own.sort(-1).values != idx.sort(-1).values).any(-1).sum()))
            return idx
        return choose

    for name, layer in ref_layers.items():
        layer.choose = recording(name, layer)
    for i, (other, queue) in enumerate(zip(others, queues)):
        layers = {n: m for n, m in other.named_modules() if isinstance(m, MoE)}
        assert set(layers) == set(ref_layers), "every model needs the reference's MoE layers"
        for name, layer in layers.items():
            layer.choose = pinned(name, layer, queue, count=i == 0)
            patched.append(layer)
    try:
        yield flipped
    finally:
        for layer in patched:
            del layer.choose
    assert not any(any(q.values()) for q in queues), "a reference call was not matched by another model's"
