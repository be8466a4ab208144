"""What each rank runs in tests/dist/test_tensor_parallel.py: a TP model next to its single-process
reference (the same seed, built in the same process), and the comparisons, returned as data."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from asyncpp.core.loss import cross_entropy
from asyncpp.parallel.sharding import ShardingPlan, layout_of
from asyncpp.core.loss import logits_loss_for
from asyncpp.parallel.tp import all_reduce_partial_grads_, vocab_parallel_cross_entropy
from asyncpp.pipeline.stage import StageSpec, prune_to_stage, stage_forward
from model_zoo import build_model, get_model_config
from model_zoo.parallelize import apply_tensor_parallel

RTOL = 1e-5
GRAD_RTOL = 1e-5  # of the gradient tensor's largest entry: fp32 reduction order only
FP32_U = 2.0**-24  # fp32 unit roundoff: one rounding moves a value x by at most FP32_U * |x|
SGD_LR, ADAMW_LR, ADAMW_EPS = 0.5, 1e-3, 1e-4


def _tokens(vocab: int, batch: int = 2, seq_len: int = 16) -> Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (batch, seq_len + 1), generator=g)


def _built(case: dict, device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return build_model(get_model_config(case["model"], **case.get("overrides", {})), device)


def _expected(ref: Tensor, plan: ShardingPlan, name: str, tp: int, rank: int) -> Tensor:
    dim = layout_of(plan, name).tp_dim
    return ref if dim is None else ref.chunk(tp, dim)[rank]


def _pairs(model: nn.Module, ref: nn.Module, plan: ShardingPlan):
    """(name, TP parameter, a function taking the reference's parameter tensor of that name (its data or its
    grad) to the slice this rank holds) for every TP parameter."""
    tp, rank = dist.get_world_size(), dist.get_rank()
    ref_params = dict(ref.named_parameters(remove_duplicate=False))  # tied head by name too
    for name, p in model.named_parameters():
        ref_p = ref_params[name]
        yield name, p, ref_p, lambda t, name=name: None if t is None else _expected(t, plan, name, tp, rank)


def _mismatches(model: nn.Module, ref: nn.Module, plan: ShardingPlan) -> list[str]:
    """Every parameter's gradient against the matching slice of the reference's."""
    out = []
    for name, p, ref_p, sliced in _pairs(model, ref, plan):
        got, want = p.grad, sliced(ref_p.grad)
        if got is None or want is None:
            out.append(f"{name}: grad missing (tp {got is None}, reference {want is None})")
            continue
        if got.shape != want.shape:
            out.append(f"{name}: shape {tuple(got.shape)} != reference slice {tuple(want.shape)}")
            continue
        err = ((got - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()
        if err > GRAD_RTOL:
            out.append(f"{name}: grad relative error {err:.3g}")
    return out


def _initial_mismatches(model: nn.Module, ref: nn.Module, plan: ShardingPlan) -> list[str]:
    """Before the first step every shard is an exact slice of the reference (the step bound assumes it)."""
    return [f"{name}: initial weights differ" for name, p, ref_p, sliced in _pairs(model, ref, plan)
            if p.shape == sliced(ref_p).shape and not torch.equal(p, sliced(ref_p))]


def _step_lipschitz(kind: str) -> float:
    """How far one step from equal weights moves a weight entry per unit of its gradient entry's difference.

    SGD: w - lr g, so lr. AdamW's first step: m^ = g and sqrt(v^) = |g|, so the step is
    w (1 - lr wd) - lr g / (|g| + eps); d/dg [g / (|g| + eps)] = eps / (|g| + eps)^2 <= 1 / eps, so lr / eps.
    """
    return SGD_LR if kind == "sgd" else ADAMW_LR / ADAMW_EPS


def _step_mismatches(model: nn.Module, ref: nn.Module, plan: ShardingPlan, before: dict[str, Tensor],
                     kind: str) -> list[str]:
    """Weights after one step against the reference slice, per entry, within what the gradients' difference allows.

    The two gradients differ by dg = |g_tp - g_ref| (fp32 reduction order, bounded by GRAD_RTOL above);
    the step turns that into at most L * dg (_step_lipschitz), an equality for AdamW at g = 0, so ratios
    just below 1 are expected (L * dg is itself computed with two roundings: the factor 1 + 4 FP32_U).
    On top, each side rounds: w (1 - lr wd) and w - step once each (FP32_U * |w|), and the step itself a
    handful of times (a few FP32_U of |step| <= |w0| + |w1|); 8 FP32_U (|w0| + |w1|) covers both sides.
    A bound relative to the weights' largest entry would not do: AdamW amplifies dg by lr / eps = 10 on
    entries with |g| << eps, and a small-init o_proj weight then differs by 1.3e-5 of its largest entry
    with an AVX-512 Xeon's default kernels and by less with others; this bound holds for all of them.
    """
    out, lipschitz = [], _step_lipschitz(kind) * (1 + 4 * FP32_U)
    for name, p, ref_p, sliced in _pairs(model, ref, plan):
        want, ref_grad = sliced(ref_p.detach()), sliced(ref_p.grad)
        if p.shape != want.shape or p.grad is None or ref_grad is None:
            continue  # already reported by _mismatches
        w0, w1 = before[name], p.detach()
        bound = lipschitz * (p.grad - ref_grad).abs() + 8 * FP32_U * (w0.abs() + want.abs())
        ratio = ((w1 - want).abs() / bound.clamp(min=1e-30)).max().item()
        if ratio > 1:
            out.append(f"{name}: weights after the step differ by {ratio:.3g} times the bound")
    return out


def _plan_names_exist(model: nn.Module, plan: ShardingPlan) -> list[str]:
    """A typo in a plan table would silently leave a parameter replicated: every name must exist."""
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return sorted(set(plan) - names)


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    # AdamW's first step is lr * g / (|g| + eps), up to lr / eps times the gradient's reduction-order
    # noise (see _step_lipschitz): with the default eps=1e-8 that is O(lr) on near-zero entries, and the
    # step would compare nothing. eps=1e-4 keeps the amplification at 10; real entries still move by ~lr.
    if kind == "sgd":
        return torch.optim.SGD(params, lr=SGD_LR)
    return torch.optim.AdamW(params, lr=ADAMW_LR, eps=ADAMW_EPS)


def equivalence(case: dict) -> dict:
    """TP model vs single-process reference: loss, every gradient, one optimizer step, a second loss."""
    group = dist.group.WORLD
    ref, model = _built(case), _built(case)
    plan = apply_tensor_parallel(model, group, sequence_parallel=case.get("sp", False))
    loss_fn, tokens = logits_loss_for(model), _tokens(model.config.vocab_size)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    result = {"unknown_plan_names": _plan_names_exist(model, plan), "losses": [], "errors": [],
              "plan": {n: (s.tp_dim, s.tp_grad_reduce) for n, s in plan.items()}}
    ref_opt, opt = _optimizer(case["optim"], ref.parameters()), _optimizer(case["optim"], model.parameters())
    for step in range(2):
        ref_loss, loss = cross_entropy(ref(inputs), labels), loss_fn(model(inputs), labels)
        result["losses"].append((loss.item(), ref_loss.item()))
        if step == 1:
            break
        ref_loss.backward()
        loss.backward()
        all_reduce_partial_grads_(model, plan, group)  # the engine's job after backward
        result["errors"] += _mismatches(model, ref, plan)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        result["errors"] += _initial_mismatches(model, ref, plan)
        ref_opt.step()
        opt.step()
        result["errors"] += _step_mismatches(model, ref, plan, before, case["optim"])
    result["tied"] = model.config.tie_embeddings and model.lm_head.weight is model.embed.weight
    clone = copy.deepcopy(model)  # hooks and the vocab-parallel modules share the group, not copy it
    result["losses"].append((logits_loss_for(clone)(clone(inputs), labels).item(), result["losses"][-1][1]))
    result["meta_errors"] = _meta_shapes(case, model) + _stale_sizes(model)
    return result


def _stale_sizes(model: nn.Module) -> list[str]:
    """Linear in/out_features must describe the shard (code reads them, e.g. to size buffers)."""
    return [f"{n}: {m.out_features}x{m.in_features} vs weight {tuple(m.weight.shape)}"
            for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and (m.out_features, m.in_features) != tuple(m.weight.shape)]


def _meta_shapes(case: dict, model: nn.Module) -> list[str]:
    """The same plan on a meta-device model (a dry run) gives the shards' shapes, on meta."""
    meta = _built(case, "meta")
    apply_tensor_parallel(meta, dist.group.WORLD, sequence_parallel=case.get("sp", False))
    real = dict(model.named_parameters())
    return [f"{n}: meta {tuple(p.shape)} on {p.device} vs {tuple(real[n].shape)}"
            for n, p in meta.named_parameters() if p.shape != real[n].shape or p.device.type != "meta"]


def pruned_stages(case: dict) -> dict:
    """Two pipeline stages, each pruned then TP-sharded, chained in this process, vs the reference."""
    group, ref = dist.group.WORLD, _built(case)
    tokens = _tokens(ref.config.vocab_size)
    stages = []
    for s in range(2):
        spec = StageSpec(s, 2, ref.config.num_layers)
        m = prune_to_stage(_built(case), spec)
        stages.append((m, spec, apply_tensor_parallel(m, group, sequence_parallel=case.get("sp", False))))
    (m0, s0, p0), (m1, s1, p1) = stages
    h = stage_forward(m0, s0, tokens[:, :-1])
    h_in = h.detach().requires_grad_()  # what the next stage receives over p2p
    loss = logits_loss_for(m1)(stage_forward(m1, s1, h_in), tokens[:, 1:])
    loss.backward()
    h.backward(h_in.grad)
    ref_loss = cross_entropy(ref(tokens[:, :-1]), tokens[:, 1:])
    ref_loss.backward()
    if ref.config.tie_embeddings:  # the engine's tied-weight reduction between first and last stage
        tied_sum = m0.embed.weight.grad + m1.lm_head.weight.grad
        m0.embed.weight.grad, m1.lm_head.weight.grad = tied_sum, tied_sum.clone()
    errors = []
    for m, plan in ((m0, p0), (m1, p1)):
        all_reduce_partial_grads_(m, plan, group)
        errors += _mismatches(m, ref, plan) + [f"unknown {n}" for n in _plan_names_exist(m, plan)]
    return {"losses": [(loss.item(), ref_loss.item())], "errors": errors}


def cross_entropy_check() -> dict:
    """vocab_parallel_cross_entropy on chunks of one set of logits vs F.cross_entropy on all of them,
    with ignored targets, a large offset on one shard (max subtraction) and bf16 logits."""
    tp, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(7)
    full = torch.randn(3, 5, 24, generator=g) * 4
    full[..., :12] += 60.0  # rank 0's shard dominates: a missing global max would overflow exp
    targets = torch.randint(0, 24, (3, 5), generator=g)
    targets[0, :2] = -100
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits = full.to(dtype)
        ref_in = logits.clone().requires_grad_()
        ref = F.cross_entropy(ref_in.float().reshape(-1, 24), targets.reshape(-1))
        (ref * 3).backward()
        local = logits.chunk(tp, -1)[rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, targets, dist.group.WORLD)
        (loss * 3).backward()
        want = ref_in.grad.chunk(tp, -1)[rank]
        out[str(dtype)] = {"loss": (loss.item(), ref.item()), "grad_dtype": str(local.grad.dtype),
                           "grad_err": (local.grad.float() - want.float()).abs().max().item(),
                           "grad_scale": want.float().abs().max().item()}
    return out


def tp_rank(rank: int, cases: dict[str, dict]) -> dict:
    """Entry point for run_ranks: every case on this rank, by name (one spawn for the whole file)."""
    runners = {"equivalence": equivalence, "pruned": pruned_stages}
    out = {name: runners[case["kind"]](case) for name, case in cases.items()}
    out["cross_entropy"] = cross_entropy_check()
    return out
