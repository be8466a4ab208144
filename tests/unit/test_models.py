"""model_zoo: shapes, gradients, the pipeline decomposition, init determinism, configs, counts, MoE."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from model_zoo import (
    MODEL_NAMES,
    Block,
    CausalLM,
    MoE,
    MoEConfig,
    build_model,
    count_parameters,
    get_model_config,
)

TINY = ("tiny_dense", "tiny_moe", "tiny_hybrid")


def _tokens(cfg, batch: int = 2, seq: int = 32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)


def _build(name: str, seed: int = 0, **overrides) -> CausalLM:
    torch.manual_seed(seed)
    return build_model(get_model_config(name, **overrides))


@pytest.fixture(scope="module", params=TINY)
def tiny(request) -> CausalLM:
    return _build(request.param)


def test_forward_backward_reaches_every_parameter(tiny: CausalLM) -> None:
    tokens = _tokens(tiny.config)
    logits = tiny(tokens[:, :-1])
    assert logits.shape == (2, 32, tiny.config.vocab_size)
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    assert torch.isfinite(loss)
    # Untrained model with init_std 0.02: the loss must be close to uniform, ln(V).
    assert abs(loss.item() - torch.log(torch.tensor(float(tiny.config.vocab_size))).item()) < 0.5
    tiny.zero_grad(set_to_none=True)
    loss.backward()
    missing = [n for n, p in tiny.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, f"no/non-finite grad for {missing}"
    zero = [n for n, p in tiny.named_parameters() if p.grad.abs().sum() == 0]
    assert not zero, f"all-zero grad for {zero}"


def test_forward_equals_pipeline_pieces(tiny: CausalLM) -> None:
    tokens = _tokens(tiny.config)[:, :-1]
    with torch.no_grad():
        full = tiny(tokens)
        h = tiny.embed_tokens(tokens)
        for i in range(len(tiny.layers)):  # addressable by index, as a stage split would use it
            h = tiny.layers[i](h)
        pieces = tiny.head(h)
    assert torch.equal(full, pieces)


@pytest.mark.parametrize("name", TINY)
def test_same_seed_same_weights_and_tied_head(name: str) -> None:
    a, b, c = _build(name, seed=3), _build(name, seed=3), _build(name, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["embed.weight"], sc["embed.weight"])
    assert a.lm_head.weight is a.embed.weight
    assert all(p.device.type == "cpu" for p in a.parameters())


def test_untied_head_is_separate_and_initialised() -> None:
    m = _build("tiny_dense", tie_embeddings=False)
    assert m.lm_head.weight is not m.embed.weight
    assert 0.015 < m.lm_head.weight.std().item() < 0.025
    assert count_parameters(m.config).total == sum(p.numel() for p in m.parameters())


def test_meta_build_allocates_nothing() -> None:
    m = build_model(get_model_config("tiny_hybrid"), device="meta")
    assert all(p.is_meta for p in m.parameters())
    assert m.lm_head.weight is m.embed.weight


def test_seq_len_above_max_raises_naming_both() -> None:
    m = _build("tiny_dense", max_seq_len=16)
    with pytest.raises(ValueError, match=r"seq_len=17.*max_seq_len=16"):
        m(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"seq_len=17.*max_seq_len=16"):
        m.layers[0](torch.zeros(1, 17, m.config.hidden_size))  # a stage without the embedding checks too


def test_unknown_model_name_lists_known_names() -> None:
    with pytest.raises(ValueError, match="model.name='foo'") as err:
        get_model_config("foo")
    assert all(n in str(err.value) for n in MODEL_NAMES)


@pytest.mark.parametrize("overrides, match", [
    ({"num_heads": 9, "num_kv_heads": 2}, "num_heads=9.*num_kv_heads=2"),
    ({"layer_types": ("attn",) * 3}, "layer_types has 3 entries.*num_layers=4"),
    ({"layer_types": ("attn", "mamba", "attn", "attn")}, "mamba"),
    ({"hidden_size": 0}, "hidden_size=0"),
    ({"head_dim": 33}, "head_dim=33"),
    ({"moe": {"top_k": 9}}, "top_k=9"),
    ({"gdn": None}, "model.gdn is None"),
    ({"nope": 1}, "nope"),
])
def test_invalid_config_raises(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        get_model_config("tiny_hybrid", **overrides)


def test_overrides_apply_and_num_layers_tiles_the_pattern() -> None:
    cfg = get_model_config("tiny_hybrid", num_layers=8, moe={"top_k": 1})
    assert cfg.layer_types == ("gdn", "gdn", "gdn", "attn") * 2
    assert cfg.moe.top_k == 1 and cfg.moe.num_experts == 8
    assert get_model_config("tiny_dense", num_layers=2).layer_types == ("attn", "attn")


def test_smollm2_counts_match_published() -> None:
    assert count_parameters(get_model_config("smollm2_135m")) == (134_515_008, 134_515_008)
    assert count_parameters(get_model_config("smollm2_360m")) == (361_821_120, 361_821_120)


@pytest.mark.parametrize("name, total, active", [("moe_2b", 2e9, 0.5e9), ("hybrid_moe_10b", 10e9, 0.65e9)])
def test_large_moe_counts_near_targets(name: str, total: float, active: float) -> None:
    cfg = get_model_config(name)
    count = count_parameters(cfg)
    assert abs(count.total / total - 1) < 0.10, count
    assert abs(count.active / active - 1) < 0.10, count
    m = build_model(cfg, device="meta")
    assert all(p.is_meta for p in m.parameters())
    if name == "hybrid_moe_10b":
        assert [b.layer_type for b in m.layers] == ["attn" if i % 4 == 3 else "gdn" for i in range(24)]
        assert m.layers[0].mlp.shared_expert is not None


def test_expert_weights_are_stacked() -> None:
    cfg = get_model_config("tiny_moe")
    moe = build_model(cfg).layers[0].mlp
    E, f, d = cfg.moe.num_experts, cfg.moe.expert_ffn_hidden_size, cfg.hidden_size
    assert moe.w_gate.shape == (E, f, d) and moe.w_up.shape == (E, f, d) and moe.w_down.shape == (E, d, f)
    assert moe.router.weight.shape == (E, d)


def _moe_router_grad(coef: float, x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden_size=16, aux_loss_coef=coef)
    moe = MoE(8, cfg)
    moe.init_weights(0.5, 0.5)
    moe(x).sum().backward()
    return moe.router.weight.grad.clone()


def test_aux_loss_gradient_is_exactly_added_to_router() -> None:
    x = torch.randn(3, 5, 8)
    g0, g1 = _moe_router_grad(0.0, x), _moe_router_grad(0.5, x)
    torch.manual_seed(0)
    moe = MoE(8, MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden_size=16, aux_loss_coef=0.5))
    moe.init_weights(0.5, 0.5)
    probs, _, idx = moe.route(x.reshape(-1, 8))
    aux = 4 * ((torch.bincount(idx.flatten(), minlength=4) / idx.numel()) * probs.mean(0)).sum()
    (expected,) = torch.autograd.grad(0.5 * aux, moe.router.weight)
    torch.testing.assert_close(g1 - g0, expected)
    moe(x)
    torch.testing.assert_close(moe.last_aux_loss, aux.detach())
    assert moe.last_expert_load.sum().item() == 15 * 2


def test_aux_loss_reaches_router_through_a_single_block() -> None:
    """A middle pipeline stage only back-propagates dL/dh; the aux loss must still train the router."""
    grads = []
    for coef in (0.0, 1.0):
        cfg = get_model_config("tiny_moe", moe={"aux_loss_coef": coef})
        torch.manual_seed(0)
        block = Block(cfg, 1)
        block.init_weights(cfg.init_std, cfg.init_std)
        h = torch.randn(2, 16, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
        upstream = torch.randn(2, 16, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
        block(h).backward(upstream)  # what the engine does with the next stage's gradient
        grads.append(block.mlp.router.weight.grad.clone())
    assert (grads[1] - grads[0]).abs().max() > 1e-6


def test_moe_stats() -> None:
    dense, moe = _build("tiny_dense"), _build("tiny_moe")
    assert dense.moe_stats() == {}
    with torch.no_grad():
        moe(_tokens(moe.config)[:, :-1])
    stats = moe.moe_stats()
    assert set(stats) == {"moe/aux_loss", "moe/load_max", "moe/load_mean"}
    assert stats["moe/aux_loss"] >= 0.99 and stats["moe/load_max"] >= stats["moe/load_mean"] >= 1.0


def test_top_k_renormalisation() -> None:
    x = torch.randn(10, 8)
    for normalize in (True, False):
        torch.manual_seed(0)
        moe = MoE(8, MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden_size=16, normalize_topk=normalize))
        moe.init_weights(0.5, 0.5)
        _, weight, _ = moe.route(x)
        sums = weight.sum(-1)
        assert torch.allclose(sums, torch.ones(10)) == normalize


def test_bf16_forward_runs() -> None:
    m = _build("tiny_moe").to(torch.bfloat16)
    logits = m(_tokens(m.config, seq=16)[:, :-1])
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_config_is_frozen() -> None:
    cfg = get_model_config("tiny_dense")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 1  # type: ignore[misc]
