"""The one loss reduction of the project: the simulator and the pipeline's last stage both call it, so
their losses are the same floats."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

LossFn = Callable[[nn.Module, Tensor], Tensor]
"""loss_fn(model, tokens [B, T+1]) -> scalar loss of the whole model."""


def cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean next-token cross entropy in fp32."""
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))


def lm_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    """Cross entropy of a whole model over a [B, T+1] token block."""
    return cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])


def token_share_loss(logits: Tensor, labels: Tensor, total_tokens: int) -> Tensor:
    """A share of a microbatch's tokens (parallel.head_split=tokens): their summed fp32 cross entropy / the
    microbatch's token count, so the shares' sum is `cross_entropy` of the whole microbatch (up to the order of
    the sum). logits [n, vocab], labels [n]."""
    return nn.functional.cross_entropy(logits.float(), labels, reduction="sum") / total_tokens
