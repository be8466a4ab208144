"""Gated DeltaNet: chunked form == step-by-step recurrence (values, states, grads), and the module's contract."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model_zoo.gated_deltanet import (
    GatedDeltaNet,
    batched_chunk_gated_delta_rule,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

B, H, DK, DV = 2, 3, 8, 16


# These are many tiny ops. On a small shared box several pytest processes oversubscribe the cores and
# OpenMP's spinning barriers then cost 10-1000x (measured: 40 ms fwd+bwd becomes 0.1-5 s); one thread
# keeps the suite fast and the reported timing reproducible.
pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(t: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random q, k, v, g <= 0, beta in (0,1). k is L2-normalised as the layer does: with raw N(0,1) keys of
    norm ~sqrt(Dk) the transition I - beta k k^T is expansive and the state blows up over 130 steps."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, t, H, DK, generator=gen, dtype=dtype)
    k = F.normalize(torch.randn(B, t, H, DK, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, t, H, DV, generator=gen, dtype=dtype)
    g = -torch.rand(B, t, H, generator=gen, dtype=dtype) * 2.0  # decays in [e^-2, 1]
    beta = torch.rand(B, t, H, generator=gen, dtype=dtype).clamp(1e-3, 1 - 1e-3)
    return q, k, v, g, beta


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("t", [1, 5, 64, 100, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_recurrent(t: int, dtype: torch.dtype, tol: float, with_state: bool) -> None:
    q, k, v, g, beta = _inputs(t, dtype)
    s0 = (
        torch.randn(B, H, DK, DV, dtype=dtype, generator=torch.Generator().manual_seed(1))
        if with_state
        else None
    )
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    for chunk_size in (16, 64):  # one reference, both chunkings (the recurrence is the slow part)
        o, s = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, initial_state=s0)
        assert o.shape == (B, t, H, DV) and s.shape == (B, H, DK, DV)
        assert o.dtype == dtype
        torch.testing.assert_close(o, o_ref, rtol=tol, atol=tol, msg=lambda m, c=chunk_size: f"C={c}: {m}")
        torch.testing.assert_close(s, s_ref, rtol=tol, atol=tol, msg=lambda m, c=chunk_size: f"C={c}: {m}")


@pytest.mark.parametrize("t,chunk_size", [(37, 16), (64, 16)])
def test_chunk_grads_match_recurrent(t: int, chunk_size: int) -> None:
    inputs = _inputs(t, torch.float64, seed=2)
    s0 = torch.randn(B, H, DK, DV, dtype=torch.float64)
    grads = []
    for fn in (
        recurrent_gated_delta_rule,
        lambda *a, **kw: chunk_gated_delta_rule(*a, chunk_size=chunk_size, **kw),
    ):
        leaves = [x.clone().requires_grad_(True) for x in (*inputs, s0)]
        o, s = fn(*leaves[:5], initial_state=leaves[5])
        # Random cotangents on both outputs so every path (incl. through the final state) is exercised.
        gen = torch.Generator().manual_seed(3)
        loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() + (
            s * torch.randn(s.shape, generator=gen, dtype=s.dtype)
        ).sum()
        grads.append(torch.autograd.grad(loss, leaves))
    for name, g_ref, g_chunk in zip(["q", "k", "v", "g", "beta", "s0"], *grads):
        torch.testing.assert_close(g_chunk, g_ref, rtol=1e-10, atol=1e-10, msg=f"grad of {name}")


@pytest.mark.parametrize("form,chunk_size", [(chunk_gated_delta_rule, 64), (batched_chunk_gated_delta_rule, 16)])
def test_chunk_stable_under_strong_decay_and_repeated_keys(form, chunk_size: int) -> None:
    # g = -50 makes the within-chunk cumsum reach -3200: a form using exp(gamma_i) * exp(-gamma_j) would
    # overflow to inf/nan, differences of cumsums must not. Identical keys with beta ~ 1 make the
    # triangular system as ill-conditioned as the delta rule gets. The batched form's products of chunk
    # transitions (model_zoo/delta_rule.affine_scan, two-level from 4 chunks: 7 here) are products of
    # contractions here too (the cumsum within 16 steps reaches -800: exp overflows fp32 from 89).
    q, k, v, g, beta = _inputs(100, torch.float32)
    k_same = k[:, :1].expand_as(k).contiguous()
    for g_case, k_case, b_case in (
        (torch.full_like(g, -50.0), k, beta),
        (g * 1e-3, k_same, beta * 0 + 0.999),
    ):
        leaves = [x.clone().requires_grad_(True) for x in (q, k_case, v, g_case, b_case)]
        o, s = form(*leaves, chunk_size=chunk_size)
        o_ref, s_ref = recurrent_gated_delta_rule(q, k_case, v, g_case, b_case)
        torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5)
        (o.sum() + s.sum()).backward()
        assert all(torch.isfinite(x.grad).all() for x in leaves)


def test_hand_computed_scalar_case() -> None:
    # B=H=Dk=Dv=1, so the q scale Dk**-0.5 is 1 and every quantity is a scalar.
    # s0 = 0.5; step 1: a=0.5, beta=0.5, k=1, v=3, q=2
    #   S = 0.5*0.5 = 0.25;  S += 0.5*1*(3 - 0.25*1) = 1.375  -> S = 1.625;  o1 = 1.625*2 = 3.25
    # step 2: a=0.8, beta=0.25, k=0.5, v=1, q=-1
    #   S = 0.8*1.625 = 1.3; S += 0.25*0.5*(1 - 1.3*0.5) = 0.04375 -> S = 1.34375; o2 = -1.34375
    q = torch.tensor([2.0, -1.0], dtype=torch.float64).view(1, 2, 1, 1)
    k = torch.tensor([1.0, 0.5], dtype=torch.float64).view(1, 2, 1, 1)
    v = torch.tensor([3.0, 1.0], dtype=torch.float64).view(1, 2, 1, 1)
    g = torch.tensor([0.5, 0.8], dtype=torch.float64).log().view(1, 2, 1)
    beta = torch.tensor([0.5, 0.25], dtype=torch.float64).view(1, 2, 1)
    s0 = torch.full((1, 1, 1, 1), 0.5, dtype=torch.float64)
    expected_o = torch.tensor([3.25, -1.34375], dtype=torch.float64).view(1, 2, 1, 1)
    for o, s in (
        recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0),
        chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, initial_state=s0),
        chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=1, initial_state=s0),
    ):
        torch.testing.assert_close(o, expected_o, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(s.flatten(), torch.tensor([1.34375], dtype=torch.float64))


def test_q_scaling_convention() -> None:
    # o is linear in q with the Dk**-0.5 factor applied inside: with S = k v^T after one full write
    # (beta -> 1, g = 0, S0 = 0), o = (q.k) v / sqrt(Dk).
    q, k, v, _, _ = _inputs(1, torch.float64)
    g, beta = torch.zeros(B, 1, H, dtype=torch.float64), torch.ones(B, 1, H, dtype=torch.float64)
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    expected = (q * k).sum(-1, keepdim=True) * v / math.sqrt(DK)
    torch.testing.assert_close(o, expected, rtol=1e-12, atol=1e-12)


def _small_layer(chunk_size: int = 8) -> GatedDeltaNet:
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 2, 8, 12, chunk_size=chunk_size).double()
    layer.reset_parameters(std=0.1)
    return layer


def test_module_is_causal() -> None:
    layer = _small_layer()
    x = torch.randn(2, 21, 32, dtype=torch.float64)
    ref = layer(x)
    for t in (0, 8, 13):  # first step, a chunk border (chunk 8), mid-chunk
        x2 = x.clone()
        x2[:, t] += torch.randn(2, 32, dtype=torch.float64)
        out = layer(x2)
        torch.testing.assert_close(out[:, :t], ref[:, :t], rtol=0, atol=0)
        assert not torch.allclose(out[:, t], ref[:, t])


def test_module_independent_of_chunk_size() -> None:
    layer = _small_layer(chunk_size=8)
    x = torch.randn(2, 29, 32, dtype=torch.float64)
    ref = layer(x)
    layer.chunk_size = 64
    torch.testing.assert_close(layer(x), ref, rtol=1e-10, atol=1e-10)


def test_module_shape_and_all_grads() -> None:
    layer = GatedDeltaNet(64, 4, 16, 16, chunk_size=16)
    x = torch.randn(2, 40, 64)
    out = layer(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    out.square().mean().backward()
    names = {n for n, _ in layer.named_parameters()}
    expected = {f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj")}
    expected |= {"conv_q.weight", "conv_k.weight", "conv_v.weight", "A_log", "dt_bias", "o_norm.weight"}
    assert names == expected
    for n, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, n


def test_module_bf16_runs() -> None:
    layer = GatedDeltaNet(64, 4, 16, 16, chunk_size=16).to(torch.bfloat16)
    out = layer(torch.randn(2, 20, 64, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_init_deterministic_and_ranges() -> None:
    def build() -> GatedDeltaNet:
        torch.manual_seed(123)
        layer = GatedDeltaNet(64, 4, 16, 16)
        layer.reset_parameters(std=0.02, out_std=0.005)
        return layer

    a, b = build(), build()
    for (n, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), n
    assert 1.0 <= a.A_log.exp().min() and a.A_log.exp().max() <= 16.0
    dt = F.softplus(a.dt_bias)  # the inverse-softplus round trip lands dt in [1e-3, 1e-1]
    assert (dt >= 1e-3 - 1e-7).all() and (dt <= 1e-1 + 1e-7).all()
    assert abs(a.o_proj.weight.std().item() - 0.005) < 0.001
    assert abs(a.q_proj.weight.std().item() - 0.02) < 0.003
    assert torch.equal(a.o_norm.weight, torch.ones(16))


def test_builds_on_meta_then_materialises() -> None:
    with torch.device("meta"):
        layer = GatedDeltaNet(64, 4, 16, 16)
    assert all(p.is_meta for p in layer.parameters())
    layer.to_empty(device="cpu")
    layer.reset_parameters(std=0.02)
    assert all(torch.isfinite(p).all() for p in layer.parameters())
    assert layer(torch.randn(1, 5, 64)).shape == (1, 5, 64)

