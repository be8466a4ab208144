"""Weight versions without processes: which storage a Parameter points at, and when."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncpp.core.partition import param_stages, stage_layer_ranges
from asyncpp.pipeline.weights import WeightVersions


def make(k: int):
    lin = nn.Linear(3, 2, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    versions = WeightVersions([lin.weight], k)
    opt = torch.optim.SGD(versions.masters, lr=1.0)
    return lin, versions, opt


def apply_update(versions, opt, step, delta):
    versions.begin_update(step)
    versions.masters[0].grad = torch.full_like(versions.masters[0], delta)
    opt.step()


def test_two_buffers_keep_the_in_flight_version_intact():
    lin, versions, opt = make(2)
    x = torch.ones(1, 3)
    versions.use(0)
    out = lin(x).sum()  # a microbatch of b_1 in flight on x_0
    apply_update(versions, opt, 0, 0.5)  # x_1 = x_0 - 0.5, written into the other buffer
    assert torch.equal(versions.masters[0], torch.full((2, 3), 0.5))
    versions.use(0)
    out.backward()  # autograd sees x_0 and an untouched version counter
    assert torch.equal(lin.weight.grad, torch.ones(2, 3))
    assert torch.equal(lin.weight, torch.ones(2, 3))
    versions.use(1)
    assert torch.equal(lin.weight, torch.full((2, 3), 0.5))


def test_versions_out_of_the_window_are_refused():
    _, versions, opt = make(2)
    apply_update(versions, opt, 0, 0.1)
    apply_update(versions, opt, 1, 0.1)
    versions.use(2)
    versions.use(1)
    with pytest.raises(RuntimeError, match="version 0 is not held"):
        versions.use(0)
    with pytest.raises(RuntimeError, match="update for step 1"):
        versions.begin_update(1)


def test_single_buffer_updates_in_place_and_returns_the_old_weights():
    lin, versions, opt = make(1)
    x_t = versions.begin_update(0)
    versions.masters[0].grad = torch.full((2, 3), 0.5)
    opt.step()
    assert torch.equal(x_t[0], torch.ones(2, 3))  # a copy: the update was in place
    assert torch.equal(lin.weight, torch.full((2, 3), 0.5))


def test_a_restored_stage_points_at_the_newest_version():
    _, versions, opt = make(2)
    apply_update(versions, opt, 0, 0.25)
    assert versions.held() == [0, 1]
    _, other, _ = make(2)
    for v in versions.held():
        for dst, src in zip(other.tensors(v), versions.tensors(v)):
            dst.copy_(src)
    other.set_newest(1)
    assert torch.equal(other.params[0], torch.full((2, 3), 0.75))
    assert torch.equal(other.masters[0], torch.full((2, 3), 0.75))
    other.use(0)
    assert torch.equal(other.params[0], torch.ones(2, 3))


def test_explicit_stage_split():
    assert [list(r) for r in stage_layer_ranges(4, 2, [3, 1])] == [[0, 1, 2], [3]]
    assert [list(r) for r in stage_layer_ranges(6, 3)] == [[0, 1], [2, 3], [4, 5]]
    # Without stage_layers the extra layers go to the first stages (the last one also runs the head and loss).
    assert [len(r) for r in stage_layer_ranges(30, 4)] == [8, 8, 7, 7]
    assert [list(r) for r in stage_layer_ranges(5, 2)] == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="parallel.pp<=4"):
        stage_layer_ranges(4, 5)
    with pytest.raises(ValueError, match="stage_layers"):
        stage_layer_ranges(4, 2, [2, 1])

    model = nn.Module()
    model.embed = nn.Embedding(4, 2)
    model.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
    model.norm = nn.LayerNorm(2)
    model.lm_head = nn.Linear(2, 4)
    stages = param_stages(model, 2, [3, 1])
    assert stages["layers.2.weight"] == 0 and stages["layers.3.weight"] == 1 and stages["lm_head.weight"] == 1
