"""The CUDA-event StageTimer on a real GPU (opt-in: `pytest -m gpu tests/gpu`).

perf_counter around an asynchronous launch measures the launch; the event timer must measure the work:
its duration for a queue of matmuls matches the synchronised wall time of the same queue, and the host
returned long before the device finished.
"""

from __future__ import annotations

import time

import pytest
import torch

from asyncpp.pipeline.timer import CudaClock, stage_timer
from asyncpp.schedules.actions import Action, Op

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda", 0)


def _work(a: torch.Tensor, n: int) -> None:
    for _ in range(n):
        a = a @ a
        a = a / a.norm()


def test_event_timer_measures_device_work_not_launches() -> None:
    torch.cuda.set_device(CUDA)
    a = torch.randn(4096, 4096, device=CUDA)
    _work(a, 5)  # warm-up: cuBLAS handles, allocator
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _work(a, 40)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0

    timer = stage_timer(0, CUDA)
    assert isinstance(timer.clock, CudaClock)
    origin = timer.restart()
    action = Action(Op.FORWARD, 0, 0, 0)
    host0 = time.perf_counter()
    start = timer.now()
    _work(a, 40)
    timer.add(action, start, timer.now())
    launch = time.perf_counter() - host0
    (event,) = timer.events  # waits for the device here, not in add()
    assert event.duration == pytest.approx(wall, rel=0.25)
    assert launch < 0.5 * event.duration  # the host ran ahead: perf_counter would have said `launch`
    assert timer.end_of(Op.FORWARD, 0) == pytest.approx(origin + event.end)
    assert timer.elapsed() >= event.end
    assert timer.busy() == pytest.approx(event.duration)
