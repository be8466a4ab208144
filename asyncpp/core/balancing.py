"""Versioned router-balancing state: the auxiliary-loss-free bias of MoE routers (semantics.md).

The bias is not a gradient-trained parameter but it changes every step, so the delayed-update rule
applies to it as to the weights: the microbatches of b_t read the bias of the weight version they run
on (x_{t-1} in 2BW), and the update of step t moves it, with b_t's expert loads, at the same moment
as the weights: bias(x_{t+1}) = bias(x_t) + rate * sign(mean(load_t) - load_t).

Written here (not in a library) because it is part of the staleness contract. Routers are duck-typed
(model_zoo.moe.MoE): `expert_bias` [E] buffer, `pop_step_load()` -> [E] assignments since the last
call, `update_bias(load)` applying the sign rule in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from asyncpp.core.stateful import load_in_place


def balanced_routers(model: nn.Module) -> dict[str, nn.Module]:
    """Modules (by name) whose router carries an aux-loss-free bias."""
    return {name: m for name, m in model.named_modules()
            if getattr(m, "expert_bias", None) is not None and hasattr(m, "pop_step_load")}


class RouterBiasVersions:
    """Bias versions of every balanced router of one stage (or of the whole model in the simulator).

    Version v is the bias belonging to weights x_v. Only `num_buffers` versions are kept, like the
    weights. use() copies a version into the routers (E floats per layer: a copy is cheaper than a
    storage swap's bookkeeping and keeps the module's buffer the one object hooks and checkpoints see).
    """

    def __init__(self, routers: dict[str, nn.Module], num_buffers: int):
        self.routers = routers
        self.names = list(routers)
        self.num_buffers = max(1, num_buffers)
        self.versions: dict[int, list[Tensor]] = {0: [m.expert_bias.detach().clone() for m in routers.values()]}
        self.loads: dict[int, list[Tensor]] = {}

    def __bool__(self) -> bool:
        return bool(self.routers)

    @property
    def newest(self) -> int:
        return max(self.versions)

    @torch.no_grad()
    def use(self, version: int | Sequence[int]) -> None:
        """Put the bias of `version` (one per router, or one for all) into the routers. Versions before
        the oldest held are the oldest (x_{-k} := x_0, the pipeline warm-up)."""
        per_router = [version] * len(self.names) if isinstance(version, int) else list(version)
        for m, v, i in zip(self.routers.values(), per_router, range(len(self.names))):
            m.expert_bias.copy_(self.versions[max(min(v, self.newest), min(self.versions))][i])

    def record(self, step: int) -> None:
        """After a forward of b_`step`: move the routers' counted loads into that step's sum."""
        loads = [m.pop_step_load() for m in self.routers.values()]
        mine = self.loads.get(step)
        self.loads[step] = loads if mine is None else [a + b for a, b in zip(mine, loads)]

    def discard(self) -> None:
        """Drop loads counted by forwards that are not part of training (diagnostics, evaluation)."""
        for m in self.routers.values():
            m.pop_step_load()

    def pop_loads(self, step: int) -> list[Tensor]:
        """b_`step`'s loads (this rank's; a caller sums them over data-parallel replicas)."""
        loads = self.loads.pop(step, None)
        return loads if loads is not None else [torch.zeros(m.expert_bias.shape, dtype=torch.int64, device=m.expert_bias.device)
                                             for m in self.routers.values()]

    @torch.no_grad()
    def update(self, step: int, loads: Sequence[Tensor], apply: bool = True) -> None:
        """bias(x_{step+1}) from bias(x_step) and b_step's global loads; `apply=False` (a skipped step)
        carries the bias over unchanged, as the weights are."""
        self.use(step)
        if apply:
            for m, load in zip(self.routers.values(), loads):
                m.update_bias(load)
        self.versions[step + 1] = [m.expert_bias.detach().clone() for m in self.routers.values()]
        for old in [v for v in self.versions if v <= step + 1 - self.num_buffers]:
            del self.versions[old]
        self.use(step + 1)

    # ---- Stateful (torch.distributed.checkpoint.stateful): the same ages as the weights ---------------
    def state_dict(self) -> dict[str, Tensor]:
        """{"balancing/<age>/<router name>": bias} for every held version (age 0 = newest); a load writes them in
        place."""
        out = {}
        for v, biases in self.versions.items():
            out.update({f"balancing/{self.newest - v}/{n}": b for n, b in zip(self.names, biases)})
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Take `state`'s biases (in place already for the tensors state_dict() gave); the routers then hold the
        newest version's."""
        mine = self.state_dict()
        load_in_place([mine[k] for k in mine], [state.get(k) for k in mine])
        self.use(self.newest)

    def expect(self, newest: int, ages: Sequence[int]) -> None:
        """Before a load: fresh buffers for versions newest-age, which state_dict() then offers the load."""
        self.versions = {newest - a: [torch.empty_like(m.expert_bias) for m in self.routers.values()] for a in ages}
        self.loads.clear()


class RouterLoadStats:
    """Each step's per-layer router health for the metrics: the expert load (busiest expert / mean, 1.0 =
    balanced, counts summed over the step's microbatches) and the un-weighted balancing loss (mean over the
    step's microbatches).

    Routers expose `last_expert_load` and `last_aux_loss`, those of their last forward. The values travel as
    two slots per layer of the whole model (loads, then losses) in the engine's gradient-norm all-reduce (no
    extra collective): a stage fills its own layers' slots on the rank that counts (`counted`: TP rank 0, EP
    rank 0) and leaves zeros elsewhere. The simulator builds the same vector, so both log the same numbers.
    """

    def __init__(self, routers: dict[int, nn.Module], num_layers: int, counted: bool = True,
                 model_has_routers: bool | None = None):
        self.routers, self.num_layers, self.counted = routers, num_layers, counted
        self.model_has_routers = bool(routers) if model_has_routers is None else model_has_routers
        self.counts: dict[int, dict[int, Tensor]] = {}
        self.aux: dict[int, dict[int, list[Tensor]]] = {}

    @classmethod
    def of(cls, model: nn.Module, counted: bool = True) -> RouterLoadStats:
        """The routers of `model`'s layers (a pipeline stage's Identity layers have none). Whether the stats
        exist at all is the whole model's property (its config has `moe`), not the stage's: every stage sends
        the same vector in the norm all-reduce, a stage with no MoE layer (0 layers) zeros (issue 21)."""
        layers = getattr(model, "layers", [])
        routers = {i: layer.mlp for i, layer in enumerate(layers)
                   if hasattr(getattr(layer, "mlp", None), "last_expert_load")}
        moe = getattr(getattr(model, "config", None), "moe", None) is not None
        return cls(routers, len(layers), counted, model_has_routers=bool(routers) or moe)

    def __bool__(self) -> bool:
        """Whether the vector exists (then of the same length on every stage of the model)."""
        return self.model_has_routers

    def record(self, step: int) -> None:
        mine, aux = self.counts.setdefault(step, {}), self.aux.setdefault(step, {})
        for i, m in self.routers.items():
            load = m.last_expert_load
            if load is not None:
                mine[i] = load.double() if i not in mine else mine[i] + load.double()
            if getattr(m, "last_aux_loss", None) is not None:
                aux.setdefault(i, []).append(m.last_aux_loss.double())

    def vector(self, step: int, device: torch.device) -> Tensor:
        """[num_layers load ratios, num_layers mean balancing losses] of `step` (zeros where not counted here)."""
        out = torch.zeros(2 * self.num_layers, dtype=torch.float64, device=device)
        counts, aux = self.counts.pop(step, {}), self.aux.pop(step, {})
        if self.counted:
            for i, load in counts.items():
                out[i] = load.max() / load.mean().clamp(min=1e-9)
            for i, losses in aux.items():
                out[self.num_layers + i] = torch.stack(losses).mean()
        return out

    @staticmethod
    def as_metrics(values: Sequence[float]) -> dict[str, float]:
        """vector() -> {"moe/layer{i}/load_max_over_mean", "moe/load_max", "moe/load_mean", "moe/aux_loss"}
        (MoE layers only; moe/aux_loss is the mean over MoE layers of the step's mean balancing loss)."""
        half = len(values) // 2
        loads, aux = values[:half], values[half:]
        layers = {i: v for i, v in enumerate(loads) if v > 0}
        if not layers:
            return {}
        out = {f"moe/layer{i}/load_max_over_mean": v for i, v in layers.items()}
        out["moe/load_max"] = max(layers.values())
        out["moe/load_mean"] = sum(layers.values()) / len(layers)
        out["moe/aux_loss"] = sum(aux[i] for i in layers) / len(layers)
        return out
