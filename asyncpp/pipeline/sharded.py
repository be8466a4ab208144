"""The distributed optimizer on one pipeline stage (parallel.distributed_optimizer=true; ZeRO-1).

Each DP rank owns whole parameters (asyncpp/optim/distributed.py): their optimizer state and their
Error-Feedback buffer u_{t-1} live on the owner only, the owner alone receives their reduced gradient
(reduction.ShardedGradientReduction) and steps them. Under mixed precision the fp32 masters are sharded
the same way (shard_masters): a rank keeps its own parameters' masters only. UPDATE(t) then broadcasts each
owner's new weights, in the compute dtype, into every replica's buffer of x_{t+1}
(weights.WeightVersions.fill_newest_later), asynchronously:
nothing reads x_{t+1} before the first forward of b_{t+2} (2BW), so the transfer is waited for there, or
earlier if the engine sees it complete at an action boundary. The timeline shows each transfer as a
"comm" event from its start in UPDATE(t) to its completion, and any wait for it as "idle".

The update rule (core/update.UpdateRule) is the simulator's, applied to the owned parameters only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from torch import Tensor

from asyncpp.optim.build import MATRIX_OPTIMIZERS, AnyOptimizer
from asyncpp.optim.distributed import Ownership, plan_ownership, restrict_to_owned
from asyncpp.parallel.mesh import Mesh
from asyncpp.pipeline.buckets import OwnerBucket, start_owner_buckets
from asyncpp.pipeline.timer import StageTimer
from asyncpp.schedules.actions import Action

if TYPE_CHECKING:
    from asyncpp.pipeline.weights import WeightVersions


def matrix_mask(optimizer: AnyOptimizer, params: Sequence[Tensor]) -> list[bool]:
    """Per parameter: whether a matrix optimizer (Muon, NorMuon, SOAP) steps it (after retarget: the masters)."""
    inner = getattr(optimizer, "optimizers", None) or {}
    ids = {id(p) for name, opt in inner.items() if name in MATRIX_OPTIMIZERS
           for group in opt.param_groups for p in group["params"]}
    return [id(p) in ids for p in params]


class StageShards:
    """Which of a stage's parameters this rank owns, and the broadcast of the owners' new weights."""

    def __init__(self, mesh: Mesh, optimizer: AnyOptimizer, masters: Sequence[Tensor], *, expert: Sequence[bool],
                 tied: Sequence[bool], wait: Callable[[object, str], None] | None = None,
                 timer: StageTimer | None = None):
        """Plans the ownership and restricts `optimizer` to this rank's share (a dry run stops here: it
        passes no `wait`/`timer`, which only the broadcast needs)."""
        d = mesh.dims
        self.mesh = mesh
        self.count = len(masters)  # no reference kept: the masters of other owners' parameters must be freeable
        self.ownership: Ownership = plan_ownership(
            masters, matrix=matrix_mask(optimizer, masters), expert=expert, replicated=tied,
            dp=d.dp, edp=d.edp, dp_rank=mesh.dp_rank, edp_rank=mesh.edp_rank)
        self.owned = [i for i, own in enumerate(self.ownership.mask) if own]
        restrict_to_owned(optimizer, self.select(masters))
        self.wait = wait
        self.timer = timer
        self._inflight: list[OwnerBucket] = []
        self.broadcasts = 0
        self.in_flight_s = 0.0  # host seconds from each broadcast's start to its completion being seen
        self.blocked_s = 0.0  # host seconds a read of x_{t+1} waited for it (0 when the slack hid it)

    def shard_masters(self, versions: WeightVersions) -> None:
        """ZeRO-1 for the fp32 masters (mixed precision): this rank keeps those of the parameters it owns
        (a tied weight, owned by every replica, included); the others' x_{t+1} comes from their owners into
        the compute-dtype buffer. A no-op in fp32, where the masters are the newest buffer. The one place
        that decides which masters a rank holds: the engine and the dry run both call it."""
        versions.keep_masters(self.ownership.mask)

    def select(self, values: Sequence) -> list:
        """The owned parameters' entries of a per-parameter list."""
        return [values[i] for i in self.owned]

    def aligned(self, owned_values: Sequence) -> list:
        """A per-owned-parameter list spread back over every parameter (None where not owned)."""
        out: list = [None] * self.count
        for i, v in zip(self.owned, owned_values):
            out[i] = v
        return out

    def start_broadcast(self, action: Action, newest: Sequence[Tensor]) -> Callable[[], None]:
        """Start sending the owned parameters' new values to the other replicas and receiving theirs in place;
        returns the function that completes it (WeightVersions' fill). `newest`: the buffer of x_{t+1} in the
        compute dtype (WeightVersions.newest_buffer), complete for the owned parameters. Under bf16 the owner
        sends bf16(master), half the bytes of the fp32 master; a receiver gets the very bits it would have
        made by casting the fp32 master itself, since the cast (round to nearest even) is deterministic.
        Issue order: dense tensors over DP, then experts over expert-DP, each by owner: one order everywhere."""
        o, d = self.ownership, self.mesh.dims
        if len(newest) != self.count:
            raise ValueError(f"start_broadcast: {len(newest)} tensors for {self.count} parameters")
        buckets: list[OwnerBucket] = []
        for expert, group, size, rank in ((False, self.mesh.dp_group, d.dp, o.dp_rank),
                                          (True, self.mesh.edp_group, d.edp, o.edp_rank)):
            idx = [i for i in range(self.count) if o.sharded(i) and o.expert[i] == expert]
            if idx and size > 1:
                kind = "expert-data-parallel" if expert else "data-parallel"
                buckets += start_owner_buckets([newest[i] for i in idx], [o.owners[i] for i in idx],
                                               group, rank, "broadcast",
                                               f"the {kind} broadcast of x_{action.step + 1} from its owners")
        self._inflight = buckets
        start, host_start = self.timer.now(), time.perf_counter()

        def fill() -> None:
            wait_start, host_wait = self.timer.now(), time.perf_counter()
            done = all(b.work.is_completed() for b in buckets)  # hidden in the slack: nothing to wait for
            for b in buckets:
                b.finish(self.wait)
            end, host_end = self.timer.now(), time.perf_counter()
            self._inflight = []
            self.broadcasts += 1
            self.in_flight_s += host_end - host_start
            if not done:
                self.blocked_s += host_end - host_wait
            self.timer.add(action, start, end, kind="comm")
            self.timer.add(action, wait_start, end, kind="idle")  # dropped if shorter than timer.MIN_IDLE_S

        return fill

    def broadcast_done(self) -> bool:
        """Whether every broadcast in flight has completed (never blocks)."""
        return all(b.work.is_completed() for b in self._inflight)
