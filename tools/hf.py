"""Hugging Face Llama format <-> model_zoo's dense CausalLM (smollm2_*, tiny_dense).

    python -m tools.hf export --model tiny_dense --state-dict weights.pt --out hf/tiny --verify
    python -m tools.hf export --checkpoint outputs/run/checkpoints/step_00000300 --out hf/run --verify
    python -m tools.hf import hf/SmolLM2-135M --out smollm2.pt --verify

A dense model_zoo model is HF Llama tensor for tensor: the same RMSNorm (fp32 statistics, then the
weight), the same RoPE layout (`rotate_half` on the two halves of each head, model_zoo/layers.py), so
q_proj/k_proj need no permutation and every weight is copied as is. Only names change, and a tied
LM head is not written (HF re-ties it from `tie_word_embeddings`).

`export_state_dict` / `import_state_dict` take and return a plain CausalLM state_dict, so a checkpoint
tool only has to produce or consume one. The model configs come from model_zoo, which the engine
otherwise never imports: this module is a format edge, imported by tools, never by the training path.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# (ours, HF) names inside one decoder layer.
_LAYER_NAMES = (
    ("mixer_norm.weight", "input_layernorm.weight"),
    ("mixer.q_proj.weight", "self_attn.q_proj.weight"),
    ("mixer.k_proj.weight", "self_attn.k_proj.weight"),
    ("mixer.v_proj.weight", "self_attn.v_proj.weight"),
    ("mixer.o_proj.weight", "self_attn.o_proj.weight"),
    ("mlp_norm.weight", "post_attention_layernorm.weight"),
    ("mlp.gate_proj.weight", "mlp.gate_proj.weight"),
    ("mlp.up_proj.weight", "mlp.up_proj.weight"),
    ("mlp.down_proj.weight", "mlp.down_proj.weight"),
)
# ModelConfig fields that decide the architecture (used to recognise a registered model on import).
_ARCH_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "ffn_hidden_size",
    "rope_theta",
    "norm_eps",
    "tie_embeddings",
)


class HFFormatError(ValueError):
    """A model, state_dict or HF directory cannot be converted; the message names what and the fix."""


# ---- names and shapes ---------------------------------------------------------------------------------


def name_map(cfg: Any) -> dict[str, str]:
    """Our state_dict key -> HF key, for every tensor the HF checkpoint holds (no lm_head when tied)."""
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    for i in range(cfg.num_layers):
        for ours, theirs in _LAYER_NAMES:
            names[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    return names


def _expected_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    d, f, hd = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    layer = {
        "mixer_norm.weight": (d,),
        "mixer.q_proj.weight": (q, d),
        "mixer.k_proj.weight": (kv, d),
        "mixer.v_proj.weight": (kv, d),
        "mixer.o_proj.weight": (d, q),
        "mlp_norm.weight": (d,),
        "mlp.gate_proj.weight": (f, d),
        "mlp.up_proj.weight": (f, d),
        "mlp.down_proj.weight": (d, f),
    }
    shapes = {"embed.weight": (cfg.vocab_size, d), "norm.weight": (d,), "lm_head.weight": (cfg.vocab_size, d)}
    for i in range(cfg.num_layers):
        shapes.update({f"layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


def _check_dense(cfg: Any) -> None:
    if getattr(cfg, "moe", None) is not None or any(t != "attn" for t in cfg.layer_types):
        raise HFFormatError(
            f"model '{cfg.name}' is not a dense attention model (moe={cfg.moe is not None}, layer_types="
            f"{sorted(set(cfg.layer_types))}); HF Llama export covers the dense models only: smollm2_135m, "
            "smollm2_360m, tiny_dense"
        )


def _full(t: Tensor) -> Tensor:
    """A plain, contiguous CPU tensor (a DTensor shard is gathered first)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().to("cpu").contiguous()


# ---- configs ------------------------------------------------------------------------------------------


def hf_config(cfg: Any, dtype: torch.dtype = torch.float32) -> dict:
    """ModelConfig -> the fields of a Llama config.json (the layout SmolLM2's published config uses)."""
    _check_dense(cfg)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "torch_dtype": str(dtype).removeprefix("torch."),
        # Our own config, so an import of this directory gives back exactly the model that was exported.
        "asyncpp_model_config": dataclasses.asdict(cfg),
    }


def _rope_theta(hf: Mapping[str, Any]) -> float:
    """rope_theta from a transformers 4.x (`rope_theta` + `rope_scaling`) or 5.x (`rope_parameters`) config."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type")) or params.get("rope_type", "default")
    if kind != "default":
        raise HFFormatError(
            f"config.json rope scaling {scaling or params} is not supported: model_zoo's RoPE is the plain "
            "(default) kind; convert a checkpoint without rope_scaling"
        )
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def model_config_from_hf(hf: Mapping[str, Any]):
    """A Llama config.json (as a dict) -> model_zoo.ModelConfig.

    A directory we exported carries our full config (`asyncpp_model_config`), used when its architecture
    still matches; otherwise a registered model with the same architecture keeps its name and init
    settings (an imported SmolLM2 is `smollm2_135m`); anything else becomes 'hf_llama'."""
    from model_zoo import ModelConfig  # the format edge: see the module doc

    if hf.get("model_type") != "llama":
        raise HFFormatError(
            f"config.json model_type={hf.get('model_type')!r} is not supported; import a 'llama' checkpoint "
            "(LlamaForCausalLM: SmolLM2, Llama 2/3 without rope scaling)"
        )
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, want) != want:
            raise HFFormatError(
                f"config.json {key}={hf[key]!r} is not supported; model_zoo's dense model needs "
                f"{key}={want!r}"
            )
    heads = hf["num_attention_heads"]
    fields = {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "ffn_hidden_size": hf["intermediate_size"],
        "rope_theta": _rope_theta(hf),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }
    max_seq_len = hf.get("max_position_embeddings", 2048)
    saved = hf.get("asyncpp_model_config")
    if saved and all(saved.get(k) == fields[k] for k in _ARCH_FIELDS):
        return dataclasses.replace(model_config_from_dict(saved), max_seq_len=max_seq_len).validate()
    registered = _registered_match(fields)
    if registered is not None:
        return dataclasses.replace(registered, max_seq_len=max_seq_len).validate()
    return ModelConfig(
        name="hf_llama",
        **fields,
        max_seq_len=max_seq_len,
        init_std=hf.get("initializer_range", 0.02),
        scale_residual_init=False,  # HF Llama initialises every projection with initializer_range
    ).validate()


def model_config_from_dict(d: Mapping[str, Any]):
    """dataclasses.asdict(ModelConfig) (e.g. read back from JSON) -> ModelConfig; dense models only."""
    from model_zoo import ModelConfig

    if d.get("moe") is not None or d.get("gdn") is not None:
        raise HFFormatError(
            f"model '{d.get('name')}' is not a dense model; only dense configs are stored here"
        )
    return ModelConfig(**{k: tuple(v) if k == "layer_types" else v for k, v in d.items()})


def _registered_match(fields: dict):
    from model_zoo import MODEL_NAMES, get_model_config

    for name in MODEL_NAMES:
        cfg = get_model_config(name)
        if cfg.moe is None and all(getattr(cfg, k) == fields[k] for k in _ARCH_FIELDS):
            return cfg
    return None


# ---- state dicts --------------------------------------------------------------------------------------


def to_hf_state_dict(
    state_dict: Mapping[str, Tensor], cfg: Any, dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """Our CausalLM state_dict -> HF Llama tensors (CPU, contiguous, unshared; lm_head dropped when tied)."""
    _check_dense(cfg)
    shapes = _expected_shapes(cfg)
    optional = {"lm_head.weight"} if cfg.tie_embeddings else set()
    missing = sorted(set(shapes) - set(state_dict) - optional)
    unknown = sorted(set(state_dict) - set(shapes))
    if missing or unknown:
        raise HFFormatError(
            f"the state_dict does not fit model '{cfg.name}': missing {missing[:5]}, unexpected {unknown[:5]}; "
            "pass a plain CausalLM state_dict (model.state_dict()) of that model"
        )
    out = {}
    for ours, theirs in name_map(cfg).items():
        t = _full(state_dict[ours])
        if tuple(t.shape) != shapes[ours]:
            raise HFFormatError(
                f"{ours} has shape {tuple(t.shape)} but model '{cfg.name}' needs {shapes[ours]}"
            )
        out[theirs] = (t.to(dtype) if dtype is not None else t).clone()
    return out


def from_hf_state_dict(tensors: Mapping[str, Tensor], cfg: Any) -> dict[str, Tensor]:
    """HF Llama tensors -> our CausalLM state_dict. A tied head is the embedding tensor itself."""
    names = name_map(cfg)
    missing = sorted(set(names.values()) - set(tensors))
    if missing:
        raise HFFormatError(f"the HF checkpoint lacks {missing[:5]} (of {len(missing)} missing tensors)")
    shapes = _expected_shapes(cfg)
    sd = {}
    for ours, theirs in names.items():
        if tuple(tensors[theirs].shape) != shapes[ours]:
            raise HFFormatError(
                f"{theirs} has shape {tuple(tensors[theirs].shape)}, but config.json implies {shapes[ours]}"
            )
        sd[ours] = tensors[theirs]
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = sd["embed.weight"]
    return sd


# ---- files --------------------------------------------------------------------------------------------


def export_state_dict(
    state_dict: Mapping[str, Tensor], model_cfg: Any, out_dir: str | Path, dtype: torch.dtype | None = None
) -> Path:
    """Write `out_dir/{config.json, model.safetensors}` loadable by transformers.LlamaForCausalLM.
    dtype None keeps the state's dtype (fp32 master weights give fp32 files)."""
    from safetensors.torch import save_file

    tensors = to_hf_state_dict(state_dict, model_cfg, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    file_dtype = next(iter(tensors.values())).dtype
    # Written under a temporary name, then renamed: a crash never leaves a truncated model.safetensors.
    tmp = out / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS_FILE)
    (out / CONFIG_FILE).write_text(json.dumps(hf_config(model_cfg, file_dtype), indent=2) + "\n")
    return out


def read_hf_tensors(hf_dir: Path) -> dict[str, Tensor]:
    """All tensors of `model.safetensors`, or of the shards listed in `model.safetensors.index.json`."""
    from safetensors.torch import load_file

    if (hf_dir / WEIGHTS_FILE).exists():
        return load_file(str(hf_dir / WEIGHTS_FILE))
    if (hf_dir / INDEX_FILE).exists():
        shards = sorted(set(json.loads((hf_dir / INDEX_FILE).read_text())["weight_map"].values()))
        tensors: dict[str, Tensor] = {}
        for shard in shards:
            tensors.update(load_file(str(hf_dir / shard)))
        return tensors
    raise HFFormatError(
        f"{hf_dir} has neither {WEIGHTS_FILE} nor {INDEX_FILE}; point at a directory saved with "
        "safetensors (save_pretrained(..., safe_serialization=True))"
    )


def import_state_dict(hf_dir: str | Path) -> tuple[dict[str, Tensor], Any]:
    """An HF Llama directory -> (our CausalLM state_dict, model_zoo.ModelConfig)."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / CONFIG_FILE).exists():
        raise HFFormatError(f"{hf_dir / CONFIG_FILE} does not exist; point at an HF model directory")
    cfg = model_config_from_hf(json.loads((hf_dir / CONFIG_FILE).read_text()))
    return from_hf_state_dict(read_hf_tensors(hf_dir), cfg), cfg


# ---- checks -------------------------------------------------------------------------------------------


def build_from_state_dict(state_dict: Mapping[str, Tensor], cfg: Any):
    """Our CausalLM holding exactly these tensors (built on meta, then assigned: no init cost)."""
    from model_zoo import build_model

    state = dict(state_dict)
    if cfg.tie_embeddings:
        state.setdefault("lm_head.weight", state["embed.weight"])
    model = build_model(cfg, device="meta")
    model.load_state_dict(state, assign=True, strict=True)
    model.tie_weights()
    return model.eval()


@torch.no_grad()
def compare_logits(
    state_dict: Mapping[str, Tensor], cfg: Any, hf_dir: str | Path, seq_len: int = 32, seed: int = 0
) -> float:
    """max |logits(asyncpp) - logits(transformers)| in fp32 on random tokens."""
    from transformers import LlamaForCausalLM

    ours = build_from_state_dict({k: v.float() for k, v in state_dict.items()}, cfg)
    theirs = LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(seed))
    return (ours(tokens) - theirs(tokens).logits).abs().max().item()


# ---- CLI ----------------------------------------------------------------------------------------------


def _load_state_file(path: Path) -> tuple[dict[str, Tensor], Any]:
    """A torch.save'd state_dict, or {'state_dict', 'model_config'} as `import` writes it."""
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(obj, dict) and "state_dict" in obj:
        cfg = obj.get("model_config")
        return obj["state_dict"], (model_config_from_dict(cfg) if cfg else None)
    return obj, None


def load_checkpoint_weights(path: str | Path) -> tuple[dict[str, Tensor], Any]:
    """The newest weights x_t of an asyncpp DCP checkpoint (any layout) as a CausalLM state_dict."""
    import torch.distributed.checkpoint as dcp

    from asyncpp.train.checkpoint import quiet_single_process_dcp, read_manifest
    from model_zoo import get_model_config

    manifest = read_manifest(path)
    cfg = get_model_config(manifest["config"]["model"]["name"])
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    prefix = "weights/0/"
    request = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if k.startswith(prefix)}
    quiet_single_process_dcp()
    dcp.load(request, checkpoint_id=str(path), no_dist=True)
    state = {k[len(prefix):]: v for k, v in request.items()}
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    return state, cfg


def _export(args: argparse.Namespace) -> int:
    from model_zoo import build_model, get_model_config

    if args.checkpoint is not None:
        state, cfg = load_checkpoint_weights(args.checkpoint)
    elif args.state_dict is None:
        if args.model is None:
            raise HFFormatError("export needs --model NAME (with --init-seed) or --state-dict FILE")
        torch.manual_seed(args.init_seed)
        cfg = get_model_config(args.model)
        state = build_model(cfg).state_dict()
    else:
        state, cfg = _load_state_file(Path(args.state_dict))
        if args.model is not None:
            cfg = get_model_config(args.model)
        if cfg is None:
            raise HFFormatError(
                f"{args.state_dict} holds a bare state_dict; say which model it is with --model NAME"
            )
    dtype = getattr(torch, args.dtype) if args.dtype else None
    out = export_state_dict(state, cfg, args.out, dtype=dtype)
    print(f"exported '{cfg.name}' to {out} ({WEIGHTS_FILE}, {CONFIG_FILE})")
    return _verify(state, cfg, out) if args.verify else 0


def _import(args: argparse.Namespace) -> int:
    state, cfg = import_state_dict(args.hf_dir)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    unique = {k: v for k, v in state.items() if not (cfg.tie_embeddings and k == "lm_head.weight")}
    torch.save({"state_dict": unique, "model_config": dataclasses.asdict(cfg)}, out)
    print(f"imported {args.hf_dir} as model '{cfg.name}' -> {out}")
    return _verify(state, cfg, args.hf_dir) if args.verify else 0


def _verify(state: Mapping[str, Tensor], cfg: Any, hf_dir: str | Path, atol: float = 1e-4) -> int:
    diff = compare_logits(state, cfg, hf_dir)
    ok = diff <= atol
    print(f"verify: max |logits(asyncpp) - logits(transformers)| = {diff:.3g} ({'ok' if ok else 'MISMATCH'})")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.hf", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser(
        "export", help="asyncpp state_dict -> HF Llama directory (safetensors + config.json)"
    )
    exp.add_argument("--model", help="registered dense model (smollm2_135m, smollm2_360m, tiny_dense)")
    exp.add_argument("--state-dict", help="torch.save'd state_dict, or a file written by `import`")
    exp.add_argument("--checkpoint", help="an asyncpp checkpoint directory (step_*), saved by any layout")
    exp.add_argument("--init-seed", type=int, default=0, help="without --state-dict: export a fresh init")
    exp.add_argument("--out", required=True, help="output directory")
    exp.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default: the state's dtype")
    exp.add_argument("--verify", action="store_true", help="load it with transformers and compare logits")
    imp = sub.add_parser("import", help="HF Llama directory -> {'state_dict', 'model_config'} .pt file")
    imp.add_argument("hf_dir")
    imp.add_argument("--out", required=True, help="output .pt file")
    imp.add_argument("--verify", action="store_true", help="compare logits with transformers")
    args = parser.parse_args(argv)
    try:
        return _export(args) if args.command == "export" else _import(args)
    except (HFFormatError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
