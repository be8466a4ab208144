"""Which Hugging Face family each model_zoo model is, and the tensor map between the two layouts.

    family      transformers class      model_zoo models (docs/hf.md)
    llama       LlamaForCausalLM        dense attention, no options: smollm2_*, tiny_dense
    qwen3       Qwen3ForCausalLM        dense attention with qk_norm
    qwen2_moe   Qwen2MoeForCausalLM     MoE with a gated shared expert, no qk_norm: tiny_moe
    qwen3_moe   Qwen3MoeForCausalLM     MoE without a shared expert, with qk_norm: moe_2b + qk_norm
    qwen3_next  Qwen3NextForCausalLM    Gated DeltaNet / attention hybrid, MoE with a gated shared expert,
                                        qk_norm and attn_output_gate (any partial rotary factor):
                                        tiny_hybrid / hybrid_moe_10b + those options

The layers compute the same function once weights are mapped; the map is a list of Rules, each a pure
function between a few of our tensors and a few of theirs, with its inverse, so export and import are one
table read in two directions. Where the layouts differ:
  * Qwen3-Next's RMSNorms (not the gated one inside Gated DeltaNet) compute x/rms(x) * (1 + w): its w is
    ours minus one;
  * Qwen3-Next packs q and the output gate per head into one q_proj ([q_h; gate_h] for every head h), and
    Gated DeltaNet's q, k, v, z (our g_proj) into in_proj_qkvz, b and a into in_proj_ba, the same way;
    its one depthwise conv1d over [q; k; v] is our three convs stacked;
  * routed experts are one tensor per expert on disk (mlp.experts.{e}.gate_proj.weight, the hub layout
    that transformers' save_pretrained writes and its loader fuses), our w_gate/w_up/w_down stacked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

FAMILIES = ("llama", "qwen3", "qwen2_moe", "qwen3_moe", "qwen3_next")
_CLASSES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}
_OPTIONS = ("qk_norm", "attn_output_gate", "partial_rotary_factor")


class HFFormatError(ValueError):
    """A model, state_dict or HF directory cannot be converted; the message names what and the fix."""


# ---- which family -------------------------------------------------------------------------------------


def family_of(cfg: Any) -> str:
    """The HF family whose transformers class computes exactly what `cfg` computes, or HFFormatError saying
    which option differs and how to get a model that has one."""
    hybrid = "gdn" in cfg.layer_types
    moe = cfg.moe
    shared = moe is not None and moe.shared_expert_ffn_hidden_size > 0
    opts = f"qk_norm={cfg.qk_norm}, attn_output_gate={cfg.attn_output_gate}, " \
           f"partial_rotary_factor={cfg.partial_rotary_factor}"
    if hybrid or cfg.attn_output_gate or cfg.partial_rotary_factor != 1.0:
        fla = cfg.gdn is None or cfg.gdn.fla_l2norm
        missing = [name for name, ok in (("qk_norm=true", cfg.qk_norm),
                                         ("attn_output_gate=true", cfg.attn_output_gate),
                                         ("gdn.fla_l2norm=true", fla),
                                         ("moe with a shared expert", shared)) if not ok]
        if missing:
            raise HFFormatError(
                f"model '{cfg.name}' ({opts}, hybrid={hybrid}, moe={moe is not None}, shared expert={shared}) has "
                f"no Hugging Face class: the hybrid / gated / partial-rotary family is Qwen3-Next, which always "
                f"has per-head q/k RMSNorm, a gated attention output, FLA's q/k L2 norm in Gated DeltaNet and MoE "
                f"layers with a shared expert; it lacks {', '.join(missing)}. Train it with "
                "+model.overrides.qk_norm=true +model.overrides.attn_output_gate=true "
                "+model.overrides.gdn.fla_l2norm=true (+model.overrides.partial_rotary_factor=0.25 for Qwen3-Next's "
                "rotary) to get an exportable model (docs/hf.md)"
            )
        return "qwen3_next"
    if moe is None:
        return "qwen3" if cfg.qk_norm else "llama"
    if shared and not cfg.qk_norm:
        return "qwen2_moe"
    if not shared and cfg.qk_norm:
        return "qwen3_moe"
    raise HFFormatError(
        f"model '{cfg.name}' (MoE, shared expert={shared}, {opts}) has no Hugging Face class: Qwen2-MoE has a "
        "shared expert and no q/k norm, Qwen3-MoE q/k norm and no shared expert. Set "
        + ("+model.overrides.qk_norm=false" if shared else "+model.overrides.qk_norm=true")
        + " (or change model.moe.shared_expert_ffn_hidden_size) when training (docs/hf.md)"
    )


def hf_class_name(family: str) -> str:
    return _CLASSES[family]


def family_of_model_type(model_type: Any) -> str:
    if model_type not in FAMILIES:
        raise HFFormatError(
            f"config.json model_type={model_type!r} is not supported; import one of {list(FAMILIES)} "
            "(Llama, Qwen3, Qwen2-MoE, Qwen3-MoE, Qwen3-Next without rope scaling)"
        )
    return model_type


# ---- configs ------------------------------------------------------------------------------------------


def hf_config(cfg: Any, dtype: torch.dtype = torch.float32) -> dict:
    """ModelConfig -> config.json of its family (the fields transformers 4.x and 5.x both read)."""
    family = family_of(cfg)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = cfg.partial_rotary_factor
    c: dict[str, Any] = {
        "architectures": [_CLASSES[family]],
        "model_type": family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # transformers 4.x; 5.x reads rope_parameters
        "rope_parameters": rope,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if family == "llama":
        c |= {"intermediate_size": cfg.ffn_hidden_size, "mlp_bias": False, "rope_scaling": None}
    elif family == "qwen3":
        c |= {"intermediate_size": cfg.ffn_hidden_size, "use_sliding_window": False, "sliding_window": None}
    else:
        m = cfg.moe
        c |= {"moe_intermediate_size": m.expert_ffn_hidden_size, "num_experts": m.num_experts,
              "num_experts_per_tok": m.top_k, "norm_topk_prob": m.normalize_topk, "decoder_sparse_step": 1,
              "mlp_only_layers": [], "router_aux_loss_coef": m.aux_loss_coef,
              # The width of dense MLP layers, of which these models have none (mlp_only_layers is empty).
              "intermediate_size": m.expert_ffn_hidden_size, "use_sliding_window": False, "sliding_window": None}
        if m.shared_expert_ffn_hidden_size:
            c["shared_expert_intermediate_size"] = m.shared_expert_ffn_hidden_size
        if family == "qwen2_moe":
            c |= {"qkv_bias": False}
    if family == "qwen3_next":
        g = cfg.gdn
        c |= {"partial_rotary_factor": cfg.partial_rotary_factor,  # transformers 4.x
              "layer_types": ["linear_attention" if t == "gdn" else "full_attention" for t in cfg.layer_types]}
        if g is not None:
            c |= {"linear_num_key_heads": g.num_heads, "linear_num_value_heads": g.num_heads,
                  "linear_key_head_dim": g.head_k_dim, "linear_value_head_dim": g.head_v_dim,
                  "linear_conv_kernel_dim": g.conv_size}
    # Our own config, so an import of this directory gives back exactly the model that was exported.
    c["asyncpp_model_config"] = dataclasses.asdict(cfg)
    return c


def _rope(hf: Mapping[str, Any]) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from a transformers 4.x or 5.x config; refuses rope scaling."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type")) or params.get("rope_type", "default")
    if kind != "default":
        raise HFFormatError(
            f"config.json rope scaling {scaling or params} is not supported: model_zoo's RoPE is the plain "
            "(default) kind; convert a checkpoint without rope_scaling"
        )
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    factor = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    return theta, factor


def model_fields_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """A config.json (as a dict) -> ModelConfig fields (name and init settings aside); refuses what
    model_zoo cannot compute (biases, other activations, dense layers inside an MoE model, ...)."""
    from model_zoo import GDNConfig, MoEConfig

    family = family_of_model_type(hf.get("model_type"))
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False), ("qkv_bias", False),
                      ("use_sliding_window", False), ("decoder_sparse_step", 1), ("mlp_only_layers", [])):
        if hf.get(key, want) != want:
            raise HFFormatError(f"config.json {key}={hf[key]!r} is not supported; model_zoo needs {key}={want!r}")
    heads = hf["num_attention_heads"]
    theta, factor = _rope(hf)
    fields: dict[str, Any] = {
        "vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"], "num_layers": hf["num_hidden_layers"],
        "num_heads": heads, "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads, "ffn_hidden_size": 0,
        "rope_theta": theta, "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qk_norm": family in ("qwen3", "qwen3_moe", "qwen3_next"), "attn_output_gate": family == "qwen3_next",
        "partial_rotary_factor": factor,
    }
    if family in ("llama", "qwen3"):
        fields["ffn_hidden_size"] = hf["intermediate_size"]
        return fields
    shared = hf.get("shared_expert_intermediate_size", 0) if family != "qwen3_moe" else 0
    experts = hf.get("num_experts", hf.get("num_local_experts"))  # transformers 5 saves Qwen3-MoE's as the latter
    fields["moe"] = MoEConfig(num_experts=experts, top_k=hf["num_experts_per_tok"],
                              expert_ffn_hidden_size=hf["moe_intermediate_size"],
                              shared_expert_ffn_hidden_size=shared,
                              aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
                              normalize_topk=bool(hf.get("norm_topk_prob", False)))
    if family == "qwen3_next":
        types = hf.get("layer_types") or [
            "full_attention" if (i + 1) % hf.get("full_attention_interval", 4) == 0 else "linear_attention"
            for i in range(hf["num_hidden_layers"])]
        fields["layer_types"] = tuple("gdn" if t == "linear_attention" else "attn" for t in types)
        if hf["linear_num_key_heads"] != hf["linear_num_value_heads"]:
            raise HFFormatError(
                f"config.json linear_num_key_heads={hf['linear_num_key_heads']} != linear_num_value_heads="
                f"{hf['linear_num_value_heads']}: model_zoo's Gated DeltaNet has one head count for q, k and v"
            )
        if "gdn" in fields["layer_types"]:
            fields["gdn"] = GDNConfig(num_heads=hf["linear_num_key_heads"], head_k_dim=hf["linear_key_head_dim"],
                                      head_v_dim=hf["linear_value_head_dim"],
                                      conv_size=hf.get("linear_conv_kernel_dim", 4), fla_l2norm=True)
    return fields


def architecture(cfg: Any, options: bool = True) -> dict:
    """What decides the function a config computes: asdict minus name, length and init settings (and
    minus the Qwen options, attention's and gdn.fla_l2norm, when options=False)."""
    d = dataclasses.asdict(cfg)
    for key in ("name", "max_seq_len", "init_std", "scale_residual_init", *(() if options else _OPTIONS)):
        d.pop(key)
    gdn_keys = ("chunk_size",) if options else ("chunk_size", "fla_l2norm")
    for sub, keys in (("moe", ("aux_loss_coef", "bias_update_rate")), ("gdn", gdn_keys)):
        if d.get(sub):
            for key in keys:
                d[sub].pop(key)
    d["layer_types"] = tuple(d["layer_types"])
    return d


# ---- the tensor map -----------------------------------------------------------------------------------


def _same(ts: list[Tensor]) -> list[Tensor]:
    return ts


@dataclass(frozen=True)
class Rule:
    """Our tensors `ours` <-> their tensors `theirs`: to_hf maps the list of ours to the list of theirs,
    from_hf back (each the other's inverse, up to the rounding of a +-1 on zero-centred norms)."""

    ours: tuple[str, ...]
    theirs: tuple[str, ...]
    to_hf: Callable[[list[Tensor]], list[Tensor]] = _same
    from_hf: Callable[[list[Tensor]], list[Tensor]] = _same


def _rename(ours: str, theirs: str) -> Rule:
    return Rule((ours,), (theirs,))


def _centred_norm(ours: str, theirs: str) -> Rule:
    # Qwen3-Next: x/rms(x) * (1 + w_hf) == x/rms(x) * w_ours.
    return Rule((ours,), (theirs,), lambda ts: [ts[0] - 1.0], lambda ts: [ts[0] + 1.0])


def _per_head(ours: tuple[str, ...], theirs: str, heads: int, rows: tuple[int, ...]) -> Rule:
    """Several head-major projections [heads * rows[i], d] <-> one with each head's rows side by side."""

    def join(ts: list[Tensor]) -> list[Tensor]:
        return [torch.cat([t.reshape(heads, r, *t.shape[1:]) for t, r in zip(ts, rows)], 1).flatten(0, 1)]

    def split(ts: list[Tensor]) -> list[Tensor]:
        t = ts[0]
        return [p.flatten(0, 1) for p in t.reshape(heads, sum(rows), *t.shape[1:]).split(list(rows), 1)]

    return Rule(ours, (theirs,), join, split)


def _stacked(ours: tuple[str, ...], theirs: tuple[str, ...], sizes: tuple[int, ...]) -> Rule:
    """Our separate tensors <-> one concatenated along dim 0 (Qwen3-Next's conv1d over [q; k; v])."""
    return Rule(ours, theirs, lambda ts: [torch.cat(ts, 0)], lambda ts: list(ts[0].split(list(sizes), 0)))


def _experts(prefix: str, hf_prefix: str, num_experts: int) -> Rule:
    """Our stacked w_gate, w_up [E, f, d], w_down [E, d, f] <-> one gate/up/down_proj per expert."""
    names = ("gate_proj", "up_proj", "down_proj")
    theirs = tuple(f"{hf_prefix}experts.{e}.{n}.weight" for e in range(num_experts) for n in names)

    def unstack(ts: list[Tensor]) -> list[Tensor]:
        return [ts[i][e] for e in range(num_experts) for i in range(3)]

    def stack(ts: list[Tensor]) -> list[Tensor]:
        return [torch.stack(ts[i::3]) for i in range(3)]

    return Rule(tuple(f"{prefix}{w}" for w in ("w_gate", "w_up", "w_down")), theirs, unstack, stack)


def rules(cfg: Any) -> list[Rule]:
    """Every tensor of the HF checkpoint of `cfg`'s family (no lm_head when the embedding is tied)."""
    family = family_of(cfg)
    norm = _centred_norm if family == "qwen3_next" else _rename
    out = [_rename("embed.weight", "model.embed_tokens.weight"), norm("norm.weight", "model.norm.weight")]
    if not cfg.tie_embeddings:
        out.append(_rename("lm_head.weight", "lm_head.weight"))
    for i, kind in enumerate(cfg.layer_types):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out += [norm(p + "mixer_norm.weight", q + "input_layernorm.weight"),
                norm(p + "mlp_norm.weight", q + "post_attention_layernorm.weight")]
        out += _attention_rules(cfg, family, p + "mixer.", q + "self_attn.", norm) if kind == "attn" \
            else _gdn_rules(cfg, p + "mixer.", q + "linear_attn.")
        out += _mlp_rules(cfg, p + "mlp.", q + "mlp.")
    return out


def _attention_rules(cfg: Any, family: str, p: str, q: str, norm: Callable[[str, str], Rule]) -> list[Rule]:
    hd = cfg.head_dim
    if family == "qwen3_next":
        out = [_per_head((p + "q_proj.weight", p + "gate_proj.weight"), q + "q_proj.weight", cfg.num_heads, (hd, hd))]
    else:
        out = [_rename(p + "q_proj.weight", q + "q_proj.weight")]
    out += [_rename(p + f"{n}.weight", q + f"{n}.weight") for n in ("k_proj", "v_proj", "o_proj")]
    if cfg.qk_norm:
        out += [norm(p + "q_norm.weight", q + "q_norm.weight"), norm(p + "k_norm.weight", q + "k_norm.weight")]
    return out


def _gdn_rules(cfg: Any, p: str, q: str) -> list[Rule]:
    g = cfg.gdn
    h, dk, dv = g.num_heads, g.head_k_dim, g.head_v_dim
    return [
        _per_head(tuple(p + f"{n}_proj.weight" for n in "qkvg"), q + "in_proj_qkvz.weight", h, (dk, dk, dv, dv)),
        _per_head((p + "b_proj.weight", p + "a_proj.weight"), q + "in_proj_ba.weight", h, (1, 1)),
        _stacked(tuple(p + f"conv_{n}.weight" for n in "qkv"), (q + "conv1d.weight",), (h * dk, h * dk, h * dv)),
        _rename(p + "A_log", q + "A_log"),
        _rename(p + "dt_bias", q + "dt_bias"),
        _rename(p + "o_norm.weight", q + "norm.weight"),  # the gated norm: plain weight, not zero-centred
        _rename(p + "o_proj.weight", q + "out_proj.weight"),
    ]


def _mlp_rules(cfg: Any, p: str, q: str) -> list[Rule]:
    names = ("gate_proj", "up_proj", "down_proj")
    if cfg.moe is None:
        return [_rename(p + f"{n}.weight", q + f"{n}.weight") for n in names]
    out = [_rename(p + "router.weight", q + "gate.weight"), _experts(p, q, cfg.moe.num_experts)]
    if cfg.moe.shared_expert_ffn_hidden_size:
        out += [_rename(p + f"shared_expert.{n}.weight", q + f"shared_expert.{n}.weight") for n in names]
        out.append(_rename(p + "shared_gate.weight", q + "shared_expert_gate.weight"))
    return out
