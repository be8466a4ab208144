"""Activation recomputation (train.recompute = none | selective | full, one value or one per stage).

    full       each transformer block keeps only its input; its forward is replayed in the backward
    selective  each block's token mixer (attention or Gated DeltaNet) is replayed; the MLP/MoE keeps its
               activations. Megatron's selective recomputes the attention core only (softmax(QK^T)V);
               ours takes the whole mixer because the pure-PyTorch GDN chunk form holds O(T * chunk)
               intermediates per head there, and replaying its projections is cheap next to that.

Both use torch.utils.checkpoint's non-reentrant form, which replays the forward with the Parameters
as they are when the backward runs. Under 2BW the engine points the Parameters at the version the
microbatch's forward read before it runs that microbatch's backward (StageEngine._backward -> _use), so
the replay reads the stashed version. The router state a forward reads that is not a Parameter (the
aux-loss-free `expert_bias`, versioned by the engine only for forwards) is captured at the forward and
put back for the replay; the replay's router bookkeeping (`step_load`, `last_*` logging) is undone, so a
microbatch counts once. Same kernels in the same order: the gradients are bit-identical to no
recomputation.

Wrapping replaces the module's `forward` on the instance: parameter names, hooks (TP regions) and
state_dict keys stay the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from torch import nn
from torch.utils.checkpoint import checkpoint

from asyncpp.core.partition import stage_layer_ranges

MODES = ("none", "selective", "full")
_WRAPPED = "_asyncpp_recompute"


def modes_per_layer(recompute: str | Sequence[str], num_layers: int, num_stages: int,
                    stage_layers: Sequence[int] | None = None) -> list[str]:
    """train.recompute (one mode, or one per pipeline stage) -> the mode of every layer of the model."""
    if isinstance(recompute, str):
        return [recompute] * num_layers
    if len(recompute) != num_stages:
        raise ValueError(f"train.recompute={list(recompute)} gives {len(recompute)} modes for parallel.pp="
                         f"{num_stages} stages; give one mode per stage, or a single mode for all")
    modes = ["none"] * num_layers
    for mode, layers in zip(recompute, stage_layer_ranges(num_layers, num_stages, stage_layers)):
        for i in layers:
            modes[i] = mode
    return modes


def apply_recompute(model: nn.Module, modes: Sequence[str]) -> int:
    """Wrap the blocks (full) or their mixers (selective) of `model.layers` in place; layers a pipeline
    stage does not own (nn.Identity) are skipped. Returns how many modules were wrapped."""
    wrapped = 0
    for layer, mode in zip(model.layers, modes, strict=True):
        if mode not in MODES:
            raise ValueError(f"train.recompute mode {mode!r} is not one of {MODES}")
        if mode == "none" or isinstance(layer, nn.Identity):
            continue
        target = layer if mode == "full" else layer.mixer
        if getattr(target, _WRAPPED, False):
            raise ValueError("apply_recompute was already applied to this model; apply it once")
        _wrap(target)
        wrapped += 1
    return wrapped


def _wrap(module: nn.Module) -> None:
    inner = module.forward  # the bound class forward; nn.Module.__call__ (and its hooks) stay outside
    routers = [m for m in module.modules() if hasattr(m, "expert_bias") and hasattr(m, "step_load")]

    def forward(*args, **kwargs):
        replay = _RouterReplay(routers)
        return checkpoint(inner, *args, use_reentrant=False, context_fn=replay.contexts, **kwargs)

    module.forward = forward
    setattr(module, _WRAPPED, True)


class _RouterReplay:
    """The router state of one checkpointed forward: what it read, put back for its replay."""

    def __init__(self, routers: list[nn.Module]) -> None:
        self.routers, self.bias = routers, []

    def contexts(self):
        return self._forward(), self._replay()

    @contextlib.contextmanager
    def _forward(self):
        self.bias = [r.expert_bias.clone() if r.expert_bias is not None else None for r in self.routers]
        yield

    @contextlib.contextmanager
    def _replay(self):
        saved = [(r.expert_bias.clone() if r.expert_bias is not None else None,
                  r.step_load.clone() if r.step_load is not None else None, r.last_aux_loss, r.last_expert_load)
                 for r in self.routers]
        for r, bias in zip(self.routers, self.bias):
            if bias is not None:
                r.expert_bias.copy_(bias)
        try:
            yield
        finally:
            for r, (bias, load, aux, expert_load) in zip(self.routers, saved):
                if bias is not None:
                    r.expert_bias.copy_(bias)
                if load is not None:
                    r.step_load.copy_(load)
                r.last_aux_loss, r.last_expert_load = aux, expert_load
