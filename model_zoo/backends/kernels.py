"""Optional fused kernels, each looked up once: flash-linear-attention (Gated DeltaNet), NVIDIA apex, and the
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
    """(flash-linear-attention's fused chunk_gated_delta_rule, "") or (None, why). Importable only: whether it is
    correct is checked per shape where a layer would use it (model_zoo/backends/fla_check.py), not here by one
    tiny probe: a probe at Dk=64 says nothing of Dk=128 (#640 is a bug of 64-wide K tiles), and it cannot see a
    wrong result at another shape (#984)."""
    ops, why = try_import("fla.ops.gated_delta_rule")
    fused = getattr(ops, "chunk_gated_delta_rule", None) if ops is not None else None
    if fused is None:
        return None, why or "no chunk_gated_delta_rule"
    return fused, ""


def fla_chunk_gated_delta_rule() -> Callable | None:
    """flash-linear-attention's fused chunk_gated_delta_rule (Triton, CUDA only), or None if it is not
    importable (`fla_status()` says why)."""
    return _fla()[0]


def fla_status() -> str:
    fused, why = _fla()
    if fused is not None:
        return ("flash-linear-attention: importable (Gated DeltaNet uses its fused kernel on CUDA for bf16 at the "
                "shapes where it passes its check: model_zoo/backends/fla_check.py)")
    return f"flash-linear-attention: unavailable ({why}); {GPU_EXTRAS_HINT}"


@functools.cache
def apex_fused_rms_norm() -> type | None:
    """apex.normalization.FusedRMSNorm, or None. Only NVIDIA's apex has it (see APEX_HINT)."""
    norm, _ = try_import("apex.normalization")
    return getattr(norm, "FusedRMSNorm", None) if norm is not None else None
