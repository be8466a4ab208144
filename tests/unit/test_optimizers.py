"""NorMuon, SOAP, Lion, Signum, AdEMAMix, MARS and Adan against their published update rules.

Each reference below is the paper's algorithm written out by hand, one matrix / tensor at a time in
float64, independent of the implementation's batching, foreach calls and state layout.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from asyncpp.optim import (
    MARS,
    OPTIMIZER_NAMES,
    SOAP,
    Adan,
    AdEMAMix,
    Lion,
    NorMuon,
    Signum,
    build_optimizer,
    split_params,
)
from asyncpp.optim.ademamix import beta3_schedule

DT = torch.float64


def make_params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g, dtype=DT)) for s in shapes]


def make_grads(shapes, steps, seed=1, scale=1.0):
    """grads[t][i]; every third step is scaled up so norm-dependent branches (MARS's clip) run both ways."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g, dtype=DT) * (scale * (4.0 if t % 3 == 1 else 1.0)) for s in shapes]
            for t in range(steps)]


def run(opt, params, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()


def assert_close(params, expected, tol=1e-10):
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e, rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------- Lion
def test_lion_matches_the_paper():
    shapes, lr, (b1, b2), wd, steps = [(3, 4), (5,)], 0.01, (0.9, 0.99), 0.3, 6
    params, grads = make_params(shapes), make_grads(shapes, steps)
    expected = []
    for i, x in enumerate(p.detach().clone() for p in params):
        m = torch.zeros_like(x)
        for t in range(steps):
            g = grads[t][i]
            c = b1 * m + (1 - b1) * g
            x = x - lr * (torch.sign(c) + wd * x)
            m = b2 * m + (1 - b2) * g
        expected.append(x)
    run(Lion(params, lr=lr, betas=(b1, b2), weight_decay=wd), params, grads)
    assert_close(params, expected)


def test_signum_matches_the_paper():
    shapes, lr, beta, wd, steps = [(3, 4), (5,)], 0.01, 0.8, 0.2, 6
    params, grads = make_params(shapes), make_grads(shapes, steps)
    expected = []
    for i, x in enumerate(p.detach().clone() for p in params):
        m = torch.zeros_like(x)
        for t in range(steps):
            m = beta * m + (1 - beta) * grads[t][i]
            x = x - lr * torch.sign(m) - lr * wd * x
        expected.append(x)
    run(Signum(params, lr=lr, momentum=beta, weight_decay=wd), params, grads)
    assert_close(params, expected)


# ------------------------------------------------------------------------------------------ AdEMAMix
@pytest.mark.parametrize("warmup", [0, 3])
def test_ademamix_matches_the_paper(warmup):
    shapes, lr, (b1, b2), b3, alpha, eps, wd, steps = [(3, 4), (5,)], 0.01, (0.9, 0.999), 0.999, 5.0, 1e-8, 0.1, 6
    params, grads = make_params(shapes), make_grads(shapes, steps)
    expected = []
    for i, x in enumerate(p.detach().clone() for p in params):
        m1, m2, nu = (torch.zeros_like(x) for _ in range(3))
        for t in range(1, steps + 1):
            g = grads[t - 1][i]
            if warmup:
                frac = min(t / warmup, 1.0)
                a_t = alpha * frac
                b3_t = min(math.exp(math.log(b1) * math.log(b3) / ((1 - frac) * math.log(b3) + frac * math.log(b1))), b3)
            else:
                a_t, b3_t = alpha, b3
            m1 = b1 * m1 + (1 - b1) * g
            m2 = b3_t * m2 + (1 - b3_t) * g
            nu = b2 * nu + (1 - b2) * g * g
            m1_hat, nu_hat = m1 / (1 - b1**t), nu / (1 - b2**t)
            x = x - lr * ((m1_hat + a_t * m2) / (nu_hat.sqrt() + eps) + wd * x)
        expected.append(x)
    opt = AdEMAMix(params, lr=lr, betas=(b1, b2), beta3=b3, alpha=alpha, warmup_steps=warmup, eps=eps, weight_decay=wd)
    run(opt, params, grads)
    assert_close(params, expected)


def test_ademamix_beta3_schedule_endpoints():
    assert beta3_schedule(0, 0.9, 0.9999, 100) == pytest.approx(0.9)
    assert beta3_schedule(100, 0.9, 0.9999, 100) == pytest.approx(0.9999)
    assert beta3_schedule(500, 0.9, 0.9999, 100) == pytest.approx(0.9999)
    assert 0.9 < beta3_schedule(50, 0.9, 0.9999, 100) < 0.9999


# ---------------------------------------------------------------------------------------------- Adan
def test_adan_matches_the_paper():
    """Algorithm 1 with the paper's betas (1 - ours), m_0 = g_0 replaced by the released code's bias
    correction, and g_0 = g_1 (v_1 = 0), decoupled decay: the authors' `no_prox=True` update."""
    shapes, lr, (b1, b2, b3), eps, wd, steps = [(3, 4), (5,)], 0.01, (0.98, 0.92, 0.99), 1e-8, 0.1, 7
    params, grads = make_params(shapes), make_grads(shapes, steps)
    expected = []
    for i, x in enumerate(p.detach().clone() for p in params):
        m, v, n = (torch.zeros_like(x) for _ in range(3))
        g_prev = grads[0][i]
        for t in range(1, steps + 1):
            g = grads[t - 1][i]
            m = (1 - (1 - b1)) * m + (1 - b1) * g          # paper: (1 - beta1') m + beta1' g, beta1' = 1 - b1
            v = b2 * v + (1 - b2) * (g - g_prev)
            n = b3 * n + (1 - b3) * (g + b2 * (g - g_prev)) ** 2
            eta = lr / ((n / (1 - b3**t)).sqrt() + eps)
            x = x * (1 - lr * wd) - eta * (m / (1 - b1**t) + b2 * v / (1 - b2**t))
            g_prev = g
        expected.append(x)
    run(Adan(params, lr=lr, betas=(b1, b2, b3), eps=eps, weight_decay=wd), params, grads)
    assert_close(params, expected)


def test_adan_first_step_has_no_difference_term_and_checks_betas():
    (p,) = make_params([(2, 3)])
    x0, g = p.detach().clone(), torch.full((2, 3), 0.5, dtype=DT)
    p.grad = g.clone()
    Adan([p], lr=0.1, eps=0.0).step()  # v_1 = 0 and n_1/(1-b3) = g^2: a sign step of size lr
    torch.testing.assert_close(p.detach(), x0 - 0.1 * torch.ones_like(x0), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="three coefficients"):
        Adan([p], betas=(0.9, 0.9))
    with pytest.raises(ValueError, match=r"betas\[2\]=1.0"):
        Adan([p], betas=(0.9, 0.9, 1.0))


# ---------------------------------------------------------------------------------------------- MARS
def test_mars_adamw_matches_the_paper():
    shapes, lr, (b1, b2), gamma, eps, wd, steps = [(3, 4), (6,)], 0.01, (0.95, 0.99), 0.025, 1e-8, 0.1, 7
    params, grads = make_params(shapes), make_grads(shapes, steps, scale=0.3)
    clipped = 0
    expected = []
    for i, x in enumerate(p.detach().clone() for p in params):
        m, v, prev = torch.zeros_like(x), torch.zeros_like(x), grads[0][i]  # g_0 := g_1: no correction at first
        for t in range(1, steps + 1):
            g = grads[t - 1][i]
            c = g + gamma * (b1 / (1 - b1)) * (g - prev)
            if c.norm() > 1:
                c, clipped = c / c.norm(), clipped + 1
            m = b1 * m + (1 - b1) * c
            v = b2 * v + (1 - b2) * c * c
            x = x - lr * ((m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps) + wd * x)
            prev = g
        expected.append(x)
    assert 0 < clipped < steps * len(shapes)  # both branches of the clip ran
    run(MARS(params, lr=lr, betas=(b1, b2), gamma=gamma, eps=eps, weight_decay=wd), params, grads)
    assert_close(params, expected)


# ------------------------------------------------------------------------------------------- NorMuon
def ns5(G, steps=5):
    """Muon's quintic Newton-Schulz on one matrix, written out."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.T if G.shape[0] > G.shape[1] else G
    X = X / max(float(X.norm()), 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if G.shape[0] > G.shape[1] else X


@pytest.mark.parametrize("nesterov", [False, True])
def test_normuon_matches_the_paper(nesterov):
    """nesterov=False is the paper's Algorithm 1 as printed; True feeds NS lerp(G, M, beta1) instead of M."""
    shapes, lr, b1, b2, eps, wd, steps = [(6, 4), (6, 4), (3, 5), (2, 4, 3)], 0.02, 0.9, 0.95, 1e-8, 0.1, 4
    params, grads = make_params(shapes), make_grads(shapes, steps)
    expected = []
    for i, x0 in enumerate(p.detach().clone() for p in params):
        mats = []
        for e in range(x0.shape[0] if x0.ndim == 3 else 1):  # a [E, m, n] stack is E independent matrices
            W = x0[e] if x0.ndim == 3 else x0
            M, v = torch.zeros_like(W), torch.zeros(W.shape[0], 1, dtype=DT)
            m, n = W.shape
            for t in range(steps):
                G = grads[t][i][e] if x0.ndim == 3 else grads[t][i]
                M = b1 * M + (1 - b1) * G
                O = ns5((1 - b1) * G + b1 * M if nesterov else M)
                v = b2 * v + (1 - b2) * (O * O).mean(dim=1, keepdim=True)
                O_hat = O / (v.sqrt() + eps)
                eta_hat = 0.2 * lr * math.sqrt(m * n) / O_hat.norm()
                W = W - lr * wd * W - eta_hat * O_hat
            mats.append(W)
        expected.append(torch.stack(mats) if x0.ndim == 3 else mats[0])
    opt = NorMuon(params, lr=lr, momentum=b1, beta2=b2, nesterov=nesterov, eps=eps, weight_decay=wd)
    run(opt, params, grads)
    assert_close(params, expected, tol=1e-9)
    assert opt.state[params[3]]["second_momentum_buffer"].shape == (2, 4, 1)


def test_normuon_update_rms_is_0_2_lr():
    (p,) = make_params([(16, 8)])
    before = p.detach().clone()
    opt = NorMuon([p], lr=0.01, weight_decay=0.0)
    p.grad = torch.randn(16, 8, dtype=DT)
    opt.step()
    assert float((p.detach() - before).pow(2).mean().sqrt()) == pytest.approx(0.002, rel=1e-9)


# ---------------------------------------------------------------------------------------------- SOAP
def soap_reference(W, grads, lr, b1, b2, eps, wd, freq):
    """SOAP (Algorithm 3) on one matrix: Q = I until the first refresh (after update 0), eigh there, then
    every `freq` updates one power-iteration step + QR with V's rows/columns reordered (Algorithm 4)."""
    m, n = W.shape
    M, V = torch.zeros_like(W), torch.zeros_like(W)
    L, R = torch.zeros(m, m, dtype=DT), torch.zeros(n, n, dtype=DT)
    QL, QR = torch.eye(m, dtype=DT), torch.eye(n, dtype=DT)
    for t, G in enumerate(grads):
        k = t + 1
        Gr = QL.T @ G @ QR
        M = b1 * M + (1 - b1) * G
        Mr = QL.T @ M @ QR
        V = b2 * V + (1 - b2) * Gr * Gr
        Nr = (Mr / (1 - b1**k)) / ((V / (1 - b2**k)).sqrt() + eps)
        N = QL @ Nr @ QR.T
        W = W - lr * N - lr * wd * W
        L = b2 * L + (1 - b2) * G @ G.T
        R = b2 * R + (1 - b2) * G.T @ G
        if t % freq != 0:
            continue
        if t == 0:
            QL = torch.linalg.eigh(L).eigenvectors.flip(1)
            QR = torch.linalg.eigh(R).eigenvectors.flip(1)
            continue
        for side in ("L", "R"):
            P, Q = (L, QL) if side == "L" else (R, QR)
            est = torch.diag(Q.T @ P @ Q)
            order = torch.argsort(est, descending=True)
            Q_new = torch.linalg.qr(P @ Q[:, order]).Q
            if side == "L":
                QL, V = Q_new, V[order, :]
            else:
                QR, V = Q_new, V[:, order]
    return W


def test_soap_matches_the_paper():
    # Square matrices: after one step G G^T and G^T G are full rank, so every eigenvector is unique
    # up to sign (which SOAP's update does not depend on) and the comparison is well defined.
    shapes, lr, (b1, b2), eps, wd, freq, steps = [(4, 4), (2, 3, 3)], 0.01, (0.95, 0.95), 1e-8, 0.1, 2, 7
    params, grads = make_params(shapes), make_grads(shapes, steps)
    expected = []
    for i, x0 in enumerate(p.detach().clone() for p in params):
        if x0.ndim == 2:
            expected.append(soap_reference(x0, [g[i] for g in grads], lr, b1, b2, eps, wd, freq))
        else:
            expected.append(torch.stack([soap_reference(x0[e], [g[i][e] for g in grads], lr, b1, b2, eps, wd, freq)
                                         for e in range(x0.shape[0])]))
    opt = SOAP(params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, precondition_frequency=freq)
    run(opt, params, grads)
    assert_close(params, expected, tol=1e-9)


def test_soap_first_step_is_adam_and_refuses_vectors():
    (p,) = make_params([(3, 5)])
    x0 = p.detach().clone()
    opt = SOAP([p], lr=0.1, weight_decay=0.0)
    p.grad = torch.randn(3, 5, dtype=DT)
    opt.step()
    # Adam's first step (bias-corrected moments g and g^2): lr * g / (|g| + eps)
    g = p.grad
    torch.testing.assert_close(p.detach(), x0 - 0.1 * g / (g.abs() + 1e-8), rtol=1e-12, atol=1e-12)
    basis = opt.state[p]["basis_left"]
    torch.testing.assert_close(basis.T @ basis, torch.eye(3, dtype=DT))
    with pytest.raises(ValueError, match="ndim >= 2"):
        SOAP([nn.Parameter(torch.zeros(4))])


# ------------------------------------------------------------------------------- resume + build
ALL = {
    "lion": lambda ps: Lion(ps, lr=0.01, weight_decay=0.1),
    "signum": lambda ps: Signum(ps, lr=0.01, weight_decay=0.1),
    "ademamix": lambda ps: AdEMAMix(ps, lr=0.01, warmup_steps=4, weight_decay=0.1),
    "adan": lambda ps: Adan(ps, lr=0.01, weight_decay=0.1),
    "mars": lambda ps: MARS(ps, lr=0.01, weight_decay=0.1),
    "normuon": lambda ps: NorMuon(ps, lr=0.01),
    "soap": lambda ps: SOAP(ps, lr=0.01, precondition_frequency=2, weight_decay=0.1),
}


@pytest.mark.parametrize("name", sorted(ALL))
def test_state_dict_round_trip_continues_identically(name):
    shapes = [(4, 4), (3, 5)] + ([] if name in ("normuon", "soap") else [(6,)])
    params, grads = make_params(shapes), make_grads(shapes, 8)
    opt = ALL[name](params)
    run(opt, params, grads[:3])
    buf = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in params], "optim": opt.state_dict()}, buf)
    run(opt, params, grads[3:])

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed = [nn.Parameter(x) for x in ckpt["params"]]
    opt2 = ALL[name](resumed)
    opt2.load_state_dict(ckpt["optim"])
    run(opt2, resumed, grads[3:])
    for a, b in zip(params, resumed):
        assert torch.equal(a, b), name


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.proj = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, tokens):
        return self.norm(self.proj(self.embed(tokens))) @ self.embed.weight.T


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_build_every_optimizer_and_train(name):
    torch.manual_seed(0)
    model = Small()
    before = [p.detach().clone() for p in model.parameters()]
    opt = build_optimizer(model, name=name, lr=1e-2, weight_decay=0.1, adamw_lr=3e-3, precondition_frequency=2)
    matrices = {id(p) for _, p in split_params(model)[0]}
    if name in ("muon", "normuon", "soap"):
        assert set(opt.optimizers) == {name, "adamw"}
        assert {id(p) for g in opt.optimizers[name].param_groups for p in g["params"]} == matrices
        assert {g["lr"] for g in opt.optimizers["adamw"].param_groups} == {3e-3}
    else:
        assert set(opt.optimizers) == {name}
    assert len(opt.params()) == len(list(model.parameters()))
    for g in opt.param_groups:  # decoupled decay only on matrices
        assert (g["weight_decay"] == 0.1) == all(p.ndim >= 2 for p in g["params"])
    tokens = torch.randint(0, 11, (2, 5))
    for _ in range(3):
        opt.zero_grad()
        model(tokens).logsumexp(-1).mean().backward()
        opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.isfinite(p).all() for p in model.parameters())
