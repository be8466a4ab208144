"""The runtime of parallel.head=tokens (the mechanism and its trade-offs: asyncpp/core/head_split.py).

Two ends of one link, each a StageComm on the pair of groups of Mesh.head_link (one direction each, so the
NCCL argument of docs/nccl.md holds unchanged: a receive-only and a send-only end per communicator, FIFO):

- the last stage's FORWARD of (t, j) sends the normed hidden states of the helper's n tokens, [n, hidden];
- the helper's HEAD of (t, j) receives them, computes the logits and the summed cross entropy / N on the
  weight version of (t, j), takes the gradients of its input and of the head weight, and sends back one fp32
  message [n * hidden + 1]: the input gradient (exact in fp32 also under bf16) and, last, its loss share;
- the last stage's BACKWARD of (t, j) receives it, adds the loss share to its own, and back-propagates both.

The head weight's gradient of an H does not go into `.grad`: the helper may run H of b_{t+1} before its
UPDATE_START(t) (the schedule's steady unit), so each step's part waits in its own accumulator and joins the
step's gradient at UPDATE_START(t), before the reduction with the last stage (the tied-embedding pair).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from asyncpp.core.head_split import HeadSplit
from asyncpp.core.loss import token_share_loss
from asyncpp.parallel.mesh import Mesh, PipelineLinks
from asyncpp.pipeline.p2p import P2PMismatch, StageComm


class HeadComm(StageComm):
    """A StageComm on the head link: it receives one shape and sends another (hidden states one way, their
    gradient and loss the other), so sends are checked against the receiving end's buffer, `send_shape`."""

    def __init__(self, mesh: Mesh, split: HeadSplit, hidden: int, dtype: torch.dtype, timeout_s: float):
        if mesh.head_link is None:
            raise ValueError("parallel.head=tokens needs the mesh's head link: build it with "
                             "Mesh(..., head_link=True) on every rank")
        hidden_shape, grad_shape = (split.helper_tokens, hidden), (split.helper_tokens * hidden + 1,)
        helper = mesh.is_first_stage
        recv_shape, recv_dtype = (hidden_shape, dtype) if helper else (grad_shape, torch.float32)
        super().__init__(mesh, recv_shape, recv_dtype, timeout_s)
        self.split = split
        self.send_shape, self.send_dtype = (grad_shape, torch.float32) if helper else (hidden_shape, dtype)
        link, last = mesh.head_link, mesh.global_rank(mesh.num_stages - 1)
        if helper:  # the helper is the last stage's "next stage": it receives forward, sends backward
            self.prev, self.next = last, None
            self.links = PipelineLinks(recv_forward=link.hidden, send_forward=None, recv_backward=None,
                                       send_backward=link.grad)
        else:
            self.prev, self.next = None, mesh.global_rank(0)
            self.links = PipelineLinks(recv_forward=None, send_forward=link.hidden, recv_backward=link.grad,
                                       send_backward=None)

    def send_hidden(self, hidden: Tensor, step: int) -> None:
        """The last stage's FORWARD: the normed hidden states of the helper's tokens. Not freed after the send
        (unlike an activation): they are a view of the stage's output, and its BACKWARD feeds their gradient
        back through them."""
        self._send(hidden, self.next, self.links.send_forward, "the head's hidden states", free_after=False,
                   step=step)

    def _check(self, tensor: Tensor, what: str, dst: int) -> None:
        if tuple(tensor.shape) != tuple(self.send_shape) or tensor.dtype != self.send_dtype:
            raise P2PMismatch(
                f"stage {self.mesh.pp_rank} (rank {self.mesh.rank}) would send {what} of shape {list(tensor.shape)} "
                f"and dtype {tensor.dtype} on the head link to rank {dst}, which receives into a buffer of shape "
                f"{list(self.send_shape)} and dtype {self.send_dtype}: parallel.head_split_tokens and the model's "
                "hidden size must be the same on both ends")


class HeadHelper:
    """Stage 0's part: the head weight replica, the HEAD action's math and the per-step weight gradients."""

    def __init__(self, comm: HeadComm, weight: nn.Parameter, labels: Callable[[int, int], Tensor]):
        """`labels(step, microbatch)`: the labels of the helper's tokens of that microbatch, [n]."""
        self.comm, self.weight, self.split, self.labels = comm, weight, comm.split, labels
        self._grads: dict[int, Tensor] = {}  # step -> the sum of its HEADs' weight gradients

    def run(self, step: int, microbatch: int, hidden: Tensor) -> None:
        """One HEAD on `hidden` [n, h], received; sends the gradient and the loss share to the last stage."""
        labels = self.labels(step, microbatch)
        hidden.requires_grad_()
        logits = nn.functional.linear(hidden, self.weight)
        loss = token_share_loss(logits, labels, self.split.tokens)
        d_hidden, d_weight = torch.autograd.grad(loss, (hidden, self.weight))
        acc = self._grads.get(step)
        self._grads[step] = d_weight if acc is None else acc.add_(d_weight)
        message = torch.cat((d_hidden.float().reshape(-1), loss.detach().float().reshape(1)))
        self.comm.send_backward(message, step)
        self.comm.release(hidden)

    def add_into(self, step: int, grads: list[Tensor], params: list[nn.Parameter]) -> None:
        """At UPDATE_START(step): the step's head gradient joins the weight's entry of the step's gradient."""
        acc = self._grads.pop(step, None)
        if acc is None:
            return
        i = next(k for k, p in enumerate(params) if p is self.weight)
        grads[i].add_(acc.to(grads[i].dtype))


def unpack(message: Tensor, split: HeadSplit, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The helper's message -> (the input gradient [n, hidden] in the compute dtype, its loss share, fp32)."""
    return message[:-1].reshape(split.helper_tokens, -1).to(dtype), message[-1]
