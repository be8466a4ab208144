"""Tensor-parallel mechanics, with no knowledge of any model: shard a parameter in place, turn a
submodule into a TP region with hooks, a vocab-parallel embedding and cross entropy.

Invariants every function here keeps:

* Sharding takes this rank's chunk of the *full*, identically initialised weight, so a TP=N run
  starts from exactly the TP=1 weights (rank r holds chunk r of torch.chunk along the sharded dim).
* With a 1-rank group (or group=None) nothing is replaced, hooked or communicated: the model stays
  bit-identical to the plain one.
* Sequence parallelism shards activations outside TP regions along SEQ_DIM ([B, T/tp, hidden]);
  regions all-gather on entry and reduce-scatter on exit instead of copy_to / reduce_from.

Collectives are those of asyncpp.parallel.collectives; all run on the group given (the stage's TP group).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from asyncpp.parallel.collectives import (
    Group,
    bounded,
    copy_to,
    gather_for_region,
    gather_from,
    group_size,
    reduce_from,
    reduce_scatter,
    scatter_to,
)
from asyncpp.parallel.sharding import ParamSharding, ShardingPlan, layout_of

SEQ_DIM = 1
"""Activations are [B, T, hidden]: sequence parallelism splits T."""

VOCAB_GROUP_ATTR = "vocab_parallel_group"
"""Set on an LM head whose logits are left sharded over the vocabulary (see logits_loss_for)."""


def group_rank(group: Group | None) -> int:
    return 0 if group is None else dist.get_rank(group)


class _Shared:
    """Keywords (a process group) that a deepcopy of the model must share rather than copy: a copied
    model keeps using the same group, and ProcessGroup objects cannot be copied. Calling it calls
    fn(*args, **bound), so it doubles as a module hook bound to a group."""

    def __init__(self, fn: Callable | None = None, **bound) -> None:
        self.fn, self.bound = fn, bound

    def __call__(self, *args):
        return self.fn(*args, **self.bound)

    def __deepcopy__(self, memo: dict) -> _Shared:
        return self


# ---------------------------------------------------------------- parameters


def shard_parameter_(module: nn.Module, name: str, dim: int, group: Group | None) -> nn.Parameter:
    """Replace module.<name> by this rank's chunk along `dim` (a new Parameter, contiguous).

    Works on meta tensors (a dry run only needs the shapes). With one rank the Parameter object is
    returned untouched. Other modules sharing the old Parameter (tied weights) are not updated:
    the caller re-ties them.
    """
    full = module._parameters.get(name)
    if full is None:
        raise ValueError(f"{type(module).__name__} has no parameter {name!r} to shard; "
                         f"it has {sorted(module._parameters)}.")
    n = group_size(group)
    if n == 1:
        return full
    if full.shape[dim] % n:
        raise ValueError(f"cannot shard {type(module).__name__}.{name} of shape {tuple(full.shape)} along dim {dim} "
                         f"over {n} tensor-parallel ranks: {full.shape[dim]} is not divisible by {n}; "
                         "choose a tp degree that divides it.")
    with torch.no_grad():
        local = full.detach().chunk(n, dim)[group_rank(group)].clone(memory_format=torch.contiguous_format)
    shard = nn.Parameter(local, requires_grad=full.requires_grad)
    setattr(module, name, shard)
    if isinstance(module, nn.Linear) and name == "weight":  # keep the size attributes truthful
        module.out_features, module.in_features = shard.shape
    return shard


def shard_by_table(module: nn.Module, table: dict[str, int], group: Group | None) -> ShardingPlan:
    """Shard each `module`-relative parameter name in `table` along its dim; the plan of what was done
    ({} with one rank: nothing is split)."""
    if group_size(group) == 1:
        return {}
    plan: ShardingPlan = {}
    for name, dim in table.items():
        owner_name, _, leaf = name.rpartition(".")
        shard_parameter_(module.get_submodule(owner_name), leaf, dim, group)
        plan[name] = ParamSharding(tp_dim=dim)
    return plan


def prefixed(prefix: str, plan: ShardingPlan) -> ShardingPlan:
    """Module-relative names -> full-model names ("layers.3." + "mlp.up_proj.weight")."""
    return {prefix + name: layout for name, layout in plan.items()}


def all_reduce_partial_grads_(model: nn.Module, plan: ShardingPlan, group: Group | None) -> None:
    """Sum over TP the gradients the plan marks tp_grad_reduce (norm weights under sequence
    parallelism, per-head-shared weights): what the engine must do after backward, before clipping
    or the optimizer read them. Blocking; one all-reduce per parameter (they are small vectors)."""
    if group_size(group) == 1:
        return
    for name, p in model.named_parameters():
        if layout_of(plan, name).tp_grad_reduce and p.grad is not None:
            with bounded(f"the tensor-parallel all-reduce of {name}'s partial gradient", group):
                dist.all_reduce(p.grad, group=group)


# ---------------------------------------------------------------- regions (hooks)


def enter_region(x: Tensor, group: Group | None, sequence_parallel: bool) -> Tensor:
    """A column-parallel input: copy_to (backward all-reduce), or under sequence parallelism the all-gather of
    the sequence shards (backward reduce-scatter)."""
    return gather_for_region(x, SEQ_DIM, group) if sequence_parallel else copy_to(x, group)


def _enter_region(module: nn.Module, args: tuple, *, group: Group, sequence_parallel: bool) -> tuple:
    x, *rest = args
    return (enter_region(x, group, sequence_parallel), *rest)


def _leave_region(module: nn.Module, args: tuple, out: Tensor, *, group: Group, sequence_parallel: bool) -> Tensor:
    return reduce_scatter(out, SEQ_DIM, group) if sequence_parallel else reduce_from(out, group)


def column_parallel_input(module: nn.Module, group: Group | None, *, sequence_parallel: bool = False) -> None:
    """Hook `module`'s first input into a TP region: copy_to (backward all-reduce), or with sequence
    parallelism an all-gather of the sequence shards (backward reduce-scatter). Output left sharded."""
    if group_size(group) > 1:
        module.register_forward_pre_hook(_Shared(_enter_region, group=group, sequence_parallel=sequence_parallel))


def tp_region(module: nn.Module, group: Group | None, *, sequence_parallel: bool = False) -> None:
    """Make `module` (column-parallel in, row-parallel out, e.g. attention or an MLP) a TP region:
    its replicated input enters with copy_to and its partial output leaves summed (reduce_from);
    under sequence parallelism: all-gather along SEQ_DIM in, reduce-scatter along SEQ_DIM out."""
    if group_size(group) == 1:
        return
    column_parallel_input(module, group, sequence_parallel=sequence_parallel)
    module.register_forward_hook(_Shared(_leave_region, group=group, sequence_parallel=sequence_parallel))


def _gather_sequence(module: nn.Module, args: tuple, *, group: Group) -> tuple:
    x, *rest = args
    return (gather_from(x, SEQ_DIM, group), *rest)


def _keep_sequence_shard(module: nn.Module, args: tuple, out: Tensor, *, group: Group) -> Tensor:
    return scatter_to(out, SEQ_DIM, group)


def sequence_parallel_around(module: nn.Module, group: Group | None) -> None:
    """Under sequence parallelism, run a module that is replicated-in / replicated-out over TP (its
    own plan reduces inside, e.g. a tensor-parallel MoE) on the full sequence: all-gather the shards
    in (backward: keep this rank's slice, as the input gradient is already whole and replicated) and
    keep this rank's slice of the output (backward: all-gather)."""
    if group_size(group) == 1:
        return
    module.register_forward_pre_hook(_Shared(_gather_sequence, group=group))
    module.register_forward_hook(_Shared(_keep_sequence_shard, group=group))


# ---------------------------------------------------------------- vocabulary


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of an embedding table: tokens outside contribute zeros, and the partial
    lookups are summed over TP (or reduce-scattered along SEQ_DIM under sequence parallelism)."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, group: Group, *, sequence_parallel: bool) -> None:
        super().__init__()
        self.weight = weight  # [vocab_size / tp, hidden]
        self.num_embeddings, self.embedding_dim = vocab_size, weight.shape[1]
        self.vocab_start = group_rank(group) * weight.shape[0]
        self.vocab_end = self.vocab_start + weight.shape[0]
        self._group, self.sequence_parallel = _Shared(group=group), sequence_parallel

    @property
    def group(self) -> Group:
        return self._group.bound["group"]

    def forward(self, ids: Tensor) -> Tensor:
        n = group_size(self.group)
        if self.sequence_parallel and ids.shape[SEQ_DIM] % n:
            raise ValueError(f"sequence parallelism splits the sequence over {n} TP ranks, but seq_len="
                             f"{ids.shape[SEQ_DIM]} is not divisible by {n}; use a multiple of {n} "
                             "or turn sequence parallelism off.")
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        # masked_fill also zeroes the gradient the masked rows would send to row 0 of the shard.
        h = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter(h, SEQ_DIM, self.group) if self.sequence_parallel else reduce_from(h, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end})"


def vocab_parallel_embedding(embed: nn.Embedding, group: Group | None, *,
                             sequence_parallel: bool = False) -> nn.Module:
    """The module to put in `embed`'s place (its weight sharded along the vocabulary, dim 0).
    Returns `embed` itself with one rank. Parameter name stays "<embed>.weight"."""
    if group_size(group) == 1:
        return embed
    vocab = embed.weight.shape[0]
    weight = shard_parameter_(embed, "weight", 0, group)
    return VocabParallelEmbedding(weight, vocab, group, sequence_parallel=sequence_parallel)


def vocab_parallel_head(head: nn.Linear, group: Group | None, *, sequence_parallel: bool = False,
                        shard: bool = True) -> None:
    """Column-parallel LM head over the vocabulary, logits left sharded [B, T, vocab / tp].
    shard=False when the weight was already sharded through a tied embedding."""
    if group_size(group) == 1:
        return
    if shard:
        shard_parameter_(head, "weight", 0, group)
    head.out_features = head.weight.shape[0]
    column_parallel_input(head, group, sequence_parallel=sequence_parallel)
    setattr(head, VOCAB_GROUP_ATTR, _Shared(group=group))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross entropy of logits sharded over the vocabulary, in fp32, without gathering them.

    Two all-reduces: the max (for stability; not differentiated: it cancels in the loss), then the
    target logit and the sum of exponentials together. Backward is local: softmax - onehot. The shards may
    have any widths (a vocabulary-parallel head over pipeline stages, asyncpp.parallel.vocab_parallel): each
    rank names the first vocabulary id of its own, `start`.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, group: Group, ignore_index: int,  # type: ignore[override]
                start: int) -> Tensor:
        t = targets.reshape(-1)
        x = logits.float().reshape(t.shape[0], logits.shape[-1])  # [N, this rank's shard] (the shard may be empty)
        v_local = x.shape[1]
        # A rank may hold no rows (a stage whose layers already fill its time): it still joins the collectives.
        gmax = x.max(dim=1).values if v_local else x.new_full((x.shape[0],), float("-inf"))
        with bounded("the vocab-parallel cross entropy's all-reduce of the logits' max", group):
            dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
        x = x - gmax.unsqueeze(1)
        mine = (t >= start) & (t < start + v_local)
        local_t = (t - start).masked_fill(~mine, 0)
        exp = x.exp()
        target = x.gather(1, local_t.unsqueeze(1)).squeeze(1) * mine if v_local else x.new_zeros(x.shape[0])
        stats = torch.stack([target, exp.sum(dim=1)])
        with bounded("the vocab-parallel cross entropy's all-reduce of the target logit and the sum of "
                     "exponentials", group):
            dist.all_reduce(stats, group=group)
        target_logit, sum_exp = stats
        valid = t != ignore_index
        count = valid.sum()
        loss = ((sum_exp.log() - target_logit) * valid).sum() / count
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(1)), local_t, mine, valid, count)
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        softmax, local_t, mine, valid, count = ctx.saved_tensors
        rows = torch.arange(softmax.shape[0], device=softmax.device)
        g = softmax  # reused in place to save [N, V/tp] floats; a second backward fails loudly (version check)
        if g.shape[1]:  # a rank without rows has an empty gradient
            g[rows, local_t] -= mine.to(g.dtype)
        g.mul_((valid.to(g.dtype) * (grad / count)).unsqueeze(1))
        return g.reshape(ctx.logits_shape).to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, targets: Tensor, group: Group | None, *,
                                 ignore_index: int = -100, vocab_start: int | None = None) -> Tensor:
    """logits [B, T, V/tp] (this rank's vocabulary chunk, rank order), targets [B, T] full-vocabulary
    ids -> scalar mean loss, equal to F.cross_entropy(full logits.float(), targets) up to reduction
    order, with the matching gradient for this rank's chunk. `group`: two or more ranks (one rank's logits are
    whole: asyncpp.core.loss.cross_entropy, which core.loss.logits_loss_for picks then). vocab_start: the first
    vocabulary id of this rank's chunk when the chunks are not equal (default: rank x width, TP's equal chunks)."""
    if group_size(group) == 1:
        raise ValueError("vocab_parallel_cross_entropy: the group has one rank, whose logits are whole; use "
                         "asyncpp.core.loss.cross_entropy (core.loss.logits_loss_for chooses between them)")
    start = group_rank(group) * logits.shape[-1] if vocab_start is None else vocab_start
    return _VocabParallelCrossEntropy.apply(logits, targets, group, ignore_index, start)
