"""One executor's share of a checkpoint, made of its `Stateful` parts, and the one path that saves and resumes it:
the pipeline's stage (asyncpp/pipeline/state.py) and the single-process simulator (asyncpp/reference/executor.py)
both go through here, so the two cannot write or read different checkpoints.

    versions    age -> weights, in parameter order: the pipeline's WeightVersions, the simulator's VersionHistory
    rule        the update rule's per-parameter buffers u_{t-1}, g_{t-1} (asyncpp/core/update.py UpdateRule)
    balancing   the router-bias versions (asyncpp/core/balancing.py); None without aux-loss-free balancing
    optimizer   its state, by parameter name (state.py)

Each follows torch's Stateful convention (asyncpp/core/stateful.py). A load first makes room (`expect(step)`: the
buffers of every age the run holds at that step), offers the Statefuls' own tensors to DCP, which fills them in
place, then hands each its loaded state (load_state_dict: the parameters point at x_t, the routers take their
bias). The checkpoint keys are state.py's, unchanged by this assembly (tests/dist/test_old_checkpoints.py)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from torch import Tensor

from asyncpp.config import RunConfig
from asyncpp.train.checkpoint.files import checkpoint_root
from asyncpp.train.checkpoint.restore import data_position, load, resume_point
from asyncpp.train.checkpoint.saver import Saver
from asyncpp.train.checkpoint.state import Shard, StageState


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Versions(Stateful, Protocol):
    """state_dict(): {str(age): x_{newest-age} in parameter order}."""

    def expect(self, newest: int) -> list[int]:
        """Make room for a checkpoint of step `newest`; the ages its load fills."""

    def copied(self) -> dict[int, list[bool]] | None:
        """age -> per parameter: a compute-dtype copy of a master another rank saves (StageState.copies)."""


class BiasVersions(Stateful, Protocol):
    def expect(self, newest: int, ages: Sequence[int]) -> None: ...


@dataclass
class StageParts:
    names: list[str]
    """Every trainable parameter's full-model name, in the order of the versions' lists."""
    versions: Versions
    rule: Stateful
    optimizer: object
    opt_params: list[Tensor | None]
    """Per name: the tensor the optimizer steps (its master); None where another rank holds it."""
    balancing: BiasVersions | None = None
    aligned: Callable[[list], list] | None = None
    """The rule's buffers, over the parameters it updates, as a list over `names` (None: another rank's; the
    distributed optimizer, pipeline/update.py per_parameter). None: the rule updates every parameter."""
    shards: list[Shard | None] | None = None
    """Per name: how this rank's tensor is a piece of the full one (TP/EP, a vocabulary-parallel head's rows)."""
    mirrors: list[bool] | None = None
    """Per name: rows of a tensor another rank saves whole (StageState.mirrors)."""

    def state(self) -> StageState:
        """The share a save writes and a load fills in place: the Statefuls' own tensors."""
        aligned = self.aligned or list
        buffers = {kind: aligned(values) for kind, values in self.rule.state_dict().items()}
        versions = {int(age): tensors for age, tensors in self.versions.state_dict().items()}
        extra = self.balancing.state_dict() if self.balancing else {}
        return StageState(self.names, versions, buffers, self.optimizer, self.opt_params, self.shards, extra=extra,
                          copies=self.versions.copied(), mirrors=self.mirrors)

    def load(self, path: str | os.PathLike, step: int) -> dict:
        """Collective. Fill every part from the checkpoint of step `step` at `path`; returns its manifest."""
        ages = self.versions.expect(step)
        if self.balancing:
            self.balancing.expect(step, ages)
        rule = self.rule.state_dict()
        state = self.state()
        manifest = load(path, state, ages)
        self.versions.load_state_dict({str(age): tensors for age, tensors in state.versions.items()})
        self.rule.load_state_dict(rule)
        if self.balancing:
            self.balancing.load_state_dict(state.extra or {})
        return manifest


class Checkpointer:
    """An executor's checkpoints: its parts saved at a step boundary (where nothing is in flight) and resumed from
    checkpoint.resume. `parts()` assembles them when a save or a load needs them (a stage's shard views import
    DTensor, which a run that never checkpoints should not pay: runtime.torch_dcp). `layout` goes into the
    manifest; `naming(what)` wraps the collectives so a wait that gives up names them (the pipeline's
    p2p.naming_the_peer; one process has none)."""

    def __init__(self, cfg: RunConfig, parts: Callable[[], StageParts], data, batches, layout: dict, *,
                 timeout_s: float | None = None, naming: Callable[[str], AbstractContextManager] | None = None):
        self.cfg, self.parts, self.data, self.batches, self.layout = cfg, parts, data, batches, layout
        self._naming = naming or (lambda what: nullcontext())
        self.saver = Saver(cfg.checkpoint.async_save, timeout_s=timeout_s)

    def save(self, step_done: int) -> Path:
        """Collective; at a step boundary where every version x_{step_done - age} is complete."""
        c = self.cfg
        with self._naming(f"every rank's part of the checkpoint of step {step_done} (its collectives)"):
            return self.saver.save(checkpoint_root(c), step_done, self.parts().state(), config=c.to_dict(),
                                   layout=self.layout, keep_last=c.checkpoint.keep_last,
                                   data=data_position(self.data, step_done, self.batches))

    def resume(self, warn: Callable[[str], None] | None = None) -> int | None:
        """Collective. Load checkpoint.resume's checkpoint, if any; returns its step (None: nothing to resume)."""
        point = resume_point(self.cfg, self.data, **({"warn": warn} if warn is not None else {}))
        if point is None:
            return None
        path, step = point
        self.saver.resumed_from = path  # never pruned by this run
        with self._naming(f"every rank's part of loading {path} (its collectives)"):
            self.parts().load(path, step)
        return step

    def wait(self) -> None:
        self.saver.wait()
