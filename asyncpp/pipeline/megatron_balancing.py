"""megatron-core's aux-loss-free router balancing under the 2BW front-end (issue 43).

With `moe_router_enable_expert_bias=True` megatron's TopKRouter adds its `expert_bias` buffer to the routing scores
and counts each expert's tokens in `local_tokens_per_expert` during training forwards (router.py
`_apply_expert_bias`); megatron moves the bias in `finalize_model_grads` (`_update_router_expert_bias` ->
moe_utils.get_updated_expert_bias: the counts all-reduced over TP x CP x DP, then
bias += rate * sign(mean - count)), which a 2BW stage never calls (megatron.py, _refuse_megatron_grad_machinery).

asyncpp's pipeline and simulator already version such a bias like the weights (core/balancing.py,
RouterBiasVersions: b_t's forwards read the bias of the version they run on; the update of step t moves it with
b_t's counts, summed over DP in the gradient all-reduce). `MegatronRouterBias` gives a megatron router the
duck-typed interface RouterBiasVersions drives, so the same mechanism runs for a GPTModel: no second one.

megatron's update function is not called: it all-reduces the counts itself, over parallel_state's global group,
at a point of its own; here they ride the DP gradient all-reduce at the step the 2BW update consumes them (no new
collective), and the sign rule is applied to the already-summed counts. Summing over TP as megatron does changes
nothing without sequence parallelism (every TP rank routes the same tokens: the sum is TP x the count, the sign is
the same; megatron itself refuses MoE with TP > 1 without SP in training, moe_layer.py:381); with it each TP rank
routes its own tokens and the TP sum is missing here: refused by name
(check_router_bias), as is context parallelism (megatron sums over CP) and activation recompute (the router would
count again inside the backward, after the step's counts were taken).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class MegatronRouterBias:
    """One megatron TopKRouter in RouterBiasVersions' router interface: `expert_bias` (the router's own buffer,
    so a version copied in is what its forward reads), `pop_step_load()` and `update_bias(load)`."""

    def __init__(self, router: nn.Module, rate: float):
        self.router, self.rate = router, rate

    @property
    def expert_bias(self) -> Tensor:
        return self.router.expert_bias

    @torch.no_grad()
    def pop_step_load(self) -> Tensor:
        """This rank's tokens per expert since the last call (megatron counts them only with grad enabled: training
        forwards, not evaluation); the counter restarts at zero, as megatron's reset_model_temporary_tensors does."""
        load = self.router.local_tokens_per_expert.clone()
        self.router.local_tokens_per_expert.zero_()
        return load

    @torch.no_grad()
    def update_bias(self, load: Tensor) -> None:
        """moe_utils.get_updated_expert_bias's rule on counts already summed over the replicas."""
        load = load.to(device=self.expert_bias.device, dtype=torch.float32)
        average = load.sum() / load.numel()
        self.expert_bias.add_(torch.sign(average - load) * self.rate)


def megatron_balanced_routers(model: nn.Module) -> dict[str, MegatronRouterBias]:
    """The routers of `model` (a stage's GPTModel, any wrapper) with megatron's expert bias on, by their MoE layer's
    name in the unsplit model: a stage numbers its layers from 0, their `layer_number` is global (so the stages'
    names are distinct in a checkpoint, and `<name>.router.weight` is the router's weight in the unsplit model, the
    simulator's convention)."""
    out = {}
    for name, layer in model.named_modules():
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if getattr(router, "enable_expert_bias", False) and router.expert_bias is not None:
            layers = name.rsplit(".", 1)[0]  # "decoder.layers" (behind any wrapper's prefix)
            out[f"{layers}.{layer.layer_number - 1}.mlp"] = MegatronRouterBias(
                router, router.config.moe_router_bias_update_rate)
    return out


def check_router_bias(config) -> None:
    """Refuse, by name, what the bias update here does not sum as megatron does (module docstring)."""
    if not getattr(config, "moe_router_enable_expert_bias", False):
        return
    if config.sequence_parallel and config.tensor_model_parallel_size > 1:
        raise NotImplementedError("moe_router_enable_expert_bias=True with sequence_parallel=True: each TP rank "
                                  "routes its own tokens and their counts would have to be summed over TP, which the "
                                  "2BW front-end does not do yet; turn one of them off")
    recompute = getattr(config, "recompute_granularity", None)
    if recompute:  # (any granularity: whether a selective one recomputes the router is megatron's to decide)
        raise NotImplementedError(f"moe_router_enable_expert_bias=True with recompute_granularity={recompute!r}: "
                                  "megatron's router counts its tokens in a recomputed forward (inside the "
                                  "backward), which the 2BW step's counts (taken after each forward) would miss")
    if getattr(config, "context_parallel_size", 1) > 1:
        raise NotImplementedError(f"moe_router_enable_expert_bias=True with context_parallel_size="
                                  f"{config.context_parallel_size}: the counts would have to be summed over CP")
