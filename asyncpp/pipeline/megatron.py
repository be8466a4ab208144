"""A drop-in for megatron-core's `forward_backward_func`: swap 1F1B for a never-flushing 2BW pipeline.

A Megatron-LM training loop keeps its shape:

    fwd_bwd = get_forward_backward_func("2bw", engine_factory=lambda s: Pipeline2BW(model, opt, mesh,
                                                                                    schedule=s, hidden_size=h))
    for k in range(train_iters):
        losses = fwd_bwd(forward_step_func=..., data_iterator=it, model=model, num_microbatches=m,
                         seq_length=S, micro_batch_size=B)
        ok, grad_norm, _ = fwd_bwd.pipeline.optimizer_step()   # reports; the update is in the schedule
    fwd_bwd.pipeline.drain()                                      # before eval, checkpoint and exit

What differs from Megatron, and why:
- The update is part of the pipeline schedule (engine.StageEngine's UPDATE_START/UPDATE), not of the
  user's `optimizer.step()`: under 2BW the update of b_t is applied lazily, during call t+2, just
  before its weights x_{t+1} are first used. `optimizer_step()` therefore only *reports*
  `(update_successful, grad_norm, num_zeros_in_grad)` of the newest update applied so far (step k-2
  after call k with 2bw, step k with 1f1b; `applied_step` says which). Its learning rate comes from
  `lr_multiplier(t)` (pass it to pin step t's LR, as the simulator does); without it, the optimizer's
  current lr at the time the update runs is used.
- Loss scaling follows Megatron, not the simulator: the last stage divides the loss returned by
  `loss_func` by num_microbatches (and by num_tokens for the 3-tuple form) before the backward, so
  the engine's grad_scale is 1.0 on this path. (The simulator sums microbatch gradients and divides
  once; the two agree exactly when m is a power of two, to rounding otherwise.) Auxiliary losses
  injected into the graph (model_zoo MoE's `aux_grad_scale`) are the model's business, as Megatron's
  MoEAuxLossAutoScaler is: set them to 1/m for this convention.
- fp16 loss scaling: megatron's `config.grad_scale_func` is applied to the last stage's loss before its backward
  and divided out of the step's summed gradient before its norm, clip and update; a non-finite (overflowed) step
  is skipped on every stage. One scale per 2BW stream (Pipeline2BW._set_loss_scale).
- Sequence parallelism: the norms megatron marks `sequence_parallel` get their partial gradients all-reduced over
  megatron's TP group when their step's reduction starts (param_layouts), as finalize_model_grads does at the end
  of a flushed step; activations travel as [seq/tp, batch, hidden].
- megatron's aux-loss-free router balancing (moe_router_enable_expert_bias): the routers' expert_bias is versioned
  and moved by asyncpp's RouterBiasVersions at the 2BW update (megatron_balancing.py), not by finalize_model_grads.
- Weight versions are switched by the engine (weights.WeightVersions.use) before every forward and
  backward, by re-pointing Parameter storage: the user's model and forward_step_func need no change.
  FP8 weight caches (TE's set_is_first_microbatch) are not refreshed on a switch: not supported.
- Options we do not implement raise NotImplementedError naming the option; `first_val_step` (an FP8
  hint) and `force_all_reduce` (our DP reduction is always an all-reduce) are accepted and ignored.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from asyncpp.core.update import NO_CORRECTIONS, Corrections
from asyncpp.parallel.mesh import Mesh
from asyncpp.parallel.sharding import REPLICATED, ParamSharding
from asyncpp.pipeline.megatron_balancing import check_router_bias, megatron_balanced_routers
from asyncpp.pipeline.plan import StagePlan, UpdateSpec, build_stage_runtime
from asyncpp.pipeline.update import StepRecord
from asyncpp.schedules.actions import Action, Op
from asyncpp.schedules.build import build_schedule
from asyncpp.schedules.registry import kind_of

SCHEDULES = ("2bw", "1f1b")
_COMPUTE = (Op.FORWARD, Op.BACKWARD)


# ---- which actions one call executes (pure; tested without processes) -----------------------------
#
# 2BW runs one continuous 1F1B stream across calls. Call k executes, on every stage, the stream's
# actions up to the stage's last FORWARD/BACKWARD before F(k+1, 0); UPDATE_START/UPDATE actions that
# sit between that compute and F(k+1, 0) are left to call k+1. So call k runs F(k, *) (exactly the m
# microbatches of b_k drawn from this call's data_iterator) and the backwards of items
# [k*m - w, (k+1)*m - w) with w = P-1-s the stage's warm-up depth (item = t*m + j).
#
# Deadlock freedom: sends never block, so a call can only hang on a wait whose counterpart lies in a
# later call on another stage. There is none:
# - F(k, j) at s waits for F(k, j) at s-1: call k on both stages.
# - B(item i) at s waits for B(i) at s+1, whose window reaches one item further (w_{s+1} = w_s - 1).
# - UPDATE_START(t) only starts reductions (tied embedding, DP, norm: engine._progress); the blocking
#   waits are in UPDATE(t). Were it to block, it would meet its peers here: every stage runs it in call t+1. It follows B(t, m-1), item (t+1)m - 1, which is inside call
#   t+1's backward range when w >= 1; on the last stage (w = 0) it trails call t and is deferred.
#   Cutting at F(k+1, 0) itself would leave the last stage blocked in that all-reduce at the end of
#   call t until the first stage's call t+1, deadlocking any collective a training loop runs between
#   calls (loss averaging, logging).
# - UPDATE(t) waits for every stage's UPDATE_START(t) (call t+1); it is placed just before F(t+2, 0),
#   i.e. trails call t+1 and runs first thing in call t+2.
# The last stage has no warm-up (w = 0): call k ran all of b_k's forwards and backwards, so its m
# loss reports are complete when the call returns.
#
# The stream is built by build_schedule over a short horizon only (steps max(k-2, start)..k+1, as a
# drained stream): from the cut before F(k, 0) on, a 1F1B stream is in steady state, so the horizon's
# actions there equal the unbounded stream's, and everything of the horizon that lies before that
# cut belongs to calls k-1 and k-2 (F/B of b_{k-2}, b_{k-1}, UPDATE_START(k-2)) -- the `done` set.


def _cut_before_forward(actions: list[Action], step: int) -> int:
    """Index just after the last F/B that precedes F(step, 0)."""
    first = next(i for i, a in enumerate(actions) if a.op is Op.FORWARD and a.step == step and a.microbatch == 0)
    return 1 + max((i for i in range(first) if actions[i].op in _COMPUTE), default=-1)


def _horizon(stage: int, num_stages: int, m: int, stream_start: int, first: int, last: int) -> list[Action]:
    t0 = max(first, stream_start)
    return build_schedule("2bw", stage, num_stages, m, [1] * (last + 1 - t0), first_step=t0)


def window_2bw(stage: int, num_stages: int, m: int, step: int, stream_start: int, done: set[Action]) -> list[Action]:
    """Actions of call `step` in a 2BW stream started (drained) at `stream_start`; `done` holds at least
    the actions of calls step-2 and step-1."""
    horizon = _horizon(stage, num_stages, m, stream_start, step - 2, step + 1)
    return [a for a in horizon[:_cut_before_forward(horizon, step + 1)] if a not in done]


def drain_2bw(stage: int, num_stages: int, m: int, last_step: int, stream_start: int, done: set[Action]) -> list[Action]:
    """The cool-down after call `last_step`: the rest of the stream truncated there."""
    horizon = _horizon(stage, num_stages, m, stream_start, last_step - 1, last_step)
    return [a for a in horizon if a not in done]


# ---- the pipeline object ----------------------------------------------------------------------------


def get_forward_backward_func(schedule: str = "2bw", *, engine_factory: Callable[[str], Pipeline2BW]):
    """The callable a Megatron loop calls once per step; `.pipeline` is its Pipeline2BW (drain,
    optimizer_step). engine_factory(schedule) builds the pipeline (model, optimizer, mesh, ...)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")
    return engine_factory(schedule).forward_backward_func


def _unwrap(model: Any, attr: str) -> Any:
    """Megatron's get_attr_wrapped_model: follow `.module` (DDP, Float16Module) until `attr` exists."""
    while not hasattr(model, attr) and hasattr(model, "module"):
        model = model.module
    if not hasattr(model, attr):
        raise AttributeError(f"model has no {attr}() (Megatron's GPTModel has one; wrap model_zoo stages)")
    return model


def _partial_over_tp(name: str, param: nn.Parameter, config) -> bool:
    """Whether a TP-replicated parameter's gradient is a partial sum on each TP rank, by finalize_model_grads' rule
    (megatron/core/distributed/finalize_model_grads.py:354, _allreduce_non_tensor_model_parallel_grads): a
    sequence-parallel norm (each TP rank normalizes its own tokens) and, with qk_layernorm, the query/key norms (each
    TP rank normalizes its own heads)."""
    if getattr(param, "average_gradients_across_tp_domain", False):
        raise NotImplementedError(f"{name}: average_gradients_across_tp_domain=True (a TP-averaged gradient) is not "
                                  "supported by the Megatron front-end")
    return bool((getattr(config, "sequence_parallel", False) and getattr(param, "sequence_parallel", False))
                or (getattr(config, "qk_layernorm", False) and ("q_layernorm" in name or "k_layernorm" in name)))


def param_layouts(model: nn.Module) -> list[ParamSharding]:
    """Each trainable parameter's tensor-parallel layout, read from megatron-core's own parameter attributes
    (`tensor_model_parallel`, `partition_dim`: tensor_parallel.set_tensor_model_parallel_attributes), so the
    global norm counts a TP shard on every TP rank and a replicated tensor once. A module without them (asyncpp's
    own stages) is replicated. An expert weight (`allreduce=False`) is reduced over the expert-data-parallel group
    and counted on every EP rank. A replicated tensor whose gradient is partial on each TP rank (_partial_over_tp:
    megatron's sequence-parallel norms) is all-reduced over megatron's TP group when its step's reduction starts
    (GradientReduction._reduce_partial_tp), as finalize_model_grads does at the end of a flushed step."""
    config = getattr(model, "config", None)
    inner = model
    while config is None and hasattr(inner, "module"):
        inner = inner.module
        config = getattr(inner, "config", None)
    layouts = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        tp_dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
        expert = getattr(p, "allreduce", True) is False
        partial = tp_dim is None and _partial_over_tp(name, p, config)
        layouts.append(ParamSharding(tp_dim=tp_dim, expert=expert, tp_grad_reduce=partial)
                       if tp_dim is not None or expert or partial else REPLICATED)
    return layouts


def optimizer_sharding(model: nn.Module) -> dict[str, ParamSharding]:
    """build_optimizer's `sharding` for a megatron-core model: the TP-sharded parameters by name (param_layouts).
    With it (and tp_group=mesh.tp_group) Muon gathers each sharded matrix over the TP group and orthogonalises
    the whole matrix, as on one process; without it Muon would orthogonalise each shard on its own."""
    named = [n for n, p in model.named_parameters() if p.requires_grad]
    return {n: lay for n, lay in zip(named, param_layouts(model)) if lay.is_tp_sharded}


def _check_optimizer_layouts(model: nn.Module, optimizer, mesh: Mesh) -> None:
    """Under TP, an optimizer that reads each parameter's TP layout (Muon's `tp_dims`, asyncpp/optim/muon.py) must
    have megatron's: a sharded matrix it believes replicated would be orthogonalised shard by shard, a different
    update from the unsplit model's, without any error."""
    if mesh.dims.tp == 1:
        return
    names = {id(p): n for n, p in model.named_parameters()}
    tp_dim = {id(p): lay.tp_dim for p, lay in zip((p for p in model.parameters() if p.requires_grad),
                                                   param_layouts(model))}
    fix = ("build it with asyncpp.optim.build_optimizer(model, ..., sharding=optimizer_sharding(model), "
           "tp_group=mesh.tp_group)")
    for opt in getattr(optimizer, "optimizers", {"optimizer": optimizer}).values():
        for group in opt.param_groups:
            if "tp_dims" not in group:
                continue
            if getattr(opt, "tp_group", None) is not mesh.tp_group:
                raise ValueError(f"{type(opt).__name__}'s tp_group is not the mesh's (megatron's tensor-parallel "
                                 f"group): {fix}")
            for p, d in zip(group["params"], group["tp_dims"]):
                want = None if tp_dim.get(id(p)) is None else tp_dim[id(p)] % p.ndim
                if d != want:
                    raise ValueError(f"{type(opt).__name__} has tp_dim={d} for {names.get(id(p), '?')}, but megatron "
                                     f"shards it along dim {want} (partition_dim): {fix}")


# ---- megatron-core's own gradient machinery: refused (docs/pipeline.md, "Inside Megatron-LM") ---------------------
_MEGATRON_GRAD_SYNC = ("finalize_model_grads_func", "grad_sync_func", "no_sync_func", "param_sync_func")
_NOT_UNDER_2BW = (
    "it keeps one gradient buffer per parameter (param.main_grad, a view of _ParamAndGradBuffer.grad_data: "
    "megatron/core/distributed/param_and_grad_buffer.py:837), its backward hook adds every microbatch's gradient "
    "into it and sets param.grad = None (distributed_data_parallel.py:440-441), and it reduces that buffer in "
    "place (param_and_grad_buffer.py:443, 455). Under 2BW the backwards of b_{t+1} run while b_t's gradient is "
    "being reduced (UPDATE_START(t) .. UPDATE(t)), so they would add into the reduction in flight")


def _refuse_megatron_grad_machinery(model: nn.Module, optimizer) -> None:
    """megatron-core's DistributedDataParallel, its DistributedOptimizer (any MegatronOptimizer) and its
    finalize_model_grads cannot drive a 2BW stage: refused with what blocks each; the reductions are asyncpp's, on
    megatron's groups (Mesh.from_megatron). `model` is any wrapper chain (DDP, Float16Module) around the stage."""
    wrapper = model
    while wrapper is not None:
        if type(wrapper).__module__.startswith("megatron.core.distributed"):
            raise ValueError(f"model is wrapped in megatron-core's {type(wrapper).__name__}: {_NOT_UNDER_2BW}. "
                             "Pass the unwrapped model: asyncpp reduces the gradients over megatron's data-parallel "
                             "group itself, with a gradient per step in flight")
        wrapper = getattr(wrapper, "module", None)
    wrapped = [n for n, p in model.named_parameters() if hasattr(p, "main_grad")]
    if wrapped:
        raise ValueError(f"parameter {wrapped[0]} has a main_grad: the model was wrapped in megatron-core's "
                         "DistributedDataParallel, whose hooks take the gradients away from asyncpp: "
                         f"{_NOT_UNDER_2BW}. Build the stage without it")
    if type(optimizer).__module__.startswith("megatron.core.optimizer"):
        raise ValueError(f"optimizer is megatron-core's {type(optimizer).__name__}: under 2BW the update runs in "
                         "the schedule through asyncpp's update rule (EF and the corrections, the weight versions), "
                         "while a MegatronOptimizer reads param.main_grad, takes its own norm and clip and writes "
                         "the model's parameters (megatron/core/optimizer/optimizer.py:534, 607, 774, 977); its "
                         "DistributedOptimizer also owns the parameters' storage through DistributedDataParallel's "
                         "parameter buffer (param_and_grad_buffer.py:831), which asyncpp's weight versions replace. "
                         "(On a CPU none is built: optimizer.py:481 and 907 allocate on device='cuda'.) Use "
                         "asyncpp.optim.build_optimizer (Muon, AdamW, ...)")


def _refuse_megatron_grad_sync(model: nn.Module) -> None:
    """Megatron's training loop sets these on the model's config (training.py's train()); its schedules call them
    around every flushed step (megatron/core/pipeline_parallel/schedules.py:2300-2311, the end of
    forward_backward_pipelining_without_interleaving). asyncpp's 2BW never flushes and does
    its own reductions in the schedule, so a set one would never run: refused rather than silently skipped."""
    config = getattr(_unwrap(model, "set_input_tensor"), "config", None)
    for name in _MEGATRON_GRAD_SYNC:
        if getattr(config, name, None) is not None:
            raise ValueError(f"the model's config has {name} set (megatron's training loop sets it for its "
                             "DistributedDataParallel): asyncpp's pipeline reduces the gradients, the tied embedding "
                             "and the norm itself inside the schedule and never calls it; set config."
                             f"{name} = None")


def _refuse_low_precision_params(model: nn.Module) -> None:
    """megatron's fp16/bf16 models (config.fp16/bf16, Float16Module) hold their parameters in 16 bits and keep fp32
    master weights in the MegatronOptimizer, which is refused here; this front-end builds its weight versions
    without a compute dtype, so the optimizer would step the 16-bit parameters themselves: refused, not silently
    degraded."""
    low = [(n, p.dtype) for n, p in model.named_parameters() if p.requires_grad and p.dtype in (torch.float16,
                                                                                              torch.bfloat16)]
    if low:
        raise NotImplementedError(f"parameter {low[0][0]} is {low[0][1]}: the Megatron front-end keeps no fp32 master "
                                  "weights for 16-bit parameters (megatron keeps them in its refused "
                                  "MegatronOptimizer). Train the model in fp32, with config.grad_scale_func for loss "
                                  "scaling if wanted, or in bf16 through asyncpp's own pipeline (train.precision=bf16)")


def _check_parallel_sizes(model: nn.Module, mesh: Mesh) -> None:
    """A megatron-core model reads its parallel sizes from its TransformerConfig (which of its weights are expert-
    parallel: `allreduce=False`, see param_layouts); they must be the mesh's, or expert gradients would be
    all-reduced over DP as if they were replicas."""
    config = getattr(_unwrap(model, "set_input_tensor"), "config", None)
    sizes = {"pipeline_model_parallel_size": mesh.dims.pp, "tensor_model_parallel_size": mesh.dims.tp,
             "expert_model_parallel_size": mesh.dims.ep}
    for name, size in sizes.items():
        value = getattr(config, name, size)
        if value != size:
            raise ValueError(f"the model's config has {name}={value} but the mesh (parallel_state) has {size}: "
                             f"build the model with {name}={size}")


def loss_scale_of(model: nn.Module, device: torch.device) -> float:
    """The loss scale megatron's `config.grad_scale_func` (fp16's dynamic or constant loss scaling: a
    MegatronOptimizer's scale_loss, or the user's) applies now: its value at 1, as megatron's forward_step probes it
    (megatron/core/pipeline_parallel/schedules.py:284). 1.0 without one."""
    config = getattr(_unwrap(model, "set_input_tensor"), "config", None)
    func = getattr(config, "grad_scale_func", None)
    if func is None:
        return 1.0
    scale = float(func(torch.ones(1, device=device)).item())
    if not scale > 0:
        raise ValueError(f"config.grad_scale_func gives a loss scale of {scale}; it must be > 0 (an infinite scale "
                         "makes the step's gradient non-finite: the step is skipped on every stage)")
    return scale


def _scale_moe_aux_loss(model: nn.Module, num_microbatches: int, loss_scale: float = 1.0) -> None:
    """What megatron's forward_step does after each forward of a MoE model: its routers' auxiliary losses are
    back-propagated with MoEAuxLossAutoScaler's scale, which must be loss_scale/m to match the main loss's
    (schedules.py:283-292)."""
    config = getattr(_unwrap(model, "set_input_tensor"), "config", None)
    if getattr(config, "num_moe_experts", None) is None:
        return
    if config.calculate_per_token_loss:
        raise NotImplementedError("calculate_per_token_loss=True is not supported by the Megatron front-end")
    # A megatron-core MoE model: megatron-core is installed.
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(loss_scale / num_microbatches))  # 0-dim: mixes with any device


@dataclass
class _Call:
    """What one forward_backward_func call hands to the microbatch forwards the engine runs."""

    forward_step_func: Callable
    data_iterator: Any
    model: nn.Module
    num_microbatches: int
    non_loss_data: bool
    loss_scale: float = 1.0
    """config.grad_scale_func's scale for this call (loss_scale_of); the reduction divides it out again."""
    store: list = field(default_factory=list)


class Pipeline2BW:
    """One pipeline stage's persistent state across forward_backward_func calls.

    model: this stage's module (any `.module` wrapper chain is fine) with set_input_tensor(list).
    optimizer: torch.optim-style over the stage's trainable parameters, not stepped yet (the engine
    retargets it to the weight-version masters). tied: the tied embedding/head weight on the first and
    last stage. Activations travel as [micro_batch_size, seq_length, hidden_size]
    ([seq, batch, hidden] with sequence_first=True, Megatron's GPTModel layout).
    The staleness options are the simulator's (DelayedUpdateSimulator) and the trainer's `staleness.*`:
    ef_lambda (update-level EF), grad_ef_lambda (gradient-level EF), dc_lambda (DC-ASGD), weight_prediction
    (each stage keeps one more weight version) and sync_start_steps; all act only on delayed steps.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer,
        mesh: Mesh,
        *,
        hidden_size: int,
        schedule: str = "2bw",
        grad_clip: float = 0.0,
        ef_lambda: float = 0.0,
        grad_ef_lambda: float = 0.0,
        dc_lambda: float = 0.0,
        weight_prediction: bool = False,
        lr_multiplier: Callable[[int], float] | None = None,
        tied: Iterable[nn.Parameter] = (),
        sequence_first: bool = False,
        pipeline_dtype: torch.dtype = torch.float32,
        sync_start_steps: int = 0,
    ):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")
        corrections = Corrections(ef_lambda=ef_lambda, grad_ef_lambda=grad_ef_lambda, dc_lambda=dc_lambda)
        if schedule == "1f1b" and (corrections != NO_CORRECTIONS or sync_start_steps or weight_prediction):
            raise ValueError(f"{corrections}, sync_start_steps={sync_start_steps}, weight_prediction="
                             f"{weight_prediction} act on delayed updates; schedule='1f1b' has none: use 0 / False")
        if sync_start_steps < 0:
            raise ValueError(f"sync_start_steps={sync_start_steps} must be >= 0")
        self.schedule, self.mesh, self.model = schedule, mesh, model
        self.hidden_size, self.sequence_first = hidden_size, sequence_first
        self.sync_start_steps = sync_start_steps
        # The activation shape is set per call from seq_length/micro_batch_size (_set_activation_shape).
        sync = (0,) * sync_start_steps or None  # later steps: the schedule's steady delay (StagePlan.delay)
        plan = StagePlan(stage=mesh.pp_rank, num_stages=mesh.num_stages, schedule=schedule, link_dtype=pipeline_dtype,
                         delays=sync, tied_delays=sync, weight_prediction=weight_prediction,
                         update=UpdateSpec(grad_clip=grad_clip, corrections=corrections, lr_multiplier=lr_multiplier))
        _refuse_megatron_grad_machinery(model, optimizer)
        _refuse_low_precision_params(model)
        _check_parallel_sizes(model, mesh)
        _check_optimizer_layouts(model, optimizer, mesh)
        check_router_bias(getattr(_unwrap(model, "set_input_tensor"), "config", None))
        self.engine = self._build_engine(plan, model, optimizer, tied)
        self.next_step = 0
        """k of the next call: the minibatch b_k it consumes."""
        self.applied_step: int | None = None
        """The newest step whose update has been applied (None before the first)."""
        self._stream_start: int | None = None  # first step of the open 2BW stream; None = drained
        self._m: int | None = None
        self._windows: deque[set[Action]] = deque(maxlen=self.DONE_CALLS)  # the latest calls' actions
        self._call: _Call | None = None  # forward_step_func, data_iterator, model, store of the running call
        self._loss_scale = 1.0  # the engine's grad_scale is its inverse (_set_loss_scale)
        self.forward_backward_func = functools.partial(self.forward_backward)
        self.forward_backward_func.pipeline = self  # type: ignore[attr-defined]

    DONE_CALLS = 2
    """How many of the latest calls' actions a window needs as `done` (window_2bw: calls k-2 and k-1)."""

    def _build_engine(self, plan: StagePlan, model: nn.Module, optimizer, tied: Iterable[nn.Parameter]):
        return build_stage_runtime(plan, None, model, self.mesh, optimizer, self._forward, grad_scale=1.0,
                                   layouts=param_layouts(model), tied=tied,  # loss already / m (docstring)
                                   routers=megatron_balanced_routers(model))

    def _sync_window(self, m: int, step: int) -> list[Action]:
        """A flushed step, b_step on x_step: every 1F1B call (call k completes b_k, its reductions and its update)
        and each synchronous start step of a 2BW run (sync_start_steps)."""
        return build_schedule(self.schedule, self.mesh.pp_rank, self.mesh.num_stages, m, [0], first_step=step)

    def _window(self, m: int, step: int, done: set[Action]) -> list[Action]:
        return window_2bw(self.mesh.pp_rank, self.mesh.num_stages, m, step, self._stream_start, done)

    def _drain_window(self, done: set[Action]) -> list[Action]:
        return drain_2bw(self.mesh.pp_rank, self.mesh.num_stages, self._m, self.next_step - 1, self._stream_start,
                         done)

    @property
    def drained(self) -> bool:
        return self._stream_start is None

    @property
    def loss_scale(self) -> float:
        """The loss scale the open stream runs at (config.grad_scale_func's; 1.0 without one)."""
        return self._loss_scale

    def restore_position(self, next_step: int, applied: StepRecord | None, loss_scale: float) -> None:
        """After a checkpoint's state was loaded into this fresh, drained pipeline (megatron_checkpoint.py): the
        next call consumes b_{next_step}; `applied` is the newest applied update's record (optimizer_step's
        report until the next update), `loss_scale` the scale the saved stream ran at."""
        self.next_step = next_step
        self.applied_step = None if applied is None else applied.step
        if applied is not None:
            self.engine.restore_record(applied)
        self._set_loss_scale(loss_scale)

    # ---- Megatron's forward_backward_func ------------------------------------------------------------
    def forward_backward(
        self,
        *,
        forward_step_func,
        data_iterator: Iterator | list[Iterator],
        model: nn.Module | list[nn.Module],
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length: int | None = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        first_val_step: bool | None = None,
        adjust_tensor_shapes_fn: Callable | None = None,
        p2p_communicator=None,
        pg_collection=None,
        force_all_reduce: bool | None = False,
    ) -> list:
        """megatron-core's forward_backward_pipelining_without_interleaving contract: consumes
        num_microbatches microbatches of b_k from data_iterator and returns forward_data_store (one
        entry per microbatch on the last stage, [] elsewhere)."""
        unsupported = {"decoder_seq_length": decoder_seq_length, "adjust_tensor_shapes_fn": adjust_tensor_shapes_fn,
                       "p2p_communicator": p2p_communicator, "pg_collection": pg_collection}
        for name, value in unsupported.items():
            if value is not None:
                raise NotImplementedError(f"{name}={value!r} is not supported by asyncpp's {self.schedule} pipeline")
        if collect_non_loss_data and not forward_only:
            raise NotImplementedError("collect_non_loss_data=True is supported only with forward_only=True")
        model = self._check_model(model)
        _refuse_megatron_grad_machinery(model, None)  # a DDP wrapper may have come after the constructor
        if not forward_only:
            _refuse_megatron_grad_sync(model)
        self._set_activation_shape(seq_length, micro_batch_size)
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches={num_microbatches} must be >= 1")
        call = _Call(forward_step_func, data_iterator, model, num_microbatches, collect_non_loss_data)
        if not forward_only:
            call.loss_scale = self._set_loss_scale(loss_scale_of(model, self.mesh.device))
        self._call = call
        try:
            if forward_only:
                self._forward_only(num_microbatches)
            else:
                self._train_step(num_microbatches)
        finally:
            self._call = None
        return call.store

    def _set_loss_scale(self, scale: float) -> float:
        """fp16 loss scaling (config.grad_scale_func): the loss of b_k is multiplied by `scale` before its backward
        and b_k's summed gradient is multiplied by 1/scale in the step's reduction, before its norm, the clip and
        the update (GradientReduction's grad_scale); a step whose unscaled gradient is not finite (an fp16 overflow)
        is skipped on every stage by the global norm (semantics.md) and reported by optimizer_step() as
        update_successful=False. One scale serves a whole 2BW stream: the reduction of b_{k-1} is in flight with
        the scale of its call, so a change needs drain() first (each 1F1B call and synchronous step is flushed, so
        there it may change every call). megatron's dynamic scaler updates its scale in MegatronOptimizer.step,
        which is refused here (_refuse_megatron_grad_machinery): a scale comes from the user's grad_scale_func."""
        if scale != self._loss_scale:
            if not self.drained:  # not only the pending reductions: b_{k-1}'s backwards may still be running
                raise ValueError(f"config.grad_scale_func's loss scale changed from {self._loss_scale} to {scale} "
                                 f"while b_{self.next_step - 1} is in flight at the old one: a 2BW stream runs at "
                                 "one loss scale; call forward_backward_func.pipeline.drain() before changing it")
            self.engine.update.rescale(1.0 / scale)
            self._loss_scale = scale
        return scale

    def _check_model(self, model) -> nn.Module:
        if isinstance(model, list):
            if len(model) != 1:
                raise NotImplementedError(f"model as a list of {len(model)} chunks (virtual pipeline stages)")
            model = model[0]
        inner = model
        while inner is not self.model and hasattr(inner, "module"):
            inner = inner.module
        if inner is not self.model:
            raise ValueError("model is not (a wrapper of) the module this Pipeline2BW was built with")
        return model

    def _set_activation_shape(self, seq_length: int, micro_batch_size: int) -> None:
        config = getattr(_unwrap(self.model, "set_input_tensor"), "config", None)
        if getattr(config, "sequence_parallel", False):  # megatron's get_tensor_shapes: each TP rank's tokens
            if seq_length % self.mesh.dims.tp:
                raise ValueError(f"seq_length={seq_length} is not divisible by the tensor-parallel size "
                                 f"{self.mesh.dims.tp} (sequence_parallel=True splits the sequence over TP)")
            seq_length //= self.mesh.dims.tp
        dims = (seq_length, micro_batch_size) if self.sequence_first else (micro_batch_size, seq_length)
        shape = (*dims, self.hidden_size)
        comm = self.engine.comm
        if comm.shape == shape:
            return
        if not self.drained:
            raise ValueError(f"activation shape changed from {comm.shape} to {shape} while microbatches are in "
                             "flight: call drain() first")
        comm.flush()  # sends of the old shape own their buffers; nothing else depends on it
        comm.shape = shape

    def _train_step(self, m: int) -> None:
        P, k = self.mesh.num_stages, self.next_step
        if self.schedule == "1f1b" or k < self.sync_start_steps:  # flushed: b_k on x_k, as the simulator's sync step
            if not self.drained:  # (a 1F1B pipeline never opens a stream)
                raise RuntimeError(f"synchronous step {k} after a 2BW stream was opened (sync steps come first)")
            self._execute(self._sync_window(m, k))
        else:
            if not kind_of(self.schedule).serves(P, m):  # the registry's rule, in this API's words
                raise ValueError(f"schedule='{self.schedule}' needs num_microbatches >= pipeline stages, got "
                                 f"num_microbatches={m} < {P} stages: two weight versions cannot cover the in-flight work")
            if not self.drained and m != self._m:
                raise ValueError(f"num_microbatches changed from {self._m} to {m} while b_{k - 1} is in flight: "
                                 "call drain() first (e.g. at a batch-size ramp-up)")
            if self.drained:
                self._stream_start, self._m = k, m
            done = set().union(*self._windows)
            self._execute(self._window(m, k, done))
        self.next_step = k + 1

    def _execute(self, actions: list[Action]) -> None:
        # The engine's timeline would grow with every step of an unbounded run: keep the last call's
        # (engine.timer then measures that call's busy time). Losses are reported via loss_func.
        self.engine.timer.clear()
        self.engine.execute(actions)
        self._collect_losses()
        self.engine.drop_losses()
        self._windows.append(set(actions))
        applied = [a.step for a in actions if a.op is Op.UPDATE]
        if applied:
            self.applied_step = applied[-1]

    def _collect_losses(self) -> None:
        """Before the engine forgets the call's microbatch losses: nothing to take (loss_func reported them)."""

    # ---- microbatch forward (runs inside the engine, on the version the engine switched to) ---------
    def _forward(self, step: int, microbatch: int, x: Tensor | None) -> Tensor:
        call = self._call
        if call is None or step != self.next_step:
            raise RuntimeError(f"forward of b_{step} outside its call (window rule broken)")
        return self._forward_step(call, x)

    def _forward_step(self, call: _Call, x: Tensor | None) -> Tensor:
        """Megatron's forward_step: inject the input, run the user's step, compute the scaled loss."""
        _unwrap(call.model, "set_input_tensor").set_input_tensor([x])  # a list, as Megatron passes it
        output, loss_func = call.forward_step_func(call.data_iterator, call.model)
        _scale_moe_aux_loss(call.model, call.num_microbatches, call.loss_scale)
        if not self.mesh.is_last_stage:
            return output
        store = call.store
        if loss_func is None:
            store.append(output)
            return output
        if call.non_loss_data:
            store.append(loss_func(output, non_loss_data=True))
            return output
        outputs = loss_func(output)
        if len(outputs) == 3:
            loss, num_tokens, report = outputs
            loss = loss / torch.as_tensor(num_tokens, device=loss.device).clamp(min=1) / call.num_microbatches
        elif len(outputs) == 2:
            loss, report = outputs
            loss = loss / call.num_microbatches  # context parallel size is 1
        else:
            raise ValueError(f"loss_func returned {len(outputs)} values; expected (loss, report) or "
                             "(loss, num_tokens, report)")
        store.append(report)
        # megatron's backward_step scales the loss by config.grad_scale_func (schedules.py:477-478); the report
        # above is unscaled, as megatron's.
        return loss * call.loss_scale if call.loss_scale != 1.0 else loss

    @torch.no_grad()
    def _forward_only(self, m: int) -> None:
        """Evaluation on the newest weights through a drained pipeline (Megatron's forward_only path)."""
        if not self.drained:
            raise RuntimeError(f"forward_only=True needs a drained pipeline, but b_{self.next_step - 1} is in "
                               "flight: call forward_backward_func.pipeline.drain() first")
        versions, comm = self.engine.versions, self.engine.comm
        versions.use(versions.newest)
        receives = not self.mesh.is_first_stage
        if receives:
            comm.post_recv_forward()
        for i in range(m):
            if receives and i + 1 < m:
                comm.post_recv_forward()  # one microbatch ahead, as the engine does
            x = comm.recv_forward() if receives else None
            out = self._forward_step(self._call, x)
            if not self.mesh.is_last_stage:
                comm.send_forward(out)
        comm.flush()

    # ---- drain and optimizer report --------------------------------------------------------------
    def drain(self) -> None:
        """Finish every in-flight microbatch and pending update (all stages call it): before eval,
        checkpoint, a change of num_microbatches, and exit. Training may continue afterwards; the next
        call starts a new stream (a warm-up bubble), with the same mathematics (b_t on x_{t-1})."""
        if not self.drained and self.schedule == "2bw":
            done = set().union(*self._windows)
            self._execute(self._drain_window(done))
        self._stream_start = None
        self._windows.clear()
        self.engine.finish()
        self.engine.versions.use(self.engine.versions.newest)  # leave the module on x_T

    def optimizer_step(self) -> tuple[bool, float | None, int | None]:
        """Megatron's (update_successful, grad_norm, num_zeros_in_grad) of the newest applied update.

        No update happens here: it is part of the schedule. Under 2BW the update of b_t runs during
        call t+2 (or drain()), so after call k this reports step k-2 (`applied_step`); before any update
        it reports (True, None, None) so Megatron's loop advances its iteration counters normally.
        """
        if self.applied_step is None:
            return True, None, None
        record = self.engine.records[self.applied_step]
        return not record.skipped, record.grad_norm, None

    @property
    def records(self) -> dict:
        """update.StepRecord per step (grad/update norm, lr, skipped); pop what has been logged."""
        return self.engine.records
