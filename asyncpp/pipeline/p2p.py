"""Activation and gradient exchange between neighbouring pipeline stages (gloo and NCCL alike).

Sends are asynchronous (isend) and never waited for on the critical path: the engine polls them and
frees the sent activation once the transfer has completed. Receives post an irecv and wait only when
the data is needed. Shapes are fixed up front ([micro_batch_size, seq_len, hidden]) so no shape
handshake is needed. Channels are FIFO per (src, dst) pair, which is what the schedule invariants
assume (asyncpp/schedules/invariants.py).
"""

from __future__ import annotations

from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from asyncpp.parallel.mesh import Mesh


class PipelineTimeout(RuntimeError):
    """A rank waited too long for a neighbour or a collective (or the peer's connection broke)."""


def wait_for(work: dist.Work, timeout_s: float, mesh: Mesh, what: str) -> None:
    """work.wait() that turns a hang or a dead peer into an error naming this stage and `what`."""
    try:
        work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise PipelineTimeout(
            f"stage {mesh.pp_rank} (rank {mesh.rank}) gave up waiting for {what} (train.timeout_s={timeout_s}): "
            f"{e}. The rank it waits for probably died or hangs; check that rank's log."
        ) from e


class StageComm:
    def __init__(self, mesh: Mesh, shape: tuple[int, ...], dtype: torch.dtype, timeout_s: float = 300.0):
        self.timeout_s = timeout_s
        self.mesh = mesh
        self.shape = shape
        self.dtype = dtype
        self.prev = mesh.global_rank(mesh.pp_rank - 1) if not mesh.is_first_stage else None
        self.next = mesh.global_rank(mesh.pp_rank + 1) if not mesh.is_last_stage else None
        # (work, payload, output-to-free or None) of sends in flight; the payload must stay alive
        # until its send completes.
        self._pending: deque[tuple[dist.Work, Tensor, Tensor | None]] = deque()

    def _recv(self, src: int, what: str) -> Tensor:
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.mesh.device)
        wait_for(dist.irecv(buf, src=src, group=self.mesh.pp_group), self.timeout_s, self.mesh,
                 f"{what} from rank {src}")
        return buf

    def _send(self, tensor: Tensor, dst: int, free_after: bool) -> None:
        payload = tensor.detach().contiguous()
        work = dist.isend(payload, dst=dst, group=self.mesh.pp_group)
        self._pending.append((work, payload, tensor if free_after else None))

    def recv_forward(self, what: str = "an activation") -> Tensor:
        """The activation of the previous stage (blocks until it arrives)."""
        return self._recv(self.prev, what)

    def recv_backward(self, what: str = "an output gradient") -> Tensor:
        """The gradient of this stage's output, from the next stage."""
        return self._recv(self.next, what)

    def send_forward(self, output: Tensor) -> None:
        """Send the output activation; its storage is released once the send has completed.

        Only the data is freed: the autograd graph hanging off `output` stays, and the engine's
        backward does not need the output's values (see engine.backward_through).
        """
        self._send(output, self.next, free_after=True)

    def send_backward(self, input_grad: Tensor) -> None:
        self._send(input_grad, self.prev, free_after=False)

    def poll(self) -> None:
        """Release what completed sends no longer need."""
        while self._pending and self._pending[0][0].is_completed():
            self._release(*self._pending.popleft())

    def flush(self) -> None:
        """Wait for every send in flight (before exit or a drain)."""
        while self._pending:
            work, payload, owner = self._pending.popleft()
            wait_for(work, self.timeout_s, self.mesh, "a send to a neighbouring stage to complete")
            self._release(work, payload, owner)

    @staticmethod
    def _release(work, payload: Tensor, owner: Tensor | None) -> None:
        if owner is not None:
            # Megatron's deallocate_output_tensor: keep the graph node, drop the values.
            owner.data = torch.empty((1,), dtype=owner.dtype, device=owner.device)
