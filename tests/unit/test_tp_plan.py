"""The tensor-parallel plan without processes: divisibility errors, and a 1-rank plan (group=None)
changing nothing, bit for bit, on full, pruned, MoE and meta-device models."""

from __future__ import annotations

import pytest
import torch

from asyncpp.core.loss import cross_entropy, logits_loss_for
from asyncpp.parallel.tp import vocab_parallel_cross_entropy
from asyncpp.pipeline.stage import StageSpec, prune_to_stage
from model_zoo import build_model, get_model_config
from model_zoo.parallelize import apply_tensor_parallel, validate_tensor_parallel

DENSE_HYBRID = {"moe": None, "ffn_hidden_size": 384}


@pytest.mark.parametrize("name, overrides, tp, field", [
    ("tiny_dense", {}, 3, "model.num_heads=4"),
    ("tiny_dense", {"num_heads": 8, "num_kv_heads": 2}, 4, "model.num_kv_heads=2"),
    ("tiny_hybrid", {"num_kv_heads": 4, "gdn": {"num_heads": 2}}, 4, "model.gdn.num_heads=2"),
    ("tiny_dense", {"ffn_hidden_size": 385}, 2, "model.ffn_hidden_size=385"),
    ("tiny_dense", {"vocab_size": 8191}, 2, "model.vocab_size=8191"),
])
def test_indivisible_sizes_are_named(name: str, overrides: dict, tp: int, field: str) -> None:
    cfg = get_model_config(name, **overrides)
    with pytest.raises(ValueError, match=rf"{field} is not divisible by .*parallel\.tp={tp}.*choose parallel\.tp in"):
        validate_tensor_parallel(cfg, tp)


def test_divisible_config_passes_and_moe_ffn_is_not_checked() -> None:
    validate_tensor_parallel(get_model_config("tiny_hybrid"), 2)  # ffn_hidden_size=0 under MoE
    validate_tensor_parallel(get_model_config("tiny_dense"), 2)


def _loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = logits_loss_for(model)(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.equivalence
@pytest.mark.parametrize("name, overrides", [
    ("tiny_dense", {}), ("tiny_hybrid", DENSE_HYBRID), ("tiny_moe", {}), ("tiny_hybrid", {}),
])
def test_one_rank_plan_is_bit_identical(name: str, overrides: dict) -> None:
    cfg = get_model_config(name, num_layers=4, **overrides)
    torch.manual_seed(0)
    plain = build_model(cfg)
    torch.manual_seed(0)
    planned = build_model(cfg)
    plan = apply_tensor_parallel(planned, None, sequence_parallel=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    loss, grads = _loss_and_grads(plain, tokens)
    loss_tp, grads_tp = _loss_and_grads(planned, tokens)
    assert torch.equal(loss, loss_tp)
    assert grads.keys() == grads_tp.keys()
    assert all(torch.equal(grads[n], grads_tp[n]) for n in grads)
    assert logits_loss_for(planned) is cross_entropy
    assert plan == {}  # a layout is reported only where a group has more than one rank


def test_pruned_meta_stage_takes_the_plan() -> None:
    """A stage without embedding (Identity layers, no embed) on the meta device, as the dry run has it."""
    cfg = get_model_config("tiny_hybrid")
    model = prune_to_stage(build_model(cfg, "meta"), StageSpec(1, 2, cfg.num_layers))
    assert apply_tensor_parallel(model, None, sequence_parallel=True) == {}
    assert all(p.is_meta for p in model.parameters())


def test_applying_twice_is_refused() -> None:
    model = build_model(get_model_config("tiny_dense"), "meta")
    apply_tensor_parallel(model, None)
    with pytest.raises(ValueError, match="already applied"):
        apply_tensor_parallel(model, None)


def test_one_rank_has_one_cross_entropy() -> None:
    """One rank's logits are whole: the plain cross entropy is the only one (logits_loss_for picks it, test above),
    and the vocabulary-parallel one refuses a one-rank group, naming it."""
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    with pytest.raises(ValueError, match="core.loss.cross_entropy"):
        vocab_parallel_cross_entropy(logits, targets, None)
