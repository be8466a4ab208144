"""The attention options (qk_norm, attn_output_gate, partial_rotary_factor) and GDN's fla_l2norm: off, the
model is unchanged; on, each computes what it says. That they compute what transformers' Qwen3, Qwen3-MoE and
Qwen3-Next compute is tests/unit/test_hf_export.py; under TP, tests/dist/test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch

from model_zoo import build_model, get_model_config
from model_zoo.attention import Attention
from model_zoo.gated_deltanet import GatedDeltaNet
from model_zoo.layers import RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.equivalence

QWEN3_NEXT = {"qk_norm": True, "attn_output_gate": True, "partial_rotary_factor": 0.25, "gdn": {"fla_l2norm": True}}


def test_options_off_add_no_tensors():
    """tiny_hybrid (make train's model) has them on in its registered config: switched off here."""
    off = {"qk_norm": False, "attn_output_gate": False, "partial_rotary_factor": 1.0}
    for name in ("tiny_dense", "tiny_moe", "tiny_hybrid", "moe_2b", "hybrid_moe_10b"):
        keys = build_model(get_model_config(name, **off), device="meta").state_dict().keys()
        assert not [k for k in keys if k.endswith(("q_norm.weight", "k_norm.weight", "gate_proj.weight"))
                    and ".mixer." in k], name


def test_options_on_add_the_per_head_tensors():
    cfg = get_model_config("tiny_hybrid", **QWEN3_NEXT)
    sd = build_model(cfg, device="meta").state_dict()
    hd = cfg.head_dim
    assert sd["layers.3.mixer.q_norm.weight"].shape == sd["layers.3.mixer.k_norm.weight"].shape == (hd,)
    assert sd["layers.3.mixer.gate_proj.weight"].shape == (cfg.num_heads * hd, cfg.hidden_size)
    assert cfg.rotary_dim == hd // 4


def _attention(**options) -> Attention:
    attn = Attention(64, 4, 2, 16, 10000.0, 64, **options)
    torch.manual_seed(0)  # after construction (nn.Linear draws its own default init)
    attn.init_weights(0.1, 0.1)
    return attn.eval()


def test_gate_multiplies_the_attention_output_by_its_sigmoid():
    """A zero gate weight gives sigmoid(0) = 1/2 on every channel; o_proj is linear and halving is exact in
    binary floating point, so the gated layer is exactly half the plain one with the same q/k/v/o."""
    plain, gated = _attention(), _attention(output_gate=True)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):  # drawn first: the same tensors
        assert torch.equal(getattr(plain, name).weight, getattr(gated, name).weight)
    torch.nn.init.zeros_(gated.gate_proj.weight)
    x = torch.randn(2, 10, 64)
    with torch.no_grad():
        assert torch.equal(gated(x), 0.5 * plain(x))
        torch.nn.init.normal_(gated.gate_proj.weight, std=0.5)
        assert not torch.allclose(gated(x), 0.5 * plain(x))


def test_qk_norm_makes_attention_invariant_to_the_scale_of_q_and_k():
    """RMSNorm per head removes any positive scale of q_proj / k_proj (without it the scores change). With
    a negligible eps and power-of-two scales every step scales exactly, so the output is unchanged."""
    normed, plain = _attention(qk_norm=True, norm_eps=1e-30), _attention()
    x = torch.randn(2, 10, 64)
    with torch.no_grad():
        before, before_plain = normed(x), plain(x)
        for attn in (normed, plain):
            attn.q_proj.weight.mul_(4.0)
            attn.k_proj.weight.mul_(0.5)  # the plain scores double
        torch.testing.assert_close(normed(x), before, atol=1e-6, rtol=1e-6)
        assert not torch.allclose(plain(x), before_plain, atol=1e-3)


def test_partial_rotary_rotates_the_first_channels_only():
    x = torch.randn(2, 3, 7, 16)
    cos, sin = RotaryEmbedding(4, 10000.0, 64)(7, x.device)
    out = apply_rotary(x, cos, sin)
    assert torch.equal(out[..., 4:], x[..., 4:])
    assert torch.equal(out[..., :4], apply_rotary(x[..., :4], cos, sin))
    assert not torch.equal(out[..., :4], x[..., :4])


def test_fla_l2norm_is_fla_and_transformers_form():
    gdn = GatedDeltaNet(32, 2, 8, 8, fla_l2norm=True)
    x = torch.randn(3, 5, 2, 8) * 1e-3  # small: here eps inside or outside the root matters
    want = x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    assert torch.equal(gdn._l2norm(x), want)
    plain = GatedDeltaNet(32, 2, 8, 8)._l2norm(x)
    assert torch.equal(plain, torch.nn.functional.normalize(x, dim=-1, eps=1e-6))
    assert not torch.allclose(plain, want, rtol=1e-3)


@pytest.mark.parametrize("factor, message", [(0.0, "must be in \\(0, 1\\]"), (1.5, "must be in \\(0, 1\\]"),
                                             (0.1, "RoPE needs an even number")])
def test_bad_partial_rotary_factor_is_refused_naming_the_field(factor, message):
    with pytest.raises(ValueError, match=f"model.partial_rotary_factor={factor}.*{message}"):
        get_model_config("tiny_dense", partial_rotary_factor=factor)


def test_non_boolean_option_is_refused():
    with pytest.raises(ValueError, match="model.qk_norm='yes' must be true or false"):
        get_model_config("tiny_dense", qk_norm="yes")


def test_transformer_engine_attention_computes_the_options():
    """train.backend=te's attention (with tests/unit/test_backends.py's CPU stand-in for TE) keeps the q/k
    norms and the gate under their names and computes what the local layer computes."""
    from model_zoo.backends.te import TEAttention, swap_to_te
    from tests.unit.test_backends import StandInTE

    cfg = get_model_config("tiny_hybrid", **QWEN3_NEXT)
    torch.manual_seed(0)
    local = build_model(cfg)
    torch.manual_seed(0)
    swapped = build_model(cfg)
    counts = swap_to_te(swapped, StandInTE)
    assert isinstance(swapped.layers[3].mixer, TEAttention) and counts["attention"] == 1
    assert counts["rmsnorm"] == 2 * cfg.num_layers + 1  # the q/k norms stay inside the TE attention
    assert list(swapped.state_dict()) == list(local.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(swapped(tokens), local(tokens), rtol=1e-5, atol=1e-5)
