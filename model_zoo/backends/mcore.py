"""train.backend=mcore: megatron-core's fused kernels in the local modules, on the very same Parameters.

What is swapped: every SwiGLU (dense MLPs, MoE shared experts) computes silu(gate) * up with
megatron-core's fused SwiGLU (one GEMM on the concatenated gate/up weights, then mcore's fused
activation, which saves only its input for the backward); every model_zoo RMSNorm becomes NVIDIA apex's
FusedRMSNorm when apex is importable (the norm megatron-core itself uses without TE).

What is not: megatron-core's TransformerLayer, attention and linear layers read its global
parallel_state (tensor/pipeline groups initialised by megatron), which asyncpp deliberately does not
have (its Mesh passes groups explicitly); adopting them needs a parallel_state shim, pending. For fused
attention and GEMMs use train.backend=te.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model_zoo.backends.kernels import APEX_HINT, apex_fused_rms_norm, try_import
from model_zoo.layers import RMSNorm, SwiGLU


class McoreSwiGLU(nn.Module):
    """down(swiglu([gate; up] x)) with megatron-core's fused activation; holds the local SwiGLU's own
    gate_proj/up_proj/down_proj (same Parameters, same names)."""

    def __init__(self, local: SwiGLU, fused: Callable[[Tensor, None], Tensor]) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = local.gate_proj, local.up_proj, local.down_proj
        self._fused = fused

    def forward(self, x: Tensor) -> Tensor:
        # One GEMM for both halves; mcore's swiglu splits its input in two along the last dim: [gate | up].
        y = F.linear(x, torch.cat((self.gate_proj.weight, self.up_proj.weight), dim=0))
        return self.down_proj(self._fused(y, None))

    def init_weights(self, std: float, out_std: float) -> None:
        SwiGLU.init_weights(self, std, out_std)  # same attribute names


@torch.no_grad()
def apex_rms_norm(local: RMSNorm, cls: type) -> nn.Module:
    new = cls(local.weight.numel(), eps=local.eps).to(device=local.weight.device, dtype=local.weight.dtype)
    new.weight.copy_(local.weight)
    return new


def fused_swiglu() -> Callable | None:
    module, _ = try_import("megatron.core.fusions.fused_bias_swiglu")
    return getattr(module, "bias_swiglu_impl", None) if module is not None else None


def swap_to_mcore(model: nn.Module, log: Callable[[str], None] = print,
                  swiglu: Callable | None = None, rms_norm: type | None = None) -> dict[str, int]:
    """Swap in place (see module docstring); returns counts per kind. `swiglu` / `rms_norm` default to
    the probed megatron-core / apex implementations (parameters for tests)."""
    swiglu = swiglu or fused_swiglu()
    rms_norm = rms_norm or apex_fused_rms_norm()
    if swiglu is None:
        log("train.backend=mcore: megatron.core.fusions.fused_bias_swiglu is not importable; SwiGLUs stay local")
    if rms_norm is None:
        log(f"train.backend=mcore: apex FusedRMSNorm is not importable, RMSNorms stay local ({APEX_HINT})")
    counts = {"fused swiglu": 0, "apex rmsnorm": 0}
    replacements: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in list(model.modules()):
        for attr, child in parent.named_children():
            if swiglu is not None and isinstance(child, SwiGLU):
                replacements.append((parent, attr, McoreSwiGLU(child, swiglu)))
                counts["fused swiglu"] += 1
            elif rms_norm is not None and isinstance(child, RMSNorm):
                replacements.append((parent, attr, apex_rms_norm(child, rms_norm)))
                counts["apex rmsnorm"] += 1
    for parent, attr, new in replacements:
        setattr(parent, attr, new)
    return counts
