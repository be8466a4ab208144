"""Selectable layer implementations (train.backend) for model_zoo models, plus torch.compile.

    local   PyTorch + SDPA: the model_zoo modules as built (default; the reference everywhere)
    te      transformer-engine: te.Linear projections, te.RMSNorm, te.DotProductAttention (CUDA only)
    mcore   megatron-core's fused SwiGLU (and apex's FusedRMSNorm where importable) (CUDA only)

A backend *swaps modules in place and adopts their weights*, keeping every parameter name (so
checkpoints, the Muon/AdamW split and a GPU test comparing against `local` on the same weights all
work unchanged). Swap before the optimizer is built: swapped modules own new Parameter objects.

Policy when a backend cannot be used:
* a GPU-only backend on a CPU device is an error (RunConfig.validate refuses it before anything is
  built; apply_backend raises BackendError for direct callers): a config asking for it is wrong;
* a missing package on a CUDA machine falls back to `local` with a message that names the package
  and `pip install -e .[gpu]`: the run is still correct, only slower.

Gated DeltaNet's FLA kernel is not a backend switch: it is used on CUDA whenever importable
(model_zoo/gated_deltanet.py, kernels.py). This package's __init__ stays import-light on purpose:
model_zoo's layers import kernels.py, and importing te/mcore here would make that a cycle.
"""

from model_zoo.backends.registry import (
    BACKENDS,
    BackendError,
    BackendProbe,
    apply_backend,
    compile_blocks,
    prepare_model,
    probe_backend,
)

__all__ = [
    "BACKENDS",
    "BackendError",
    "BackendProbe",
    "apply_backend",
    "compile_blocks",
    "prepare_model",
    "probe_backend",
]
