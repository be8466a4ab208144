"""The Megatron front-end's checks that need no process group: megatron's TP layout read from its parameter
attributes, the refusal of a Muon that does not share it, and the refusals of megatron-core's DDP, optimizers and
gradient-sync hooks (asyncpp/pipeline/megatron.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from asyncpp.optim import build_optimizer
from asyncpp.pipeline.megatron import (
    _check_optimizer_layouts,
    _refuse_megatron_grad_machinery,
    _refuse_megatron_grad_sync,
    optimizer_sharding,
    param_layouts,
)


class TwoLinears(nn.Module):
    """Megatron's marks on two hidden matrices: a column-parallel (dim 0) and a row-parallel (dim 1) shard."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.norm = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False), nn.LayerNorm(8)
        for linear, dim in ((self.fc1, 0), (self.fc2, 1)):
            linear.weight.tensor_model_parallel, linear.weight.partition_dim = True, dim


TP_GROUP = object()  # stands for megatron's TP group: only its identity is compared
MESH = SimpleNamespace(dims=SimpleNamespace(tp=2), tp_group=TP_GROUP)


def test_optimizer_sharding_is_megatrons_partition_dims():
    model = TwoLinears()
    assert [lay.tp_dim for lay in param_layouts(model)] == [0, 1, None, None]
    assert {n: lay.tp_dim for n, lay in optimizer_sharding(model).items()} == {"fc1.weight": 0, "fc2.weight": 1}


def test_muon_with_megatrons_layout_passes():
    model = TwoLinears()
    optimizer = build_optimizer(model, name="muon", lr=0.01, sharding=optimizer_sharding(model), tp_group=TP_GROUP)
    _check_optimizer_layouts(model, optimizer, MESH)


@pytest.mark.parametrize("mistake", ["no_sharding", "other_group", "wrong_dim"])
def test_muon_without_megatrons_layout_is_refused(mistake):
    model = TwoLinears()
    sharding = optimizer_sharding(model)
    if mistake == "no_sharding":
        sharding = {}
    if mistake == "wrong_dim":
        sharding["fc2.weight"] = sharding["fc1.weight"]  # dim 0 where megatron split dim 1
    group = object() if mistake == "other_group" else TP_GROUP
    optimizer = build_optimizer(model, name="muon", lr=0.01, sharding=sharding, tp_group=group)
    with pytest.raises(ValueError, match=r"sharding=optimizer_sharding\(model\), tp_group=mesh.tp_group") as e:
        _check_optimizer_layouts(model, optimizer, MESH)
    if mistake != "other_group":
        assert "megatron shards it along dim" in str(e.value)


def test_elementwise_optimizers_and_tp1_have_nothing_to_check():
    model = TwoLinears()
    _check_optimizer_layouts(model, build_optimizer(model, name="adamw", lr=0.01), MESH)
    tp1 = SimpleNamespace(dims=SimpleNamespace(tp=1), tp_group=None)
    _check_optimizer_layouts(model, build_optimizer(model, name="muon", lr=0.01), tp1)


class Stage(TwoLinears):
    """A stage as the front-end sees a megatron model: set_input_tensor and a TransformerConfig-like config."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(finalize_model_grads_func=None, grad_sync_func=None, no_sync_func=None,
                                      param_sync_func=None)

    def set_input_tensor(self, tensors) -> None:
        pass


def test_a_model_whose_gradients_megatrons_ddp_takes_is_refused():
    """megatron's DistributedDataParallel marks every parameter with main_grad (param_and_grad_buffer.py:837) and
    takes param.grad away in its hook; the real wrapper is refused in tests/dist/test_megatron_core.py (slow)."""
    model = Stage()
    _refuse_megatron_grad_machinery(model, None)
    model.fc2.weight.main_grad = model.fc2.weight.detach().clone()
    with pytest.raises(ValueError, match=r"fc2.weight has a main_grad.*param_and_grad_buffer.py:837"):
        _refuse_megatron_grad_machinery(model, None)


def test_a_megatron_optimizer_is_refused():
    model = Stage()
    _refuse_megatron_grad_machinery(model, build_optimizer(model, name="adamw", lr=0.01))
    # A class of megatron's optimizer module (a real one cannot be built on a CPU: optimizer.py:481, 907).
    megatrons = type("DistributedOptimizer", (), {"__module__": "megatron.core.optimizer.distrib_optimizer"})
    with pytest.raises(ValueError, match=r"megatron-core's DistributedOptimizer.*build_optimizer"):
        _refuse_megatron_grad_machinery(model, megatrons())


@pytest.mark.parametrize("name", ["finalize_model_grads_func", "grad_sync_func", "no_sync_func", "param_sync_func"])
def test_megatrons_grad_sync_hooks_on_the_config_are_refused(name):
    model = Stage()
    _refuse_megatron_grad_sync(model)
    setattr(model.config, name, lambda *a, **k: None)
    with pytest.raises(ValueError, match=rf"config has {name} set.*config.{name} = None"):
        _refuse_megatron_grad_sync(model)
