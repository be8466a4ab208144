"""A rank's share of a checkpoint (StageState) as DCP's layout-free keys, both ways: the flat dict a save
writes (and the non-finite check reads), and the optimizer state a load allocates and installs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from asyncpp.optim.build import AnyOptimizer
from asyncpp.train.checkpoint.runtime import my_rank


@dataclass
class StageState:
    """What one rank contributes to a checkpoint (and receives on load), by full-model name."""

    names: list[str]
    versions: dict[int, list[Tensor]]
    """age -> tensors in `names` order; written in place on load."""
    buffers: dict[str, list[Tensor | None]]
    """Per-parameter state besides weights and optimizer: {"ef": u_{t-1}, "gef": g_{t-1}}. None where another
    rank holds it (the distributed optimizer: the parameter's owner saves it, under the same key)."""
    optimizer: object
    """An OptimizerSet (or torch optimizer) whose params are `opt_params`."""
    opt_params: list[Tensor | None]
    """Per name: the tensor the optimizer steps (its master); None where another rank holds the master."""
    shards: list[Shard | None] | None = None
    """Per name: how this rank's tensor is a piece of the full one (TP/EP), None = the whole tensor."""
    extra: dict[str, Tensor] | None = None
    """Other named state, whole on every rank that holds it (versioned router biases); filled in place."""
    copies: dict[int, list[bool]] | None = None
    """age -> per name: this rank's tensor is a compute-dtype copy of an fp32 master another rank holds (the
    distributed optimizer under bf16). Not saved from here (the owner saves the master under the same key,
    so no key has writers of two dtypes); loaded all the same: DCP copies the saved fp32 values into the
    bf16 tensor, which is the owner's own cast, bit for bit."""
    mirrors: list[bool] | None = None
    """Per name: this rank's tensors of it (every age, buffers, optimizer state) are rows of a tensor another rank
    holds whole and saves (a tied embedding's rows of a vocabulary-parallel head): not saved from here, loaded by
    their global offsets like any piece."""


Shard = Callable[[Tensor], Tensor]
"""Wraps a rank's local piece as a DTensor over its TP/EP submesh, sharing its storage: DCP then saves
and loads global tensors (layout-free keys), and reshards when the layout changes."""


def global_view(state: StageState, i: int, t: Tensor) -> Tensor:
    shard = state.shards[i] if state.shards is not None else None
    return t if shard is None else shard(t)


def inner_optimizers(optimizer: AnyOptimizer) -> list[torch.optim.Optimizer]:
    inner = getattr(optimizer, "optimizers", None)
    return list(inner.values()) if isinstance(inner, dict) else [optimizer]


def _optimizer_tensors(state: StageState, wrap: bool = True) -> dict[str, Tensor]:
    index_of = {id(p): i for i, p in enumerate(state.opt_params)}
    out = {}
    for opt in inner_optimizers(state.optimizer):
        for p, st in opt.state.items():
            i = index_of[id(p)]
            for key, value in st.items():
                if not isinstance(value, Tensor):
                    value = torch.tensor(value)
                whole = wrap and value.shape == p.shape
                out[_optim_key(state, i, key, value)] = global_view(state, i, value) if whole else value
    return out


def _optim_key(state: StageState, i: int, key: str, value: Tensor) -> str:
    """State shaped like its parameter is sharded like it. Other tensors of a sharded parameter (e.g.
    SOAP's preconditioners of the local block) differ per shard: they are keyed per rank, and only
    a resume with the same TP/EP layout finds them."""
    sharded = state.shards is not None and state.shards[i] is not None
    own = value.dim() > 0 and value.shape != state.opt_params[i].shape and sharded
    suffix = f"/rank{my_rank()}" if own else ""
    return f"optim/{state.names[i]}/{key}{suffix}"


def flat_state(state: StageState, wrap: bool = True) -> dict[str, Tensor]:
    """Checkpoint key -> tensor; `wrap=False` keeps this rank's local pieces (no DTensor views)."""
    def view(i: int, t: Tensor) -> Tensor:
        return global_view(state, i, t) if wrap else t

    flat = {}
    mirror = state.mirrors or [False] * len(state.names)
    for age, tensors in state.versions.items():
        copy = (state.copies or {}).get(age) or [False] * len(tensors)
        flat.update({f"weights/{age}/{n}": view(i, t) for i, (n, t) in enumerate(zip(state.names, tensors))
                     if not copy[i] and not mirror[i]})
    for kind, tensors in state.buffers.items():
        flat.update({f"{kind}/{n}": view(i, t) for i, (n, t) in enumerate(zip(state.names, tensors))
                     if t is not None and not mirror[i]})
    mirrored = {f"optim/{n}/" for n, m in zip(state.names, mirror) if m}
    flat.update({k: t for k, t in _optimizer_tensors(state, wrap).items()
                 if not any(k.startswith(prefix) for prefix in mirrored)})
    flat.update(state.extra or {})
    return flat


def _finite_flags(tensors: Sequence[Tensor]) -> list[bool]:
    """Per tensor: no element is NaN or infinite. One reduction per tensor and one host sync for the lot: a NaN or
    an infinity anywhere makes the tensor's sum non-finite, and the sum reads the tensor once where isfinite(t)
    writes a bool tensor as large as t first (20x slower on a CPU for fp32: bench/checkpoint_write.py's state spent
    40 of its 50 s of save() there). A sum that overflows although every element is finite (values near the
    dtype's largest) is checked element by element before it counts as non-finite."""
    if not tensors:
        return []
    flags = torch.stack([torch.isfinite(t.sum()).all() for t in tensors]).tolist()
    return [ok or bool(torch.isfinite(t).all()) for t, ok in zip(tensors, flags)]


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """True if no element of `tensors` is NaN or infinite. One host sync for the lot (not one per tensor);
    integer tensors are finite by definition. Local: no collective."""
    return all(_finite_flags([t for t in tensors if t.is_floating_point() or t.is_complex()]))


def nonfinite_tensors(state: StageState) -> list[str]:
    """The checkpoint keys of this rank's tensors that hold a NaN or an infinity (weights of every age,
    Error-Feedback buffers, optimizer state, router biases); [] when the state may be saved. Local: no
    collective; save() agrees on it over all ranks."""
    flat = {k: t for k, t in flat_state(state, wrap=False).items() if t.is_floating_point() or t.is_complex()}
    return [k for k, ok in zip(flat, _finite_flags(list(flat.values()))) if not ok]


def allocate_optimizer_state(state: StageState, saved: dict) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Local buffers for every saved optimizer tensor of this rank's parameters, and what to ask DCP
    for (the same buffers, wrapped as global DTensors where the parameter is sharded)."""
    local, request = {}, {}
    weights = state.versions[min(state.versions)]
    stepped = _stepped(state)
    for i, (name, p) in enumerate(zip(state.names, state.opt_params)):
        if id(p) not in stepped:  # the distributed optimizer: another DP rank owns this parameter's state
            continue
        prefix = f"optim/{name}/"
        full_shape = tuple(global_view(state, i, weights[i]).shape)
        for key, meta in saved.items():
            if not key.startswith(prefix) or "/rank" in key[len(prefix):] and not key.endswith(f"/rank{my_rank()}"):
                continue
            if tuple(meta.size) == full_shape and full_shape != tuple(p.shape):
                buf = torch.empty(p.shape, dtype=meta.properties.dtype, device=p.device)
                local[key], request[key] = buf, global_view(state, i, buf)
            else:
                local[key] = request[key] = torch.empty(meta.size, dtype=meta.properties.dtype, device=p.device)
    return local, request


def _stepped(state: StageState) -> set[int]:
    """Ids of the parameters this rank's optimizer steps (under the distributed optimizer, its share)."""
    return {id(p) for opt in inner_optimizers(state.optimizer) for g in opt.param_groups for p in g["params"]}


def install_optimizer_state(state: StageState, tensors: dict[str, Tensor]) -> None:
    by_name = dict(zip(state.names, state.opt_params))
    owner = {id(p): opt for opt in inner_optimizers(state.optimizer) for g in opt.param_groups for p in g["params"]}
    for key, value in tensors.items():
        _, name, field = key.split("/", 2)
        field = field.split("/rank")[0]
        p = by_name[name]
        opt = owner[id(p)]
        # fused/foreach AdamW keep `step` as a float32 tensor on the params' device: keep its form
        opt.state[p][field] = value.to(p.device)
