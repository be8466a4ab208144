"""The pipeline reuses its receive buffers and, under a delayed schedule, its gradient sets: resident
memory must not grow with run length (bench/peers.py --memory measures it; these check the mechanism)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from asyncpp.pipeline.p2p import StageComm
from asyncpp.pipeline.weights import WeightVersions


def _comm() -> StageComm:
    links = SimpleNamespace(send_forward=None, send_backward=None, recv_forward=None, recv_backward=None)
    mesh = SimpleNamespace(is_first_stage=False, is_last_stage=False, pp_rank=1, rank=1, device=torch.device("cpu"),
                           global_rank=lambda stage: stage, links=links)
    return StageComm(mesh, (2, 3, 4), torch.float32)


def test_a_released_receive_buffer_is_reused_clean():
    comm = _comm()
    a, b = comm._buffer(), comm._buffer()
    assert a is not b
    a.requires_grad_()
    (a * 2).sum().backward()
    comm.release(a)
    again = comm._buffer()
    assert again is a and again.grad is None and not again.requires_grad
    assert comm._buffer() is not b  # b was never released: still in use


def test_tensors_the_comm_did_not_allocate_are_not_pooled():
    comm = _comm()
    foreign = torch.empty(2, 3, 4)
    comm.release(foreign)
    assert comm._buffer() is not foreign


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _accumulate(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        model(torch.randn(5, 4, generator=g)).pow(2).sum().backward()


def test_two_gradient_sets_alternate_under_two_weight_versions_with_the_same_sums():
    """With a recycled set the next step accumulates into it (zeroed): the same sums as into a fresh .grad."""
    model, fresh = _model(), _model()
    versions = WeightVersions(list(model.parameters()), num_buffers=2)
    reference = WeightVersions(list(fresh.parameters()), num_buffers=2)
    _accumulate(model, 0)
    first = versions.take_grads()
    versions.recycle(first)
    _accumulate(model, 1)
    second = versions.take_grads()  # installed `first` (zeroed) as the accumulator of step 2
    assert all(p.grad is g for p, g in zip(model.parameters(), first))
    _accumulate(model, 2)
    third = versions.take_grads()
    assert all(t is f for t, f in zip(third, first))  # the recycled tensors, not new ones
    expected = []
    for seed in range(3):
        _accumulate(fresh, seed)
        expected.append(reference.take_grads())  # fresh .grad every step (reference never recycles)
    # Step 1 went into a fresh set, step 2 into the recycled one (which held step 0's sums before).
    assert all(torch.equal(g, e) for g, e in zip(second, expected[1]))
    assert all(torch.equal(g, e) for g, e in zip(third, expected[2]))


def test_a_synchronous_stage_keeps_one_gradient_set():
    model = _model()
    versions = WeightVersions(list(model.parameters()), num_buffers=1)
    _accumulate(model, 0)
    versions.recycle(versions.take_grads())
    _accumulate(model, 1)
    versions.take_grads()
    assert all(p.grad is None for p in model.parameters())


def test_a_gradient_set_with_holes_is_not_recycled():
    """The distributed optimizer drops the gradients a rank does not own (None): such a set is not reused
    (its memory is what the optimizer saves), and nothing fails on the holes."""
    model = _model()
    versions = WeightVersions(list(model.parameters()), num_buffers=2)
    _accumulate(model, 0)
    grads = versions.take_grads()
    grads[1] = None
    versions.recycle(grads)
    _accumulate(model, 1)
    versions.take_grads()
    assert all(p.grad is None for p in model.parameters())  # no spare set was installed


class _GlooSend:
    """A gloo send handle as gloo reports it: never complete until waited for (is_completed() stays False
    even after the peer received, measured with torch 2.13's ProcessGroupGloo)."""

    def __init__(self) -> None:
        self.waited = False

    def is_completed(self) -> bool:
        return self.waited

    def wait(self, timeout=None) -> bool:
        self.waited = True
        return True


def test_retire_releases_the_sends_of_finished_steps_that_poll_never_sees_complete(monkeypatch):
    """Without `retire`, a gloo stage kept every sent activation of a segment alive until its drain (RSS grew
    with run length). `retire(t)` frees exactly the sends of steps <= t, including an interleaved later step's
    send issued before them, and leaves later steps' and evaluation sends (step None) pending."""
    comm = _comm()
    handles = []

    def isend(payload, dst, group):
        handles.append(_GlooSend())
        return handles[-1]

    monkeypatch.setattr("asyncpp.pipeline.p2p.dist.isend", isend)
    outputs = {}
    for step, mb in ((0, 0), (0, 1), (1, 0), (0, 2), (1, 1)):  # 2BW: forwards of step 1 before step 0's last
        outputs[step, mb] = torch.ones(2, 3, 4)
        comm.send_forward(outputs[step, mb], step)
    comm.send_backward(torch.ones(2, 3, 4))  # no step: waited for only by flush
    comm.poll()
    assert len(comm._pending) == 6 and all(o.numel() == 24 for o in outputs.values())  # gloo: nothing completes
    comm.retire(0)
    assert [s for *_, s in comm._pending] == [1, 1, None]
    assert all(outputs[0, mb].numel() == 1 for mb in range(3))  # the values were dropped, the graph node kept
    assert outputs[1, 0].numel() == 24 and outputs[1, 1].numel() == 24
    assert [h.waited for h in handles] == [True, True, False, True, False, False]
    comm.retire(1)
    assert [s for *_, s in comm._pending] == [None]
    comm.flush()
    assert not comm._pending and all(h.waited for h in handles)
