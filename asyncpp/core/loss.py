"""The one loss reduction of the project: the simulator and the pipeline's last stage both call it, so
their losses are the same floats.

Over whole logits the cross entropy is `cross_entropy` here, and only here. Logits sharded over the vocabulary
need the shards' maxima and sums of exponentials combined across ranks, and two forms do that, each in the
floating-point order its runs are tested and resumed in:

- tensor parallelism (parallel/tp.vocab_parallel_cross_entropy): an autograd function with two all-reduces, the
  global max first, then the target logit and sum of exp(logit - global max): one blocking pass inside the
  TP layers' forward;
- the vocabulary-parallel head over pipeline stages (pipeline/vocab_head.py: shard_statistics_, mean_loss): each
  shard's own max and sum of exp(logit - its max), all-gathered asynchronously at S and combined at T (the online
  softmax), so that S never waits inside its pass.

Writing the TP form as the gathered statistics would make S/T's one all-gather serve both, but it changes the order
of the TP loss's sums (a rescale by exp(max_i - max) per shard), so a TP run's losses and its resumed checkpoints
would no longer be the floats they are: the two stay apart.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import Tensor, nn

from asyncpp.parallel.collectives import group_size
from asyncpp.parallel.tp import VOCAB_GROUP_ATTR, vocab_parallel_cross_entropy

LossFn = Callable[[nn.Module, Tensor], Tensor]
"""loss_fn(model, tokens [B, T+1]) -> scalar loss of the whole model."""

LogitsLoss = Callable[[Tensor, Tensor], Tensor]
"""loss(logits, labels) -> scalar loss: what a last stage's whole head ends with (logits_loss_for)."""


def cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean next-token cross entropy in fp32."""
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))


def lm_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    """Cross entropy of a whole model over a [B, T+1] token block."""
    return cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])


def logits_loss_for(model: nn.Module) -> LogitsLoss:
    """The loss (logits, labels) -> scalar the last stage must use for `model`'s logits: the
    vocab-parallel cross entropy over the head's TP group when a plan left them sharded, otherwise
    the project's plain cross entropy (`cross_entropy` above)."""
    marker = getattr(getattr(model, "lm_head", None), VOCAB_GROUP_ATTR, None)
    group = None if marker is None else marker.bound["group"]
    if group_size(group) > 1:
        return functools.partial(vocab_parallel_cross_entropy, group=group)
    return cross_entropy
