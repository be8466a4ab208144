"""p2p's own guards, without processes: the send check, stream-ordered waits and their watchdog, the
DP buckets, eager communicator init on CUDA."""

from __future__ import annotations

import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from asyncpp.parallel import mesh as mesh_module
from asyncpp.pipeline import buckets
from asyncpp.pipeline.p2p import P2PMismatch, PipelineTimeout, StageComm, Watchdog


def fake_mesh(device: str = "cpu", stage: int = 1, stages: int = 3):
    return SimpleNamespace(
        pp_rank=stage, rank=stage + 2, device=torch.device(device), is_first_stage=stage == 0,
        is_last_stage=stage == stages - 1, global_rank=lambda s: s + 2,
        links=SimpleNamespace(recv_forward=None, send_forward=None, recv_backward=None, send_backward=None))


class FakeWork:
    def __init__(self, done: bool = False):
        self.done, self.waits = done, []

    def is_completed(self) -> bool:
        return self.done

    def wait(self, *args):
        self.waits.append(args)
        return True


@pytest.mark.parametrize("tensor, named", [
    (torch.zeros(2, 4, 8, dtype=torch.bfloat16), "dtype torch.bfloat16"),
    (torch.zeros(2, 5, 8), "shape [2, 5, 8]"),
])
def test_a_send_that_does_not_match_the_receiving_buffer_is_refused(tensor, named, monkeypatch):
    monkeypatch.setattr("torch.distributed.isend", lambda *a, **k: pytest.fail("isend reached"))
    comm = StageComm(fake_mesh(), (2, 4, 8), torch.float32)
    with pytest.raises(P2PMismatch) as e:
        comm.send_forward(tensor)
    assert named in str(e.value) and "buffer of shape [2, 4, 8] and dtype torch.float32" in str(e.value)
    assert "stage 1 (rank 3)" in str(e.value) and "train.precision" in str(e.value)


def test_a_matching_send_goes_out(monkeypatch):
    sent = []
    monkeypatch.setattr("torch.distributed.isend", lambda t, dst, group: sent.append((t.shape, dst)) or FakeWork())
    StageComm(fake_mesh(), (2, 4, 8), torch.float32).send_backward(torch.zeros(2, 4, 8))
    assert sent == [(torch.Size([2, 4, 8]), 2)]


def test_cpu_waits_are_timed_and_cuda_waits_are_stream_ordered_and_watched():
    cpu = StageComm(fake_mesh("cpu"), (1,), torch.float32, timeout_s=7.0)
    work = FakeWork(done=True)
    cpu.wait(work, "x")
    assert work.waits == [(timedelta(seconds=7.0),)]  # a timed wait: blocks the thread, bounded
    assert cpu.watchdog is None
    gpu = StageComm(fake_mesh("cuda"), (1,), torch.float32, timeout_s=7.0)
    work = FakeWork()
    gpu.wait(work, "x")
    assert work.waits == [()]  # Work.wait() without a timeout: the stream waits, the CPU goes on
    assert [what for _, _, what in gpu.watchdog._watched] == ["x"]


def test_watchdog_names_the_stage_and_what_hung():
    dog = Watchdog(fake_mesh("cuda"), timeout_s=0.05, period_s=3600)  # scanned by hand below
    done, hung = FakeWork(), FakeWork()
    dog.watch(done, "an activation from rank 2")
    dog.watch(hung, "the output gradient of B3.1@v2 from rank 4")
    done.done = True
    dog.scan()
    dog.check()  # nothing expired yet
    time.sleep(0.1)
    dog.scan()
    with pytest.raises(PipelineTimeout, match=r"stage 1 \(rank 3\) gave up waiting for the output gradient of "
                                              r"B3.1@v2 from rank 4 \(train.timeout_s=0.05\)"):
        dog.check()


def test_watchdog_thread_reports_without_a_scan_by_hand():
    dog = Watchdog(fake_mesh("cuda"), timeout_s=0.05, period_s=0.01)
    dog.watch(FakeWork(), "the tied-embedding gradient all-reduce")
    deadline = time.monotonic() + 5
    while dog.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(PipelineTimeout, match="gave up waiting for the tied-embedding"):
        dog.check()


def test_dp_buckets_reduce_large_tensors_in_place_and_pack_small_ones(monkeypatch):
    issued = []

    def all_reduce(t, group, async_op):
        issued.append((t.data_ptr(), t.numel()))
        t.mul_(2)  # a stand-in for the sum over two replicas
        return FakeWork(done=True)

    monkeypatch.setattr(buckets.dist, "all_reduce", all_reduce)
    big, a, b, c = torch.ones(10), torch.ones(3), torch.full((2, 2), 3.0), torch.ones(4)
    started = buckets.start_buckets([big, a, b, c], group=None, what="dp", cap=8)
    # big (>= cap) in place; a + b packed (7 <= 8); c opens a new bucket
    assert issued[0] == (big.data_ptr(), 10) and [n for _, n in issued[1:]] == [7, 4]
    for bucket in started:
        bucket.finish(lambda work, what: work.wait())
    assert torch.equal(big, torch.full((10,), 2.0)) and torch.equal(a, torch.full((3,), 2.0))
    assert torch.equal(b, torch.full((2, 2), 6.0)) and torch.equal(c, torch.full((4,), 2.0))


@pytest.mark.parametrize("device, bound", [("cuda", True), ("cpu", False)])
def test_init_binds_the_device_on_cuda_only(device, bound, monkeypatch):
    seen = {}
    monkeypatch.setattr(mesh_module.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(mesh_module.dist, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    mesh_module.init_distributed(device, timeout_s=5)
    assert ("device_id" in seen) == bound
    if bound:
        assert seen["device_id"] == torch.device("cuda", 0) and seen["backend"] == "nccl"


def test_a_dead_receive_buffer_s_id_does_not_let_another_tensor_into_the_pool():
    """An evaluation's received buffer is never released: it dies, and CPython hands its id to a later object.
    A tensor of another shape with that id (the spread head's [mb, seq, h] output gradient, which the engine
    releases as a no-op) must not enter the receive pool: the next receive would fill it, and a GPTModel stage
    read [mb, seq, h] as [seq, mb, h] (seen: the example's evaluation failed 2 runs in 11 in attention's mask)."""
    comm = StageComm(fake_mesh(), (32, 4, 8), torch.float32)
    buf = comm._buffer()  # a receive's buffer, handed out and never released (an evaluation's)
    dead = id(buf)
    del buf
    foreign = next((t for t in (torch.empty(4, 32, 8) for _ in range(1000)) if id(t) == dead), None)
    assert foreign is not None, "CPython did not reuse the id here: the case is not exercised"
    comm.release(foreign)
    assert comm._free == [] and tuple(comm._buffer().shape) == (32, 4, 8)
