"""The pieces of a checkpoint follow torch's Stateful convention (asyncpp/core/stateful.py), which is what lets both
executors assemble, save and load their state through one path (asyncpp/train/checkpoint/parts.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from asyncpp.core.balancing import RouterBiasVersions
from asyncpp.core.update import Corrections, UpdateRule
from asyncpp.pipeline.state import StageCheckpoint
from asyncpp.pipeline.weights import WeightVersions
from asyncpp.reference.simulator import DelayedUpdateSimulator, VersionHistory
from asyncpp.train import checkpoint as ckpt


def trained_versions(k: int, steps: int, dtype: torch.dtype | None, seed: int) -> tuple[nn.Linear, WeightVersions]:
    """A stage of one Linear whose K versions differ: `steps` SGD updates of a seeded gradient."""
    torch.manual_seed(seed)
    lin = nn.Linear(3, 2, bias=False)
    versions = WeightVersions([lin.weight], k, compute_dtype=dtype)
    opt = torch.optim.SGD(versions.masters, lr=0.1)
    for step in range(steps):
        versions.begin_update(step)
        versions.masters[0].grad = torch.randn_like(versions.masters[0])
        opt.step()
    return lin, versions


class _Router(nn.Module):
    def __init__(self, bias: list[float]):
        super().__init__()
        self.register_buffer("expert_bias", torch.tensor(bias))

    def pop_step_load(self):
        return torch.zeros(len(self.expert_bias), dtype=torch.int64)


def test_every_part_of_a_checkpoint_is_a_torch_stateful():
    lin = nn.Linear(3, 2, bias=False)
    sim = DelayedUpdateSimulator(lin, torch.optim.SGD(lin.parameters(), lr=0.1), [1])
    parts = [WeightVersions([nn.Parameter(torch.ones(2))], 2), sim.versions, sim.rule,
             RouterBiasVersions({"r": _Router([0.0, 1.0])}, 2)]
    assert isinstance(sim.versions, VersionHistory)
    for part in parts:
        assert isinstance(part, Stateful), type(part).__name__
    # Both executors' checkpoints are the one Checkpointer over their parts.
    assert issubclass(StageCheckpoint, ckpt.Checkpointer)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_weight_versions_load_another_stages_state(dtype):
    """load_state_dict from tensors that are not its own: every held version copied, the parameters on the newest
    (bf16: the fp32 masters loaded, the parameters their cast)."""
    _, source = trained_versions(2, 3, dtype, seed=0)
    saved = {age: [t.clone() for t in tensors] for age, tensors in source.state_dict().items()}
    assert sorted(saved) == ["0", "1"] and not torch.equal(saved["0"][0], saved["1"][0])
    lin, target = trained_versions(2, 0, dtype, seed=1)
    assert target.expect(3) == [1, 0]
    target.load_state_dict(saved)
    for age, tensors in target.state_dict().items():
        assert torch.equal(tensors[0], saved[age][0]), age
    newest = saved["0"][0] if dtype is None else saved["0"][0].to(dtype)
    assert torch.equal(lin.weight.detach(), newest) and target.newest == 3


def test_the_rule_and_the_router_biases_load_another_state():
    params = [nn.Parameter(torch.zeros(2))]
    rule = UpdateRule(torch.optim.SGD(params, lr=0.1), params, corrections=Corrections(ef_lambda=1.0,
                                                                                         grad_ef_lambda=0.5))
    state = {"ef": [torch.tensor([1.0, 2.0])], "gef": [torch.tensor([3.0, 4.0])]}
    rule.load_state_dict(state)
    assert {k: v[0].tolist() for k, v in rule.state_dict().items()} == {"ef": [1.0, 2.0], "gef": [3.0, 4.0]}

    router = _Router([0.0, 0.0])
    bias = RouterBiasVersions({"r": router}, 2)
    bias.expect(5, [1, 0])
    bias.load_state_dict({"balancing/0/r": torch.tensor([0.5, -0.5]), "balancing/1/r": torch.tensor([0.1, 0.2])})
    assert bias.newest == 5 and router.expert_bias.tolist() == [0.5, -0.5]  # the router holds x_5's bias
    assert bias.state_dict()["balancing/1/r"].tolist() == pytest.approx([0.1, 0.2])
