"""The replayer itself, on hand-made logs: the cases NCCL deadlocks on must deadlock, the others pass."""

from __future__ import annotations

import pytest

from tests.nccl.recorder import Op, P2PPart, Wait
from tests.nccl.replay import replay

PP = ("pp", (0, 1))
SHAPE, F32 = (2, 3), "float32"


class Log:
    """A rank's log written by hand: isend/irecv/batch/all_reduce append an Op, wait a Wait."""

    def __init__(self, rank: int):
        self.rank, self.events = rank, []

    def _op(self, name, group, parts=(), shape=None, dtype=None) -> int:
        seq = sum(isinstance(e, Op) for e in self.events)
        self.events.append(Op(seq, name, group[0], group[1], list(parts), shape, dtype, site="test"))
        return seq

    def send(self, peer, group=PP, shape=SHAPE, dtype=F32):
        return self._op("isend", group, [P2PPart("send", peer, shape, dtype)])

    def recv(self, peer, group=PP, shape=SHAPE, dtype=F32):
        return self._op("irecv", group, [P2PPart("recv", peer, shape, dtype)])

    def batch(self, *parts, group=PP):
        return self._op("batch_isend_irecv", group, [P2PPart(k, p, SHAPE, F32) for k, p in parts])

    def all_reduce(self, group=PP):
        return self._op("all_reduce", group, shape=(2,), dtype="float64")

    def wait(self, seq):
        self.events.append(Wait(seq))
        return self


def logs(*ranks: Log) -> dict:
    return {r.rank: r.events for r in ranks}


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_both_ends_sending_first_deadlocks(mode):
    """Today's 1F1B at op number w: stage 0 sends F, stage 1 sends B, each receive queued behind."""
    a, b = Log(0), Log(1)
    a.send(1), a.wait(a.recv(1))
    b.send(0), b.wait(b.recv(0))
    r = replay(logs(a, b), mode)
    assert r.deadlocked
    assert r.blocked[0].startswith("#0 isend(send to 1") and r.blocked[1].startswith("#0 isend(send to 0")


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_complementary_order_completes(mode):
    a, b = Log(0), Log(1)
    a.send(1), a.wait(a.recv(1))
    b.wait(b.recv(0)), b.send(0)
    assert replay(logs(a, b), mode).ok


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_unwaited_send_that_never_meets_a_receive_is_reported(mode):
    a, b = Log(0), Log(1)
    a.send(1)
    r = replay(logs(a, b), mode)
    assert r.deadlocked and 0 in r.blocked and 1 not in r.blocked


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_a_batch_of_send_and_recv_meets_the_opposite_batch(mode):
    a, b = Log(0), Log(1)
    a.wait(a.batch(("send", 1), ("recv", 1)))
    b.wait(b.batch(("send", 0), ("recv", 0)))
    assert replay(logs(a, b), mode).ok


def test_a_batch_progresses_against_single_ops_on_the_group_communicator():
    """Eager init: the peer's unbatched ops share the group's communicator with the batch."""
    a, b = Log(0), Log(1)
    a.wait(a.batch(("send", 1), ("recv", 1)))
    b.wait(b.recv(0)), b.wait(b.send(0))
    assert replay(logs(a, b), "eager").ok
    # Lazy init: the unbatched ops sit on the pair's own communicator and never meet the batch.
    assert replay(logs(a, b), "lazy").deadlocked


def test_collective_behind_a_p2p_op_deadlocks_only_on_eager_init():
    """Rank 0 sends then all-reduces; rank 1 all-reduces then receives (the tied embedding at P=2)."""
    a, b = Log(0), Log(1)
    a.send(1), a.wait(a.all_reduce())
    b.wait(b.all_reduce()), b.wait(b.recv(0))
    assert replay(logs(a, b), "lazy").ok
    r = replay(logs(a, b), "eager")
    assert r.deadlocked and "all_reduce" in r.blocked[1]


def test_a_collective_on_a_group_of_its_own_does_not_serialize_with_p2p():
    a, b = Log(0), Log(1)
    own = ("embedding", (0, 1))
    a.send(1), a.wait(a.all_reduce(own))
    b.wait(b.all_reduce(own)), b.wait(b.recv(0))
    assert replay(logs(a, b), "eager").ok


def test_collective_waits_for_every_member():
    group = ("dp", (0, 1, 2))
    a, b, c = Log(0), Log(1), Log(2)
    a.wait(a.all_reduce(group)), b.wait(b.all_reduce(group))
    r = replay(logs(a, b, c), "lazy")
    assert r.deadlocked and set(r.blocked) == {0, 1}
    c.wait(c.all_reduce(group))
    assert replay(logs(a, b, c), "lazy").ok


def test_wait_orders_later_ops_behind_the_waited_one():
    """Stage 1 waits for its activation before it sends the gradient; stage 0 receives the gradient
    before it sends the activation: a cycle through the waits, on separate communicators alike."""
    fwd, bwd = ("fwd", (0, 1)), ("bwd", (0, 1))
    a, b = Log(0), Log(1)
    a.wait(a.recv(1, group=bwd)), a.send(1, group=fwd)
    b.wait(b.recv(0, group=fwd)), b.send(0, group=bwd)
    assert replay(logs(a, b), "lazy").deadlocked
    a2, b2 = Log(0), Log(1)
    a2.send(1, group=fwd), a2.wait(a2.recv(1, group=bwd))
    b2.wait(b2.recv(0, group=fwd)), b2.send(0, group=bwd)
    assert replay(logs(a2, b2), "eager").ok


def test_one_communicator_per_direction_makes_both_ends_sending_first_complete():
    fwd, bwd = ("fwd", (0, 1)), ("bwd", (0, 1))
    a, b = Log(0), Log(1)
    a.send(1, group=fwd), a.wait(a.recv(1, group=bwd))
    b.send(0, group=bwd), b.wait(b.recv(0, group=fwd))
    for mode in ("lazy", "eager"):
        assert replay(logs(a, b), mode).ok


def test_dtype_or_shape_mismatch_is_reported():
    a, b = Log(0), Log(1)
    a.send(1, dtype="bfloat16"), b.wait(b.recv(0))
    r = replay(logs(a, b), "lazy")
    assert not r.deadlocked and len(r.mismatches) == 1 and "bfloat16" in r.mismatches[0]
    a, b = Log(0), Log(1)
    a.send(1, shape=(2, 4)), b.wait(b.recv(0))
    assert "[2, 4]" in replay(logs(a, b), "eager").mismatches[0]


def test_different_collectives_on_one_group_are_reported():
    a, b = Log(0), Log(1)
    a.wait(a.all_reduce())
    b.wait(b._op("barrier", PP))
    assert replay(logs(a, b), "lazy").mismatches
