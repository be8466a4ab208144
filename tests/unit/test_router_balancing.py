"""semantics.md: the aux-loss-free router bias is versioned with the weights. Microbatches of b_t read
the bias of x_{t-d}; step t moves it with b_t's loads: b(x_{t+1}) = b(x_t) + rate * sign(mean(L_t) - L_t).

The expected biases are rebuilt here from what the routers saw (their per-forward expert counts), not
from asyncpp.core.balancing, so a wrong version or a wrong rule in the simulator fails these tests."""

from __future__ import annotations

import pytest
import torch

from asyncpp.optim import build_optimizer
from asyncpp.reference.executor import parameter_delays
from asyncpp.reference.simulator import DelayedUpdateSimulator
from model_zoo import build_model, get_model_config
from model_zoo.moe import MoE

RATE = 0.05


def run(schedule: str, steps: int = 5, m: int = 2):
    torch.manual_seed(0)
    model = build_model(get_model_config("tiny_moe", moe={"bias_update_rate": RATE}))
    moes = [mod for mod in model.modules() if isinstance(mod, MoE)]
    seen: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in moes]  # per layer: (bias read, counts)

    def hook(i):
        def record(module, args, out):
            if torch.is_grad_enabled():
                seen[i].append((module.expert_bias.clone(), module.last_expert_load.clone()))
        return record

    for i, mod in enumerate(moes):
        mod.register_forward_hook(hook(i))
    opt = build_optimizer(model, name="adamw", lr=1e-3, weight_decay=0.0)
    sim = DelayedUpdateSimulator(model, opt, parameter_delays(model, schedule, 2, None))
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    for t in range(steps):
        sim.step(t, [torch.randint(0, vocab, (2, 17), generator=g) for _ in range(m)])
    return seen, m


def expected_biases(seen_layer, m: int, steps: int) -> list[torch.Tensor]:
    """b(x_0) = 0, then the sign rule with the summed counts of each step's m forwards."""
    biases = [torch.zeros_like(seen_layer[0][0])]
    for t in range(steps):
        load = sum(c for _, c in seen_layer[t * m:(t + 1) * m]).float()
        biases.append(biases[-1] + RATE * torch.sign(load.mean() - load))
    return biases


@pytest.mark.equivalence
@pytest.mark.parametrize("schedule, delay", [("sync", 0), ("2bw", 1)])
def test_microbatches_of_step_t_read_the_bias_of_x_t_minus_d(schedule, delay):
    steps = 5
    seen, m = run(schedule, steps)
    for layer in seen:
        assert len(layer) == steps * m
        biases = expected_biases(layer, m, steps)
        assert any(not torch.equal(b, biases[0]) for b in biases[1:-1]), "the bias never moved: the test proves nothing"
        for t in range(steps):
            want = biases[max(t - delay, 0)]
            for bias, _ in layer[t * m:(t + 1) * m]:
                torch.testing.assert_close(bias, want, rtol=0, atol=1e-7)


def test_bias_changes_routing_but_not_the_weights_formula():
    seen_sync, _ = run("sync")
    seen_2bw, _ = run("2bw")
    counts_sync = [c for _, c in seen_sync[0][4:]]
    counts_2bw = [c for _, c in seen_2bw[0][4:]]
    assert any(not torch.equal(a, b) for a, b in zip(counts_sync, counts_2bw)), \
        "sync and 2bw read different biases from step 1 on, so their routing must differ somewhere"


@pytest.mark.parametrize("sizes", [[4, 0], [0, 4], [2, 2]])
def test_every_stage_of_a_moe_model_sends_the_same_load_vector(sizes):
    """Issue 21: the per-layer load statistics ride the gradient-norm all-reduce over the stages, so every stage
    must send a vector of the same length; a stage with 0 layers (no router of its own) sent none, and gloo
    failed with a size mismatch. It now sends zeros in the model's slots."""
    from asyncpp.core.balancing import RouterLoadStats
    from asyncpp.pipeline.stage import StageSpec, prune_to_stage

    cfg = get_model_config("tiny_moe")
    for stage in range(2):
        model = prune_to_stage(build_model(cfg), StageSpec(stage, 2, cfg.num_layers, sizes))
        stats = RouterLoadStats.of(model)
        assert stats, (sizes, stage)
        assert stats.vector(0, torch.device("cpu")).shape == (2 * cfg.num_layers,)
    assert not RouterLoadStats.of(build_model(get_model_config("tiny_dense")))  # no MoE: nothing rides along
