"""The contract of semantics.md on the single-process simulator (no process group needed).

Each test compares the simulator against an independent, hand-written computation of the rule.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from asyncpp.config import StalenessConfig
from asyncpp.reference.executor import parameter_delays
from asyncpp.reference.simulator import DelayedUpdateSimulator
from asyncpp.schedules.registry import is_sync_step, stage_delay, step_delay

pytestmark = pytest.mark.equivalence

torch.set_default_dtype(torch.float32)


class Scalars(nn.Module):
    """A 'model' laid out like model_zoo's (embed, layers, norm, lm_head), one scalar per part."""

    def __init__(self, num_layers: int, init: float = 1.0):
        super().__init__()

        def box(v: float) -> nn.Module:
            m = nn.Module()
            m.weight = nn.Parameter(torch.tensor([v], dtype=torch.float64))
            return m

        self.embed = box(init)
        self.layers = nn.ModuleList(box(init + 0.1 * (i + 1)) for i in range(num_layers))
        self.norm = box(init - 0.2)
        self.lm_head = box(init - 0.3)


def separable_quadratic(a: float):
    """loss(w; b) = sum_k a/2 (w_k - c_b)^2 with c_b = the batch's mean: gradient a (w_k - c_b)."""

    def loss_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        c = batch.double().mean()
        return sum(0.5 * a * (p - c).pow(2).sum() for p in model.parameters())

    return loss_fn


def batch(t: int) -> list[torch.Tensor]:
    return [torch.full((1, 2), float(t % 3) - 1.0)]  # c_t in {-1, 0, 1}, one microbatch


def run_sim(model, delays, steps, lr, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sim = DelayedUpdateSimulator(model, opt, delays, loss_fn=separable_quadratic(2.0), **kw)
    for t in range(steps):
        sim.step(t, batch(t))
    return sim


def scalar_recurrence(x0: float, delay_at, steps: int, lr: float, a: float = 2.0) -> list[float]:
    """x_{t+1} = x_t - lr * a * (x_{t-d_t} - c_t), x_{-k} = x_0, written out by hand."""
    xs = [x0]
    for t in range(steps):
        d = delay_at(t)
        stale = xs[max(t - d, 0)]
        c = float(t % 3) - 1.0
        xs.append(xs[t] - lr * a * (stale - c))
    return xs


def test_stage_delays_follow_the_spec():
    assert [stage_delay("2bw", s, 4) for s in range(4)] == [1, 1, 1, 1]
    assert [stage_delay("pipedream", s, 4) for s in range(4)] == [3, 2, 1, 0]
    for sched in ("sync", "gpipe", "1f1b"):
        assert [stage_delay(sched, s, 4) for s in range(4)] == [0, 0, 0, 0]
    s = StalenessConfig(sync_start_steps=2, sync_cooldown_steps=3)
    assert [is_sync_step(t, 10, s) for t in range(10)] == [True] * 2 + [False] * 5 + [True] * 3
    assert step_delay("2bw", 0, 2, 1, 10, s) == 0 and step_delay("2bw", 0, 2, 2, 10, s) == 1


def _clip_fp64_norm_(params, max_norm: float) -> None:
    """The project's clipping rule (asyncpp/optim/clip.py), written out: the norm summed in fp64 and
    clip_grad_norm_'s coefficient max_norm / (norm + 1e-6), capped at 1, applied to the fp32 gradients.

    Not torch.nn.utils.clip_grad_norm_: that one takes an fp32 norm from _foreach_norm, a vectorized
    reduction whose lane count ATen picks at run time (AVX-512, AVX2 or scalar), so it differs from the
    fp64 norm in the last bit on some CPUs and not others; the coefficient then rounds to a different
    fp32 (on an AVX-512 Xeon, by 2 ulp at step 3 here), and the weights drift apart from there."""
    grads = [p.grad for p in params]
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    coef = min(max_norm / (norm + 1e-6), 1.0)
    for g in grads:
        g.mul_(coef)


def test_sync_equals_plain_training_bitwise():
    """schedule=sync in the simulator is ordinary training: same floats, step for step.

    Bit for bit is a fair claim here: both sides run the same modules on the same shapes in the same
    order (forward, backward summed over the microbatches, scale by 1/m, the fp64-norm clip, AdamW), in
    one process, so every kernel (MKL's sgemm, ATen's vectorized reductions) is the same one on both."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    ref = copy.deepcopy(net)
    data = [[torch.randn(4, 6) for _ in range(3)] for _ in range(5)]

    def loss_fn(model, x):
        return model(x).pow(2).mean()

    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sim = DelayedUpdateSimulator(net, opt, [0] * 4, loss_fn=loss_fn, grad_clip=0.5)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for t, mbs in enumerate(data):
        stats = sim.step(t, mbs)
        ref_opt.zero_grad()
        losses = []
        for x in mbs:
            loss = loss_fn(ref, x)
            loss.backward()
            losses.append(loss.item())
        for p in ref.parameters():
            p.grad.mul_(1.0 / len(mbs))
        _clip_fp64_norm_(list(ref.parameters()), 0.5)
        ref_opt.step()
        assert stats.loss == sum(losses) / len(losses)
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_2bw_two_step_example_by_hand():
    """x_{t+1} = x_t - lr * g(x_{t-1}; b_t), x_{-1} = x_0, on loss a/2 (w - c)^2, unrolled by hand."""
    model = Scalars(num_layers=0)
    model.layers = nn.ModuleList()
    lr, a = 0.1, 2.0
    w0 = {n: float(p.detach()) for n, p in model.named_parameters()}
    run_sim(model, [1] * 3, steps=3, lr=lr)
    for name, p in model.named_parameters():
        x0 = w0[name]
        # step 0: gradient on x_{-1} = x_0, batch c_0 = -1
        x1 = x0 - lr * a * (x0 - (-1.0))
        # step 1: gradient on x_0 (not x_1!), batch c_1 = 0
        x2 = x1 - lr * a * (x0 - 0.0)
        # step 2: gradient on x_1, batch c_2 = 1
        x3 = x2 - lr * a * (x1 - 1.0)
        assert float(p.detach()) == pytest.approx(x3, abs=1e-12)
        assert float(p.detach()) != pytest.approx(x0 - 3 * lr * a * x0, abs=1e-6)  # not synchronous


@pytest.mark.parametrize("schedule", ["2bw", "pipedream", "sync"])
def test_each_stage_sees_its_delay(schedule):
    """pipedream: stage s of P applies gradients P-1-s steps stale; 2bw: 1; sync: 0."""
    P, steps, lr = 4, 12, 0.05
    model = Scalars(num_layers=4)
    delays = parameter_delays(model, schedule, P)
    init = {n: float(p.detach()) for n, p in model.named_parameters()}
    run_sim(model, delays, steps, lr)
    stage_of = {"embed.weight": 0, "layers.0.weight": 0, "layers.1.weight": 1, "layers.2.weight": 2,
                "layers.3.weight": 3, "norm.weight": 3, "lm_head.weight": 3}
    for name, p in model.named_parameters():
        d = stage_delay(schedule, stage_of[name], P)
        expected = scalar_recurrence(init[name], lambda t, d=d: d, steps, lr)[-1]
        assert float(p.detach()) == pytest.approx(expected, abs=1e-12), (name, d)


def test_sync_start_and_cooldown_switch_the_delay():
    steps, lr = 10, 0.1
    staleness = StalenessConfig(sync_start_steps=3, sync_cooldown_steps=2)
    model = Scalars(num_layers=1)
    init = {n: float(p.detach()) for n, p in model.named_parameters()}
    run_sim(model, [1] * 4, steps, lr, sync_step=lambda t: is_sync_step(t, steps, staleness))
    for name, p in model.named_parameters():
        expected = scalar_recurrence(
            init[name], lambda t: step_delay("2bw", 0, 1, t, steps, staleness), steps, lr
        )[-1]
        assert float(p.detach()) == pytest.approx(expected, abs=1e-12)


def reference_2bw_adamw(model, data, loss_fn, lr):
    """An independent delayed loop: keep x_{t-1} aside, take grads there, step x_t with AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    prev = [p.detach().clone() for p in model.parameters()]
    for mbs in data:
        cur = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p, x in zip(model.parameters(), prev):
                p.copy_(x)
        opt.zero_grad()
        for x in mbs:
            loss_fn(model, x).backward()
        with torch.no_grad():
            for p, x in zip(model.parameters(), cur):
                p.grad.mul_(1.0 / len(mbs))
                p.copy_(x)
        opt.step()
        prev = cur


def test_ef_lambda_zero_is_plain_2bw_bitwise():
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 2))
    ref = copy.deepcopy(net)
    data = [[torch.randn(3, 5) for _ in range(2)] for _ in range(6)]

    def loss_fn(model, x):
        return model(x).sin().mean()

    opt = torch.optim.AdamW(net.parameters(), lr=3e-2)
    sim = DelayedUpdateSimulator(net, opt, [1] * 4, loss_fn=loss_fn, ef_lambda=0.0)
    for t, mbs in enumerate(data):
        sim.step(t, mbs)
    reference_2bw_adamw(ref, data, loss_fn, lr=3e-2)
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    # and EF with lambda > 0 really changes the trajectory (the test above is not vacuous)
    torch.manual_seed(1)
    net2 = nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 2))
    sim2 = DelayedUpdateSimulator(net2, torch.optim.AdamW(net2.parameters(), lr=3e-2), [1] * 4,
                                  loss_fn=loss_fn, ef_lambda=1.0)
    for t, mbs in enumerate(data):
        sim2.step(t, mbs)
    assert not torch.equal(next(net2.parameters()), next(net.parameters()))


@pytest.mark.parametrize("lam", [1.0, 0.5])
def test_error_feedback_sgd_quadratic_matches_closed_form(lam):
    """SGD on f(x) = a/2 x^2 with one-step delay and EF is linear: s_{t+1} = M s_t.

    State s_t = (x_t, x_{t-1}, u_{t-1}); u_t = lr a x_{t-1}; x_{t+1} = x_t - u_t - lam (u_t - u_{t-1}).
    x_t is then e_1^T V diag(eig)^t V^{-1} s_0 with s_0 = (x_0, x_0, 0): the closed form.
    """
    a, lr, x0, steps = 1.5, 0.2, 3.0, 25
    c = lr * a
    M = np.array([[1.0, -(1 + lam) * c, lam], [1.0, 0.0, 0.0], [0.0, c, 0.0]])
    eig, V = np.linalg.eig(M)
    coef = np.linalg.solve(V, np.array([x0, x0, 0.0]))
    closed = [float(np.real(V[0] @ (coef * eig**t))) for t in range(steps + 1)]

    model = nn.Module()
    model.w = nn.Parameter(torch.tensor([x0], dtype=torch.float64))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sim = DelayedUpdateSimulator(model, opt, [1], loss_fn=lambda m, b: 0.5 * a * m.w.pow(2).sum(),
                                 ef_lambda=lam)
    traj = [x0]
    for t in range(steps):
        sim.step(t, [torch.zeros(1, 2)])
        traj.append(float(model.w.detach()))
    np.testing.assert_allclose(traj, closed, rtol=1e-9, atol=1e-12)
    # EF changes the dynamics: without it the trajectory is different
    assert abs(traj[5] - scalar_free_delayed(x0, c, 5)) > 1e-3


def scalar_free_delayed(x0: float, c: float, steps: int) -> float:
    xs = [x0, x0]  # x_{-1}, x_0
    for _ in range(steps):
        xs.append(xs[-1] - c * xs[-2])
    return xs[-1]


def test_non_finite_gradient_skips_the_step_and_keeps_versions_advancing():
    model = nn.Module()
    model.w = nn.Parameter(torch.tensor([1.0]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    poison = {1}

    def loss_fn(m, b):
        scale = float("nan") if int(b[0, 0]) in poison else 1.0
        return 0.5 * scale * m.w.pow(2).sum()

    sim = DelayedUpdateSimulator(model, opt, [1], loss_fn=loss_fn)
    s0 = sim.step(0, [torch.zeros(1, 2)])
    w_after0 = float(model.w.detach())
    s1 = sim.step(1, [torch.ones(1, 2)])
    assert not s0.skipped and s1.skipped and float(model.w.detach()) == w_after0
    assert len(sim.history) == 1  # the version counter advanced
    s2 = sim.step(2, [torch.full((1, 2), 2.0)])
    assert not s2.skipped
    # step 2 uses x_1 (== x_2, since step 1 was skipped): w <- w - 0.1 * w
    assert float(model.w.detach()) == pytest.approx(w_after0 * 0.9)
