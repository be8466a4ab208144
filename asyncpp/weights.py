"""Weight versions of one pipeline stage: K buffers, version v lives in buffer v % K.

K = 1 for synchronous schedules, 2 for PipeDream-2BW, P-s for original PipeDream at stage s.

Written by hand because weight versioning is the paper's mechanism and no library has it. Versions
are switched by pointing each Parameter's storage at a buffer (`p.data = buffer`) rather than by
copying or by functional calls: any model, hook or user forward function (Megatron-style
forward_step_func) then runs on the right version unchanged, and autograd, which saved the Parameter
object, reads whatever storage it points at when the backward runs. That is why the engine switches
to a microbatch's version before its backward as well as before its forward.

The optimizer does not own the module's Parameters but *master* Parameters that share storage with
the newest version. Autograd checks the version counter of the Parameter objects it saved; an
optimizer stepping those in place would bump it (and fail the backward of in-flight microbatches)
even though it writes another buffer. An update for step t points the masters at the buffer of
version t+1, fills it with x_t and steps in place, so x_t's buffer (still used by in-flight
microbatches) is never written.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class WeightVersions:
    def __init__(self, params: list[nn.Parameter], num_buffers: int):
        if num_buffers < 1:
            raise ValueError(f"num_buffers={num_buffers} must be >= 1")
        self.params = params
        self.num_buffers = num_buffers
        # Buffer 0 is the parameters' own storage: K buffers in all, not K + 1.
        self.buffers: list[list[Tensor]] = [[p.data for p in params]]
        for _ in range(num_buffers - 1):
            self.buffers.append([torch.empty_like(p.data) for p in params])
        self.masters = [nn.Parameter(p.data, requires_grad=p.requires_grad) for p in params]
        self.newest = 0
        self._active = 0  # index of the buffer the parameters point at

    def available(self, version: int) -> bool:
        return self.newest - self.num_buffers < version <= self.newest

    def use(self, version: int) -> None:
        """Point every parameter at version `version` (must still be held)."""
        if not self.available(version):
            raise RuntimeError(
                f"weight version {version} is not held (newest {self.newest}, {self.num_buffers} buffers); "
                "the schedule used a version out of order"
            )
        self._point(version % self.num_buffers)

    def _point(self, index: int) -> None:
        if index != self._active:
            for p, buf in zip(self.params, self.buffers[index]):
                p.data = buf
            self._active = index

    @torch.no_grad()
    def begin_update(self, step: int) -> list[Tensor]:
        """Prepare version step+1 = x_step in its own buffer, parameters pointing at it.

        Returns x_step's tensors (read-only from here on: in-flight microbatches use them). The
        caller then runs the optimizer in place on the parameters.
        """
        if step != self.newest:
            raise RuntimeError(f"update for step {step} but the newest version is {self.newest}")
        src = self.buffers[step % self.num_buffers]
        dst_index = (step + 1) % self.num_buffers
        if dst_index != step % self.num_buffers:
            for d, s in zip(self.buffers[dst_index], src):
                d.copy_(s)
        else:
            src = [s.clone() for s in src]  # K == 1: x_t is overwritten in place, keep a copy
        for q, buf in zip(self.masters, self.buffers[dst_index]):
            q.data = buf
        self.newest = step + 1
        return src

    def held(self) -> list[int]:
        """Versions currently held, oldest first."""
        return list(range(max(self.newest - self.num_buffers + 1, 0), self.newest + 1))

    def tensors(self, version: int) -> list[Tensor]:
        """The buffer holding `version` (for checkpoints; written in place on load)."""
        return self.buffers[version % self.num_buffers]

    def set_newest(self, version: int) -> None:
        """After a load: `version` is the newest; parameters and masters point at it."""
        self.newest = version
        self._active = -1
        self._point(version % self.num_buffers)
        for q, buf in zip(self.masters, self.buffers[version % self.num_buffers]):
            q.data = buf

    def retarget(self, optimizer) -> None:
        """Make a freshly built optimizer step the masters instead of the module's Parameters."""
        swap = {id(p): q for p, q in zip(self.params, self.masters)}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if optimizer_state_of(optimizer, p):
                    raise RuntimeError("retarget() needs an optimizer that has not stepped yet")
            group["params"] = [swap.get(id(p), p) for p in group["params"]]


def optimizer_state_of(optimizer, p) -> bool:
    inner = getattr(optimizer, "optimizers", None)
    optimizers = inner.values() if isinstance(inner, dict) else (inner or [optimizer])
    return any(p in opt.state and opt.state[p] for opt in optimizers)
