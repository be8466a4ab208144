"""Expert (EP) and tensor (TP) parallelism for a model_zoo MoE layer, applied after the model is built.

parallelize_moe() shards the layer's weights in place and installs an ExpertDispatcher, the object
behind the MoE's dispatcher seam (enter / scale / dispatch / leave, see model_zoo.moe.Dispatcher).
The MoE is duck-typed here (asyncpp never imports model_zoo): it needs w_gate/w_up [E, f, d],
w_down [E, d, f], num_experts, a `dispatcher` attribute and optionally shared_expert
(gate_proj/up_proj/down_proj linears).

Under TP (tokens replicated over the TP group) every expert's ffn dim is split: rank r computes a
partial output of every expert from its slice of f, and the partial outputs are summed once, after
the routing weights scaled them. Under EP (tokens differ per rank) each rank holds E/ep whole experts
and all-to-alls every assignment to the rank of its expert and the result back. Both compose: the
EP all-to-all runs between the ranks of one TP coordinate, each carrying its own ffn slice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from asyncpp.config import divisors
from asyncpp.parallel.collectives import Group, all_to_all, bounded, copy_to, group_size, reduce_from
from asyncpp.parallel.sharding import ParamSharding, ShardingPlan

ExpertFn = Callable[[Tensor, Tensor], Tensor]


class ExpertDispatcher:
    """The dispatcher of a MoE whose experts are sharded over `tp_group` (ffn dim) and `ep_group` (dim 0).

    TP gradients, which is where the subtlety is: every value that multiplies a partial expert output
    (the routing weights, the shared expert's sigmoid gate) receives only a partial gradient on each
    TP rank, so scale() wraps it in copy_to (identity forward, all-reduce backward). The router's own
    parameter gradient must NOT be all-reduced over TP: its aux-loss path is replicated and would be
    counted tp times. The router reads the input before enter(), so it never sees a partial gradient.
    """

    def __init__(self, tp_group: Group | None, ep_group: Group | None, num_experts: int) -> None:
        self.tp_group = tp_group
        self.ep_group = ep_group
        self.ep = group_size(ep_group)
        self.num_local_experts = num_experts // self.ep

    def __deepcopy__(self, memo: dict) -> ExpertDispatcher:
        return self  # process groups cannot be copied; a copied model shares them

    def enter(self, x: Tensor) -> Tensor:
        return copy_to(x, self.tp_group)

    def scale(self, w: Tensor) -> Tensor:
        return copy_to(w, self.tp_group)

    def leave(self, y: Tensor) -> Tensor:
        return reduce_from(y, self.tp_group)

    def dispatch(self, rows: Tensor, counts: Tensor, experts: ExpertFn) -> Tensor:
        """rows [M, d] sorted by global expert, counts [E] -> expert outputs [M, d] in the same order.

        Blocks on the host once (the .tolist() of the split sizes, after the count exchange): the all-to-all's
        split sizes must be known on the CPU. Dropless: every row is sent, nothing is capped.
        """
        if self.ep == 1:
            return experts(rows, counts)
        send = counts.view(self.ep, self.num_local_experts)  # [destination rank, its local expert]
        recv = torch.empty_like(counts)
        with bounded("the expert dispatcher's all-to-all of the token counts", self.ep_group):
            dist.all_to_all_single(recv, counts.contiguous(), group=self.ep_group)  # E/ep counts to each rank
        recv = recv.view(self.ep, self.num_local_experts)  # [source rank, my local expert]
        # One read of both split vectors: each .tolist() of a device tensor is a host sync of its own.
        splits = torch.cat((send.sum(1), recv.sum(1))).tolist()
        send_splits, recv_splits = splits[:self.ep], splits[self.ep:]
        got = all_to_all(rows, recv_splits, send_splits, self.ep_group,  # source-major, expert-minor
                         "the expert dispatcher's all-to-all of the tokens to their experts")
        perm = _source_to_expert_major(recv, sum(recv_splits))
        y = experts(got.index_select(0, perm), recv.sum(0))
        back = y.index_select(0, torch.argsort(perm))  # back to source-major, as the sources sent them
        return all_to_all(back, send_splits, recv_splits, self.ep_group,
                          "the expert dispatcher's all-to-all of the expert outputs back to their tokens")


def _source_to_expert_major(recv: Tensor, rows: int) -> Tensor:
    """recv [ep, E_local] row counts, received source-major (`rows` of them in all, known on the host) -> the
    permutation that sorts rows by local expert (stable, so each expert's rows stay in source order)."""
    ep, n_local = recv.shape
    expert_of = torch.arange(n_local, device=recv.device).repeat(ep)
    # output_size: without it CUDA's repeat_interleave reads the counts' sum back to size its output (a host
    # sync per MoE layer per forward; found by the meta trace, asyncpp/analysis/traced.py).
    row_expert = torch.repeat_interleave(expert_of, recv.flatten(), output_size=rows)
    return torch.argsort(row_expert, stable=True)


def parallelize_moe(moe: nn.Module, tp_group: Group | None, ep_group: Group | None) -> ShardingPlan:
    """Shard `moe` in place over TP (ffn dims) and EP (experts) and install its ExpertDispatcher.

    Each rank keeps its chunk of the full, identically initialised tensors, so a parallel run starts
    from the single-rank weights; on the meta device only shapes change (a dry run). Returns the plan,
    names relative to the module ("w_gate", "shared_expert.down_proj.weight"); a field is set only
    where its group has more than one rank, so tp = ep = 1 returns {} and changes nothing. Call it
    before building optimizers: the sharded parameters are new Parameter objects.
    """
    tp, ep = group_size(tp_group), group_size(ep_group)
    _validate(moe, tp, ep)
    plan: ShardingPlan = {}
    if tp == 1 and ep == 1:
        return plan
    tp_rank = dist.get_rank(tp_group) if tp > 1 else 0
    ep_rank = dist.get_rank(ep_group) if ep > 1 else 0
    for name, tp_dim in (("w_gate", 1), ("w_up", 1), ("w_down", 2)):
        p = getattr(moe, name).detach()
        if ep > 1:
            p = p.chunk(ep, dim=0)[ep_rank]
        if tp > 1:
            p = p.chunk(tp, dim=tp_dim)[tp_rank]
        setattr(moe, name, nn.Parameter(p.clone()))
        plan[name] = ParamSharding(tp_dim=tp_dim if tp > 1 else None, expert=ep > 1)
    if tp > 1 and getattr(moe, "shared_expert", None) is not None:
        plan.update(_shard_shared_expert(moe.shared_expert, tp, tp_rank))
    moe.dispatcher = ExpertDispatcher(tp_group, ep_group, moe.num_experts)
    return plan


def _shard_shared_expert(shared: nn.Module, tp: int, rank: int) -> ShardingPlan:
    """Column-parallel gate/up (split out_features, weight dim 0), row-parallel down (weight dim 1)."""
    plan: ShardingPlan = {}
    for name, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
        lin: nn.Linear = getattr(shared, name)
        lin.weight = nn.Parameter(lin.weight.detach().chunk(tp, dim=dim)[rank].clone())
        lin.out_features, lin.in_features = lin.weight.shape
        plan[f"shared_expert.{name}.weight"] = ParamSharding(tp_dim=dim)
    return plan


def _validate(moe: nn.Module, tp: int, ep: int) -> None:
    if isinstance(getattr(moe, "dispatcher", None), ExpertDispatcher):  # sharding twice would shard the shards
        raise RuntimeError(  # noqa: TRY004 - a state error, not an argument of the wrong type
            "parallelize_moe: this MoE is already parallelized (its dispatcher is an ExpertDispatcher); "
            "apply the plan once, to the freshly built model.")
    E = moe.num_experts
    if E % ep:
        raise ValueError(f"model.moe.num_experts={E} is not divisible by parallel.ep={ep} (each EP rank holds "
                         f"E/ep whole experts); choose ep in {divisors(E)}.")
    f = moe.w_gate.shape[1]
    if f % tp:
        raise ValueError(f"model.moe.expert_ffn_hidden_size={f} is not divisible by parallel.tp={tp} (each TP rank "
                         f"holds f/tp of every expert); choose tp in {divisors(f)} or change the ffn size.")
    shared = getattr(moe, "shared_expert", None)
    if shared is not None and shared.gate_proj.out_features % tp:
        fs = shared.gate_proj.out_features
        raise ValueError(f"model.moe.shared_expert_ffn_hidden_size={fs} is not divisible by parallel.tp={tp}; "
                         f"choose tp in {divisors(fs)} or change the shared expert's size.")

