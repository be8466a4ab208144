"""Our batched Muon against torch.optim.Muon, the properties batching must preserve, and the
parallel-aware parts that need no process group (work plan, per-parameter layout). The multi-rank
behaviour is tests/dist/test_muon_distributed.py."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from asyncpp.optim.muon import Muon, adjusted_lr, newton_schulz
from asyncpp.optim.muon_sharded import Bucket, MatrixJob, plan_buckets

# Repeated shapes make buckets of size > 1, so the stacked path is what gets compared.
SHAPES = [(64, 32), (64, 32), (32, 64), (48, 48), (48, 48), (20, 70)]


def _params(shapes, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _run(opt: torch.optim.Optimizer, params, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_matches_torch_muon(nesterov: bool, adjust_lr: str) -> None:
    # torch.optim.Muon always runs NS in bf16 (grad.bfloat16()), so ours runs in bf16 here too;
    # parameters, grads, momentum and the update arithmetic are fp32 in both.
    ours, ref = _params(SHAPES), _params(SHAPES)
    kw = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": nesterov}
    opt = Muon(ours, adjust_lr=adjust_lr, compute_dtype=torch.bfloat16, **kw)
    opt_ref = torch.optim.Muon(ref, adjust_lr_fn=adjust_lr, **kw)
    _run(opt, ours, steps=5)
    _run(opt_ref, ref, steps=5)
    for a, b in zip(ours, ref):
        assert (a - b).abs().max().item() < 1e-6
        buf, buf_ref = opt.state[a]["momentum_buffer"], opt_ref.state[b]["momentum_buffer"]
        assert (buf - buf_ref).abs().max().item() < 1e-6


def test_defaults_match_torch() -> None:
    p = _params([(4, 4)])
    ours, ref = Muon(p).defaults, torch.optim.Muon(p).defaults
    for key in ("lr", "weight_decay", "momentum", "nesterov", "eps", "ns_steps"):
        assert ours[key] == ref[key], key
    assert tuple(ours["ns_coefficients"]) == tuple(ref["ns_coefficients"])
    assert ours["adjust_lr"] == "original" and ref["adjust_lr_fn"] in (None, "original")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_ns_equals_per_matrix(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    for shape in [(5, 40, 24), (5, 24, 40), (2, 3, 32, 32)]:
        G = torch.randn(shape, generator=g)
        out = newton_schulz(G, 5, compute_dtype=dtype)
        assert out.shape == G.shape and out.dtype == G.dtype
        flat = G.reshape(-1, *shape[-2:])
        per = torch.stack([newton_schulz(m, 5, compute_dtype=dtype) for m in flat]).reshape(shape)
        atol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out, per, atol=atol, rtol=0)


def test_ns_does_not_modify_input() -> None:
    G = torch.randn(8, 16)
    before = G.clone()
    newton_schulz(G, 5)
    assert torch.equal(G, before)


def test_ns_singular_values_near_one() -> None:
    g = torch.Generator().manual_seed(3)
    mats = [torch.randn(64, 32, generator=g), torch.randn(32, 64, generator=g)]
    # A square matrix with a controlled spectrum (a Gaussian square one has singular values near 0,
    # which 5 quintic steps cannot lift; real gradients are far from that corner).
    U, _ = torch.linalg.qr(torch.randn(32, 32, generator=g))
    V, _ = torch.linalg.qr(torch.randn(32, 32, generator=g))
    mats.append(U @ torch.diag(torch.logspace(-2, 0, 32)) @ V.T)
    for G in mats:
        s = torch.linalg.svdvals(newton_schulz(G, 5))
        assert 0.5 <= s.min().item() and s.max().item() <= 1.5, (tuple(G.shape), s.min(), s.max())


def test_expert_stack_equals_separate_params() -> None:
    E, m, n = 4, 24, 40
    g = torch.Generator().manual_seed(4)
    stack = torch.nn.Parameter(torch.randn(E, m, n, generator=g))
    separate = [torch.nn.Parameter(stack.detach()[e].clone()) for e in range(E)]
    kw = {"lr": 0.05, "weight_decay": 0.1, "adjust_lr": "match_rms_adamw"}
    opt_stack, opt_sep = Muon([stack], **kw), Muon(separate, **kw)
    for _ in range(5):
        grad = torch.randn(E, m, n, generator=g)
        stack.grad = grad.clone()
        for e, p in enumerate(separate):
            p.grad = grad[e].clone()
        opt_stack.step()
        opt_sep.step()
    torch.testing.assert_close(stack.detach(), torch.stack([p.detach() for p in separate]), atol=1e-6, rtol=0)


def test_state_dict_round_trip_continues_identically() -> None:
    params = _params(SHAPES)
    opt = Muon(params, lr=0.02)
    _run(opt, params, steps=3, seed=5)
    saved_params = [p.detach().clone() for p in params]
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    _run(opt, params, steps=2, seed=6)

    resumed = [torch.nn.Parameter(p.clone()) for p in saved_params]
    opt2 = Muon(resumed, lr=0.02)
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    _run(opt2, resumed, steps=2, seed=6)
    for a, b in zip(params, resumed):
        assert torch.equal(a, b)


def test_state_layout_is_per_param_like_torch() -> None:
    params = _params(SHAPES)
    opt = Muon(params)
    _run(opt, params, steps=1)
    state = copy.deepcopy(opt.state_dict())
    assert set(state["state"]) == set(range(len(params)))
    for i, p in enumerate(params):
        assert set(state["state"][i]) == {"momentum_buffer"}
        assert state["state"][i]["momentum_buffer"].shape == p.shape


def test_params_without_grad_are_skipped() -> None:
    a, b = _params([(8, 8), (8, 8)])
    opt = Muon([a, b], lr=0.1)
    before = b.detach().clone()
    a.grad = torch.randn(8, 8)
    opt.step()
    assert torch.equal(b, before) and b not in opt.state


@pytest.mark.parametrize("shape", [(16,), ()])
def test_rejects_vectors_and_scalars(shape) -> None:
    with pytest.raises(ValueError, match=r"AdamW") as err:
        Muon([torch.nn.Parameter(torch.zeros(shape))])
    assert str(tuple(shape)) in str(err.value)
    opt = Muon(_params([(4, 4)]))
    with pytest.raises(ValueError, match="ndim"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})


def test_rejects_bad_hyperparameters() -> None:
    p = _params([(4, 4)])
    with pytest.raises(ValueError, match="adjust_lr"):
        Muon(p, adjust_lr="spectral")
    with pytest.raises(ValueError, match="compute_dtype"):
        Muon(p, compute_dtype="int8")
    with pytest.raises(ValueError, match="momentum"):
        Muon(p, momentum=1.5)


def test_adjusted_lr_formulas() -> None:
    assert adjusted_lr(1.0, "original", (64, 16)) == pytest.approx(2.0)
    assert adjusted_lr(1.0, "original", (16, 64)) == pytest.approx(1.0)
    assert adjusted_lr(1.0, "match_rms_adamw", (8, 16, 64)) == pytest.approx(0.2 * 8.0)


# ------------------------------------------------------------------ parallel-aware layout and plan
def _jobs(shapes, expert: bool = False) -> tuple[tuple[int, MatrixJob], ...]:
    return tuple((i, MatrixJob(tuple(s), torch.float32, expert=expert)) for i, s in enumerate(shapes))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_plan_covers_every_matrix_once_and_balances_cost(world: int) -> None:
    shapes = [(64, 32), (64, 32), (32, 64), (48, 48), (5, 24, 40), (24, 40), (7, 16, 16)]
    jobs = _jobs(shapes)
    buckets = plan_buckets(jobs, world, bucket_numel=2 * 48 * 48)
    # deterministic: a fresh computation (past the cache) gives the same plan
    assert buckets == plan_buckets.__wrapped__(jobs, world, bucket_numel=2 * 48 * 48)
    assert [b.cost for b in buckets] == sorted((b.cost for b in buckets), reverse=True)
    covered = {i: [] for i, _ in jobs}
    load = [0] * world
    for b in buckets:
        assert b.size <= max(world, (2 * 48 * 48) // (b.matrix[0] * b.matrix[1]))
        assert sum(b.counts) == b.size and max(b.counts) - min(b.counts) <= 1  # padding <= 1 matrix
        for r in range(world):
            mine = b.owned(r)
            assert sum(stop - start for _, start, stop in mine) == b.counts[r]
            for job, start, stop in mine:
                covered[job] += range(start, stop)
            load[r] += b.counts[r] * b.cost
    for i, job in jobs:
        assert sorted(covered[i]) == list(range(job.count)), (i, covered[i])
    assert max(load) - min(load) <= max(job.cost for _, job in jobs)


def test_tp_gather_job_sees_the_full_shape() -> None:
    job = MatrixJob((3, 16, 24), torch.float32, gather_dim=-1)
    assert (job.count, job.cost) == (3, 16 * 24 * 16)
    assert plan_buckets(((0, job),), 1, 2**20)[0].gather_dim == -1


def _named(shapes):
    return [(f"layers.{i}.weight", p) for i, p in enumerate(_params(shapes))]


def test_layout_is_validated_and_named() -> None:
    params = _params([(8, 4), (8, 4)])
    with pytest.raises(ValueError, match=r"'tp_dims' has 1 entries but 'params' has 2"):
        Muon([{"params": params, "tp_dims": [0]}])
    with pytest.raises(ValueError, match=r"tp_dims\[1\]=2 is not a dim .* \(8, 4\)"):
        Muon([{"params": params, "tp_dims": [0, 2]}])
    with pytest.raises(ValueError, match="tp_mode='rows'"):
        Muon(params, tp_mode="rows")
    with pytest.raises(ValueError, match=r"contiguous .* \(4, 8\)"):
        Muon([torch.nn.Parameter(torch.randn(8, 4).T)])
    opt = Muon([{"params": params, "tp_dims": [-1, None], "experts": [0, 1]}])
    assert opt.param_groups[0]["tp_dims"] == [1, None] and opt.param_groups[0]["experts"] == [False, True]
    assert Muon(params).param_groups[0]["tp_dims"] == [None, None]


@pytest.mark.parametrize("tp_mode", ["gather", "block"])
def test_layout_without_a_tp_group_is_plain_muon(tp_mode: str) -> None:
    ours, ref = _params(SHAPES), _params(SHAPES)
    layout = {"tp_dims": [0, 1, None, 1, 0, None], "experts": [False, True, False, False, True, False]}
    _run(Muon([{"params": ours, **layout}], lr=0.02, tp_mode=tp_mode), ours, steps=3)
    _run(Muon(ref, lr=0.02), ref, steps=3)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


class _Stage(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(8, 16, bias=False)
        self.o = torch.nn.Linear(16, 8, bias=False)
        self.norm = torch.nn.LayerNorm(8)
        self.experts = torch.nn.ParameterDict({"w_up": torch.nn.Parameter(torch.randn(4, 6, 8))})
        self.mlp = torch.nn.Linear(8, 8, bias=False)


def test_layout_stays_aligned_through_retarget_and_load_state_dict() -> None:
    from asyncpp.optim import build_optimizer
    from asyncpp.parallel.sharding import ParamSharding
    from asyncpp.pipeline.weights import WeightVersions

    stage = _Stage()
    plan = {"q.weight": ParamSharding(tp_dim=0), "o.weight": ParamSharding(tp_dim=1),
            "experts.w_up": ParamSharding(expert=True)}
    opt = build_optimizer(stage, name="muon", lr=0.01, weight_decay=0.1, sharding=plan)
    muon = opt.optimizers["muon"]
    names = {id(p): n for n, p in stage.named_parameters()}
    group = muon.param_groups[0]
    expected = {n: (plan.get(n, ParamSharding()).tp_dim, plan.get(n, ParamSharding()).expert)
                for n in (names[id(p)] for p in group["params"])}
    versions = WeightVersions(list(stage.parameters()), num_buffers=2)
    master_name = {id(q): names[id(p)] for p, q in zip(versions.params, versions.masters)}
    versions.retarget(opt)
    group = muon.param_groups[0]
    assert all(id(p) in master_name for p in group["params"])  # the masters now, same order
    got = {master_name[id(p)]: (d, e) for p, d, e in zip(group["params"], group["tp_dims"], group["experts"])}
    assert got == expected and got["q.weight"] == (0, False) and got["experts.w_up"] == (None, True)
    # A checkpoint from another layout (here: none recorded) must not overwrite this run's layout.
    saved = muon.state_dict()
    for g in saved["param_groups"]:
        g.pop("tp_dims")
        g.pop("experts")
    muon.load_state_dict(saved)
    assert muon.param_groups[0]["tp_dims"] == group["tp_dims"]


def test_config_refuses_gather_mode_for_shard_only_optimizers() -> None:
    from asyncpp.config import ConfigError
    from asyncpp.job import compose, resolve

    with pytest.raises(ConfigError, match=r"optimizer.name=normuon with parallel.tp=2 .*tp_mode=block"):
        resolve(compose(["optimizer=normuon", "parallel.tp=2"]))
    cfg, _ = resolve(compose(["optimizer=normuon", "parallel.tp=2", "++optimizer.tp_mode=block"]))
    assert cfg.optimizer.tp_mode == "block"
    assert resolve(compose([]))[0].optimizer.tp_mode == "gather"


def test_bucket_ownership_in_one_pass_is_every_other_ranks_share():
    """owned_by_others(r) (one pass: what the other ranks orthogonalise, which r still steps the momentum of) is the
    other ranks' owned() in bucket order, each matrix once, split pieces merged: what the O(world^2) loop over the
    ranks gave (a dry run at 16384 ranks spent minutes in it). Pieces straddle rank boundaries here."""
    bucket = Bucket(matrix=(2, 2), gather_dim=None, cost=1, pieces=[(0, 0, 5), (1, 2, 5), (2, 0, 1)],
                    counts=[3, 3, 2, 1])
    assert bucket.offsets == [0, 3, 6, 8]

    def rows(pieces):
        return [(job, i) for job, a, b in pieces for i in range(a, b)]

    for rank in range(4):
        others = [p for r in range(4) if r != rank for p in bucket.owned(r)]
        assert rows(bucket.owned_by_others(rank)) == rows(others)
        assert sorted(rows(bucket.owned(rank)) + rows(others)) == sorted(rows(bucket.pieces))
