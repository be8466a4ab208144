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

Mixed precision (train.precision=bf16, `compute_dtype=torch.bfloat16`): the K buffers hold the versions
in the compute dtype, the masters are separate fp32 tensors holding the newest version x_t at full
precision. The optimizer steps the masters in place (they are not the module's Parameters, so no
in-flight backward notices); the bf16 buffer of x_{t+1} is filled from them lazily, before the next
use() of any version (or tensors()), which keeps the engine's call sequence the same in both modes.
Gradients: each microbatch's bf16 gradient is added, as autograd produces it, into an fp32 sum per
parameter (GradSums); take_grads() hands the step's fp32 sums over, so reductions, clipping and the
optimizer see fp32 only. The simulator (simulate.py) uses the same pieces and so computes the same floats.

The distributed optimizer under mixed precision (keep_masters): a rank keeps the fp32 masters of the
parameters it owns only; `masters[i]` is None for the others, whose x_{t+1} its owner sends straight into
the compute-dtype buffer (newest_buffer). In fp32 the masters are the newest buffer and cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from asyncpp.core.masters import MASTER_DTYPE, GradSums, is_mixed, make_masters, retarget
from asyncpp.core.staleness import predict_weights
from asyncpp.core.stateful import load_in_place
from asyncpp.optim.build import AnyOptimizer


class WeightVersions:
    """A stage's K weight versions (version v in buffer v % K), the parameters pointed at the one an action reads,
    and the optimizer's masters (the module docstring)."""

    def __init__(self, params: list[nn.Parameter], num_buffers: int, compute_dtype: torch.dtype | None = None,
                 predict_delay: int = 0):
        """`compute_dtype` below fp32 (bf16) casts `params` to it in place and keeps fp32 masters apart;
        None or fp32: the masters share storage with the newest version (no extra memory).

        `predict_delay` d > 0 turns on SAPipe-style weight prediction: a delayed read of version v points the
        parameters at x^_v = x_v + d (x_v - x_{v-1}) (asyncpp.core.staleness.predict_weights), kept in a
        buffer of its own while v is held, so the exact versions (what the optimizer, the checkpoints and the
        synchronous steps read) are never overwritten. It needs x_{v-1} held too: one buffer more."""
        if num_buffers < 1:
            raise ValueError(f"num_buffers={num_buffers} must be >= 1")
        if predict_delay and num_buffers < predict_delay + 2:
            raise ValueError(f"weight prediction at delay {predict_delay} needs {predict_delay + 2} buffers, "
                             f"got num_buffers={num_buffers}")
        self.predict_delay = predict_delay
        self._predicted: dict[int, list[Tensor]] = {}  # version -> x^_version, while the version is held
        self.params = params
        self.num_buffers = num_buffers
        self.mixed = is_mixed(compute_dtype)
        if self.mixed:
            self.masters = make_masters(params, compute_dtype)
        # Buffer 0 is the parameters' own storage: K buffers in all, not K + 1.
        self.buffers: list[list[Tensor]] = [[p.data for p in params]]
        for _ in range(num_buffers - 1):
            self.buffers.append([torch.empty_like(p.data) for p in params])
        if not self.mixed:
            self.masters: list[nn.Parameter | None] = [nn.Parameter(p.data, requires_grad=p.requires_grad)
                                                       for p in params]
        self.grad_sums = GradSums(params) if self.mixed else None
        self._spare_grads: list[Tensor] | None = None  # a consumed gradient set to reuse (recycle())
        self.newest = 0
        self._active = 0  # index of the buffer the parameters point at
        self._unsynced: int | None = None  # mixed: the buffer of `newest` still waiting for the masters
        # The distributed optimizer: the owners' new weights on their way into `newest` (fill_newest_later).
        self._fill: Callable[[], None] | None = None

    def available(self, version: int) -> bool:
        return self.newest - self.num_buffers < version <= self.newest

    def use(self, version: int, predicted: bool = False) -> None:
        """Point every parameter at version `version` (must still be held); `predicted`: at its weight
        prediction (a delayed read with weight prediction on)."""
        self._check_held(version)
        if version == self.newest:  # older versions are complete: using them never waits for a fill
            self.sync()
        if predicted and self.predict_delay:
            self._point_at(("predicted", version), self.prediction(version))
        else:
            self._point(version % self.num_buffers)

    def _check_held(self, version: int) -> None:
        if not self.available(version):
            raise RuntimeError(
                f"weight version {version} is not held (newest {self.newest}, {self.num_buffers} buffers); "
                "the schedule used a version out of order"
            )

    def read_tensors(self, version: int, predicted: bool = False) -> list[Tensor]:
        """What a forward/backward of `version` reads (compute dtype; the prediction if `predicted`): the
        x_read of DC-ASGD."""
        self._check_held(version)
        if version == self.newest:
            self.sync()
        return self.prediction(version) if predicted and self.predict_delay else self.buffers[version % self.num_buffers]

    @torch.no_grad()
    def prediction(self, version: int) -> list[Tensor]:
        """x^_v = x_v + d (x_v - x_{v-1}), x_{-1} := x_0, computed once per held version into a reused buffer."""
        spare = [self._predicted.pop(v) for v in list(self._predicted) if not self.available(v)]
        if version not in self._predicted:
            older = max(version - 1, 0)
            self._check_held(older)
            x, x_old = self.buffers[version % self.num_buffers], self.buffers[older % self.num_buffers]
            out = spare.pop() if spare else [torch.empty_like(b) for b in x]
            for o, a, b in zip(out, x, x_old):
                predict_weights(a, b, self.predict_delay, out=o)
            self._predicted[version] = out
        return self._predicted[version]

    def keep_masters(self, keep: Sequence[bool]) -> None:
        """Mixed precision: drop the fp32 masters where `keep` is False (the distributed optimizer: another DP
        rank owns the parameter; pipeline.sharded.StageShards decides which). Their entries become None, in
        place, so every holder of this list sees it; the newest version of those parameters then arrives by
        fill_newest_later into the compute-dtype buffer. A no-op in fp32, where a master is the newest
        buffer itself. Before the first update only: the masters must not be stepped yet."""
        if len(keep) != len(self.masters):
            raise ValueError(f"keep_masters: {len(keep)} flags for {len(self.masters)} parameters")
        if not self.mixed:
            return
        if self.newest != 0:
            raise RuntimeError(f"keep_masters() after {self.newest} updates; call it before the first")
        for i, k in enumerate(keep):
            if not k:
                self.masters[i] = None

    def fill_newest_later(self, fill: Callable[[], None]) -> None:
        """The newest version is complete only after `fill()` (the distributed optimizer: the other DP ranks'
        parameters, broadcast into the newest buffer by their owners). It runs at the first read of the newest
        version (use, read_tensors, tensors, the next begin_update): under 2BW the first forward of x_{t+1}
        comes m - (P-1-s) >= 1 microbatches after UPDATE(t), so the transfer hides in that slack."""
        if self._fill is not None:
            raise RuntimeError(f"version {self.newest} already has a fill in flight")
        self._fill = fill

    @property
    def filling(self) -> bool:
        """Whether the newest version is still waiting for its fill."""
        return self._fill is not None

    @torch.no_grad()
    def sync(self) -> None:
        """Complete the newest version: its pending fill, then (mixed precision) its buffer from the masters
        after an update (no-op otherwise)."""
        if self._fill is not None:
            fill, self._fill = self._fill, None
            fill()
        self._cast_masters()

    @torch.no_grad()
    def _cast_masters(self) -> None:
        """Mixed precision after an update: the masters held here, cast into the newest buffer (once)."""
        if self._unsynced is None:
            return
        held = [(b, q) for b, q in zip(self.buffers[self._unsynced], self.masters) if q is not None]
        if held:
            torch._foreach_copy_([b for b, _ in held], [q for _, q in held])
        self._unsynced = None

    def newest_buffer(self) -> list[Tensor]:
        """The newest version in the compute dtype, as the distributed optimizer's owners send it: its buffer,
        with every master held here cast into it first (fp32: the buffer is the masters' own storage)."""
        if self._fill is not None:
            raise RuntimeError(f"version {self.newest} is still waiting for its fill; it cannot be sent yet")
        self._cast_masters()
        return self.buffers[self.newest % self.num_buffers]

    def take_grads(self) -> list[Tensor]:
        """The step's gradient of every parameter, in the masters' dtype (zeros where none arrived);
        the parameters start accumulating the next step's from nothing."""
        if self.grad_sums is not None:
            return [g if g is not None else torch.zeros_like(p, dtype=MASTER_DTYPE)
                    for g, p in zip(self.grad_sums.pop(), self.params)]
        grads, spare, self._spare_grads = [], self._spare_grads, None
        for i, p in enumerate(self.params):
            grads.append(p.grad if p.grad is not None else torch.zeros_like(p))
            # The next step's microbatches accumulate into a recycled, zeroed gradient set if the engine
            # gave one back (`recycle`), else into a fresh .grad. Autograd adds into an existing .grad in
            # place, and 0 + g == g, so the sums are the same floats (up to the sign of an exact zero).
            p.grad = spare[i].zero_() if spare is not None else None
        return grads

    def recycle(self, grads: list[Tensor]) -> None:
        """Give back a step's gradient set once the update has consumed it; the next take_grads() installs it
        (zeroed) as the accumulator of the step after. Two sets then alternate for the whole run instead of
        a fresh one per step (whose allocation pattern kept the host heap growing). fp32 only: under mixed
        precision the sums live in GradSums. Only where the schedule holds two sets anyway (two or more weight
        versions: step t's gradient waits for UPDATE(t) while step t+1 accumulates); a synchronous stage
        keeps one, as the memory plan (asyncpp.core.memory) counts. Not a set with holes: the distributed
        optimizer drops the gradients a rank does not own (None), which is the memory it saves."""
        whole = all(g is not None and g.shape == p.shape and g.dtype == p.dtype for g, p in zip(grads, self.params))
        if self.num_buffers >= 2 and self.grad_sums is None and whole:
            self._spare_grads = grads

    def _point(self, index: int) -> None:
        self._point_at(index, self.buffers[index])

    def _point_at(self, key, tensors: list[Tensor]) -> None:
        """Parameters take `tensors`' storage; `key` names them (a buffer index or a predicted version)."""
        if key != self._active:
            for p, buf in zip(self.params, tensors):
                p.data = buf
            self._active = key

    @torch.no_grad()
    def begin_update(self, step: int) -> list[Tensor]:
        """Prepare version step+1 = x_step in its own buffer, parameters pointing at it.

        Returns x_step's tensors (read-only from here on: in-flight microbatches use them). The
        caller then runs the optimizer in place on the parameters.
        """
        if step != self.newest:
            raise RuntimeError(f"update for step {step} but the newest version is {self.newest}")
        self.sync()  # x_step complete (the distributed optimizer's fill)
        if self.mixed:
            # The masters hold x_t in fp32 and are stepped in place; x_t is returned in fp32 too, so Error
            # Feedback and the update norm measure the fp32 update (bf16(x_t) would add rounding to u_t).
            # None where no master is held here (keep_masters): that parameter is another rank's to update.
            x_t = [q.detach().clone() if q is not None else None for q in self.masters]
            self._unsynced = (step + 1) % self.num_buffers
            self.newest = step + 1
            return x_t
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
        """The tensors holding `version` at full precision (for checkpoints; written in place on load):
        its buffer, or in mixed precision the fp32 masters for the newest version (its compute-dtype buffer
        where no master is held here: keep_masters)."""
        self.sync()
        buffer = self.buffers[version % self.num_buffers]
        if self.mixed and version == self.newest:
            return [q.detach() if q is not None else b for q, b in zip(self.masters, buffer)]
        return buffer

    def copies(self, version: int) -> list[bool]:
        """Per parameter: whether tensors(version) is a compute-dtype copy of an fp32 master another rank
        holds (the distributed optimizer under mixed precision), which that rank saves."""
        return [self.mixed and version == self.newest and q is None for q in self.masters]

    @torch.no_grad()
    def set_newest(self, version: int) -> None:
        """After a load: `version` is the newest; parameters and masters point at it (mixed precision:
        its buffer is refilled from the masters held here, which the load wrote; it wrote the others'
        entries of the buffer directly)."""
        self.sync()  # nothing may still be filling the buffers the load rewrites
        self.newest = version
        self._active = -1
        self._predicted.clear()  # the load rewrote the versions they were made from
        if self.mixed:
            self._unsynced = version % self.num_buffers
            self.sync()
        self._point(version % self.num_buffers)
        if not self.mixed:
            for q, buf in zip(self.masters, self.buffers[version % self.num_buffers]):
                q.data = buf

    def retarget(self, optimizer: AnyOptimizer) -> None:
        """Make a freshly built optimizer step the masters instead of the module's Parameters."""
        retarget(optimizer, self.params, self.masters)

    # ---- Stateful (torch.distributed.checkpoint.stateful): the versions as a checkpoint holds them ---------
    def state_dict(self) -> dict[str, list[Tensor]]:
        """{str(age): x_{newest-age}} for every held version, at full precision (tensors()): the storage itself,
        which a load writes in place."""
        return {str(self.newest - version): self.tensors(version) for version in self.held()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Sequence[Tensor]]) -> None:
        """Take `state`'s versions (in place already for the tensors state_dict() gave); then the parameters and
        the masters point at the newest (mixed precision: its buffer refilled from the masters the load wrote)."""
        for age, tensors in state.items():
            load_in_place(self.tensors(self.newest - int(age)), tensors)
        self.set_newest(self.newest)

    def expect(self, newest: int) -> list[int]:
        """Before a load of a checkpoint of step `newest`: the buffers stand for x_newest, x_newest-1, ... (what
        state_dict() then offers the load); returns the ages the load must fill."""
        self.set_newest(newest)
        return [newest - version for version in self.held()]

    def copied(self) -> dict[int, list[bool]]:
        """age -> copies(version) of every held version: the tensors another rank saves."""
        return {self.newest - version: self.copies(version) for version in self.held()}
