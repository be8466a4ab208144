"""Named model configs. `get_model_config(name, **overrides)` is the only way code should get one."""

from __future__ import annotations

import dataclasses
from typing import Any

from model_zoo.config import GDNConfig, ModelConfig, MoEConfig

# Public SmolLM2 configs (HF config.json / torchtune builders). 134,515,008 and 361,821,120 parameters.
SMOLLM2_135M = ModelConfig(
    name="smollm2_135m", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
    head_dim=64, ffn_hidden_size=1536, max_seq_len=8192, rope_theta=100000.0, norm_eps=1e-5,
    tie_embeddings=True, init_std=0.0417,
)
# Spelled out, not dataclasses.replace(SMOLLM2_135M, ...): replace would carry 30 layer_types into 32 layers.
SMOLLM2_360M = ModelConfig(
    name="smollm2_360m", vocab_size=49152, hidden_size=960, num_layers=32, num_heads=15, num_kv_heads=5,
    head_dim=64, ffn_hidden_size=2560, max_seq_len=8192, rope_theta=100000.0, norm_eps=1e-5,
    tie_embeddings=True, init_std=0.02,
)

# 2B MoE, 0.5B active. Paper fixes: 16 q / 4 KV heads, 64 experts top-8, 128k vocab, 8k context.
# Chosen: d=1024, head_dim=64 (16*64 = d), 16 layers (divisible by pp = 2, 4, 8, 16), expert ffn 512.
#   embed + untied head: 2 * 131072 * 1024                       = 268.4M  (all active)
#   per layer: attention 1024*(1024 + 2*256) + 1024*1024         =   2.62M
#              router 1024*64 = 0.07M; one expert 3*1024*512     =   1.57M
#              64 experts = 100.7M, 8 active = 12.6M
#   total  = 268.4M + 16 * (2.62 + 0.07 + 100.7)M               = 1.922B
#   active = 268.4M + 16 * (2.62 + 0.07 + 12.6)M                = 0.513B
MOE_2B = ModelConfig(
    name="moe_2b", vocab_size=131072, hidden_size=1024, num_layers=16, num_heads=16, num_kv_heads=4,
    head_dim=64, ffn_hidden_size=0, max_seq_len=8192, rope_theta=1_000_000.0, norm_eps=1e-6,
    tie_embeddings=False, init_std=0.02,
    moe=MoEConfig(num_experts=64, top_k=8, expert_ffn_hidden_size=512, aux_loss_coef=0.01, normalize_topk=True),
)

# 10B hybrid MoE, 0.65B active. Paper fixes: 24 layers, full attention every 4th (i % 4 == 3), Gated
# DeltaNet elsewhere, 512 experts top-10 + one gated shared expert, 128k vocab, 8k context.
# Chosen: Qwen3-Next-80B-A3B halved in width (d 2048 -> 1024) keeping its ratios: expert and shared
# ffn = d/4 = 256; attention 8 q / 2 KV heads of 128; GDN 8 heads, key dim 128 (key_dim = d),
# value dim 256 (value_dim = 2d).
#   embed + untied head: 2 * 131072 * 1024                             = 268.4M
#   per layer: one expert 3*1024*256 = 0.786M; 512 experts = 402.7M, 10 active = 7.86M
#              shared expert 0.786M + gate; router 1024*512 = 0.52M
#   attention layer 1024*(1024 + 2*256) + 1024*1024 = 2.62M (x6)
#   GDN layer q,k 2*1024^2 + v,gate,out 3*1024*2048 + a,b,conv,... ~ 8.42M (x18)
#   total  = 268.4M + 24 * (402.7 + 0.79 + 0.52)M + 6 * 2.62M + 18 * 8.42M  = 10.13B
#   active = 268.4M + 24 * (7.86 + 0.79 + 0.52)M + 6 * 2.62M + 18 * 8.42M   = 0.656B
HYBRID_MOE_10B = ModelConfig(
    name="hybrid_moe_10b", vocab_size=131072, hidden_size=1024, num_layers=24, num_heads=8, num_kv_heads=2,
    head_dim=128, ffn_hidden_size=0, max_seq_len=8192, rope_theta=1_000_000.0, norm_eps=1e-6,
    tie_embeddings=False, init_std=0.02,
    layer_types=tuple("attn" if i % 4 == 3 else "gdn" for i in range(24)),
    moe=MoEConfig(num_experts=512, top_k=10, expert_ffn_hidden_size=256, shared_expert_ffn_hidden_size=256,
                  aux_loss_coef=0.001, normalize_topk=True),
    gdn=GDNConfig(num_heads=8, head_k_dim=128, head_v_dim=256, conv_size=4, chunk_size=64),
)

# CPU-sized versions of the same code paths; vocab 8192 matches the project's shipped tokenizer.
TINY_DENSE = ModelConfig(
    name="tiny_dense", vocab_size=8192, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
    head_dim=32, ffn_hidden_size=384, max_seq_len=512, rope_theta=10000.0, norm_eps=1e-5,
    tie_embeddings=True, init_std=0.02,
)
_TINY_MOE_SETTINGS = MoEConfig(num_experts=8, top_k=2, expert_ffn_hidden_size=128,
                               shared_expert_ffn_hidden_size=128, aux_loss_coef=0.01, normalize_topk=True)
TINY_MOE = dataclasses.replace(TINY_DENSE, name="tiny_moe", ffn_hidden_size=0, moe=_TINY_MOE_SETTINGS)
# The embedded default (`make train`) has Qwen3-Next's attention and Gated DeltaNet choices (per-head q/k
# RMSNorm, a sigmoid-gated output, rotary on a quarter of each head, FLA's L2 norm), so a run of it exports to
# transformers' Qwen3NextForCausalLM as it is (tools/hf.py, docs/hf.md). The paper configs keep them off.
TINY_HYBRID = dataclasses.replace(
    TINY_MOE, name="tiny_hybrid", layer_types=("gdn", "gdn", "gdn", "attn"),
    gdn=GDNConfig(num_heads=4, head_k_dim=32, head_v_dim=32, conv_size=4, chunk_size=64, fla_l2norm=True),
    qk_norm=True, attn_output_gate=True, partial_rotary_factor=0.25,
)

_REGISTRY: dict[str, ModelConfig] = {c.name: c for c in (
    SMOLLM2_135M, SMOLLM2_360M, MOE_2B, HYBRID_MOE_10B, TINY_DENSE, TINY_MOE, TINY_HYBRID)}
MODEL_NAMES: tuple[str, ...] = tuple(_REGISTRY)
_SUBCONFIGS = {"moe": MoEConfig, "gdn": GDNConfig}


def get_model_config(name: str, **overrides: Any) -> ModelConfig:
    """The registered config `name` with `overrides` applied (dataclasses.replace), validated.

    `moe=` / `gdn=` may be dicts of sub-fields to change (what hydra passes). Overriding num_layers
    without layer_types tiles the model's layer pattern to the new depth (its shortest period, e.g.
    gdn,gdn,gdn,attn), so `num_layers=8` on a hybrid keeps attention in every 4th layer.
    """
    if name not in _REGISTRY:
        raise ValueError(f"model.name={name!r} is not a known model; choose one of: {', '.join(MODEL_NAMES)}.")
    base = _REGISTRY[name]
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"model overrides {unknown} are not ModelConfig fields; valid fields: {sorted(fields)}.")
    overrides = dict(overrides)
    for key, cls in _SUBCONFIGS.items():
        if isinstance(overrides.get(key), dict):
            overrides[key] = _merge_subconfig(key, cls, getattr(base, key), overrides[key])
    if "num_layers" in overrides and "layer_types" not in overrides:
        overrides["layer_types"] = _tile_pattern(base.layer_types, overrides["num_layers"])
    return dataclasses.replace(base, **overrides).validate()


def _merge_subconfig(key: str, cls: type, current: Any, changes: dict[str, Any]) -> Any:
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(changes) - valid)
    if unknown:
        raise ValueError(f"model.{key} overrides {unknown} are not {cls.__name__} fields; valid: {sorted(valid)}.")
    if current is not None:
        return dataclasses.replace(current, **changes)
    try:
        return cls(**changes)
    except TypeError as err:  # a required sub-field is missing
        raise ValueError(f"model.{key} is None in this model, so the override must give every required "
                         f"{cls.__name__} field: {err}") from None


def _tile_pattern(pattern: tuple[str, ...], num_layers: int) -> tuple[str, ...]:
    if not isinstance(num_layers, int) or num_layers <= 0 or not pattern:
        return pattern  # let validate() report the bad num_layers
    period = next(p for p in range(1, len(pattern) + 1)
                  if all(pattern[i] == pattern[i % p] for i in range(len(pattern))))
    return tuple(pattern[i % period] for i in range(num_layers))
