"""train.recompute (asyncpp/core/recompute.py): the same gradients bit for bit, from a replayed forward."""

from __future__ import annotations

import pytest
import torch

from asyncpp.config import ConfigError, RunConfig
from asyncpp.core.recompute import apply_recompute, modes_per_layer
from asyncpp.optim import build_from_config
from asyncpp.reference.executor import build_simulator
from model_zoo import build_model, get_model_config
from tests.dist.workers import data_for, make_config


def _simulate(cfg: RunConfig, recompute) -> tuple[list[float], dict[str, torch.Tensor], int]:
    model_cfg = get_model_config(cfg.model.name, **(cfg.model.overrides or {}))
    model = build_model(model_cfg, seed=cfg.seed)
    wrapped = apply_recompute(model, modes_per_layer(recompute, model_cfg.num_layers, cfg.parallel.pp))
    sim = build_simulator(cfg, model, build_from_config(model, cfg.optimizer))
    data = data_for(cfg, model_cfg.vocab_size)
    m = cfg.train.num_microbatches
    losses = [sim.step(t, [data.train_microbatch(t * m + j) for j in range(m)]).loss for t in range(cfg.train.steps)]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, wrapped


@pytest.mark.parametrize("recompute", ["full", ("selective", "full")])
def test_simulated_2bw_with_recompute_is_bit_identical(recompute):
    """Delayed (2BW) training of a hybrid MoE with aux-loss-free balancing: recomputing changes nothing."""
    cfg = make_config(model={"name": "tiny_hybrid", "overrides": {"moe": {"bias_update_rate": 0.05}}},
                      parallel={"pp": 2}, train={"steps": 3, "num_microbatches": 2},
                      staleness={"ef_lambda": 1.0})
    ref_losses, ref_params, none = _simulate(cfg, "none")
    losses, params, wrapped = _simulate(cfg, recompute)
    assert none == 0 and wrapped == 4
    assert losses == ref_losses
    for name, p in ref_params.items():
        assert torch.equal(params[name], p), name


def test_the_forward_is_replayed_in_the_backward():
    """Full recompute runs each block's forward twice per backward (else nothing was recomputed), and the
    replay leaves the router's counted load alone (a microbatch counts once)."""
    model_cfg = get_model_config("tiny_moe", moe={"bias_update_rate": 0.05})
    model = build_model(model_cfg, seed=0)
    calls = []
    for layer in model.layers:
        # A pre-hook: the replay stops as soon as the last saved tensor is recomputed (checkpoint's early stop),
        # before a forward hook of the MoE would fire.
        layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    apply_recompute(model, ["full"] * model_cfg.num_layers)
    tokens = torch.randint(0, model_cfg.vocab_size, (2, 16))
    model(tokens).float().mean().backward()
    assert len(calls) == 2 * model_cfg.num_layers
    assert all(int(layer.mlp.step_load.sum()) == 2 * 16 * model_cfg.moe.top_k for layer in model.layers)


def test_per_stage_modes_and_their_errors():
    assert modes_per_layer(["full", "none"], 4, 2) == ["full", "full", "none", "none"]
    assert modes_per_layer(["full", "selective"], 4, 2, [3, 1]) == ["full"] * 3 + ["selective"]
    with pytest.raises(ValueError, match="one mode per stage"):
        modes_per_layer(["full"], 4, 2)
    with pytest.raises(ConfigError, match=r"train.recompute=\['full'\].*parallel.pp=2"):
        make_config(parallel={"pp": 2}, train={"recompute": ["full"]}).validate(get_model_config("tiny_dense"))
    with pytest.raises(ConfigError, match="train.recompute"):
        make_config(train={"recompute": "some"})
