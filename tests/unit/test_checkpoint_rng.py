"""Checkpoint RNG state on CUDA: only the current device's generator is saved and restored.

Runs on the CPU with torch.cuda's RNG functions replaced by a stand-in of N visible GPUs, each with
its own generator state; get_rng_state_all/set_rng_state_all must not be used at all (restoring on
fewer visible GPUs than were saved used to raise IndexError).
"""

from __future__ import annotations

import pytest
import torch

from asyncpp.train.checkpoint import rng


class FakeCuda:
    def __init__(self, num_devices: int, current: int):
        self.states = {i: torch.full((16,), i + 1, dtype=torch.uint8) for i in range(num_devices)}
        self.current = current

    def install(self, monkeypatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(cuda, "get_rng_state", lambda device="cuda": self.states[self._index(device)].clone())
        monkeypatch.setattr(cuda, "set_rng_state", self._set)
        for name in ("get_rng_state_all", "set_rng_state_all"):
            monkeypatch.setattr(cuda, name, lambda *a, name=name: pytest.fail(f"{name} touches every visible GPU"))

    def _index(self, device) -> int:
        return device if isinstance(device, int) else torch.device(device).index

    def _set(self, state: torch.Tensor, device="cuda") -> None:
        index = self._index(device)
        if index not in self.states:
            raise IndexError(f"no cuda:{index}")
        self.states[index] = state.clone()


def test_saves_the_current_devices_generator_only(monkeypatch) -> None:
    fake = FakeCuda(num_devices=4, current=2)
    fake.install(monkeypatch)
    state = rng.rng_state()
    assert state["cuda"] == [3] * 16  # cuda:2's state, one list, not one per visible GPU


def test_restores_on_fewer_visible_gpus(monkeypatch) -> None:
    saver = FakeCuda(num_devices=8, current=5)
    saver.install(monkeypatch)
    manifest = {"rng": [rng.rng_state()]}
    cpu_before = torch.get_rng_state()
    loader = FakeCuda(num_devices=1, current=0)  # resumed with CUDA_VISIBLE_DEVICES set to one GPU
    loader.install(monkeypatch)
    rng.restore_rng(manifest)
    assert loader.states[0].tolist() == [6] * 16  # the saving rank's generator, now on this rank's GPU
    assert torch.equal(torch.get_rng_state(), cpu_before)


def test_reads_the_older_one_state_per_gpu_format(monkeypatch) -> None:
    per_gpu = [[i + 10] * 16 for i in range(4)]
    fake = FakeCuda(num_devices=4, current=1)
    fake.install(monkeypatch)
    rng.restore_rng({"rng": [{"torch": torch.get_rng_state().tolist(), "cuda": per_gpu}]})
    assert fake.states[1].tolist() == [11] * 16 and fake.states[0].tolist() == [1] * 16
    fake.current = 6  # more GPUs than the old checkpoint knew of: said so, not an IndexError
    with pytest.warns(UserWarning, match="CUDA RNG states of 4 GPUs"):
        rng.restore_rng({"rng": [{"torch": torch.get_rng_state().tolist(), "cuda": per_gpu}]})
