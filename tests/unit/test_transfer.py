"""asyncpp.core.transfer.to_device: plain on the CPU; on CUDA the copy is staged through pinned memory
and queued with non_blocking (checked on a stand-in tensor that records the calls; tests/gpu checks a real
GPU with torch.cuda's sync debug mode)."""

from __future__ import annotations

import torch

from asyncpp.core.transfer import to_device

CUDA0 = torch.device("cuda", 0)


class RecordingTokens:
    """What to_device may call on a CPU tensor, recorded."""

    def __init__(self, pinned: bool = False, calls: list | None = None):
        self.device, self.pinned, self.calls = torch.device("cpu"), pinned, calls if calls is not None else []

    def is_pinned(self) -> bool:
        return self.pinned

    def pin_memory(self) -> RecordingTokens:
        self.calls.append("pin_memory")
        return RecordingTokens(True, self.calls)

    def to(self, device, non_blocking: bool = False) -> str:
        self.calls.append(("to", str(device), non_blocking, self.pinned))
        return "on device"


def test_cpu_is_a_plain_move() -> None:
    tokens = torch.arange(12).reshape(3, 4)
    out = to_device(tokens, "cpu")
    assert out.device.type == "cpu" and torch.equal(out, tokens)


def test_cuda_copies_from_pinned_memory_without_blocking() -> None:
    pageable = RecordingTokens()
    assert to_device(pageable, CUDA0) == "on device"
    assert pageable.calls == ["pin_memory", ("to", "cuda:0", True, True)]
    pinned = RecordingTokens(pinned=True)
    to_device(pinned, CUDA0)
    assert pinned.calls == [("to", "cuda:0", True, True)]  # already pinned: no second staging copy
