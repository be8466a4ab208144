"""The NCCL-order tier: the ops real multi-process runs issue, replayed under NCCL's rules.

Each layout runs on gloo (which forgives any order), recording every torch.distributed op per rank;
tests/nccl/replay.py then replays the logs with one FIFO per (rank, communicator), for lazy and for
eager communicator initialization. A deadlock reports the first blocked op of every rank.
"""

from __future__ import annotations

import pytest

from tests.nccl.layouts import FAST, LAYOUTS, record_layout
from tests.nccl.replay import MODES, replay

pytestmark = [pytest.mark.dist, pytest.mark.usefixtures("one_thread")]


def _params():
    return [pytest.param(name, marks=() if name in FAST else pytest.mark.slow) for name in LAYOUTS]


@pytest.mark.parametrize("name", _params())
def test_layout_cannot_deadlock_on_nccl(name):
    logs = record_layout(LAYOUTS[name])
    assert all(logs.values()), "a rank recorded nothing: the recorder is not installed"
    for mode in MODES:
        result = replay(logs, mode)
        assert result.ok, f"{name}\n{result.summary()}"
