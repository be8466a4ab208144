"""Weight initialization as a pure function of (seed, parameter name, global shape, the slice held).

Modules state their scheme in `init_weights(std, out_std, init)` by calling an Initializer
(`init.normal_(w, std)`, `init.uniform_(w, lo, hi)`, `init.ones_(w)`); the Initializer decides where
the random numbers come from:

* `KeyedInit` (what build_model and the pipeline's stage build use): every parameter draws its values
  from generators seeded by hash(seed, full-model name, row block), blocks of rows of the *global*
  tensor. A rank that holds a shard (a TP column, an EP slice of experts, a vocabulary shard, or only
  the layers of its pipeline stage) draws just the row blocks its slice touches and keeps its slice,
  so every layout starts from the same full-model weights, bit for bit, and no rank ever
  materializes a tensor it does not own (at most one block of `BLOCK_ELEMENTS` extra). Values are
  drawn in fp32 on the CPU and copied to the parameter's device and dtype: a CUDA run starts from the
  CPU run's weights. Hand-written on purpose: torch's init functions draw from one stream whose
  order depends on which modules exist, i.e. on the layout.
* `GlobalRNG`: torch.nn.init on the global generator, for a standalone module (unit tests).

Elementwise transforms applied after a draw (GDN's A_log = log U[1, 16]) commute with slicing, so
they stay layout-free.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

BLOCK_ELEMENTS = 1 << 20
"""Target elements per drawn row block (4 MiB in fp32): bounds the scratch a shard needs."""


class Initializer(Protocol):
    def normal_(self, p: Tensor, std: float) -> None: ...
    def uniform_(self, p: Tensor, low: float, high: float) -> None: ...
    def ones_(self, p: Tensor) -> None: ...


class GlobalRNG:
    """torch.nn.init on the global generator (a module initialized on its own, outside a model)."""

    @torch.no_grad()
    def normal_(self, p: Tensor, std: float) -> None:
        nn.init.normal_(p, mean=0.0, std=std)

    @torch.no_grad()
    def uniform_(self, p: Tensor, low: float, high: float) -> None:
        nn.init.uniform_(p, low, high)

    @torch.no_grad()
    def ones_(self, p: Tensor) -> None:
        nn.init.ones_(p)


@dataclass(frozen=True)
class ParamSlice:
    """Where a local tensor sits in its global tensor: the global shape and, per dim, the offset
    of the local slice (its length is the local tensor's size along that dim)."""

    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    @staticmethod
    def whole(name: str, shape: Sequence[int]) -> ParamSlice:
        return ParamSlice(name, tuple(shape), (0,) * len(shape))


def block_seed(seed: int, name: str, block: int) -> int:
    """A 63-bit generator seed from (seed, name, block). hashlib, not hash(): Python salts str hashes."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def fill_slice_(out: Tensor, seed: int, where: ParamSlice, draw: Callable[[Tensor, torch.Generator], None]) -> Tensor:
    """Fill `out` (the local slice, any device and dtype) with the values the global tensor `where`
    describes has there.

    The global tensor is cut into blocks of `rows_per_block` rows along dim 0 (a function of the
    global shape only); block b is filled by `draw` (in fp32, on the CPU) from a generator seeded by
    (seed, name, b). The slice draws only the blocks its rows touch and copies its part of each into
    `out`, so the scratch is one block, never a whole tensor."""
    g_shape = where.global_shape
    gen = torch.Generator()
    if len(g_shape) == 0:  # a scalar parameter: one block
        block = torch.empty(())
        draw(block, gen.manual_seed(block_seed(seed, where.name, 0)))
        return out.copy_(block)
    rows_per_block = max(1, BLOCK_ELEMENTS // max(math.prod(g_shape[1:]), 1))
    start, stop = where.offsets[0], where.offsets[0] + out.shape[0]
    for b in range(start // rows_per_block, -(-stop // rows_per_block)):
        lo, hi = b * rows_per_block, min((b + 1) * rows_per_block, g_shape[0])
        block = torch.empty((hi - lo, *g_shape[1:]))
        draw(block, gen.manual_seed(block_seed(seed, where.name, b)))
        first, last = max(start, lo), min(stop, hi)
        piece = block[first - lo:last - lo]
        for dim in range(1, len(g_shape)):  # the slice along the other dims (a TP column shard)
            piece = piece.narrow(dim, where.offsets[dim], out.shape[dim])
        out[first - start:last - start].copy_(piece)
    return out


def draw_slice(seed: int, where: ParamSlice, local_shape: Sequence[int],
               draw: Callable[[Tensor, torch.Generator], None]) -> Tensor:
    """The local slice's values as a new fp32 CPU tensor (fill_slice_)."""
    return fill_slice_(torch.empty(tuple(local_shape)), seed, where, draw)


class KeyedInit:
    """Layout-free initialization: each parameter's values depend only on (seed, its name in the full
    model, its global shape, the slice this rank holds). `slices` maps id(parameter) to its ParamSlice;
    a tied head maps to the embedding's name, so both copies get one init."""

    def __init__(self, seed: int, slices: dict[int, ParamSlice]) -> None:
        self.seed, self.slices = seed, slices
        self.done: set[int] = set()

    @staticmethod
    def for_model(model: nn.Module, seed: int, slice_of: Callable[[str, Tensor], ParamSlice] | None = None,
                  aliases: dict[str, str] | None = None) -> KeyedInit:
        """Slices for every parameter of `model` by its full name: `slice_of(name, param)` (a sharded
        model's plan), or the whole tensor. `aliases` renames keys (a tied lm_head -> embed)."""
        aliases = aliases or {}
        slices = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            key = aliases.get(name, name)
            where = slice_of(name, p) if slice_of is not None else ParamSlice.whole(name, p.shape)
            slices[id(p)] = ParamSlice(key, where.global_shape, where.offsets)
        return KeyedInit(seed, slices)

    def _fill(self, p: Tensor, draw: Callable[[Tensor, torch.Generator], None]) -> None:
        where = self.slices.get(id(p))
        if where is None:
            raise KeyError(f"KeyedInit has no slice for a parameter of shape {tuple(p.shape)}: initialize "
                           "parameters of the model the initializer was built for (KeyedInit.for_model)")
        with torch.no_grad():
            fill_slice_(p, self.seed, where, draw)
        self.done.add(id(p))

    def normal_(self, p: Tensor, std: float) -> None:
        self._fill(p, lambda t, g: t.normal_(0.0, std, generator=g))

    def uniform_(self, p: Tensor, low: float, high: float) -> None:
        self._fill(p, lambda t, g: t.uniform_(low, high, generator=g))

    def ones_(self, p: Tensor) -> None:
        with torch.no_grad():
            p.fill_(1.0)
        self.done.add(id(p))

    def check_complete(self, params: Iterable[tuple[str, Tensor]]) -> None:
        """Every parameter went through this initializer (a module that called torch.nn.init directly
        would make the run's weights depend on the layout)."""
        missed = [n for n, p in params if id(p) not in self.done]
        if missed:
            raise RuntimeError(f"parameters {missed} were not initialized through the model's Initializer; "
                               "call init.normal_/uniform_/ones_ in their module's init_weights "
                               "(model_zoo/init.py), not torch.nn.init")



def load_weights_(params: Iterable[tuple[str, Tensor]], slices: dict[int, ParamSlice],
                  weights: Mapping[str, Tensor]) -> None:
    """Every parameter becomes its slice of the full-model `weights` (continued pretraining: checkpoint.init_from),
    cut by the ParamSlice its KeyedInit draw used, so any layout (a pipeline stage, a TP column, an EP slice of
    experts, a vocabulary shard) starts from the same weights and no rank copies more than its slice. Called after
    init_weights, which keeps doing what it does for buffers; the parameters' draws (and GDN's transforms after
    them) are then overwritten."""
    for name, p in params:
        where = slices[id(p)]
        full = weights.get(where.name)
        if full is None:
            raise KeyError(f"the initial weights have no tensor '{where.name}' (for {name}): their model must be "
                           "the run's")
        if tuple(full.shape) != where.global_shape:
            raise ValueError(f"the initial weights' '{where.name}' has shape {tuple(full.shape)}, the run's model "
                             f"{where.global_shape}: their model must be the run's")
        piece = full
        for dim, (offset, size) in enumerate(zip(where.offsets, p.shape)):
            piece = piece.narrow(dim, offset, size)
        with torch.no_grad():
            p.copy_(piece)


# Fields of a ModelConfig that do not shape the weights: a file's model may differ from the run's in these.
NOT_WEIGHTS = ("name", "init_std", "scale_residual_init", "max_seq_len")


@functools.lru_cache(maxsize=2)
def read_weights_file(path: str) -> tuple[dict[str, Tensor], dict | None]:
    """(full-model tensors by name, the model config they were written with or None) of a file `python -m
    tools.hf import` wrote ({"state_dict", "model_config"}) or a plain torch.save'd state dict. Memory-mapped:
    each rank then reads only the slices it copies."""
    obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if isinstance(obj, dict) and "state_dict" in obj:
        return obj["state_dict"], obj.get("model_config")
    return obj, None


def weight_config_differences(written: Mapping, run: Mapping) -> list[str]:
    """'field (file x, run y)' for every weight-shaping field where a file's model config and the run's differ."""
    def norm(v):  # tuples read back as lists; nested configs as dicts
        return json.loads(json.dumps(v, default=list))

    keys = sorted((set(written) | set(run)) - set(NOT_WEIGHTS))
    return [f"{k} (file {written.get(k)!r}, run {run.get(k)!r})" for k in keys if norm(written.get(k)) != norm(run.get(k))]
