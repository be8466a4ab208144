"""The hot path's device helpers add no host synchronisation (opt-in: `pytest -m gpu tests/gpu`).

torch.cuda.set_sync_debug_mode("error") raises on any call that makes the host wait for the device:
the token copy (asyncpp.core.transfer.to_device) and the event timer (asyncpp.pipeline.timer) must pass under
it, while the pageable copy they replace must not.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from asyncpp.core.transfer import to_device
from asyncpp.pipeline.timer import stage_timer
from asyncpp.schedules.actions import Action, Op

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda", 0)


@contextlib.contextmanager
def no_host_sync():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_token_copy_and_timer_do_not_sync_the_host() -> None:
    torch.cuda.set_device(CUDA)
    tokens = torch.randint(0, 49152, (4, 4097))
    a = torch.randn(2048, 2048, device=CUDA)
    timer = stage_timer(0, CUDA)
    timer.restart()
    with no_host_sync():
        for j in range(4):
            start = timer.now()
            on_device = to_device(tokens, CUDA)
            for _ in range(5):
                a = a @ a
                a = a / 64.0
            timer.add(Action(Op.FORWARD, 0, j, 0), start, timer.now())
    assert torch.equal(on_device.cpu(), tokens)
    assert [e.microbatch for e in timer.events] == [0, 1, 2, 3]
    with no_host_sync(), pytest.raises(RuntimeError, match="synchroniz"):
        tokens.to(CUDA)  # the pageable copy waits for the stream: what to_device replaces
