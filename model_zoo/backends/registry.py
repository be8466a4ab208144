"""Probe, choose and apply a layer backend (see the package docstring for the policy)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from model_zoo.backends.kernels import GPU_EXTRAS_HINT, try_import

BACKENDS = ("local", "te", "mcore")
Log = Callable[[str], None]


class BackendError(ValueError):
    """A backend that cannot run here by configuration (a GPU-only backend on the CPU)."""


@dataclass(frozen=True)
class BackendProbe:
    name: str
    available: bool
    reason: str
    """Why not, with the fix (empty when available)."""
    module: Any = None
    """What the swap functions need: transformer_engine.pytorch for te, megatron.core for mcore."""


def probe_backend(name: str, device: torch.device | str = "cuda") -> BackendProbe:
    """Whether `name` can run on `device`, without changing anything."""
    device = torch.device(device)
    if name not in BACKENDS:
        raise BackendError(f"train.backend={name!r} is not a backend; choose one of {', '.join(BACKENDS)}")
    if name == "local":
        return BackendProbe(name, True, "")
    if device.type != "cuda":
        return BackendProbe(name, False, f"train.backend={name} runs only on CUDA devices, but the device is "
                                         f"{device}; use train.backend=local on the CPU, or train.device=cuda")
    if not torch.cuda.is_available():
        return BackendProbe(name, False, f"train.backend={name} needs CUDA, but torch.cuda.is_available() is "
                                         "False (a CPU build of torch, or no visible GPU)")
    package = {"te": "transformer_engine.pytorch", "mcore": "megatron.core"}[name]
    module, why = try_import(package)
    if module is None:
        return BackendProbe(name, False, f"train.backend={name} needs {package.split('.')[0]}, which is not "
                                         f"importable ({why}); {GPU_EXTRAS_HINT}")
    return BackendProbe(name, True, "", module)


def apply_backend(model: nn.Module, name: str, device: torch.device | str, log: Log = print) -> str:
    """Swap `model`'s layers for backend `name` in place; returns the backend in effect.

    Raises BackendError for a GPU-only backend on a non-CUDA device; falls back to "local" (and says
    so through `log`) when the backend's package is missing or CUDA is unavailable at run time."""
    device = torch.device(device)
    if name != "local" and device.type != "cuda":
        raise BackendError(probe_backend(name, device).reason)
    probe = probe_backend(name, device)
    if not probe.available:
        log(f"{probe.reason}. Falling back to train.backend=local (same results, slower).")
        return "local"
    if name == "te":
        from model_zoo.backends.te import swap_to_te

        swapped = swap_to_te(model, probe.module)
    elif name == "mcore":
        from model_zoo.backends.mcore import swap_to_mcore

        swapped = swap_to_mcore(model, log)
    else:
        return "local"
    log(f"train.backend={name}: {_summary(swapped)}")
    return name


def _summary(swapped: dict[str, int]) -> str:
    done = ", ".join(f"{n} {kind}" for kind, n in swapped.items() if n)
    return f"swapped {done}" if done else "nothing to swap in this model (all layers stay local)"


def compile_blocks(model: nn.Module) -> int:
    """torch.compile every transformer block in place (nn.Module.compile keeps parameter names, unlike
    torch.compile(module), whose wrapper prefixes them with `_orig_mod.`). One graph per block type is
    reused by all blocks of that type; a pipeline stage compiles only its own blocks. Returns the count."""
    count = 0
    for layer in getattr(model, "layers", []):
        if isinstance(layer, nn.Identity):  # a block another pipeline stage owns
            continue
        layer.compile()
        count += 1
    return count


def prepare_model(model: nn.Module, *, backend: str, compile: bool, device: torch.device | str,
                  log: Log = print) -> str:
    """apply_backend, then (train.compile) compile_blocks. Call before building the optimizer."""
    used = apply_backend(model, backend, device, log)
    if compile:
        log(f"train.compile=true: compiling {compile_blocks(model)} transformer blocks on first use")
    return used
