"""Never apply a non-finite update (core/update.py): a finite gradient whose update overflows leaves x_t in place
and stops the run with NonFiniteUpdate; a finite update is applied exactly as before."""

from __future__ import annotations

import pytest
import torch

from asyncpp.core.update import NonFiniteUpdate, UpdateRule


def rule_and_weights(lr: float, raise_on_nonfinite_update: bool = True):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3))
    b = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.SGD([w, b], lr=lr)
    return UpdateRule(opt, [w, b], raise_on_nonfinite_update=raise_on_nonfinite_update), [w, b]


def grads_for(params):
    return [torch.full_like(p, 10.0) for p in params]


def test_an_overflowing_update_is_refused_and_x_t_kept():
    rule, params = rule_and_weights(lr=1e38)  # lr * g = 1e39: inf in fp32
    x_t = [p.detach().clone() for p in params]
    with pytest.raises(NonFiniteUpdate, match=r"step 0: the update was not finite .* Lower optimizer.lr"):
        rule.apply(0, grads_for(params), 1.0, x_t, [False, False])
    assert all(torch.equal(p, x) for p, x in zip(params, x_t))


def test_a_pipeline_rank_reports_it_instead_of_raising():
    rule, params = rule_and_weights(lr=1e38, raise_on_nonfinite_update=False)
    x_t = [p.detach().clone() for p in params]
    outcome = rule.apply(0, grads_for(params), 1.0, x_t, [False, False])
    assert outcome.skipped and not outcome.update_finite
    assert all(torch.equal(p, x) for p, x in zip(params, x_t))


def test_a_finite_update_is_applied_exactly_as_the_optimizer_computes_it():
    rule, params = rule_and_weights(lr=1e-2)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    plain = torch.optim.SGD(twin, lr=1e-2)
    for q, g in zip(twin, grads_for(twin)):
        q.grad = g
    plain.step()
    outcome = rule.apply(0, grads_for(params), 1.0, [p.detach().clone() for p in params], [False, False])
    assert not outcome.skipped and outcome.update_finite
    assert all(torch.equal(p, q) for p, q in zip(params, twin))
