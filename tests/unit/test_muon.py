"""Our batched Muon against torch.optim.Muon, and the properties batching must preserve."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from asyncpp.optim.muon import Muon, adjusted_lr, newton_schulz

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
