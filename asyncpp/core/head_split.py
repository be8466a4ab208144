"""parallel.head=tokens: the last stage's LM head and loss shared with stage 0, by tokens.

The last stage of a small-hidden, large-vocabulary model spends most of its time in the LM head and the fp32
cross entropy (tiny_dense: about six blocks' worth, asyncpp/core/layer_costs.py), which no split of the layers
can balance. With a head split the last stage applies the final norm as before, keeps the head and loss of the
first N - n of the microbatch's N tokens (flattened [micro_batch, seq]) and sends the normed hidden states of
the last n tokens to stage 0 (the helper), which holds a replica of the head weight, computes their logits and
summed loss, and sends back their input gradient and loss (Op.HEAD, asyncpp/schedules/build.py). The loss of
the microbatch is (sum over the own tokens + sum over the helper's) / N: the same mean cross entropy as the
unsplit head, up to the summation order. The head weight's gradient is the sum of both replicas' parts, reduced
over the pair (first, last stage) exactly like a tied embedding (semantics.md), and both replicas take the same
update, so they stay equal under 2BW's two versions.

Why tokens and not the vocabulary (Yeung et al., 2024, "Balancing Pipeline Parallelism with Vocabulary
Parallelism"): a vocabulary shard's softmax needs the max and the sum of every shard's logits, a collective
per microbatch that couples the stages, plus a reduction of the input gradient; a token share needs only two
p2p messages between one pair of stages, and its loss is a plain sum. The price is a replica of the head
weight on the helper: 1M parameters for tiny_dense (vocabulary 8192 x hidden 128), none extra for a model with
tied embeddings (the helper's embedding *is* the head weight: smollm2_135m), but 151k x hidden for
hybrid_moe_10b's untied head, where vocabulary sharding (no replica) is the better trade.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from asyncpp.core.layer_costs import LayerCosts
from asyncpp.core.layer_split import balanced_split

GRID = 64
"""Shares tried when the layer split is chosen together with the share: x = i / GRID of the head's tokens."""


@dataclass(frozen=True)
class HeadSplit:
    sizes: tuple[int, ...]
    """Layers per stage."""
    helper_tokens: int
    """n: the helper (stage 0) runs the head and loss of the last n of each microbatch's N flattened tokens."""
    tokens: int
    """N = micro_batch_size x seq_len."""

    @property
    def own_tokens(self) -> int:
        return self.tokens - self.helper_tokens


def stage_costs(costs: LayerCosts, sizes: Sequence[int], share: float) -> list[float]:
    """Per-stage cost with a fraction `share` of the head's tokens moved from the last stage to stage 0."""
    out = costs.stage_costs(list(sizes))
    out[0] += share * costs.head
    out[-1] -= share * costs.head
    return out


def best_share(costs: LayerCosts, sizes: Sequence[int]) -> float:
    """The share in [0, 1] that equalizes stage 0 and the last stage: (c_last - c_0) / (2 head)."""
    c = costs.stage_costs(list(sizes))
    if costs.head <= 0:
        return 0.0
    return min(max((c[-1] - c[0]) / (2 * costs.head), 0.0), 1.0)


def plan_head_split(costs: LayerCosts, num_stages: int, tokens: int, sizes: Sequence[int] | None = None,
                    helper_tokens: int | None = None) -> HeadSplit:
    """The layer split (given, or chosen jointly with the share) and the helper's token count.

    Joint choice: for each share on a grid of 1/GRID, the cost model's balanced split with that share of the
    head counted on stage 0 (core.layer_split.balanced_split); the split whose slowest stage is cheapest wins,
    then its share is refined to the exact balance of stage 0 and the last stage. Deterministic, so every rank
    and the simulator agree without communicating. The share is at least one token and leaves at least one."""
    if num_stages < 2:
        raise ValueError(f"a head split needs at least 2 stages, got {num_stages}")
    if tokens < 2:
        raise ValueError(f"a head split needs at least 2 tokens per microbatch, got {tokens}")
    if sizes is None:
        def score(split: list[int], x: float) -> tuple[float, float]:
            c = stage_costs(costs, split, x)
            return (max(c), sum(v * v for v in c))

        candidates = []
        for i in range(GRID + 1):
            x = i / GRID
            moved = LayerCosts(costs.layers, costs.embedding + x * costs.head, (1 - x) * costs.head)
            split = balanced_split(moved, num_stages)
            candidates.append((score(split, best_share(costs, split)), split))
        sizes = min(candidates)[1]
    if helper_tokens is None:
        helper_tokens = round(best_share(costs, sizes) * tokens)
    helper_tokens = min(max(int(helper_tokens), 1), tokens - 1)
    return HeadSplit(tuple(sizes), helper_tokens, tokens)
