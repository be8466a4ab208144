"""Optional fused kernels, each probed once: flash-linear-attention (Gated DeltaNet), NVIDIA apex, and the
GPU's compute capability (which torch._grouped_mm needs for the MoE experts).

Nothing here is required: every caller keeps a pure-PyTorch path for when a probe returns None. This
module imports nothing from model_zoo, so model_zoo's own layers can import it without a cycle.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

GPU_EXTRAS_HINT = "install the GPU extras: pip install -e .[gpu]"
APEX_HINT = ("build NVIDIA apex from source (https://github.com/NVIDIA/apex); never `pip install apex`, "
             "which is an unrelated PyPI package")


def try_import(module: str) -> tuple[Any | None, str]:
    """(module, "") or (None, why): any exception counts, since GPU packages can fail at import time for
    reasons other than absence (a CUDA/driver mismatch, a missing shared library)."""
    try:
        return importlib.import_module(module), ""
    except Exception as e:  # noqa: BLE001 - reported to the user verbatim
        return None, f"{type(e).__name__}: {e}"


@functools.cache
def cuda_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device, asked once per device."""
    return torch.cuda.get_device_capability(device)


@functools.cache
def _fla() -> tuple[Callable | None, str]:
    """(flash-linear-attention's fused chunk_gated_delta_rule, "") or (None, why).

    Importable is not enough: some FLA versions refuse at their first *backward* on some GPUs (FLA 0.6 with
    Triton < 3.7.1 on Hopper raises "produces incorrect results for gated chunk_bwd_dqkwg", seen on an H200),
    which would crash a run at its first step. So on a CUDA machine the kernel runs one tiny forward and
    backward here, once, and a failure falls back to the PyTorch form with the reason in `fla_status()`."""
    ops, why = try_import("fla.ops.gated_delta_rule")
    fused = getattr(ops, "chunk_gated_delta_rule", None) if ops is not None else None
    if fused is None:
        return None, why or "no chunk_gated_delta_rule"
    if torch.cuda.is_available():
        try:
            _probe(fused, torch.device("cuda", torch.cuda.current_device()))
        except Exception as e:  # noqa: BLE001 - the reason is reported by fla_status() and the GPU tests
            return None, (f"its kernel failed a forward+backward probe on {torch.cuda.get_device_name()}: "
                          f"{type(e).__name__}: {str(e)[:300]}")
    return fused, ""


def _probe(fused: Callable, device: torch.device) -> None:
    # The first GDN forward may run under no_grad or inference mode (an evaluation first, a test's forward):
    # the probe's backward needs autograd whatever its caller's mode (seen on the H200: "element 0 of tensors
    # does not require grad" reported as the kernel's failure).
    with torch.inference_mode(False), torch.enable_grad():
        b, t, h, d = 1, 64, 1, 64  # one chunk of FLA's fixed size 64
        q, k, v = (torch.randn(b, t, h, d, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        g = -torch.rand(b, t, h, device=device)
        beta = torch.rand(b, t, h, device=device)
        o, _ = fused(q, torch.nn.functional.normalize(k.float(), dim=-1).to(k.dtype), v, g, beta,
                     output_final_state=False)
        o.float().sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fla_chunk_gated_delta_rule() -> Callable | None:
    """flash-linear-attention's fused chunk_gated_delta_rule (Triton, CUDA only), or None if it is not
    importable or failed its probe on this GPU (`fla_status()` says why)."""
    return _fla()[0]


def fla_status() -> str:
    fused, why = _fla()
    if fused is not None:
        return "flash-linear-attention: available (Gated DeltaNet uses its fused kernel on CUDA for bf16)"
    return f"flash-linear-attention: unavailable ({why}); {GPU_EXTRAS_HINT}"


@functools.cache
def apex_fused_rms_norm() -> type | None:
    """apex.normalization.FusedRMSNorm, or None. Only NVIDIA's apex has it (see APEX_HINT)."""
    norm, _ = try_import("apex.normalization")
    return getattr(norm, "FusedRMSNorm", None) if norm is not None else None
