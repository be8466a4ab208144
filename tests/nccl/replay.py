"""Replay recorded torch.distributed logs under NCCL's ordering rules and find deadlocks.

The rules (torch's ProcessGroupNCCL on NCCL), with messages assumed larger than NCCL's internal
buffers, so a send cannot complete before its receive is running:

- Every rank has one FIFO per communicator it uses; an operation runs only at the head of its FIFO.
- A collective completes when every member of its group has it at the head of that group's FIFO.
- A p2p op completes when it meets its complement (send <-> recv, same pair) at the head of the
  peer's FIFO on the same communicator. A `batch_isend_irecv` is one unit: its ops progress together
  and the unit leaves the head when all of them have completed.
- Which communicator: a collective and a batch use their group's. An unbatched isend/irecv uses a
  2-rank communicator of its own per pair of the group under lazy init (torch's default), and the
  group's communicator under eager init (`init_process_group(device_id=...)`), where it serializes
  with the collectives of that group.
- A rank issues its log in order; issuing never blocks. A `Wait` blocks everything the rank issues
  after it until the op has completed (the CPU thread, or the GPU stream for a stream-ordered wait).

`replay(logs, mode)` returns a `Replay`: `deadlocked` with the first blocked op of each rank, and
`mismatches`: sends whose dtype or shape differ from the receiving buffer, collectives whose kind
differs between members (NCCL would corrupt data or hang; gloo only sometimes errors).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tests.nccl.recorder import Op, P2PPart, Wait

MODES = ("lazy", "eager")


@dataclass
class _Unit:
    rank: int
    op: Op
    key: tuple
    done: list[bool]

    @property
    def complete(self) -> bool:
        return all(self.done)


@dataclass
class Replay:
    mode: str
    deadlocked: bool
    blocked: dict[int, str] = field(default_factory=dict)
    """rank -> the first op it issued that never completed (and what its thread waits on)."""
    mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.deadlocked and not self.mismatches

    def summary(self) -> str:
        lines = [f"{self.mode}: {'DEADLOCK' if self.deadlocked else 'completes'}"]
        lines += [f"  rank {r}: {what}" for r, what in sorted(self.blocked.items())]
        lines += [f"  mismatch: {m}" for m in self.mismatches[:10]]
        return "\n".join(lines)


def communicator(op: Op, rank: int, mode: str) -> tuple:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    if op.is_p2p and not op.batched and mode == "lazy":
        return (op.group, tuple(sorted((rank, op.parts[0].peer))))
    return (op.group,)


def replay(logs: dict[int, list[Op | Wait]], mode: str) -> Replay:
    fifos: dict[tuple[int, tuple], deque[_Unit]] = {}
    pcs = {r: 0 for r in logs}
    issued: dict[tuple[int, int], _Unit] = {}
    result = Replay(mode, False)
    progress = True
    while progress:
        progress = False
        for rank, log in logs.items():
            while pcs[rank] < len(log):
                event = log[pcs[rank]]
                if isinstance(event, Wait):
                    if not issued[(rank, event.seq)].complete:
                        break
                else:
                    unit = _Unit(rank, event, communicator(event, rank, mode), [False] * max(len(event.parts), 1))
                    fifos.setdefault((rank, unit.key), deque()).append(unit)
                    issued[(rank, event.seq)] = unit
                pcs[rank] += 1
                progress = True
        for (rank, key), fifo in list(fifos.items()):
            if fifo and _advance(fifo[0], fifos, result):
                progress = True
            for f in fifos.values():
                while f and f[0].complete:
                    f.popleft()
                    progress = True
    stuck = {r for r in logs if pcs[r] < len(logs[r])} | {u.rank for f in fifos.values() for u in f}
    result.deadlocked = bool(stuck)
    for rank in sorted(stuck):
        pending = [u for (r, _), f in fifos.items() if r == rank for u in f]
        first = min(pending, key=lambda u: u.op.seq, default=None)
        what = first.op.describe() if first else "nothing pending"
        if pcs[rank] < len(logs[rank]):
            what += f"; its thread waits for #{logs[rank][pcs[rank]].seq}"
        result.blocked[rank] = what
    return result


def _advance(unit: _Unit, fifos: dict, result: Replay) -> bool:
    """Try to complete what is at the head of a FIFO; True if anything changed."""
    if not unit.op.is_p2p:
        return _collective(unit, fifos, result)
    changed = False
    for i, part in enumerate(unit.op.parts):
        if unit.done[i]:
            continue
        peer_fifo = fifos.get((part.peer, unit.key))  # the same key from both ends
        if not peer_fifo:
            continue
        head = peer_fifo[0]
        j = next((j for j, q in enumerate(head.op.parts) if not head.done[j] and q.peer == unit.rank
                  and q.kind != part.kind), None)
        if j is None:
            continue
        _check_pair(unit, part, head, head.op.parts[j], result)
        unit.done[i] = head.done[j] = True
        changed = True
    return changed


def _collective(unit: _Unit, fifos: dict, result: Replay) -> bool:
    heads = []
    for member in unit.op.ranks:
        fifo = fifos.get((member, unit.key))
        if not fifo or fifo[0].op.is_p2p:
            return False
        heads.append(fifo[0])
    names = {h.op.name for h in heads}
    if len(names) > 1:
        result.mismatches.append(f"collectives differ on {list(unit.op.ranks)}: "
                                 + "; ".join(f"rank {h.rank} {h.op.describe()}" for h in heads))
    for h in heads:
        h.done[0] = True
    return True


def _check_pair(a: _Unit, pa: P2PPart, b: _Unit, pb: P2PPart, result: Replay) -> None:
    if (pa.shape, pa.dtype) != (pb.shape, pb.dtype):
        send, recv = ((a, pa), (b, pb)) if pa.kind == "send" else ((b, pb), (a, pa))
        result.mismatches.append(
            f"rank {send[0].rank} sends {list(send[1].shape)} {send[1].dtype} into rank {recv[0].rank}'s "
            f"{list(recv[1].shape)} {recv[1].dtype} buffer ({send[0].op.describe()} -> {recv[0].op.describe()})")
