"""What the training log reports about speed and memory: achieved TFLOP/s, MFU against the device's peak,
and the peak memory of this process.

The FLOP count is the model's own (model_zoo.flops_per_token); this module only turns it into rates. The
peak table holds dense (no sparsity) vendor figures per precision; a CPU has no entry (its peak depends
on the part, the cores and the vector units), so MFU there needs `train.peak_tflops`.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import torch

#: Dense peak TFLOP/s per device family and train.precision (vendor data sheets, SXM parts). fp32 is the
#: plain FP32 pipe (torch does not use TF32 for fp32 matmuls unless told to).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp32": 67.0},
    "H100": {"bf16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp32": 19.5},
}


def device_peak_tflops(device: torch.device | str, precision: str, override: float | None = None) -> float | None:
    """The peak used for MFU: `override` (train.peak_tflops) if given, else the table's entry for a CUDA
    device's name, else None (MFU is then not reported)."""
    if override is not None:
        return override
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for family, peaks in PEAK_TFLOPS.items():
        if family in name:
            return peaks.get(precision)
    return None


def peak_memory_bytes(device: torch.device | str) -> int:
    """The high-water mark of this process: allocated device memory on CUDA (torch's caching allocator),
    the resident set size on the CPU (ru_maxrss: KiB on Linux, bytes on macOS)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


@dataclass(frozen=True)
class Throughput:
    """FLOPs of one token and how many devices share them, to turn a token rate into per-device rates. Per
    token, not per step: under a batch rampup (train.batch_rampup) steps differ in size."""

    flops_per_token: float
    """Model FLOPs of one trained token (model_zoo.flops_per_token: forward and backward)."""
    devices: int
    """Devices the step runs on (world size; 1 in a single process, which simulates every stage and replica)."""
    peak_tflops: float | None
    """Per-device peak (device_peak_tflops); None: MFU is not reported."""

    def tflops_per_device(self, tokens_per_s: float) -> float:
        return self.flops_per_token * tokens_per_s / self.devices / 1e12

    def mfu(self, tokens_per_s: float) -> float | None:
        if self.peak_tflops is None:
            return None
        return self.tflops_per_device(tokens_per_s) / self.peak_tflops
