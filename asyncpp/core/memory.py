"""Memory of one rank, item by item: weight versions, fp32 masters, optimizer state, Error Feedback,
gradient sums and activations. Printed at the start of a run; the same functions size a dry run on the
meta device (every tensor below may be a meta tensor: only shapes and dtypes are read).

Two kinds of numbers, and the report says which is which:

* allocated: the bytes of the distinct storages behind the tensors that exist (a storage shared by two
  items, e.g. fp32 masters sharing the newest version's buffer, is counted once, in the first item);
* estimated: things that do not exist yet when the run starts. Optimizer state is created by the first
  step, so it is sized by one step of a copy of the optimizer on meta tensors (no memory, exact shapes);
  activations come from `activation_bytes_per_token`, a count of the tensors autograd saves in the local
  (PyTorch) layers, checked against a saved-tensor-hook measurement in tests/unit/test_memory.py.

Phases: a stage runs one action at a time, and what lives only inside some actions (the activations of the
microbatches in flight, the loss's and the vocabulary head's scratch, the update's fp32 copy of x_t and Error
Feedback's per-parameter temporaries) is tagged with the phase it belongs to. The total is what is held through the
step plus the largest action's share, not the sum of every item's own maximum: issue 33's traced step showed the
update scratch is never live at the forward/backward peak (the sum over-counted it by 6-13%), nor the vocabulary
head's T scratch in a FORWARD. A pipeline stage's plan walks its action list (`action_loads`: the microbatches in
flight, the gradient sets that exist and the head's buffers during each action), adds each action's own scratch and
takes the largest action of each kind (`MemoryReport.peaks`, pipeline/memory.py); without an action list (the
simulator) the larger of the two phases' item sums.

Not counted: the CUDA context and allocator caching (~0.5-1 GiB per GPU), communication buffers,
temporaries of a single op (a matmul's workspace), the activations a fused kernel saves instead of the
local ones (TE, FLA: pending a GPU measurement, docs/gpu.md).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from asyncpp.config import RunConfig
from asyncpp.optim.build import AnyOptimizer
from asyncpp.schedules.actions import Action, Op
from asyncpp.schedules.build import build_schedule
from asyncpp.schedules.invariants import in_flight_after, peak_in_flight
from asyncpp.schedules.registry import kind_of

ALLOCATED, ESTIMATED = "allocated", "estimated"
HELD, FORWARD_BACKWARD, UPDATE, PER_ACTION = "", "forward/backward", "update", "per action"
"""An item's phase: held through the step, or live only in the forward/backward actions, or only inside UPDATE; or
counted action by action (MemoryReport.peaks), the item giving its own peak."""
PHASES = (FORWARD_BACKWARD, UPDATE)
_MIB = 1024 * 1024


@dataclass(frozen=True)
class MemoryItem:
    name: str
    nbytes: int
    how: str
    """ALLOCATED (measured from existing tensors) or ESTIMATED (see the module docstring)."""
    phase: str = HELD
    """HELD, FORWARD_BACKWARD, UPDATE or PER_ACTION (see the module docstring)."""


@dataclass(frozen=True)
class ActionPeak:
    """The largest share of one kind of action (FORWARD, T, UPDATE...) above the held items: `action` is where."""

    kind: str
    action: str
    nbytes: int
    what: str


@dataclass
class MemoryReport:
    title: str
    items: list[MemoryItem] = field(default_factory=list)
    peaks: list[ActionPeak] = field(default_factory=list)
    """Per kind of action, the most it holds above the held items (from the stage's action list); empty: the
    phases' item sums stand in for it."""

    @property
    def total(self) -> int:
        """What is held through the step plus the largest action's share (module docstring)."""
        if self.peaks:
            return self.phase_bytes(HELD) + max(p.nbytes for p in self.peaks)
        return self.phase_bytes(HELD) + max(self.phase_bytes(p) for p in PHASES)

    def phase_bytes(self, phase: str) -> int:
        return sum(i.nbytes for i in self.items if i.phase == phase)

    def get(self, name: str) -> int:
        """Bytes of the item whose name starts with `name` (KeyError if none)."""
        for item in self.items:
            if item.name.startswith(name):
                return item.nbytes
        raise KeyError(f"no memory item named {name!r}; items: {[i.name for i in self.items]}")

    def table(self) -> str:
        phased = any(i.phase != HELD for i in self.items)
        if self.peaks:
            sums = [(f"+ in {p.kind} ({p.action})", p.nbytes, p.what) for p in self.peaks]
            how = "held + the largest action's share"
        else:
            sums = [(f"+ {p} phase", self.phase_bytes(p), "") for p in PHASES] if phased else []
            how = "held + the larger phase"
        width = max([len(i.name) for i in self.items] + [len("total")] + [len(n) for n, _, _ in sums])
        lines = [self.title, f"  {'item':<{width}} {'MiB':>10}  how"]
        lines += [f"  {i.name:<{width}} {i.nbytes / _MIB:>10.2f}  {i.how}" + _phase_note(i.phase) for i in self.items]
        if phased:
            lines.append(f"  {'held':<{width}} {self.phase_bytes(HELD) / _MIB:>10.2f}")
            lines += [f"  {n:<{width}} {b / _MIB:>10.2f}  {what}".rstrip() for n, b, what in sums]
        lines.append(f"  {'total':<{width}} {self.total / _MIB:>10.2f}" + (f"  ({how})" if phased else ""))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "total_bytes": self.total,
                "phase_bytes": {p or "held": self.phase_bytes(p) for p in (HELD, *PHASES)},
                "items": [{"name": i.name, "bytes": i.nbytes, "how": i.how, "phase": i.phase or "held"}
                          for i in self.items],
                "peaks": [vars(p) for p in self.peaks]}


# ---- tensors that exist ------------------------------------------------------------------------

def _storage_id(t: Tensor) -> int:
    # The StorageImpl's address: the one identity of a storage that views, .data aliases and meta
    # tensors all share (data_ptr() is 0 for every meta tensor).
    return t.untyped_storage()._cdata


def storage_bytes(tensors: Iterable[Tensor], counted: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (a tensor and its views count once). Storages
    already in `counted` count 0; the ones counted here are added to it."""
    counted = set() if counted is None else counted
    total = 0
    for t in tensors:
        key = _storage_id(t)
        if key not in counted:
            counted.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _optimizers(optimizer: AnyOptimizer) -> list:
    inner = getattr(optimizer, "optimizers", None)
    return list(inner.values()) if isinstance(inner, dict) else [optimizer]


def optimizer_state_tensors(optimizer: AnyOptimizer) -> list[Tensor]:
    """Every tensor in the optimizer's per-parameter state (an OptimizerSet's inner optimizers included)."""
    return [v for opt in _optimizers(optimizer) for state in opt.state.values()
            for v in state.values() if isinstance(v, Tensor)]


def _shadow(optimizer: AnyOptimizer, twins: dict[int, Tensor]):
    """A copy of `optimizer` over `twins` (id(param) -> twin) with empty state. Built by hand, not with
    deepcopy: torch optimizers pickle only defaults/state/param_groups, which would drop attributes such
    as process groups that step() reads; those are shared with the original here (read-only)."""
    shadow = object.__new__(type(optimizer))
    shadow.__dict__.update(optimizer.__dict__)
    inner = getattr(optimizer, "optimizers", None)
    if isinstance(inner, dict):  # an OptimizerSet: its param_groups are its optimizers' groups
        shadow.optimizers = {k: _shadow(opt, twins) for k, opt in inner.items()}
        return shadow
    # Fused kernels refuse meta tensors; the state they keep is the same as the unfused path's.
    shadow.param_groups = [{**g, "params": [twins[id(p)] for p in g["params"]],
                            **({"fused": False} if g.get("fused") else {})} for g in optimizer.param_groups]
    shadow.state = collections.defaultdict(dict)
    return shadow


def _meta_shadow_state(optimizer: AnyOptimizer) -> list[Tensor]:
    """The state one step would create, from a copy of the optimizer over meta twins of its parameters
    (meta ops allocate nothing and run no kernels, so this is free at any model size)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    twins = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad) for p in params}
    shadow = _shadow(optimizer, twins)
    for twin in twins.values():
        twin.grad = torch.empty_like(twin)
    shadow.step()
    return optimizer_state_tensors(shadow)


def optimizer_state_bytes(optimizer: AnyOptimizer, counted: set[int] | None = None) -> tuple[int, str]:
    """(bytes, how): the allocated state if the optimizer has stepped, else one meta step's state (or, if
    the optimizer cannot step on meta tensors, 2 fp32 tensors per parameter, AdamW's, as a stated guess)."""
    existing = optimizer_state_tensors(optimizer)
    if existing:
        return storage_bytes(existing, counted), ALLOCATED
    try:
        return storage_bytes(_meta_shadow_state(optimizer)), ESTIMATED + " (one step on meta tensors)"
    except Exception as e:  # noqa: BLE001 - an optimizer with host syncs (.item()) cannot run on meta
        params = [p for group in optimizer.param_groups for p in group["params"]]
        guess = 2 * _numel_bytes(params, torch.float32)
        return guess, f"{ESTIMATED} (guess: 2 fp32 tensors per parameter; meta step failed: {type(e).__name__})"


def materialize_optimizer_state(optimizer: AnyOptimizer) -> None:
    """Dry runs on meta parameters: take one step so the state exists (as meta tensors) and is counted
    as allocated. Never call it on real parameters: it applies an update with garbage gradients."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(p.device.type != "meta" for p in params):
        raise ValueError("materialize_optimizer_state() is for meta parameters only (it steps with empty gradients)")
    for group in optimizer.param_groups:
        if group.get("fused"):
            group["fused"] = False
    for p in params:
        p.grad = torch.empty_like(p)
    optimizer.step()
    for p in params:
        p.grad = None


def _numel_bytes(tensors: Iterable[Tensor], dtype: torch.dtype | None = None) -> int:
    return sum(t.numel() * (dtype.itemsize if dtype is not None else t.element_size()) for t in tensors)


# ---- activations -------------------------------------------------------------------------------

class LayerShapes(Protocol):
    """What the activation count reads from a model config (model_zoo.ModelConfig satisfies it)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    layer_types: tuple[str, ...]
    moe: Any
    gdn: Any


def _norm_bytes(h: int, c: int) -> int:
    # RMSNorm: its fp32 input, the per-token rstd, the normalised value (the weight's gradient needs
    # it) and its output, which the next projection saves as its input.
    return 4 * h + 4 + 2 * c * h


def _attention_bytes(cfg: LayerShapes, c: int, micro_batch_size: int) -> float:
    hq, hkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    # SDPA saves rotated q and k, v, its output (o_proj's input is a view of it) and the fp32 logsumexp.
    sdpa = c * (2 * hq + 2 * hkv) + 4 * cfg.num_heads
    # The cos/sin tables, per position (shared by the batch): fp32 as cached, or cast copies for q and k.
    tables = (2 if c == 4 else 4) * cfg.head_dim * c / micro_batch_size
    return sdpa + tables


def _gdn_bytes(cfg: LayerShapes, c: int, seq_len: int, micro_batch_size: int) -> float:
    g = cfg.gdn
    hk, hv, h, chunk = g.num_heads * g.head_k_dim, g.num_heads * g.head_v_dim, g.num_heads, min(g.chunk_size, seq_len)
    # Counted from model_zoo/gated_deltanet.py's saved tensors: projections and convolutions in the
    # compute dtype; q/k normalisation, gates and the gated output norm in fp32; inside the chunked
    # kernel (on the sequence padded to whole chunks) the WY/UT matrices [C, C] per head and chunk and
    # one [Dk, Dv] state per chunk, in fp32. Within 1% of a measurement when seq_len is a multiple of
    # chunk_size (what training uses), within ~12% otherwise (padding copies depend on the layout).
    padded = math.ceil(seq_len / chunk) * chunk / seq_len
    compute = c * (4 * hk + 3 * hv) + c * (2 * hk + hv) * (g.conv_size - 1) / seq_len
    outside = 4 * (6 * hk + 8 * hv + 12 * h)
    inside = 4 * (5 * hk + 6 * h * chunk + h * g.head_k_dim * g.head_v_dim / chunk) * padded
    masks = 2 * chunk * chunk / (micro_batch_size * seq_len)
    return compute + outside + inside + masks


def _swiglu_bytes(ffn: int, c: int) -> int:
    return 4 * c * ffn  # gate and up outputs, silu(gate), and down's input


def _moe_bytes(cfg: LayerShapes, c: int, imbalance: float) -> float:
    moe, h = cfg.moe, cfg.hidden_size
    k, e, f = moe.top_k, moe.num_experts, moe.expert_ffn_hidden_size
    # The grouped expert buffer ([E, busiest expert's rows, h] in the padded-bmm kernel, so `imbalance` =
    # busiest / mean expert load; ~1 with grouped_mm) and each expert's SwiGLU on it.
    grouped = k * imbalance * (c * h + _swiglu_bytes(f, c))
    # Per assignment: its gathered input row, its expert output and router weight (saved by the weighting),
    # the weighted output (saved by the scatter-add); the int64 index vectors (sort order, token of each
    # row, buffer position, top-k), the fp32 top-k weights and their sum, the fp32 router softmax.
    routed = k * (3 * c * h + c) + 32 * k + 4 * k + 4 + 4 * e
    shared = 0
    if moe.shared_expert_ffn_hidden_size:
        shared = _swiglu_bytes(moe.shared_expert_ffn_hidden_size, c) + c * h + c
    return grouped + routed + shared


def activation_bytes_per_token(cfg: LayerShapes, layer: int, dtype: torch.dtype, seq_len: int,
                               micro_batch_size: int, moe_imbalance: float = 1.0) -> float:
    """Bytes autograd keeps per token for the backward of Block `layer` (local layers, see module doc)."""
    c = dtype.itemsize
    h = cfg.hidden_size
    kind = cfg.layer_types[layer]
    if kind == "attn":
        mixer = _attention_bytes(cfg, c, micro_batch_size)
    elif kind == "gdn":
        mixer = _gdn_bytes(cfg, c, seq_len, micro_batch_size)
    else:
        raise ValueError(f"model.layer_types[{layer}]={kind!r} has no activation count; known: attn, gdn")
    mlp = _moe_bytes(cfg, c, moe_imbalance) if cfg.moe is not None else _swiglu_bytes(cfg.ffn_hidden_size, c)
    return 2 * _norm_bytes(h, c) + mixer + mlp


def recomputed_layer_bytes_per_token(cfg: LayerShapes, layer: int, mode: str, dtype: torch.dtype, seq_len: int,
                                    micro_batch_size: int, moe_imbalance: float = 1.0) -> float:
    """What Block `layer` keeps per token under train.recompute `mode` (asyncpp/core/recompute.py): full keeps
    its input only; selective drops the token mixer's saved tensors (its input is the mixer norm's output,
    already counted with the norm). Not counted: while a recomputed block's backward runs, that one block's
    activations of one microbatch are live again (at most one block's worth more than this)."""
    whole = activation_bytes_per_token(cfg, layer, dtype, seq_len, micro_batch_size, moe_imbalance)
    if mode == "full":
        return dtype.itemsize * cfg.hidden_size
    if mode == "selective":
        c = dtype.itemsize
        mixer = (_attention_bytes(cfg, c, micro_batch_size) if cfg.layer_types[layer] == "attn"
                 else _gdn_bytes(cfg, c, seq_len, micro_batch_size))
        return whole - mixer
    return whole


def activation_bytes(cfg: LayerShapes, layers: Iterable[int], *, dtype: torch.dtype, micro_batch_size: int,
                     seq_len: int, first: bool, last: bool, moe_imbalance: float = 1.0,
                     recompute: Sequence[str] | None = None, head: bool = True) -> int:
    """Saved activations of one microbatch's forward through a stage: the given Blocks, plus the token
    ids on the first stage, plus the final norm, LM head and fp32 cross entropy on the last.
    `moe_imbalance`: mean over MoE layers of busiest / mean expert load (1.0 = balanced router).
    `recompute`: the train.recompute mode of every layer of the model (None: none). `head=False`
    (parallel.head=vocab): the last stage's forward ends with the final norm; the head's logits and labels
    are every stage's, held from S to T (VocabHead.memory_items)."""
    tokens = micro_batch_size * seq_len
    layers = list(layers)
    per_token = sum(recomputed_layer_bytes_per_token(cfg, i, recompute[i] if recompute else "none", dtype, seq_len,
                                                     micro_batch_size, moe_imbalance) for i in layers)
    if first:
        per_token += 8 * (seq_len + 1) / seq_len  # the int64 token block the embedding's backward indexes
    if last and not head:
        per_token += _norm_bytes(cfg.hidden_size, dtype.itemsize)
    elif last:
        c = dtype.itemsize
        # Final norm, the head's input, and log_softmax's fp32 output over the vocabulary (the loss is
        # computed in fp32 whatever the compute dtype: asyncpp.core.loss.cross_entropy).
        per_token += _norm_bytes(cfg.hidden_size, c) + 4 * cfg.vocab_size + (0 if first else 8)
    return math.ceil(per_token * tokens)


def backward_scratch_bytes(params: Sequence[Tensor], *, grad_itemsize: int, tokens: int, vocab_size: int,
                           last: bool) -> int:
    """Bytes the last stage's backward holds for a moment above its saved activations and gradient sums.

    The fp32 cross entropy's backward holds two [tokens, vocab] fp32 tensors at once (the gradients of the
    log-probabilities and of the logits: 8 T V); then, while the head's weight gradient G (the stage's largest
    parameter) is formed in a fresh tensor before autograd adds it into the accumulated one, the logits'
    gradient is still alive but the log-probabilities (counted with the activations) are gone. So

        last stage: max(8 T V, G) (+ c T V below fp32: the logits' gradient cast back to the compute dtype)

    On other stages the same happens with smaller tensors: the first stage's embedding gradient is formed
    when its microbatch's activations are already freed, so it is not counted (a single op's temporaries are
    not, see the module docstring). Checked against live allocations in fp32 in tests/unit/test_memory.py;
    the bf16 term is the GPU's arithmetic (the CPU's bf16 matmul backward adds fp32 temporaries of its own)."""
    if not last:
        return 0
    largest = max((p.numel() for p in params), default=0) * grad_itemsize
    cast = grad_itemsize * tokens * vocab_size if grad_itemsize != 4 else 0
    return max(8 * tokens * vocab_size, largest) + cast


def measure_saved_activations(fn: Callable[[], Any], exclude: Iterable[Tensor] = ()) -> tuple[int, Any]:
    """(bytes of the distinct storages autograd saves while `fn()` runs, fn's result). Tensors sharing
    storage with `exclude` (pass the parameters) are not activations and are not counted."""
    skip = {_storage_id(t) for t in exclude}
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        key = _storage_id(t)
        if key not in skip:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return sum(saved.values()), result


def stage_actions(schedule: str, stage: int, num_stages: int, num_microbatches: int, steps: int = 3
                  ) -> list[Action]:
    """`stage`'s actions of `steps` steps at its steady delay (the schedule's own list)."""
    delay = kind_of(schedule).stage_delay(stage, num_stages)  # pipedream: P-1-s, not 1
    return build_schedule(schedule, stage, num_stages, num_microbatches, [delay] * steps)


def in_flight_microbatches(schedule: str, stage: int, num_stages: int, num_microbatches: int, steps: int = 3
                           ) -> int:
    """Most microbatches whose forward ran and backward did not, at once, on `stage` (from the
    schedule's own action list, so it is right for every kind: m for GPipe, P - s for 1F1B/2BW)."""
    return peak_in_flight(stage_actions(schedule, stage, num_stages, num_microbatches, steps))


def error_feedback_scratch_bytes(masters: Sequence[Tensor], ef_lambda: float) -> int:
    """What ErrorFeedback.apply (core/staleness.py) holds above the EF buffer inside UPDATE: it runs one parameter at
    a time, and for the largest one the new u_t exists next to the u_{t-1} it replaces, plus the temporary
    u_t - u_{t-1}: two copies of the largest parameter, in the masters' dtype. With λ = 0 it does nothing (and there
    is no buffer): 0."""
    largest = max((q.numel() * q.element_size() for q in masters), default=0)
    return 2 * largest if ef_lambda else 0


@dataclass(frozen=True)
class VocabHeld:
    """The most of each of a vocabulary-parallel head's buffers (pipeline/vocab_head.py) a stage holds at once,
    read off its placed schedule (core/vocab_split.vocab_pipeline: the S and T positions the engine runs)."""

    passes: int
    """S done, T not: the fp32 logits [N, rows], the labels and the gathered statistics of each."""
    hidden: int
    """Stages but the last: the received hidden states [mb, seq, h] of each S until its T (the engine posts
    the broadcast at S: S is not a compute action receives_ahead posts early). The last stage: its sent
    hidden states still held after the microbatch's BACKWARD freed its activations, until UPDATE(t) retires
    the broadcast (before that B they are the final norm's output, counted with the activations)."""
    input_grads: int
    """The fp32 partial input gradients [mb, seq, h] of the reduce: from T until UPDATE(t) retires it (the
    last stage: until the microbatch's BACKWARD takes the sum)."""
    accumulators: int
    """Steps whose shard gradient [rows, h] (fp32) waits for UPDATE_START(t): a T of b_{t+1} may run first."""


@dataclass(frozen=True)
class ActionLoad:
    """What a stage holds while one of its actions runs, besides the step's held items: the microbatches whose
    activations are live, the vocabulary head's buffers and the gradient sets. While an action runs it holds what
    was there before it and what it leaves (a FORWARD's new activations, a BACKWARD's not yet freed ones), except
    an UPDATE, which retires its step's head buffers before it applies the update (StageEngine._update), but holds
    the gradient set it consumes."""

    action: Action
    in_flight: int
    vocab: VocabHeld
    grad_sets: int
    """Steps whose gradient sum exists: from the step's first BACKWARD to the end of its UPDATE (a recycled fp32
    set, pipeline/weights.WeightVersions.recycle, stays once allocated)."""


def action_loads(actions: Sequence[Action], last: bool, recycled_grads: bool = False) -> list[ActionLoad]:
    """ActionLoad of every action of one stage's list (`last`: the last stage). An UPDATE holds the step's gradient
    set it consumes but not the head's buffers it retires first."""
    loads = []
    before = (0, VocabHeld(0, 0, 0, 0), 0)
    for a, after in zip(actions, _held_after(actions, last, recycled_grads)):
        in_flight = max(before[0], after[0])
        vocab = VocabHeld(*map(max, vars(before[1]).values(), vars(after[1]).values()))
        if a.op is Op.UPDATE:
            in_flight, vocab = after[0], after[1]
        loads.append(ActionLoad(a, in_flight, vocab, max(before[2], after[2])))
        before = after
    return loads


def vocab_held(actions: Sequence[Action], last: bool) -> VocabHeld:
    """The peaks of VocabHeld's buffers over one stage's action list, each taken on its own (their sum bounds
    the combined peak from above)."""
    held = [vars(v) for _, v, _ in _held_after(actions, last)] or [vars(VocabHeld(0, 0, 0, 0))]
    return VocabHeld(**{k: max(h[k] for h in held) for k in held[0]})


def _held_after(actions: Sequence[Action], last: bool, recycled_grads: bool = False):
    """(microbatches in flight, VocabHeld, gradient sets) after each action of the list."""
    passes: set[tuple[int, int]] = set()
    hidden: set[tuple[int, int]] = set()
    grads: set[tuple[int, int]] = set()
    steps: set[int] = set()
    summing: set[int] = set()
    most_sets = 0
    for a, in_flight in zip(actions, in_flight_after(actions)):
        if a.op is Op.BACKWARD:
            summing.add(a.step)
        elif a.op is Op.UPDATE:
            summing.discard(a.step)
        most_sets = max(most_sets, len(summing))
        key = (a.step, a.microbatch)
        if a.op is Op.VOCAB_FORWARD:
            passes.add(key)
            if not last:
                hidden.add(key)
        elif a.op is Op.VOCAB_BACKWARD:
            passes.discard(key)
            hidden.discard(key)
            grads.add(key)
            steps.add(a.step)
        elif a.op is Op.BACKWARD and last:
            grads.discard(key)  # the sum is taken
            hidden.add(key)  # the sent buffer outlives the activations until UPDATE(t)
        elif a.op is Op.UPDATE_START:
            steps.discard(a.step)
        elif a.op is Op.UPDATE:
            hidden = {k for k in hidden if not last or k[0] > a.step}
            grads = {k for k in grads if last or k[0] > a.step}
        yield in_flight, VocabHeld(len(passes), len(hidden), len(grads), len(steps)), \
            most_sets if recycled_grads else len(summing)


# ---- reports -----------------------------------------------------------------------------------

def versions_report(versions, optimizer: AnyOptimizer, *, error_feedback: Sequence[Tensor], activation_bytes_per_mb: int,
                    in_flight: int, grad_buffers: int, title: str, backward_scratch: int = 0,
                    extra: Sequence[MemoryItem] = (), ef_lambda: float = 0.0, peaks: Sequence[ActionPeak] = ()
                    ) -> MemoryReport:
    """One pipeline stage (asyncpp.pipeline.weights.WeightVersions): K versions in the compute dtype, the fp32
    masters if separate, the optimizer state, the EF buffer, the fp32 gradients (`grad_buffers` of them
    live at once: 2 in 2BW, whose lazy update overlaps the next step's backward) and activations.

    Phases (module docstring): `in_flight` microbatches' activations and the backward scratch in the
    forward/backward phase; the fp32 copy of x_t and Error Feedback's per-parameter scratch (`ef_lambda`) in the
    update phase; `extra` items carry their own. `peaks`: the largest action of each kind (ActionPeak), which the
    total takes instead of the phases' sums (pipeline/memory.py computes them from the stage's action list)."""
    counted: set[int] = set()
    buffers = [t for version in versions.buffers for t in version]
    dtype = buffers[0].dtype if buffers else torch.float32
    items = [MemoryItem(f"weight versions ({versions.num_buffers} x {dtype_name(dtype)})",
                        storage_bytes(buffers, counted), ALLOCATED)]
    held = [q for q in versions.masters if q is not None]  # bf16 + distributed optimizer: the owned share
    masters = storage_bytes(held, counted)
    items.append(MemoryItem("fp32 master weights" + ("" if versions.mixed else " (share the newest version)"),
                            masters, ALLOCATED))
    items += _optimizer_and_rest(optimizer, error_feedback, versions.params, counted, grad_buffers)
    items.append(_activation_item(activation_bytes_per_mb, in_flight))
    if backward_scratch:
        items.append(MemoryItem("loss backward scratch (fp32 logits gradients)", backward_scratch, ESTIMATED,
                                FORWARD_BACKWARD))
    if versions.mixed:  # begin_update's fp32 copy of x_t (the masters held here), alive during the update
        items.append(MemoryItem("update scratch (fp32 x_t)", _numel_bytes(held), ESTIMATED, UPDATE))
    owned = held if versions.mixed else versions.params
    items.append(MemoryItem("update scratch: error feedback's u_t of the largest parameter",
                            error_feedback_scratch_bytes(owned, ef_lambda), ESTIMATED, UPDATE))
    items += extra
    return MemoryReport(title, items, list(peaks))


def simulator_report(sim, *, activation_bytes_per_mb: int, title: str) -> MemoryReport:
    """The single-process simulator (asyncpp.reference.simulator): the model's parameters, its past versions
    (allocated as the run goes: estimated from shapes until then), masters, optimizer, EF, one
    microbatch in flight, and the fp32 copy of x_t each step makes."""
    counted: set[int] = set()
    past = sim.num_past_versions
    params_bytes = storage_bytes(sim.params, counted)
    dtype = sim.params[0].dtype if sim.params else torch.float32
    history = [t for version in sim.history for t in version]
    past_bytes = storage_bytes(history, counted) if len(sim.history) == past else _numel_bytes(sim.params) * past
    items = [
        MemoryItem(f"weights ({dtype_name(dtype)})", params_bytes, ALLOCATED),
        MemoryItem(f"past versions ({past} x {dtype_name(dtype)})", past_bytes,
                   ALLOCATED if len(sim.history) == past else ESTIMATED),
        MemoryItem("fp32 master weights" + ("" if sim.mixed else " (are the weights)"),
                   storage_bytes(sim.masters, counted), ALLOCATED),
    ]
    items += _optimizer_and_rest(sim.optimizer, sim.error_feedback.prev_update, sim.masters, counted, 1)
    items.append(MemoryItem("step scratch (fp32 x_t)", _numel_bytes(sim.masters), ESTIMATED, UPDATE))
    items.append(MemoryItem("update scratch: error feedback's u_t of the largest parameter",
                            error_feedback_scratch_bytes(sim.masters, sim.error_feedback.lam), ESTIMATED, UPDATE))
    items.append(_activation_item(activation_bytes_per_mb, 1))  # the step runs after the microbatch's backward
    return MemoryReport(title, items)


def _optimizer_and_rest(optimizer: AnyOptimizer, error_feedback: Sequence[Tensor], masters: Sequence[Tensor], counted: set[int],
                        grad_buffers: int) -> list[MemoryItem]:
    state, how = optimizer_state_bytes(optimizer, counted)
    return [
        MemoryItem("optimizer state (fp32)", state, how),
        MemoryItem("error feedback buffer", storage_bytes(error_feedback, counted), ALLOCATED),
        MemoryItem(f"gradients (fp32, {grad_buffers} live)", grad_buffers * _numel_bytes(masters, torch.float32),
                   ESTIMATED),
    ]


def _activation_item(per_microbatch: int, in_flight: int) -> MemoryItem:
    return MemoryItem(f"activations ({in_flight} microbatch{'es' if in_flight != 1 else ''} in flight)",
                      per_microbatch * in_flight, ESTIMATED, FORWARD_BACKWARD)


def _phase_note(phase: str) -> str:
    if phase == PER_ACTION:
        return "; its peak (counted per action below)"
    return f"; {phase} only" if phase else ""


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def simulator_run_report(sim, model_cfg: LayerShapes, cfg: RunConfig) -> MemoryReport:
    """The report pretrain.py prints when a single process simulates the run (`cfg`: a RunConfig): the
    whole model, one microbatch of cfg.train's shape in flight, MoE routing assumed balanced."""
    t = cfg.train
    dtype = sim.params[0].dtype if sim.params else torch.float32
    per_mb = activation_bytes(model_cfg, range(len(model_cfg.layer_types)), dtype=dtype,
                              micro_batch_size=t.micro_batch_size, seq_len=t.seq_len, first=True, last=True)
    title = (f"memory of this process: single-process {cfg.schedule.name} (simulating pp={cfg.parallel.pp}), "
             f"precision={t.precision}, microbatch {t.micro_batch_size}x{t.seq_len}")
    return simulator_report(sim, activation_bytes_per_mb=per_mb, title=title)
