"""Gradient-level EF, DC-ASGD, weight prediction and the fresh-update diagnostics in the simulator.

Each correction is checked against its formula written out by hand as a scalar recurrence (SGD on a
separable quadratic, like tests/unit/test_simulator.py), and "off" against plain delayed training, bit
for bit.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from asyncpp.config import RunConfig, StalenessConfig
from asyncpp.job import compose, resolve
from asyncpp.optim import build_optimizer
from asyncpp.reference.executor import build_simulator, parameter_delays, simulator_state
from asyncpp.reference.simulator import DelayedUpdateSimulator
from asyncpp.schedules.registry import is_sync_step, step_delay
from asyncpp.train import checkpoint as ckpt

A, LR = 2.0, 0.1


class Scalars(nn.Module):
    """embed, layers, norm, lm_head: one float64 scalar each, laid out like model_zoo's models."""

    def __init__(self, num_layers: int):
        super().__init__()

        def box(v: float) -> nn.Module:
            m = nn.Module()
            m.weight = nn.Parameter(torch.tensor([v], dtype=torch.float64))
            return m

        self.embed = box(1.0)
        self.layers = nn.ModuleList(box(1.0 + 0.1 * (i + 1)) for i in range(num_layers))
        self.norm = box(0.8)
        self.lm_head = box(0.7)


def quadratic(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """sum_k A/2 (w_k - c)^2, c = the batch's mean: gradient A (w_k - c)."""
    c = batch.double().mean()
    return sum(0.5 * A * (p - c).pow(2).sum() for p in model.parameters())


def batch(t: int) -> list[torch.Tensor]:
    return [torch.full((1, 2), float(t % 3) - 1.0)]  # c_t in {-1, 0, 1}


def recurrence(x0, delay_at, steps, ef=0.0, grad_ef=0.0, dc=0.0, predict=False):
    """The corrections on one scalar, by hand (x_{-k} := x_0, u_{-1} = g_{-1} := 0):
    x_read = x_{t-d} [+ d (x_{t-d} - x_{t-d-1})]; g = A (x_read - c_t); g += dc g^2 (x_t - x_read);
    g~ = g + grad_ef (g - g_prev); u = LR g~; x_{t+1} = x_t - u - ef (u - u_prev).
    Corrections apply when d > 0; g_prev and u_prev are refreshed every step."""
    xs, u_prev, g_prev = [x0], 0.0, 0.0

    def x(k: int) -> float:
        return xs[max(k, 0)]

    for t in range(steps):
        d, c = delay_at(t), float(t % 3) - 1.0
        x_read = x(t - d) + (d * (x(t - d) - x(t - d - 1)) if predict and d else 0.0)
        g = A * (x_read - c)
        if d:
            g = g + dc * g * g * (xs[t] - x_read)
        g_tilde = g + grad_ef * (g - g_prev) if d else g
        g_prev = g
        u = LR * g_tilde
        xs.append(xs[t] - u - (ef * (u - u_prev) if d else 0.0))
        u_prev = u
    return xs


STAGE_OF = {"embed.weight": 0, "layers.0.weight": 0, "layers.1.weight": 1, "layers.2.weight": 2,
            "norm.weight": 2, "lm_head.weight": 2}


@pytest.mark.equivalence
@pytest.mark.parametrize(
    "schedule, kw, sync",
    [
        ("2bw", {"grad_ef": 0.5}, (0, 0)),
        ("2bw", {"grad_ef": 1.0}, (2, 1)),
        ("2bw", {"dc": 0.3}, (0, 0)),
        ("pipedream", {"dc": 0.3}, (1, 0)),
        ("2bw", {"predict": True}, (0, 0)),
        ("pipedream", {"predict": True}, (2, 2)),
        ("2bw", {"ef": 1.0, "grad_ef": 0.5, "dc": 0.3, "predict": True}, (1, 1)),
        ("pipedream", {"ef": 0.5, "dc": 0.2, "predict": True}, (0, 0)),
    ],
)
def test_corrections_follow_their_formulas(schedule, kw, sync):
    """2bw: d = 1 everywhere; pipedream with P = 3: d = 2, 1, 0 by stage (x_t - x_{t-d} for DC-ASGD,
    d-step extrapolation for weight prediction); sync start/cooldown steps use d = 0."""
    P, steps = 3, 12
    staleness = StalenessConfig(sync_start_steps=sync[0], sync_cooldown_steps=sync[1])
    model = Scalars(num_layers=3)
    init = {n: float(p.detach()) for n, p in model.named_parameters()}
    sim = DelayedUpdateSimulator(
        model, torch.optim.SGD(model.parameters(), lr=LR), parameter_delays(model, schedule, P),
        loss_fn=quadratic, sync_step=lambda t: is_sync_step(t, steps, staleness),
        ef_lambda=kw.get("ef", 0.0), grad_ef_lambda=kw.get("grad_ef", 0.0), dc_lambda=kw.get("dc", 0.0),
        weight_prediction=kw.get("predict", False),
    )
    for t in range(steps):
        sim.step(t, batch(t))
    changed = False
    for name, p in model.named_parameters():
        def delay_at(t, s=STAGE_OF[name]):
            return step_delay(schedule, s, P, t, steps, staleness)

        expected = recurrence(init[name], delay_at, steps, **kw)[-1]
        assert float(p.detach()) == pytest.approx(expected, rel=1e-12, abs=1e-12), name
        changed |= abs(expected - recurrence(init[name], delay_at, steps)[-1]) > 1e-6
    assert changed  # the correction did something (the comparison is not vacuous)


@pytest.mark.equivalence
def test_everything_off_is_plain_delayed_training_bitwise():
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 2))
    data = [[torch.randn(3, 5) for _ in range(2)] for _ in range(6)]

    def loss_fn(model, x):
        return model(x).sin().mean()

    def train(**kw):
        model = copy.deepcopy(net)
        sim = DelayedUpdateSimulator(model, torch.optim.AdamW(model.parameters(), lr=3e-2), [1, 1, 2, 2],
                                     loss_fn=loss_fn, grad_clip=0.5, **kw)
        losses = [sim.step(t, mbs).loss for t, mbs in enumerate(data)]
        return losses, list(model.parameters())

    plain = train()
    off = train(grad_ef_lambda=0.0, dc_lambda=0.0, weight_prediction=False, diagnostics_every=0, ef_lambda=0.0)
    assert plain[0] == off[0]
    assert all(torch.equal(p, q) for p, q in zip(plain[1], off[1]))
    for kw in ({"grad_ef_lambda": 0.5}, {"dc_lambda": 1.0}, {"weight_prediction": True}):
        on = train(**kw)
        assert not all(torch.equal(p, q) for p, q in zip(plain[1], on[1])), kw


@pytest.mark.equivalence
def test_gradient_ef_state_round_trip(tmp_path):
    """g_{t-1} and the prediction's x_{t-2} survive a checkpoint: saved and loaded through the one checkpoint
    state both executors use (asyncpp/train/checkpoint/), a resumed simulator continues bit for bit."""
    model = Scalars(num_layers=1)
    sim = DelayedUpdateSimulator(model, torch.optim.SGD(model.parameters(), lr=LR), [1] * 4, loss_fn=quadratic,
                                 grad_ef_lambda=0.5, weight_prediction=True)
    for t in range(3):
        sim.step(t, batch(t))
    assert sim.num_past_versions == 2 and len(sim.history) == 2  # x_{t-1}, x_{t-2} for the prediction
    ckpt.save(tmp_path, 3, simulator_state(sim, model), config={}, layout={"pp": 1})
    for t in range(3, 6):
        sim.step(t, batch(t))
    resumed = Scalars(num_layers=1)
    sim2 = DelayedUpdateSimulator(resumed, torch.optim.SGD(resumed.parameters(), lr=LR), [1] * 4,
                                  loss_fn=quadratic, grad_ef_lambda=0.5, weight_prediction=True)
    ckpt.load(tmp_path / "step_00000003", simulator_state(sim2, resumed, num_past=2, step=3), ages=range(3))
    sim2.sync_params()
    assert any(g.abs().sum() > 0 for g in sim2.grad_error_feedback.prev_grad)  # g_{t-1} was restored
    for t in range(3, 6):
        sim2.step(t, batch(t))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters()))


# ----------------------------------------------------------------------------------- diagnostics
def small_lm():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 3))


def mse(model, x):
    return model(x).pow(2).mean()


def test_diagnostics_with_delay_zero_give_cosine_one_and_error_zero():
    """Sync: the fresh update is the applied update, through the same optimizer (Muon + AdamW), lr
    schedule and clipping; dropout draws the same masks because the RNG is restored."""
    model = small_lm()
    opt = build_optimizer(model, name="muon", lr=0.02, weight_decay=0.1)
    sim = DelayedUpdateSimulator(model, opt, [0] * 4, loss_fn=mse, grad_clip=0.3,
                                 lr_multiplier=lambda t: (t + 1) / 4, diagnostics_every=1)
    torch.manual_seed(1)
    for t in range(4):
        stats = sim.step(t, [torch.randn(4, 6) for _ in range(2)])
        assert stats.update_cosine == pytest.approx(1.0, abs=1e-12)
        assert stats.update_rel_error == 0.0


@pytest.mark.equivalence
@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_diagnostics_leave_the_trajectory_bit_identical(name):
    data = [[torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * t + i)) for i in range(2)]
            for t in range(7)]

    def train(every):
        model = small_lm()
        opt = build_optimizer(model, name=name, lr=0.02, weight_decay=0.1)
        sim = DelayedUpdateSimulator(model, opt, [1] * 4, loss_fn=mse, grad_clip=0.3, ef_lambda=1.0,
                                     lr_multiplier=lambda t: 0.5 + 0.1 * t, diagnostics_every=every)
        torch.manual_seed(5)
        stats = [sim.step(t, mbs) for t, mbs in enumerate(data)]
        return stats, model, opt

    off, on = train(0), train(3)
    assert [s.loss for s in off[0]] == [s.loss for s in on[0]]
    assert all(torch.equal(p, q) for p, q in zip(off[1].parameters(), on[1].parameters()))
    opt_off, opt_on = off[2].state_dict(), on[2].state_dict()
    for part in opt_off:
        for key, st in opt_off[part]["state"].items():
            for k, v in st.items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(opt_on[part]["state"][key][k])), (part, k)
    logged = [t for t, s in enumerate(on[0]) if s.update_cosine is not None]
    assert logged == [0, 3, 6] and all(s.update_cosine is None for s in off[0])
    # step 0 reads x_{-1} = x_0 = x_t, but EF (u_{-1} = 0) doubles the update: cosine 1, error 1
    assert on[0][0].update_cosine == pytest.approx(1.0, abs=1e-9)
    assert on[0][0].update_rel_error == pytest.approx(1.0, abs=1e-6)
    for t in (3, 6):  # delayed steps: a genuinely different update
        assert -1.0 <= on[0][t].update_cosine < 0.9999 and on[0][t].update_rel_error > 1e-4


def test_diagnostics_values_by_hand():
    """SGD on sum_k A/2 (w_k - c)^2, one-step delay: fresh = LR A (x_t - c), applied = LR A (x_{t-1} - c)."""
    model = nn.Module()
    model.w = nn.Parameter(torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64))
    sim = DelayedUpdateSimulator(model, torch.optim.SGD(model.parameters(), lr=LR), [1], loss_fn=quadratic,
                                 diagnostics_every=1)
    xs = [model.w.detach().clone()]
    for t in range(5):
        stats = sim.step(t, batch(t))
        c = float(t % 3) - 1.0
        fresh = LR * A * (xs[t] - c)
        applied = LR * A * (xs[max(t - 1, 0)] - c)
        cos = float(fresh @ applied) / math.sqrt(float(fresh @ fresh) * float(applied @ applied))
        assert stats.update_cosine == pytest.approx(cos, rel=1e-12)
        assert stats.update_rel_error == pytest.approx(float((applied - fresh).norm() / fresh.norm()), rel=1e-12)
        xs.append(model.w.detach().clone())
        torch.testing.assert_close(xs[-1], xs[t] - applied, rtol=1e-14, atol=1e-14)


# ------------------------------------------------------------------------------- config + wiring
def test_build_simulator_wires_the_staleness_fields():
    from model_zoo import build_model, get_model_config

    model = build_model(get_model_config("tiny_dense"))
    cfg = RunConfig.from_dict({
        "schedule": {"name": "2bw"},
        "staleness": {"grad_ef_lambda": 0.5, "dc_lambda": 0.1, "weight_prediction": True, "diagnostics_every": 4},
    })
    sim = build_simulator(cfg, model, build_optimizer(model, name="adamw", lr=1e-3, weight_decay=0.1))
    assert (sim.grad_error_feedback.lam, sim.rule.corrections.dc_lambda, sim.weight_prediction, sim.diagnostics_every) == (
        0.5, 0.1, True, 4)
    assert sim.num_past_versions == 2


@pytest.mark.parametrize(
    "overrides, must_contain",
    [
        (["staleness.dc_lambda=-1"], ["staleness.dc_lambda=-1.0", ">= 0"]),
        (["staleness.grad_ef_lambda=-0.5"], ["staleness.grad_ef_lambda=-0.5", ">= 0"]),
        (["staleness.diagnostics_every=-2"], ["staleness.diagnostics_every=-2"]),
        (["schedule=sync", "staleness.weight_prediction=true"], ["weight_prediction=True", "schedule=2bw"]),
        (["schedule=1f1b", "staleness.dc_lambda=0.1"], ["dc_lambda=0.1", "schedule=1f1b"]),
        (["optimizer=soap", "optimizer.precondition_frequency=0"], ["optimizer.precondition_frequency=0", ">= 1"]),
        (["optimizer=ademamix", "optimizer.beta3=1.0"], ["optimizer.beta3=1.0", "[0, 1)"]),
        (["optimizer=ademamix", "optimizer.alpha=-1"], ["optimizer.alpha=-1.0", ">= 0"]),
        (["optimizer=ademamix", "optimizer.ademamix_warmup_steps=-1"], ["ademamix_warmup_steps=-1"]),
        (["optimizer=mars", "optimizer.gamma=2"], ["optimizer.gamma=2.0", "0.025"]),
        (["optimizer.name=adam"], ["optimizer.name='adam'", "'normuon'", "'soap'", "'lion'"]),
    ],
)
def test_bad_values_are_refused_with_field_value_and_fix(overrides, must_contain):
    from asyncpp.config import ConfigError

    with pytest.raises(ConfigError) as err:
        resolve(compose(overrides))
    for fragment in must_contain:
        assert fragment in str(err.value), (fragment, str(err.value))


def test_diagnostics_are_allowed_on_sync_schedules():
    cfg, _ = resolve(compose(["schedule=sync", "staleness.diagnostics_every=5"]))
    assert cfg.staleness.diagnostics_every == 5
