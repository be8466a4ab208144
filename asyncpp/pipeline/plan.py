"""One pipeline stage, resolved once and built once.

`StagePlan` holds every decision about a stage that comes from the configuration: its delays at every step,
how many weight versions it keeps (the registry's rule, weight prediction included), the compute dtype, the
activation shape on its links, the head placement, the timeout and the update's options. `build_stage_runtime`
turns a plan, a built stage module and its optimizer into the engine that runs it: the weight versions, the
links (`comm_cls`, injectable), the head split's ends, the router-bias versions and the engine itself.

Three callers build a stage, and all go through here so they cannot drift apart: a trainer run's composition
(compose.py, from a RunConfig), the Megatron front-end (megatron.py, from its keyword arguments) and the dry
run (asyncpp/analysis/dryrun.py, on meta tensors: it asks the plan how many versions the run allocates).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from asyncpp.config import RunConfig
from asyncpp.core.balancing import RouterBiasVersions, RouterLoadStats, balanced_routers
from asyncpp.core.layout import Layout
from asyncpp.core.masters import compute_dtype_of
from asyncpp.core.update import NO_CORRECTIONS, Corrections, lr_multiplier_for
from asyncpp.core.vocab_split import VocabSplit
from asyncpp.optim.build import AnyOptimizer
from asyncpp.parallel.mesh import Mesh, ParallelDims
from asyncpp.parallel.sharding import REPLICATED, ParamSharding
from asyncpp.pipeline.engine import ForwardFn, StageEngine
from asyncpp.pipeline.p2p import StageComm
from asyncpp.pipeline.parts import (
    DownstreamLink,
    Part,
    StagePart,
    UpstreamLink,
    Wait,
    WholeEmbedding,
    WholeHead,
)
from asyncpp.pipeline.stage import StageSpec, vocab_head_rows
from asyncpp.pipeline.timer import stage_timer
from asyncpp.pipeline.update import StageUpdate
from asyncpp.pipeline.vocab_embedding import VocabEmbedding
from asyncpp.pipeline.vocab_head import VocabHead
from asyncpp.pipeline.weights import WeightVersions
from asyncpp.schedules.costmodel import VocabPlacement
from asyncpp.schedules.registry import kind_of, step_delay
from model_zoo import ModelConfig


@dataclass(frozen=True)
class UpdateSpec:
    """The update's options a stage applies at UPDATE(t) (asyncpp/core/update.py)."""

    grad_clip: float = 0.0
    corrections: Corrections = NO_CORRECTIONS
    lr_multiplier: Callable[[int], float] | None = None
    distributed_optimizer: bool = False
    """Own, step and keep the state of only this DP rank's share of the parameters (pipeline/sharded.py)."""


@dataclass(frozen=True)
class StagePlan:
    """Every decision about one stage that comes from the configuration, resolved once (the module docstring):
    `StagePlan.of` for a trainer run, keyword arguments for the Megatron front-end; `build_stage_runtime` builds
    the stage's engine from it."""

    stage: int
    num_stages: int
    schedule: str
    delays: tuple[int, ...] | None = None
    """d_t of this stage for t = 0 .. steps-1 (a synchronous start or cooldown gives 0 there); None: the kind's
    steady-state delay at every step. Steps past its end take the steady-state delay (the Megatron front-end,
    whose run length is not known, gives only its synchronous start)."""
    tied_delays: tuple[int, ...] | None = None
    """The same for the first stage, the owner of a tied weight: its corrections follow the owner's delay."""
    weight_prediction: bool = False
    compute_dtype: torch.dtype | None = None
    """bf16: parameters cast for compute, fp32 masters kept apart (weights.py); None: compute in the masters'."""
    head_shape: tuple[int, ...] = (0,)
    """What the head reads, [micro batch, sequence, hidden]: the whole sequence, also under SP."""
    activation_shape: tuple[int, ...] = (0,)
    """What a stage boundary carries, [micro batch, sequence (this TP rank's shard under SP), hidden]; (0,) when
    the caller sets it per call (the Megatron front-end)."""
    link_dtype: torch.dtype = torch.float32
    vocab: VocabSplit | None = None
    """parallel.head=vocab: every stage's layers and head rows (asyncpp/core/vocab_split.py)."""
    vocab_placement: VocabPlacement | None = None
    """The warm-up and slack the head's S and T are placed with (core/layout.Layout.placement)."""
    timeout_s: float = 300.0
    update: UpdateSpec = field(default_factory=UpdateSpec)

    @classmethod
    def of(cls, cfg: RunConfig, model_cfg: ModelConfig, spec: StageSpec, dims: ParallelDims) -> StagePlan:
        """A trainer run's plan for `spec`'s stage at the layout `dims`."""
        t, s = cfg.train, cfg.staleness

        def delays(stage: int) -> tuple[int, ...]:
            return tuple(step_delay(cfg.schedule.name, stage, spec.num_stages, k, t.steps, s) for k in range(t.steps))

        dtype = compute_dtype_of(t.precision)
        seq = t.seq_len // dims.tp if cfg.parallel.sequence_parallel else t.seq_len
        layout = Layout.of(cfg, model_cfg)
        vocab = layout.vocab if spec.vocab is not None else None
        placement = layout.placement if vocab is not None else None
        return cls(
            stage=spec.stage, num_stages=spec.num_stages, schedule=cfg.schedule.name, delays=delays(spec.stage),
            tied_delays=delays(0), weight_prediction=s.weight_prediction, compute_dtype=dtype,
            activation_shape=(t.micro_batch_size, seq, model_cfg.hidden_size),
            head_shape=(t.micro_batch_size, t.seq_len, model_cfg.hidden_size),
            link_dtype=dtype if dtype is not None else torch.float32,
            vocab=vocab, vocab_placement=placement, timeout_s=t.timeout_s,
            update=UpdateSpec(grad_clip=t.grad_clip, corrections=Corrections.of(s), lr_multiplier=lr_multiplier_for(cfg),
                              distributed_optimizer=cfg.parallel.distributed_optimizer))

    # ---- the registry's rules, asked once ---------------------------------------------------------------
    @property
    def steady_delay(self) -> int:
        return kind_of(self.schedule).stage_delay(self.stage, self.num_stages)

    @property
    def num_buffers(self) -> int:
        """The weight versions this stage holds: the kind's, plus one under weight prediction."""
        return kind_of(self.schedule).num_buffers(self.stage, self.num_stages, weight_prediction=self.weight_prediction)

    @property
    def predict_delay(self) -> int:
        return self.steady_delay if self.weight_prediction else 0

    def delay(self, step: int) -> int:
        return self.delays[step] if self.delays is not None and step < len(self.delays) else self.steady_delay

    def is_delayed(self, step: int) -> bool:
        return self.delay(step) > 0

    def tied_is_delayed(self, step: int) -> bool:
        if self.tied_delays is None or step >= len(self.tied_delays):
            return kind_of(self.schedule).stage_delay(0, self.num_stages) > 0
        return self.tied_delays[step] > 0

    def weight_versions(self, params: list[nn.Parameter]) -> WeightVersions:
        return WeightVersions(params, self.num_buffers, compute_dtype=self.compute_dtype,
                              predict_delay=self.predict_delay)


def build_stage_runtime(
    plan: StagePlan,
    spec: StageSpec | None,
    module: nn.Module,
    mesh: Mesh,
    optimizer: AnyOptimizer,
    forward_fn: ForwardFn,
    *,
    grad_scale: float,
    layouts: Sequence[ParamSharding] | None = None,
    tied: Iterable[nn.Parameter] = (),
    head_labels: Callable | None = None,
    embed_inputs: Callable | None = None,
    comm_cls: type[StageComm] = StageComm,
    extra_parts: Sequence[StagePart] = (),
    head_part: Callable[[Wait], Part] | None = None,
    embedding_part: Callable[[Wait], Part] | None = None,
    tied_rows: tuple[int, int] | None = None,
    routers: dict[str, Any] | None = None,
) -> StageEngine:
    """The engine of `plan`'s stage: `module` is the stage (pruned and sharded), `spec` its place in the
    model_zoo layout (None: a module of its own, e.g. Megatron's GPTModel stage), `optimizer` built over its
    trainable parameters (not stepped yet: the engine retargets it to the masters), `forward_fn` the stage's
    microbatch forward. Under a vocabulary-parallel head `head_labels(step, microbatch)` gives every stage the
    labels of the whole microbatch; with a sharded embedding
    `embed_inputs(step, microbatch)` every stage's the input token ids. `extra_parts`: more parts the stage runs
    (parts.py), after its head and embedding. `head_part(wait)`: the stage's head part, built by the caller (the
    Megatron front-end's vocabulary-parallel head over a GPTModel, which has no StageSpec), in place of the plan's,
    and `embedding_part(wait)` its embedding part likewise;
    `tied_rows` (row0, vocab) its tied tensor's place in the tied weight (else derived from the plan's split);
    `routers` the stage's bias-balanced routers in core/balancing.py's interface (default: balanced_routers(module))."""
    if plan.stage != mesh.pp_rank or plan.num_stages != mesh.num_stages or (
            spec is not None and (spec.stage, spec.num_stages) != (plan.stage, plan.num_stages)):
        built = f"stage {spec.stage} of {spec.num_stages}, " if spec is not None else ""
        raise ValueError(f"the stage was built as {built}planned as stage {plan.stage} of {plan.num_stages}, but "
                         f"this rank is stage {mesh.pp_rank} of {mesh.num_stages}")
    if plan.vocab is not None and spec is None:
        raise ValueError("a vocabulary-parallel head needs the stage's StageSpec (a model_zoo stage): it places the "
                         "head")
    params = [p for p in module.parameters() if p.requires_grad]
    tied_ids = {id(p) for p in tied}
    versions = plan.weight_versions(params)
    comm = comm_cls(mesh, plan.activation_shape, plan.link_dtype, plan.timeout_s)
    if tied_rows is None and plan.vocab is not None and tied_ids and not spec.is_first:
        tied_rows = (spec.vocab.start, sum(plan.vocab.shards))  # its head rows are rows of the tied weight the first
        # stage holds whole
    head, embedding = stage_parts(plan, spec, module, mesh, comm.wait, head_labels, embed_inputs)
    if head_part is not None:
        head = head_part(comm.wait)
    if embedding_part is not None:
        embedding = embedding_part(comm.wait)
    timer = stage_timer(mesh.pp_rank, mesh.device)
    update = StageUpdate(mesh, versions, optimizer, spec=plan.update, grad_scale=grad_scale,
                         is_delayed=plan.is_delayed, tied_is_delayed=plan.tied_is_delayed,
                         tied_mask=[id(p) in tied_ids for p in params],
                         layouts=list(layouts) if layouts is not None else [REPLICATED] * len(params),
                         wait=comm.wait, timer=timer,
                         balancing=RouterBiasVersions(balanced_routers(module) if routers is None else routers,
                                                              versions.num_buffers),
                         load_stats=RouterLoadStats.of(module, counted=mesh.tp_rank == 0 and mesh.ep_rank == 0),
                         tied_rows=tied_rows)
    entry = embedding if mesh.is_first_stage else UpstreamLink(comm)
    exit = head if mesh.is_last_stage else DownstreamLink(comm)
    parts = [p for p in (head, embedding) if p is not None] + list(extra_parts)
    return StageEngine(module=module, mesh=mesh, comm=comm, update=update, forward_fn=forward_fn, timer=timer,
                       entry=entry, exit=exit, parts=parts)


def stage_parts(plan: StagePlan, spec: StageSpec | None, module: nn.Module, mesh: Mesh, wait: Wait,
                head_labels: Callable | None, embed_inputs: Callable | None) -> tuple[Part | None, Part | None]:
    """The stage's head part and embedding part, where it holds (some of) them: a vocabulary-parallel head's rows on
    every stage, else the whole head on the last; a sharded embedding's rows on every stage, else the whole
    embedding on the first. None where the stage holds none."""
    head = embedding = None
    if plan.vocab is not None:
        param, row0, piece = vocab_head_rows(module, spec, mesh.dims.tp, mesh.tp_rank)
        head = VocabHead(mesh, piece, param, row0, head_labels, plan.head_shape, plan.link_dtype, wait)
    elif mesh.is_last_stage:
        head = WholeHead()
    if spec is not None and spec.embed is not None:
        embedding = VocabEmbedding(mesh, spec.embed, module.embed.weight, embed_inputs, wait)
    elif mesh.is_first_stage:
        embedding = WholeEmbedding()
    return head, embedding
